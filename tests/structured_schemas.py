"""JSON schemas for the structured-outputs tests: nested objects, arrays with min/max items, enums,
integer/number ranges, string patterns and lengths, anyOf, $ref, required and optional fields.

Strings carry a maxLength (or a pattern, enum or const) and arrays a maxItems wherever a random
model could otherwise go on until max_tokens: a random-weight model tries everything, and only
bounded choices let most samples finish.
"""

NAME = {"type": "string", "minLength": 1, "maxLength": 6}

SCHEMAS = [
    # 0-4: flat objects
    {"type": "object", "properties": {"name": NAME}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}},
     "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    # 5-9: enums, consts, patterns, lengths
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"}, "v": {"enum": [1, 2, 3, None, True]}},
     "required": ["kind", "v"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 4}},
     "required": ["word"], "additionalProperties": False},
    # 10-14: arrays
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"type": "object", "properties": {"pts": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}},
     "required": ["pts"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 1, "maximum": 3}, {"enum": ["u", "v"]}],
     "items": False},
    # 15-19: nesting
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 999}, "nick": NAME},
                                               "required": ["id", "nick"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"m": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"enum": [0, 1]}}}}, "required": ["m"], "additionalProperties": False},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"lang": {"enum": ["en", "fr"]},
                                                                                "n": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 5}},
                                               "required": ["lang"], "additionalProperties": False},
                                      "ok": {"type": "boolean"}},
     "required": ["meta", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[a-z]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    # 20-24: anyOf / oneOf / $ref / $defs
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                       {"type": "string", "pattern": "^id[0-9]$"}]}},
     "required": ["id"], "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"cat": {"const": "meow"}}, "required": ["cat"],
                "additionalProperties": False},
               {"type": "object", "properties": {"dog": {"const": "woof"}}, "required": ["dog"],
                "additionalProperties": False}]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"definitions": {"color": {"enum": ["red", "blue"]}},
     "type": "object", "properties": {"fg": {"$ref": "#/definitions/color"}, "bg": {"$ref": "#/definitions/color"}},
     "required": ["fg"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["v"],
     "additionalProperties": False},
    # 25-29: optional fields, numbers, mixtures
    {"type": "object", "properties": {"name": NAME, "nick": NAME, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
     "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
     "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
     "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": -3, "maximum": 3}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                                      "status": {"enum": ["open", "closed"]}},
     "required": ["date", "status"], "additionalProperties": False},
    # 30-33: top-level non-objects and recursion
    {"enum": ["yes", "no", 0, 1]},
    {"type": "integer", "minimum": 100, "maximum": 200},
    {"type": "string", "maxLength": 5},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                            {"type": "null"}]}},
                        "required": ["v", "next"], "additionalProperties": False}},
     "$ref": "#/$defs/node"},
]

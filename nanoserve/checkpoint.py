"""The files of a checkpoint directory besides its weights: JSON files and the tokenizer.

Every problem is a ValueError naming the file (and the field, where there is one), raised at
startup, never a JSONDecodeError from deep inside transformers or a tokenizer that silently
encodes nothing. No code from the directory is ever run: the tokenizer is built with
`trust_remote_code=False`, whatever `auto_map` its files declare.
"""
from __future__ import annotations

import json
import os
from typing import Any

# Imported with this module, not when the first engine starts: frames of an import made inside
# LLM() can outlive it (transformers pulls in trio, which keeps a traceback of its own import),
# and they hold that LLM until the cycle collector runs: its memory would not go when it is dropped.
from transformers import AutoTokenizer

# A tokenizer needs its vocabulary: the fast tokenizer's file, a SentencePiece model, or a slow
# BPE / WordPiece vocabulary. Without one transformers builds an empty tokenizer without complaint.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def read_json(path: str, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in `path`; a ValueError naming the file if it is unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold {what}, found {type(data).__name__}")
    return data


def read_optional_json(path: str) -> dict[str, Any]:
    """read_json, or {} when the file does not exist (e.g. generation_config.json)."""
    return read_json(path) if os.path.isfile(path) else {}


def load_tokenizer(directory: str):
    """The HF tokenizer in `directory`, checked for the files it needs first."""
    for name in TOKENIZER_JSON_FILES:
        read_optional_json(os.path.join(directory, name))  # a broken file is named here
    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_VOCAB_FILES):
        raise ValueError(
            f"tokenizer directory {directory!r} has no vocabulary file (one of {', '.join(TOKENIZER_VOCAB_FILES)}); "
            "copy the tokenizer's files there or pass tokenizer=<a directory that has them>"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a bad file; all mean the same here
        raise ValueError(f"the tokenizer in {directory!r} cannot be loaded: {type(e).__name__}: {e}") from e
    if len(tokenizer) == 0:
        raise ValueError(f"the tokenizer in {directory!r} has an empty vocabulary")
    return tokenizer


def read_generation_config(model_dir: str) -> dict:
    return read_optional_json(os.path.join(model_dir, "generation_config.json"))


def eos_token_ids(tokenizer, generation_config: dict) -> list[int]:
    ids = generation_config.get("eos_token_id")
    ids = ids if isinstance(ids, list) else ([ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id, *ids]
    return list(dict.fromkeys(ids))

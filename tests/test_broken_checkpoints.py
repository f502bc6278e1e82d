"""Broken checkpoints: each a ValueError naming the file and the field or tensor, raised at startup,
never a crash deep inside torch or transformers, and never a silently wrong model."""
import json
import os
import re
import shutil

import pytest
import torch
from helpers import make_llm
from safetensors.torch import load_file, save_file


def copy_of(tiny_model, tmp_path) -> str:
    return str(shutil.copytree(tiny_model, tmp_path / "ckpt"))


def start(path, **kw):
    return make_llm(path, num_kvcache_blocks=64, max_model_len=128, **kw)


def edit_config(path, **fields):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for name, value in fields.items():
        if value is None:
            del cfg[name]
        else:
            cfg[name] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def edit_weights(path, fn):
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    fn(weights)
    save_file(weights, file)


# ---- weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 0.999, 4 / 1e9], ids=["half", "last-bytes", "header"])
def test_truncated_safetensors(tiny_model, tmp_path, keep):
    path = copy_of(tiny_model, tmp_path)
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(max(4, int(os.path.getsize(file) * keep)))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        start(path)


def test_garbage_instead_of_safetensors(tiny_model, tmp_path):
    path = copy_of(tiny_model, tmp_path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(os.urandom(4096))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        start(path)


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.mlp.down_proj.weight", (64, 100)),  # narrower than the config says
    ("model.layers.1.mlp.up_proj.weight", (200, 64)),  # wider: must not be cut to fit
    ("model.layers.0.self_attn.k_proj.weight", (48, 64)),
    ("model.embed_tokens.weight", (1200, 64)),  # more rows than vocab_size
    ("model.norm.weight", (32,)),
    ("model.layers.0.input_layernorm.weight", (64, 1)),  # copy_ would broadcast it
])
def test_tensor_of_the_wrong_shape(tiny_model, tmp_path, name, shape):
    path = copy_of(tiny_model, tmp_path)
    edit_weights(path, lambda w: w.__setitem__(name, torch.randn(shape)))
    message = f"model.safetensors: tensor '{name}' of shape {list(shape)} does not fit"
    with pytest.raises(ValueError, match=re.escape(message)):
        start(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_tensor_of_the_wrong_dtype(tiny_model, tmp_path, dtype):
    path = copy_of(tiny_model, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    edit_weights(path, lambda w: w.__setitem__(name, w[name].to(dtype)))
    dtype_name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' has dtype {dtype_name}; weights must"):
        start(path)


def test_config_vocab_size_disagrees_with_the_weights(tiny_model, tmp_path):
    """A larger vocab_size would leave rows of the embedding unset: refused, not zero-filled."""
    for vocab in (1500, 800):
        path = copy_of(tiny_model, tmp_path / str(vocab))
        edit_config(path, vocab_size=vocab)
        with pytest.raises(ValueError, match=rf"tensor 'model.embed_tokens.weight'.*must have shape \[{vocab}, 64\]"):
            start(path)


def test_broken_shard_index(tiny_model, tmp_path):
    path = copy_of(tiny_model, tmp_path)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write('{"weight_map": ')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: cannot be read as JSON"):
        start(path)
    with open(index, "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: weight_map must map"):
        start(path)


# ---- config.json -----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                                   "vocab_size"])
def test_config_missing_a_required_field(tiny_model, tmp_path, field):
    path = copy_of(tiny_model, tmp_path)
    edit_config(path, **{field: None})
    with pytest.raises(ValueError, match=rf"config\.json lacks the required field '{field}'"):
        start(path)


@pytest.mark.parametrize("fields, match", [
    (dict(num_key_value_heads=3), r"num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    (dict(num_key_value_heads=8), r"num_attention_heads=4 must be a multiple of num_key_value_heads=8"),
    (dict(hidden_size=66, head_dim=None), r"hidden_size=66 is not a multiple of num_attention_heads=4"),
    (dict(head_dim=15), r"the head dimension \(15\) must be even"),
    (dict(num_hidden_layers=3), r"layer_types has 2 entries but num_hidden_layers=3"),
    (dict(hidden_size="64"), r"hidden_size must be a positive int, got '64'"),
    (dict(num_hidden_layers=0), r"num_hidden_layers must be a positive int, got 0"),
    (dict(num_key_value_heads=-2), r"num_key_value_heads must be a positive int"),
    (dict(max_position_embeddings=1.5), r"max_position_embeddings must be a positive int"),
    (dict(rms_norm_eps="tiny"), r"rms_norm_eps must be a positive number"),
    (dict(tie_word_embeddings="yes"), r"tie_word_embeddings must be true or false"),
    (dict(rope_theta=-1.0, rope_parameters=None), r"rope_theta must be a positive number"),
    (dict(architectures="Qwen3ForCausalLM"), r"architectures must be a list"),
    (dict(architectures=None), r"architectures must be a list"),
])
def test_config_with_inconsistent_fields(tiny_model, tmp_path, fields, match):
    path = copy_of(tiny_model, tmp_path)
    edit_config(path, **fields)
    with pytest.raises(ValueError, match=re.escape(os.path.join(path, "config.json") + ": ") + match):
        start(path)


def test_moe_config_fields(tmp_path):
    from nanoserve.utils.tiny_checkpoint import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    edit_config(path, num_experts_per_tok=experts + 1)
    with pytest.raises(ValueError, match=rf"config\.json: num_experts_per_tok={experts + 1} must be in \[1, "):
        start(path)
    edit_config(path, num_experts_per_tok=1, moe_intermediate_size=None)
    with pytest.raises(ValueError, match=r"config\.json lacks the required field 'moe_intermediate_size'"):
        start(path)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_unparsable_json(tiny_model, tmp_path, name):
    path = copy_of(tiny_model, tmp_path)
    with open(os.path.join(path, name), "w") as f:
        f.write('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=rf"{name}: cannot be read as JSON"):
        start(path)
    with open(os.path.join(path, name), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(ValueError, match=rf"{name}: must hold a JSON object, found list"):
        start(path)


# ---- tokenizer -------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [("tokenizer.json",), ("tokenizer.json", "tokenizer_config.json")])
def test_missing_tokenizer(tiny_model, tmp_path, missing):
    """Without its vocabulary transformers builds an empty tokenizer that encodes nothing: refused."""
    path = copy_of(tiny_model, tmp_path)
    for name in missing:
        os.remove(os.path.join(path, name))
    with pytest.raises(ValueError, match=r"tokenizer directory .* has no vocabulary file \(one of tokenizer\.json"):
        start(path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_broken_tokenizer_file(tiny_model, tmp_path, name):
    path = copy_of(tiny_model, tmp_path)
    with open(os.path.join(path, name), "w") as f:
        f.write('{"model": {"type": "BPE", ')
    with pytest.raises(ValueError, match=rf"{name}: cannot be read as JSON"):
        start(path)


def test_tokenizer_json_of_the_wrong_kind(tiny_model, tmp_path):
    """Valid JSON that is no tokenizer: the error names the directory and what transformers said."""
    path = copy_of(tiny_model, tmp_path)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"model": {"type": "NoSuchModel"}}, f)
    with pytest.raises(ValueError, match=r"the tokenizer in .* cannot be loaded: \w+"):
        start(path)


def test_separate_tokenizer_directory_is_checked_too(tiny_model, tmp_path):
    empty = tmp_path / "tok"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"tokenizer directory '{empty}' has no vocabulary file"):
        start(tiny_model, tokenizer=str(empty))

"""The tiny random-weight Qwen3 checkpoints load in transformers and behave like a model.

Other architectures: tests/test_tiny_architectures.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from nanoserve.utils.tiny_checkpoint import (
    FINGERPRINT_FILE,
    QWEN3_0_6B,
    TINY_QWEN3,
    build_tiny_qwen3,
    count_parameters,
    default_model_dir,
    ensure_tiny_qwen3,
)

transformers.logging.set_verbosity_error()  # keeps load-report noise out of test output

PROMPTS = ["The quick brown fox", "Once upon a time", "What is the capital of France?"]


def _load_model(path: str):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def _weight_files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def _tensor_names(path: str) -> set[str]:
    names = set()
    for file_name in _weight_files(path):
        with safe_open(os.path.join(path, file_name), "pt") as f:
            names |= set(f.keys())
    return names


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shard_size_bytes", [None, 40_000])
def test_hf_loads_with_no_missing_or_unexpected_keys(tmp_path, tied, shard_size_bytes):
    path = build_tiny_qwen3(tmp_path, tie_word_embeddings=tied, shard_size_bytes=shard_size_bytes)
    model, info = _load_model(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert ("lm_head.weight" in _tensor_names(path)) == (not tied)
    if shard_size_bytes is None:
        assert _weight_files(path) == ["model.safetensors"]
    else:
        assert len(_weight_files(path)) > 1


def test_sharded_index_lists_every_tensor(tmp_path):
    path = build_tiny_qwen3(tmp_path, shard_size_bytes=40_000, tie_word_embeddings=False)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = _weight_files(path)
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    assert set(index["weight_map"].values()) == set(files)
    total = 0
    for file_name in files:
        with safe_open(os.path.join(path, file_name), "pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == file_name
                total += f.get_tensor(name).nbytes
    assert set(index["weight_map"]) == _tensor_names(path)
    assert index["metadata"]["total_size"] == total


def test_config_and_generation_config(tmp_path):
    path = build_tiny_qwen3(tmp_path, dtype="bfloat16", generation_config={"temperature": 0.6, "top_p": 0.95})
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config[key] == TINY_QWEN3[key]
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["vocab_size"] == len(tok)
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == TINY_QWEN3["rope_theta"]
    assert config["attention_bias"] is False and config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert config["bos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert gen["eos_token_id"] == [config["eos_token_id"], config["bos_token_id"]]
    assert gen["temperature"] == 0.6 and gen["top_p"] == 0.95
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    _, info = _load_model(path)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_greedy_generation_is_varied(tiny, tokenizer):
    model, _ = _load_model(tiny)
    generated = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        generated += out[0, ids.shape[1] :].tolist()
    assert len(set(generated)) >= 8, generated


def test_norm_weights_are_near_one_but_not_exactly(tiny):
    with safe_open(os.path.join(tiny, "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert (norm - 1).abs().max() < 0.6 and norm.std() > 0.01


def test_same_seed_same_bytes_different_seed_different_weights(tmp_path):
    paths = [build_tiny_qwen3(tmp_path / name, seed=seed) for name, seed in (("a", 3), ("b", 3), ("c", 4))]
    data = [open(os.path.join(p, "model.safetensors"), "rb").read() for p in paths]
    assert data[0] == data[1]
    assert data[0] != data[2]


def test_seed_gives_same_weights_whatever_the_sharding(tmp_path):
    single = build_tiny_qwen3(tmp_path / "single", seed=5)
    sharded = build_tiny_qwen3(tmp_path / "sharded", seed=5, shard_size_bytes=30_000)
    name = "model.layers.1.mlp.down_proj.weight"
    with safe_open(os.path.join(single, "model.safetensors"), "pt") as f:
        expected = f.get_tensor(name)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(sharded, shard), "pt") as f:
        assert torch.equal(f.get_tensor(name), expected)


def test_tokenizer_round_trips_text(tokenizer):
    for text in ["Hello, world! The fox jumps.", "héllo 世界 🙂", "  two  spaces\nand a newline\t"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert 900 <= len(tokenizer) <= 1000


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == prompt + "<think>\n\n</think>\n\n"
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


def test_qwen3_0_6b_architecture_has_the_real_parameter_count():
    # Qwen3-0.6B has 596,049,920 parameters (embeddings tied); no need to build it.
    assert count_parameters("qwen3", **QWEN3_0_6B) == 596_049_920


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        build_tiny_qwen3(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="dtype"):
        build_tiny_qwen3(tmp_path, dtype="float32", torch_dtype="bfloat16")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_tiny_qwen3(tmp_path, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_qwen3(tmp_path, hidden_size=0)
    with pytest.raises(ValueError, match="shard_size_bytes"):
        build_tiny_qwen3(tmp_path, shard_size_bytes=0)
    with pytest.raises(TypeError, match="hidden_sise"):
        build_tiny_qwen3(tmp_path, hidden_sise=32)
    with pytest.raises(ValueError, match="name"):
        default_model_dir("../escape")


def test_rebuilding_into_a_used_dir_drops_the_old_layout(tmp_path):
    build_tiny_qwen3(tmp_path, shard_size_bytes=40_000)
    build_tiny_qwen3(tmp_path)
    assert _weight_files(str(tmp_path)) == ["model.safetensors"]
    assert not os.path.exists(tmp_path / "model.safetensors.index.json")


def test_ensure_reuses_a_matching_build(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    path = ensure_tiny_qwen3("t", seed=1)
    assert path == str(tmp_path / "t") == default_model_dir("t")
    config = os.path.join(path, "config.json")
    mtime = os.stat(config).st_mtime_ns
    assert ensure_tiny_qwen3("t", seed=1) == path
    assert os.stat(config).st_mtime_ns == mtime
    assert os.listdir(tmp_path) == ["t"]  # no temporary or stale directories left behind


def test_ensure_rebuilds_when_kwargs_change(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    path = ensure_tiny_qwen3("t", seed=1)
    with open(os.path.join(path, FINGERPRINT_FILE)) as f:
        assert json.load(f)["kwargs"] == {"seed": 1}
    weights = open(os.path.join(path, "model.safetensors"), "rb").read()
    assert ensure_tiny_qwen3("t", seed=2) == path
    with open(os.path.join(path, FINGERPRINT_FILE)) as f:
        assert json.load(f)["kwargs"] == {"seed": 2}
    assert open(os.path.join(path, "model.safetensors"), "rb").read() != weights
    assert os.listdir(tmp_path) == ["t"]


def test_ensure_replaces_a_half_built_dir(tmp_path, monkeypatch):
    # A directory without a fingerprint (e.g. from an interrupted older build) is not trusted.
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    path = ensure_tiny_qwen3("t")
    _, info = _load_model(path)
    assert not info["missing_keys"]

"""Every architecture of the tiny-checkpoint builder is HF's own: transformers loads it with no
missing or unexpected tensors, it greedy-generates varied tokens, and a seed gives the same
weights whatever the sharding or dtype. Qwen3-only details: tests/test_tiny_checkpoint.py."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from nanoserve.utils.tiny_checkpoint import (
    ARCHITECTURES,
    REAL_SHAPES,
    build_tiny_checkpoint,
    count_parameters,
    default_model_dir,
    ensure_tiny_checkpoint,
)

transformers.logging.set_verbosity_error()

ARCHS = list(ARCHITECTURES)
PROMPTS = ["The quick brown fox", "Once upon a time", "What is the capital of France?"]


def _load_model(path: str):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def _tensors(path: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file_name in sorted(os.listdir(path)):
        if file_name.endswith(".safetensors"):
            with safe_open(os.path.join(path, file_name), "pt") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (not iterable)
    return tensors


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: build_tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_it_with_no_missing_or_unexpected_keys(built, arch):
    model, info = _load_model(built[arch])
    assert type(model).__name__ == ARCHITECTURES[arch].model_class
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = _config(built[arch])
    assert config["architectures"] == [ARCHITECTURES[arch].model_class] and config["model_type"] == arch
    # 5.x keys and the 4.x keys real checkpoints have, agreeing.
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == ARCHITECTURES[arch].defaults["rope_theta"]
    assert config["rope_scaling"] is None


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_is_varied(built, arch):
    model, _ = _load_model(built[arch])
    tokenizer = transformers.AutoTokenizer.from_pretrained(built[arch])
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        outputs.append(out[0, ids.shape[1]:].tolist())
    assert len({token for output in outputs for token in output}) >= 12, outputs
    assert len({tuple(output) for output in outputs}) == len(PROMPTS), outputs


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_bf16_build_has_the_same_weights(built, arch, tmp_path):
    path = build_tiny_checkpoint(tmp_path, arch, dtype="bfloat16", shard_size_bytes=40_000)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1
    sharded, single = _tensors(path), _tensors(built[arch])
    assert set(sharded) == set(weight_map) == set(single)
    for name, tensor in single.items():
        assert sharded[name].dtype == torch.bfloat16
        assert torch.equal(sharded[name], tensor.to(torch.bfloat16)), name
    _, info = _load_model(path)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_moe_experts_are_saved_one_tensor_per_expert(built):
    # transformers 5 packs a layer's experts into 3-D parameters (experts.gate_up_proj,
    # experts.down_proj) and save_pretrained splits them back into the published layout.
    path = built["qwen3_moe"]
    config, tensors = _config(path), _tensors(path)
    num_experts, hidden, width = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    assert num_experts == config["num_local_experts"] == 8 and config["norm_topk_prob"] is True
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp."
        assert tensors[p + "gate.weight"].shape == (num_experts, hidden)
        for e in range(num_experts):
            assert tensors[f"{p}experts.{e}.gate_proj.weight"].shape == (width, hidden)
            assert tensors[f"{p}experts.{e}.up_proj.weight"].shape == (width, hidden)
            assert tensors[f"{p}experts.{e}.down_proj.weight"].shape == (hidden, width)
        assert p + "gate_proj.weight" not in tensors
    assert not [name for name in tensors if "gate_up_proj" in name or name.endswith("experts.down_proj")]


def test_moe_dense_layers_from_sparse_step_and_mlp_only_layers(tmp_path):
    path = build_tiny_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                 mlp_only_layers=[3], intermediate_size=96)
    tensors = _tensors(path)
    # Sparse where (layer + 1) % decoder_sparse_step == 0 and the layer is not in mlp_only_layers.
    for layer, sparse in enumerate([False, True, False, False]):
        p = f"model.layers.{layer}.mlp."
        assert (p + "gate.weight" in tensors) == sparse
        assert (p + "experts.0.up_proj.weight" in tensors) == sparse
        if not sparse:
            assert tensors[p + "up_proj.weight"].shape == (96, 64)
    _, info = _load_model(path)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_moe_same_seed_same_bytes(tmp_path):
    paths = [build_tiny_checkpoint(tmp_path / name, "qwen3_moe", seed=2) for name in "ab"]
    data = []
    for p in paths:
        with open(os.path.join(p, "model.safetensors"), "rb") as f:
            data.append(f.read())
    assert data[0] == data[1]


def test_qwen2_has_qkv_biases_and_no_head_dim(built):
    tensors, config = _tensors(built["qwen2"]), _config(built["qwen2"])
    for name in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{name}.bias" in tensors
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert "head_dim" not in config  # like Qwen2.5's config.json: hidden_size / num_attention_heads


def test_llama_rope_scaling_is_written_both_ways(tmp_path):
    scaling = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 256, "rope_type": "llama3"}
    path = build_tiny_checkpoint(tmp_path, "llama", rope_scaling=scaling, tie_word_embeddings=True)
    config = _config(path)
    assert config["rope_scaling"] == scaling and config["rope_theta"] == 500000.0
    assert config["rope_parameters"] == {**scaling, "rope_theta": 500000.0}
    model, info = _load_model(path)
    assert model.config.rope_parameters["rope_type"] == "llama3" and not info["missing_keys"]
    assert "lm_head.weight" not in _tensors(path)


def test_mistral_sliding_window_is_kept(tmp_path):
    path = build_tiny_checkpoint(tmp_path, "mistral", sliding_window=32)
    assert _config(path)["sliding_window"] == 32
    assert _config(build_tiny_checkpoint(tmp_path / "none", "mistral"))["sliding_window"] is None


@pytest.mark.parametrize("name, expected", [("llama-3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768)])
def test_real_shapes_have_the_published_parameter_counts(name, expected):
    arch, preset = REAL_SHAPES[name]
    assert count_parameters(arch, **preset) == expected


def test_scaled_down_qwen3_moe_has_1_to_2_billion_parameters():
    arch, preset = REAL_SHAPES["qwen3-moe-1.6b"]
    assert 1e9 <= count_parameters(arch, **preset) <= 2e9


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of .*LlamaForCausalLM"):
        build_tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(TypeError, match="head_dim"):
        build_tiny_checkpoint(tmp_path, "qwen2", head_dim=16)  # Qwen2Config has no such field
    with pytest.raises(TypeError, match="num_experts"):
        build_tiny_checkpoint(tmp_path, "llama", num_experts=4)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        build_tiny_checkpoint(tmp_path, "qwen3_moe", num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts"):
        build_tiny_checkpoint(tmp_path, "qwen3_moe", num_experts=0)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        build_tiny_checkpoint(tmp_path, "qwen3_moe", mlp_only_layers=[2])
    with pytest.raises(ValueError, match="sliding_window"):
        build_tiny_checkpoint(tmp_path, "mistral", sliding_window=0)
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_checkpoint(tmp_path, "llama", head_dim=None, hidden_size=66)
    assert not os.listdir(tmp_path)  # every error came before any work


def test_ensure_tiny_checkpoint_keys_the_cache_on_the_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    path = ensure_tiny_checkpoint("m", arch="llama", seed=1)
    assert path == default_model_dir("m") and _config(path)["architectures"] == ["LlamaForCausalLM"]
    mtime = os.stat(os.path.join(path, "config.json")).st_mtime_ns
    assert ensure_tiny_checkpoint("m", arch="LlamaForCausalLM", seed=1) == path  # same arch, other name
    assert os.stat(os.path.join(path, "config.json")).st_mtime_ns == mtime
    assert ensure_tiny_checkpoint("m", arch="mistral", seed=1) == path
    assert _config(path)["architectures"] == ["MistralForCausalLM"]
    assert os.listdir(tmp_path) == ["m"]

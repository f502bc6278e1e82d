"""Checkpoint loading: sharded safetensors, half-precision files, tied and untied heads."""
import pytest
import torch

from helpers import make_llm, random_prompts
from nanoserve import SamplingParams
from nanoserve.models.loader import checkpoint_files
from nanoserve.utils.tiny_checkpoint import build_tiny_qwen3


@pytest.mark.parametrize("dtype, tied", [("bfloat16", False), ("float16", True)])
def test_sharded_half_precision_checkpoint_matches_hf(tmp_path, hf, dtype, tied):
    path = build_tiny_qwen3(tmp_path / "m", seed=5, dtype=dtype, shard_size_bytes=40_000, tie_word_embeddings=tied)
    assert len(checkpoint_files(path)) > 2
    llm = make_llm(path, num_kvcache_blocks=64, max_model_len=256)
    prompts = random_prompts(3, 5, 20, seed=6)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf.greedy(path, prompt, 16)


def test_weights_land_in_packed_parameters(tiny_model):
    from safetensors.torch import load_file

    # The torch backend multiplies the loaded parameters themselves (the CPU one packs copies of them).
    llm = make_llm(tiny_model, num_kvcache_blocks=64, max_model_len=256, attention_backend="torch")
    model = llm.engine.model_runner.model
    ref = load_file(f"{tiny_model}/model.safetensors")
    attn = model.model.layers[1].self_attn
    q, k, v = (ref[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.weight.cpu(), torch.cat([q, k, v]))
    mlp = model.model.layers[0].mlp
    gate, up = (ref[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(mlp.gate_up_proj.weight.cpu(), torch.cat([gate, up]))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


@pytest.mark.parametrize("tied", [True, False])
def test_packing_backends_hold_each_weight_once(tmp_path, tied):
    """Where the GEMMs keep packed copies, the loaded weights are dropped; the embedding stays
    (a tied head shares it), and the model still matches the torch backend token for token."""
    path = build_tiny_qwen3(tmp_path / "m", seed=3, tie_word_embeddings=tied)
    kwargs = dict(num_kvcache_blocks=64, max_model_len=128)
    packed = make_llm(path, device="cpu", attention_backend="cpu", **kwargs)
    model = packed.engine.model_runner.model
    assert packed.engine.model_runner.backend.packs_weights
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.mlp.down_proj.weight is None
    assert model.lm_head.weight is None
    assert model.model.embed_tokens.weight is not None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(2, 4, 12, seed=2)
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    reference = make_llm(path, attention_backend="torch", **kwargs)
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]


def test_missing_tensor_is_reported(tmp_path, tiny_model):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        make_llm(str(tmp_path / "m"), num_kvcache_blocks=64, max_model_len=256)

"""Llama, Qwen2, Mistral and Qwen3-MoE token-exact with HF transformers (float32), built by HF's own classes.

Each runs with prefix caching on, chunked prefill (a budget smaller than the prompts), from sharded
checkpoints, and with tensor parallelism where the head counts divide; RoPE scaling is exercised
with prompts past `original_max_position_embeddings`. The MoE layer is also checked alone against
HF's MoE block, ties in the routing included.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import assert_matches_hf, assert_no_leak, make_llm, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.utils.tiny_checkpoint import build_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 48}

CASES = {
    # biases everywhere, untied, llama3 RoPE scaling
    "llama3": dict(arch="llama", attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3_SCALING, seed=1),
    # tied, linear RoPE scaling, head_dim absent (hidden_size / num_attention_heads)
    "llama-linear": dict(arch="llama", tie_word_embeddings=True, head_dim=None,
                         rope_scaling={"rope_type": "linear", "factor": 2.0}, seed=2),
    "qwen2": dict(arch="qwen2", seed=3),
    "mistral": dict(arch="mistral", sliding_window=2048, head_dim=24, hidden_size=96, seed=4),
    # a MoE layer then a dense one; 8 experts, top-2, renormalised
    "qwen3-moe": dict(arch="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], seed=5),
    "qwen3-moe-sparse-step": dict(arch="qwen3_moe", decoder_sparse_step=2, norm_topk_prob=False, seed=6),
}
TP2 = ("llama3", "qwen3-moe")


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {name: build_tiny_checkpoint(root / name, shard_size_bytes=60_000, **kw) for name, kw in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_with_prefix_caching_and_chunked_prefill(arch_dirs, hf, case):
    path = arch_dirs[case]
    assert len(list(__import__("pathlib").Path(path).glob("*.safetensors"))) > 1, "meant to load a sharded checkpoint"
    system = random_prompts(1, 70, 70, seed=11)[0]  # past original_max_position_embeddings=48
    prompts = [system + tail for tail in random_prompts(4, 3, 30, seed=12)]
    llm = make_llm(path, max_num_batched_tokens=32)  # every prompt is prefilled in chunks
    outputs = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in outputs[1:]), "the shared prefix was not served from the cache"
    assert_matches_hf(hf, path, prompts, outputs, 16)
    assert len({t for o in outputs for t in o.outputs[0].token_ids}) > 8, "outputs are degenerate"
    assert_no_leak(llm)


@pytest.mark.parametrize("case", TP2)
def test_tensor_parallel_matches_hf(arch_dirs, hf, case):
    path = arch_dirs[case]
    prompts = random_prompts(3, 5, 60, seed=21)
    with make_llm(path, device="cpu", tensor_parallel_size=2, num_kvcache_blocks=64, max_model_len=128) as llm:
        assert_matches_hf(hf, path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), 16)


def _with_config(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_both_config_formats_load_the_same_model(arch_dirs, tmp_path):
    src = arch_dirs["llama3"]
    only_4x = _with_config(src, tmp_path / "v4", lambda c: c.pop("rope_parameters", None))
    only_5x = _with_config(src, tmp_path / "v5", lambda c: [c.pop(k, None) for k in ("rope_theta", "rope_scaling")])
    prompt = random_prompts(1, 60, 60, seed=31)[0]
    outs = [make_llm(p).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in (src, only_4x, only_5x)]
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported.*longest sequence"),
    ({"rope_type": "yarn", "factor": 4.0}, "'yarn' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks.*low_freq_factor"),
])
def test_unsupported_rope_scaling_is_refused(arch_dirs, tmp_path, rope, match):
    path = _with_config(arch_dirs["llama3"], tmp_path / "m", lambda c: (c.update(rope_scaling=rope),
                                                                      c.pop("rope_parameters", None)))
    with pytest.raises(ValueError, match=match):
        LLM(path, device="cpu")


def test_sliding_window_shorter_than_max_model_len_is_refused(tmp_path, hf):
    path = build_tiny_checkpoint(tmp_path / "m", arch="mistral", sliding_window=64)
    with pytest.raises(ValueError, match=r"sliding_window=64.*max_model_len <= 64 \(got 128\)"):
        LLM(path, device="cpu", max_model_len=128)
    llm = make_llm(path, num_kvcache_blocks=32, max_model_len=None)  # None: the default, the window
    assert llm.config.max_model_len == 64
    prompt = random_prompts(1, 40, 40, seed=41)[0]
    assert_matches_hf(hf, path, [prompt], llm.generate([prompt], GREEDY, use_tqdm=False), 16)


def test_missing_and_unexpected_expert_tensors_are_named(arch_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    def rewrite(name: str, edit) -> str:
        dst = tmp_path / name
        shutil.copytree(arch_dirs["qwen3-moe"], dst)
        for f in dst.glob("*.safetensors"):
            tensors = load_file(str(f))
            edit(tensors)
            save_file(tensors, str(f))
        index = dst / "model.safetensors.index.json"
        index.unlink()  # the weight map would disagree with the files now
        return str(dst)

    missing = rewrite("missing", lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight", None))
    with pytest.raises(ValueError, match=r"lacks weights for.*layers\.0\.mlp\.experts\.w13.*\(3, 'up'\)"):
        make_llm(missing, num_kvcache_blocks=64, max_model_len=128)
    no_k = rewrite("no-k", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight", None))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight \(parts \['k'\]\)"):
        make_llm(no_k, num_kvcache_blocks=64, max_model_len=128)
    extra = rewrite("extra", lambda t: t.update({"model.layers.0.mlp.experts.99.gate_proj.weight": torch.zeros(1)})
                    if "model.layers.0.mlp.gate.weight" in t else None)
    with pytest.raises(ValueError, match=r"experts\.99\.gate_proj\.weight"):
        make_llm(extra, num_kvcache_blocks=64, max_model_len=128)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_moe_layer_matches_hf_block_including_routing_ties(renormalize, backend_name):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from nanoserve.backends import select_backend
    from nanoserve.layers.context import ModelContext
    from nanoserve.models.qwen3_moe import Qwen3MoeSparseBlock

    torch.manual_seed(0)
    cfg = dict(hidden_size=48, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
               norm_topk_prob=renormalize)
    hf_block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**cfg, num_local_experts=6)).float()
    with torch.no_grad():
        for p in hf_block.parameters():
            p.normal_(0, 0.3)
        # Small dyadic router weights and integer inputs: every router logit is exact whatever the
        # summation order, so experts 1 and 4 (same row) tie exactly in both implementations.
        hf_block.gate.weight.copy_(torch.randint(-2, 3, hf_block.gate.weight.shape) * 0.125)
        hf_block.gate.weight[4] = hf_block.gate.weight[1]
    backend = select_backend(torch.device("cpu"), torch.float32, backend_name, None, 16)
    ours = Qwen3MoeSparseBlock(cfg, ModelContext(backend))
    ours.gate.weight.data.copy_(hf_block.gate.weight)
    experts = ours.experts
    for e in range(6):
        gate_up = hf_block.experts.gate_up_proj[e]  # [2 * inter, hidden]: gate rows, then up rows
        experts.weight_loader(experts.w13, gate_up[:40], (e, "gate"))
        experts.weight_loader(experts.w13, gate_up[40:], (e, "up"))
        experts.weight_loader(experts.w2, hf_block.experts.down_proj[e], (e, "down"))
    for module in ours.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    x = torch.randint(-3, 4, (37, 48)).float()
    with torch.no_grad():
        expected = hf_block(x[None])[0]
        got = ours(x)
        router_probs = torch.softmax(x @ hf_block.gate.weight.T, dim=-1)
    assert (router_probs[:, 1] == router_probs[:, 4]).all(), "the tie must be exact to test tie-breaking"
    second, third = router_probs.topk(3, dim=-1).values[:, 1:].T
    at_the_cut = (router_probs[:, 1] == second) & (second == third)  # only one of experts 1 and 4 gets in
    assert at_the_cut.any(), "no token has the tie at the top-k boundary"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_every_layer_reads_one_rope_table(arch_dirs):
    """One cos/sin table per model (~21 MB per layer for Qwen3 at 40960 positions if each had its own)."""
    llm = make_llm(arch_dirs["llama3"], num_kvcache_blocks=16, max_model_len=128)
    tables = {layer.self_attn.rotary_emb.cos_sin.data_ptr() for layer in llm.engine.model_runner.model.model.layers}
    assert len(tables) == 1

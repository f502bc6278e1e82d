"""The AVX512-VNNI kernels of cpu_int8.c: int8 weights (q + 128 as vpdpbusd's unsigned operand)
against their PyTorch reference, the packing, W4A8's VNNI tile against its AVX2 tile (the same bits),
and `quantization="int8"` choosing them. Skipped on CPUs without AVX512-VNNI (AVX2 runs the other
int8 kernels, tests/test_int8.py)."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import cpu_kernels
from nanoserve.kernels.cpu_int8 import (
    PANEL, VNNI_ZERO, Int4Kernels, Int8Kernels, int8_gemm_vnni_torch, pack_int4, pack_int8_vnni, quantize_weight_int8,
)

LIB = cpu_kernels.load()
VNNI = LIB is not None and LIB.int8_gemm_supported() and bool(LIB.vnni_supported())
pytestmark = pytest.mark.skipif(not VNNI, reason="needs a CPU with AVX512-VNNI")

# rows: every tile height 1-8, a full 8-row tile plus a ragged one, past one 256-row block.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 65, 257, 300]
# (N, K, group): N not a multiple of the 16-column panel, K not a multiple of the 32-input block,
# per channel (None) and groups of whole blocks.
SHAPES = [(101, 64, None), (35, 101, None), (16, 3, None), (1, 130, None), (40, 1000, None), (33, 256, 64),
          (20, 160, 32), (40, 200, 32),  # groups that do not divide K
          (33, 200, 64),  # two-block scale runs, the last group partial
          (37, 520, 128),  # four-block runs in groups, the last group one partial block
          (20, 288, 96)]  # three blocks a group: one scale per block (a run never spans two groups)


def _case(rows: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # per-channel spread
    x = torch.randn(rows, k, generator=g)
    channels = torch.randperm(k, generator=g)[: max(1, k // 40)]
    x[:, channels] *= 20 + 80 * torch.rand(len(channels), generator=g)  # outlier channels, kept exact
    return weight, x, torch.randn(n, generator=g)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, group", SHAPES)
def test_int8_vnni_kernel_matches_reference(rows, n, k, group):
    weight, x, bias = _case(rows, n, k, rows * 1000 + n + k)
    q, scales = quantize_weight_int8(weight, group)
    packed = pack_int8_vnni(q, scales, group)
    kernels = Int8Kernels(LIB)
    for b in (None, bias):
        got = kernels.vnni(x, packed, b)
        ref = int8_gemm_vnni_torch(x, q, scales, group, b)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    # bf16 rows in and out: the float32 call's result, rounded
    got = kernels.vnni(x.bfloat16(), packed, bias, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, kernels.vnni(x.bfloat16().float(), packed, bias).bfloat16())


def test_vnni_packing_holds_q_plus_128_in_vpdpbusd_order():
    weight, _, _ = _case(1, 37, 70, 0)
    q, scales = quantize_weight_int8(weight)
    packed = pack_int8_vnni(q, scales)
    panels, kp = packed.panels, 96  # K rounded up to whole 32-input blocks
    assert panels.shape == (3, kp // 4, PANEL, 4) and panels.dtype == torch.uint8
    # [panel, step, column, input] back to [column, k]
    u = panels.permute(0, 2, 1, 3).reshape(3 * PANEL, kp)
    assert torch.equal(u[:37, :70].int() - VNNI_ZERO, q.int())
    assert (u[37:] == VNNI_ZERO).all() and (u[:, 70:] == VNNI_ZERO).all()  # padding is zero
    assert torch.equal(packed.offsets, -VNNI_ZERO * packed.scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int8_vnni(*quantize_weight_int8(weight, 16), 16)


# activation runs of 4 (group 128, one group spanning K: 4 + 3 blocks at k 200), of 2 (group 64, the
# last group partial), of 1 (groups of 1 or 3 blocks); a last group of one block (520); one block (3);
# 6 and 7 groups: the zero-point term's four chains and a tail of 2 or 3
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 14, 17, 300])
@pytest.mark.parametrize("n, k, group", [(101, 256, 128), (37, 520, 128), (33, 200, 64), (20, 288, 96), (16, 64, 32),
                                         (24, 200, 200), (35, 100, 100), (16, 3, 3), (20, 224, 32), (33, 416, 64),
                                         (40, 768, 128)])
def test_w4a8_vnni_tile_gives_the_avx2_tiles_bits(rows, n, k, group):
    g = torch.Generator().manual_seed(rows + n + k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (n, -(-k // group)), generator=g, dtype=torch.int32)
    scales = torch.rand(zeros.shape, generator=g) * 0.1
    _, x, bias = _case(rows, n, k, rows)
    packed, kernels = pack_int4(q, zeros, scales, group, w4a8=True), Int4Kernels(LIB)
    try:
        LIB.set_w4a8_vnni(0)
        avx2 = kernels(x, packed, bias)
        LIB.set_w4a8_vnni(1)
        vnni = kernels(x, packed, bias)
    finally:
        LIB.set_w4a8_vnni(1)
    assert torch.equal(vnni, avx2)


@pytest.mark.parametrize("rows", [1, 6, 16])
def test_w4a8_tiles_agree_with_outliers_in_some_groups_and_rows_only(rows):
    """Outliers in groups 0 and 2 of even rows only: rows without any, and a group without between two
    with, take their own path through both tiles' finish."""
    n, k, group = 33, 416, 64
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (n, -(-k // group)), generator=g, dtype=torch.int32)
    scales = torch.rand(zeros.shape, generator=g) * 0.1
    x = torch.randn(rows, k, generator=g)
    x[0::2, 5], x[0::2, 2 * group + 7] = 400.0, -300.0
    packed, kernels = pack_int4(q, zeros, scales, group, w4a8=True), Int4Kernels(LIB)
    count = kernels.quantize_blocks(x, group)[3]
    assert int(count[0]) == 2 and (rows == 1 or int(count[1]) == 0)
    try:
        LIB.set_w4a8_vnni(0)
        avx2 = kernels(x, packed)
        LIB.set_w4a8_vnni(1)
        vnni = kernels(x, packed)
    finally:
        LIB.set_w4a8_vnni(1)
    assert torch.equal(vnni, avx2)


def test_llm_int8_runs_the_vnni_kernel_by_default(tiny_model, monkeypatch):
    from nanoserve import LLM, SamplingParams
    from nanoserve.kernels.cpu_gemm import Int8Gemm

    monkeypatch.delenv("NANOSERVE_CPU_INT8", raising=False)
    kw = dict(device="cpu", dtype="bfloat16", max_model_len=128, num_kvcache_blocks=64)
    llm = LLM(tiny_model, quantization="int8", **kw)
    assert "VNNI" in llm.engine.model_runner.backend.describe()["gemm"]
    gemms = [m.gemm for m in llm.engine.model_runner.model.modules() if hasattr(m, "gemm")]
    assert gemms and all(isinstance(g, Int8Gemm) and g.vnni for g in gemms)  # LM head included
    # one byte per weight (K padded to 32)
    for g in gemms:
        w = g.weight
        assert w.panels.numel() == -(-w.out_features // PANEL) * PANEL * -(-w.in_features // 32) * 32
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(3, 40))}]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    # W8A16 on the same weights: the same model up to the activations' rounding
    monkeypatch.setenv("NANOSERVE_CPU_INT8", "w8a16")
    ref = LLM(tiny_model, quantization="int8", **kw).generate(prompts, params, use_tqdm=False)
    same = sum(a == b for o, r in zip(out, ref) for a, b in zip(o.outputs[0].token_ids, r.outputs[0].token_ids))
    assert same >= 12  # of 16: a random model amplifies rounding, yet most greedy tokens agree


def test_vnni_request_is_checked_where_int8_weights_need_it():
    from nanoserve.backends.cpu import CPUBackend, CPUOptions
    from nanoserve.quantization.weight import QuantizedWeight

    # a model without int8 weights does not care which int8 path is asked for
    CPUBackend(torch.device("cpu"), torch.bfloat16, CPUOptions(int8="vnni"), quantization=None)
    backend = CPUBackend(torch.device("cpu"), torch.bfloat16, CPUOptions(int8="vnni"), quantization="int8")
    assert backend.int8_vnni
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    with pytest.raises(ValueError, match="group_size a multiple of 32.*16"):
        backend.prepare_quantized_linear(QuantizedWeight(q, torch.rand(32, 4), 16), None)

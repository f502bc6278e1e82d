"""The W4A16 and W4A8 kernels of cpu_int8.c (4-bit weights with group zero points and scales)
against their PyTorch references, W4A8's activation quantization (blocks of 32, outliers kept
exact) against its reference, and the split of a checkpoint's q - z integers into nibbles and
zero points."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import cpu_kernels
from nanoserve.kernels.cpu_int8 import (
    ACTIVATION_RUN_BLOCKS, PANEL, W4A8_BLOCK, W4A8_MAX_OUTLIERS, Int4Kernels, Int8Kernels, fits_int4,
    int4_gemm_w4a8_torch, int4_gemm_w4a16_torch, pack_int4, quantize_blocks_int8_torch, quantize_weight_int8,
    activation_run_blocks, split_int4,
)

LIB = cpu_kernels.load()
KERNELS = Int4Kernels(LIB) if LIB is not None and LIB.int8_gemm_supported() else None
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="no AVX2/FMA build of the CPU kernels")

# rows: every tile height 1-6, a full tile plus a ragged one, past one 256-row block.
ROWS = [1, 2, 3, 4, 5, 6, 7, 16, 65, 257, 300]
# (N, K, group): N not a multiple of the 16-column panel, K not a multiple of the group (a short
# last group), odd K, one group spanning K (per channel), a group of 2.
SHAPES = [(101, 64, 32), (35, 100, 16), (16, 3, 2), (1, 130, 128), (40, 97, 97)]


def _case(rows: int, n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (n, groups), generator=g, dtype=torch.int32)  # GPTQ v1 zeros reach 16
    scales = torch.rand(n, groups, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    return q, zeros, scales, torch.randn(rows, k, generator=g) * 3, torch.randn(n, generator=g)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, group", SHAPES)
def test_w4a16_kernel_matches_reference(rows, n, k, group):
    q, zeros, scales, x, bias = _case(rows, n, k, group, rows * 1000 + n + k)
    packed = pack_int4(q, zeros, scales, group)
    for b in (None, bias):
        got = KERNELS.w4a16(x, packed, b)
        ref = int4_gemm_w4a16_torch(x, q, zeros, scales, group, b)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        # float32 sums of x * q, then - z * (sum of x) per group: float32 rounding of both
        torch.testing.assert_close(got, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)


@needs_kernel
def test_w4a16_weights_take_half_the_int8_bytes():
    q, zeros, scales, _, _ = _case(1, 256, 1024, 128, 0)
    int4 = pack_int4(q, zeros, scales, 128)
    int8 = Int8Kernels(LIB).pack(*quantize_weight_int8(torch.randn(256, 1024), 128), 128)
    assert int4.panels.numel() * 2 == int8.panels.numel()
    assert int4.panels.shape == (256 // PANEL, 1024, PANEL // 2) and int4.panels.dtype == torch.uint8


def test_split_int4_recovers_nibbles_and_zero_points_exactly():
    q, zeros, _, _, _ = _case(1, 37, 70, 16, 1)
    values = (q.int() - zeros.repeat_interleave(16, dim=1)[:, :70]).to(torch.int8)  # what a checkpoint decodes to
    assert fits_int4(values, 16)
    q2, z2 = split_int4(values, 16)
    assert q2.dtype == torch.uint8 and int(q2.max()) <= 15
    assert torch.equal(q2.int() - z2.repeat_interleave(16, dim=1)[:, :70], values.int())


def test_values_spanning_more_than_16_levels_in_a_group_do_not_fit_int4():
    values = torch.zeros(4, 64, dtype=torch.int8)
    values[2, 40] = 16  # group 1 of row 2 spans 0 .. 16: 17 levels
    assert not fits_int4(values, 32)
    assert fits_int4(values, 64) is False and fits_int4(values[:, :32], 32)


# ---- W4A8 -----------------------------------------------------------------------------------------

# groups W4A8 takes: whole blocks of 32 inputs, or one group spanning K; K a multiple of 32 or not,
# N not a multiple of 16, a K shorter than one block.
W4A8_SHAPES = [(101, 64, 32), (40, 97, 97), (33, 200, 64), (16, 3, 3), (20, 70, 32), (48, 256, 128),
               (24, 200, 200),  # one group spanning K: activation runs of 4 + 3 blocks
               (20, 224, 32), (33, 416, 64)]  # 7 groups: the zero-point term's four chains and a tail


def _with_outliers(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A few input channels 20-100x the rest, as the hidden states of LLaMA/Qwen-class models have."""
    g = torch.Generator().manual_seed(seed)
    channels = torch.randperm(x.shape[1], generator=g)[: max(1, x.shape[1] // 40)]
    x = x.clone()
    x[:, channels] *= 20 + 80 * torch.rand(len(channels), generator=g)
    return x


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, group", W4A8_SHAPES)
@pytest.mark.parametrize("tile", ["default", "avx2"])  # avx2: the AVX2 tile where VNNI would run it
def test_w4a8_kernel_matches_reference(rows, n, k, group, tile):
    if tile == "avx2" and not LIB.vnni_supported():
        pytest.skip("the default tile is the AVX2 one here")
    q, zeros, scales, x, bias = _case(rows, n, k, group, rows * 1000 + n + k)
    x = _with_outliers(x, rows + k)
    packed = pack_int4(q, zeros, scales, group, w4a8=True)
    try:
        LIB.set_w4a8_vnni(0 if tile == "avx2" else 1)
        for b in (None, bias):
            got = KERNELS(x, packed, b)
            ref = int4_gemm_w4a8_torch(x, q, zeros, scales, group, b)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            torch.testing.assert_close(got, ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    finally:
        LIB.set_w4a8_vnni(1)  # the library's default (VNNI where the CPU has it)


@needs_kernel
# scale_blocks 4: the kernels' default; 1, 2: groups of fewer blocks; 3: partial runs
@pytest.mark.parametrize("scale_blocks", [1, 2, 3, 4])
# k: whole sixteen-block chunks (1024, 3072) and a tail after them (1000: 32 blocks, the last partial; 1100: 35)
@pytest.mark.parametrize("rows, k, heavy", [(1, 64, False), (7, 97, False), (300, 1024, False), (3, 3, False),
                                           (5, 3072, True), (3, 1000, False), (4, 1100, True)])
def test_w4a8_activation_quantization_equals_reference_exactly(rows, k, heavy, scale_blocks):
    gen = torch.Generator().manual_seed(k)
    x = _with_outliers(torch.randn(rows, k, generator=gen) * 2, rows)
    if heavy:  # SiLU-and-mul's heavy tails, a down projection's input: most blocks hold an outlier
        x = torch.nn.functional.silu(x) * torch.randn(rows, k, generator=gen)
    x[0, : min(k, 40)] = 0.0  # an all-zero block: scale 0, no outlier
    qx, xs, outlier = quantize_blocks_int8_torch(x, scale_blocks=scale_blocks)
    got_qx, got_xs, _, count, inputs, values = KERNELS.quantize_blocks(x, k, scale_blocks=scale_blocks)
    assert torch.equal(got_qx, qx) and torch.equal(got_xs, xs)
    runs = got_xs[:, : got_xs.shape[1] // scale_blocks * scale_blocks].view(rows, -1, scale_blocks)
    assert (runs == runs[..., :1]).all()  # one scale per run of blocks
    assert got_qx.shape == (rows, -(-k // W4A8_BLOCK) * W4A8_BLOCK) and int(got_qx.abs().max()) <= 127
    assert torch.equal(count.long(), outlier.sum(1))
    for m in range(rows):  # the outliers' inputs in order, their values exactly x's
        cols = outlier[m].nonzero().flatten()
        assert torch.equal(inputs[m, : count[m]].long(), cols) and torch.equal(values[m, : count[m]], x[m, cols])
    assert int(count.max()) <= -(-k // W4A8_BLOCK) * W4A8_MAX_OUTLIERS


@needs_kernel
@pytest.mark.parametrize("scale_blocks", [2, 4])
def test_a_run_of_blocks_keeps_one_scale_even_with_a_nan(scale_blocks):
    x = torch.randn(2, 1024)
    x[0, 31] = float("nan")  # the first run's first block: its amax NaN, vmaxps's result order-dependent
    xs = KERNELS.quantize_blocks(x, 1024, scale_blocks=scale_blocks)[1]
    runs = xs.view(2, -1, scale_blocks)
    assert torch.allclose(runs, runs[..., :1].expand_as(runs), rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(LIB is None, reason="no C compiler")
@pytest.mark.parametrize("group, k", [(1024, 1024), (4096, 1024), (3072, 3072), (32, 1024), (64, 1024), (96, 288),
                                      (128, 1024), (256, 1000), (160, 320), (192, 1024)])
def test_activation_scale_runs_never_span_two_weight_groups_and_the_reference_agrees(group, k):
    run = LIB.activation_run_blocks(group, k)
    assert run == activation_run_blocks(group, k)  # the PyTorch references quantize as the kernels do
    assert 1 <= run <= ACTIVATION_RUN_BLOCKS
    if group < k:  # the longest run that divides the group
        assert (group // 32) % run == 0 and (run == ACTIVATION_RUN_BLOCKS or (group // 32) % (2 * run))


@needs_kernel
def test_w4a8_keeps_outlier_channels_exact_so_their_blocks_keep_their_resolution():
    """With 100x channels, per-block int8 alone would round their blocks' other inputs to a few
    levels; kept exact, W4A8 stays within ~1% of the exact-activation W4A16."""
    q, zeros, scales, x, _ = _case(16, 64, 512, 128, 5)
    x[:, [3, 130, 300]] = 300.0 * torch.sign(x[:, [3, 130, 300]])  # x is ~N(0, 9): 100 standard deviations
    ref = KERNELS.w4a16(x, pack_int4(q, zeros, scales, 128))
    got = KERNELS(x, pack_int4(q, zeros, scales, 128, w4a8=True))
    assert int(KERNELS.quantize_blocks(x, 128)[3].min()) >= 3  # every row: the three channels at least
    assert (got - ref).norm() / ref.norm() < 0.01


def test_w4a8_refuses_groups_that_split_its_activation_blocks():
    q, zeros, scales, _, _ = _case(1, 16, 64, 16, 0)
    with pytest.raises(ValueError, match="group_size a multiple of 32"):
        pack_int4(q, zeros, scales, 16, w4a8=True)
    with pytest.raises(ValueError, match="w4a16 takes"):
        Int4Kernels.w4a16(KERNELS, torch.zeros(1, 64), pack_int4(*_case(1, 16, 64, 32, 0)[:3], 32, w4a8=True))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_gemm_kernels_take_and_give_bf16_rows_as_the_float32_call_rounded(rows):
    # Each GEMM kernel reads bf16 x and writes bf16 y itself: bit for bit the float32 call on the
    # widened x, its result rounded (what the torch conversions around the call did). 300 x 1024:
    # past 2^18 values the conversions run threaded.
    n, k, group = 70, 1024, 64
    q, zeros, scales, x, bias = _case(rows, n, k, group, rows)
    x = x.bfloat16()
    int8 = Int8Kernels(LIB)
    panels = cpu_kernels.CPUKernels(LIB).pack_panels(torch.randn(n, k).bfloat16())
    weight8 = int8.pack(*quantize_weight_int8(torch.randn(n, k), None), None)
    kernels = {
        "panel": lambda x, out: cpu_kernels.CPUKernels(LIB).panel_gemm(x, panels, n, bias, out),
        "w8a16": lambda x, out: int8.w8a16(x, weight8, bias, out),
        "w4a16": lambda x, out: KERNELS(x, pack_int4(q, zeros, scales, group), bias, out),
        "w4a8": lambda x, out: KERNELS(x, pack_int4(q, zeros, scales, group, w4a8=True), bias, out),
    }
    for name, gemm in kernels.items():
        as_float = gemm(x.float(), torch.float32)
        got_float, got_bf16 = gemm(x, torch.float32), gemm(x, torch.bfloat16)
        assert got_float.dtype == torch.float32 and got_bf16.dtype == torch.bfloat16, name
        assert torch.equal(got_float, as_float), name
        assert torch.equal(got_bf16, as_float.to(torch.bfloat16)), name

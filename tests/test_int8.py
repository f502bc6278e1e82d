"""int8 weights on the CPU: the C kernels of cpu_int8.c against their PyTorch references, the
quantizer's invariants, and the packed weights' size."""
from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import cpu_kernels
from nanoserve.kernels.cpu_int8 import (
    QMAX, Int8Kernels, dequantize_weight_int8, int8_gemm_w8a8_torch, int8_gemm_w8a16_torch, quantize_rows_int8_torch,
    quantize_weight_int8,
)

LIB = cpu_kernels.load()
KERNELS = Int8Kernels(LIB) if LIB is not None and LIB.int8_gemm_supported() else None
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="no AVX2/FMA build of the CPU kernels")

# rows: every tile height 1-6, a full tile plus a ragged one, past one 256-row block.
ROWS = [1, 2, 3, 4, 5, 6, 7, 16, 65, 257, 300]
# (N, K): N not a multiple of the 16-column panel, K odd (the padded pair) and not a multiple of 8.
SHAPES = [(101, 64), (35, 101), (16, 3), (1, 130)]


def _case(rows: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # per-channel spread
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    return weight, x, bias


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_kernels_match_references(rows, n, k, group_size):
    weight, x, bias = _case(rows, n, k, rows * 1000 + n + k)
    q, scales = quantize_weight_int8(weight, group_size)
    packed = KERNELS.pack(q, scales, group_size)
    for kernel, reference in ((KERNELS.w8a16, int8_gemm_w8a16_torch), (KERNELS.w8a8, int8_gemm_w8a8_torch)):
        for b in (None, bias):
            got = kernel(x, packed, b)
            ref = reference(x, q, scales, group_size, b)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            # float32 sums (w8a16) or the float32 rescale of exact int32 sums (w8a8)
            torch.testing.assert_close(got, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows, k", [(1, 1), (3, 64), (300, 101)])
def test_activation_quantizer_matches_reference_exactly(rows, k):
    x = torch.randn(rows, k) * 10
    x[0] = 0.0  # a zero row: scale 0, all zeros
    q, s = KERNELS.quantize_rows(x, k + 3)
    ref_q, ref_s = quantize_rows_int8_torch(x)
    assert torch.equal(q[:, :k], ref_q) and torch.equal(s, ref_s)
    assert not q[:, k:].any()  # the padding stays zero
    assert q.abs().max() <= QMAX


@pytest.mark.parametrize("group_size", [None, 16])
def test_weight_quantizer_is_symmetric_per_channel_within_half_a_step(group_size):
    weight, _, _ = _case(1, 37, 70, 3)
    weight[5] = 0.0  # an all-zero channel stays zero, with no division by zero
    q, scales = quantize_weight_int8(weight, group_size)
    assert q.dtype == torch.int8 and q.abs().max() == QMAX and q.min() >= -QMAX
    err = (dequantize_weight_int8(q, scales, group_size) - weight).abs()
    step = scales.repeat_interleave(group_size or 70, dim=1)[:, :70]
    assert (err <= step / 2 + 1e-7).all()
    assert not q[5].any() and not scales[5].any()
    # each channel (group) reaches +-127 exactly once its max is hit: the full range is used
    assert (q.abs().amax(dim=1)[scales[:, 0] > 0] == QMAX).all()


def test_weight_quantizer_refuses_odd_groups():
    with pytest.raises(ValueError, match="group_size"):
        quantize_weight_int8(torch.randn(4, 64), 7)


@needs_kernel
def test_packed_int8_weight_is_half_the_bf16_bytes():
    weight = torch.randn(1024, 3072).bfloat16()
    q, scales = quantize_weight_int8(weight)
    packed = KERNELS.pack(q, scales)
    bf16_bytes = weight.numel() * weight.element_size()
    assert packed.panels.dtype == torch.int8
    # int8 panels (no padding at this shape) plus one float32 scale per channel
    assert packed.nbytes == bf16_bytes / 2 + 4 * 1024


@needs_kernel
def test_instruction_peak_loops_count_their_work():
    for name, per_iter in (("peak_loop_fma_f32", 12 * 8), ("peak_loop_madd_i16", 12 * 16),
                           ("peak_loop_maddubs_u8s8", 12 * 32)):
        assert getattr(LIB, name)(1000, 2) == 1000 * per_iter * 2

"""CPU fast paths against their references: the C kernels (paged attention, RMSNorm, q/k norm + RoPE)
and the prepacked float32 GEMM."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import as_fp32_batch, make_paged_batch, naive_paged_attention
from nanoserve.backends.base import Backend
from nanoserve.backends.cpu import gemm_unavailable
from nanoserve.kernels import cpu_attention as ca
from nanoserve.kernels import cpu_kernels
from nanoserve.kernels.cpu_gemm import BucketedLinear, DotBF16Gemm, OneDNNGemm, PanelGemm, row_bucket
from nanoserve.layers.context import ModelContext
from nanoserve.layers.rotary_embedding import RotaryEmbedding

LIB = cpu_kernels.load()
KERNELS = cpu_kernels.CPUKernels(LIB) if LIB is not None else None
REFERENCE = Backend(torch.device("cpu"), torch.bfloat16)
needs_kernel = pytest.mark.skipif(LIB is None, reason="no C compiler: the CPU kernels are not built")


def varlen_cpu(b: dict) -> torch.Tensor:
    """The varlen C kernel on every query run, however long (the backend sends long ones to SDPA)."""
    tiles = ca.varlen_tiles(b["cu_seqlens_q"], b["context_lens"])
    return ca.paged_attention_varlen_cpu(LIB, b["q"], b["k_cache"], b["v_cache"], b["block_tables"], tiles, b["scale"])


def decode_cpu(b: dict) -> torch.Tensor:
    plan = ca.decode_plan(b["block_tables"], b["context_lens"])
    return ca.paged_attention_decode_cpu(LIB, b["q"], b["k_cache"], b["v_cache"], plan, b["scale"])

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Max abs error against float64 attention over the same (rounded) inputs; bf16/fp16 round the output.
ATOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 3e-3}

CASES = {
    # name: (seqs as (q_len, context_len), num_heads, num_kv_heads, head_dim, block_size)
    "mha_prefill": ([(7, 7), (3, 3)], 4, 4, 16, 4),
    "gqa2_mixed": ([(5, 5), (3, 11), (1, 9), (4, 4)], 4, 2, 16, 4),
    "gqa4_prefix": ([(6, 20), (2, 17)], 8, 2, 32, 8),
    "mqa_block1": ([(3, 6), (1, 5)], 4, 1, 16, 1),
    "gqa3_block6_d24": ([(4, 13), (1, 7), (7, 7)], 6, 2, 24, 6),
    "gqa3_d64": ([(1, 45), (2, 9), (1, 1)], 6, 2, 64, 16),  # an odd GQA group in the AVX-512 decode loops
    "mha_d64": ([(2, 29), (1, 8)], 4, 4, 64, 16),  # one query head a KV head: the two-head loops' lone head
    # Longer than one 32-token tile, a cached prefix, Qwen3-0.6B's head shape.
    "qwen3_shape_multi_tile": ([(40, 40), (6, 70), (1, 33), (33, 100)], 16, 8, 128, 16),
}


@needs_kernel
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_kernel_matches_naive(name, dtype):
    seqs, heads, kv_heads, head_dim, block_size = CASES[name]
    b = make_paged_batch(seqs, heads, kv_heads, head_dim, block_size, dtype=DTYPES[dtype])
    got = varlen_cpu(b)
    assert got.dtype == DTYPES[dtype] and got.shape == b["q"].shape
    torch.testing.assert_close(got.double(), naive_paged_attention(as_fp32_batch(b)), atol=ATOL[dtype], rtol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_decode_kernel_matches_naive(name, dtype):
    seqs, heads, kv_heads, head_dim, block_size = CASES[name]
    b = make_paged_batch([(1, ctx) for _, ctx in seqs], heads, kv_heads, head_dim, block_size, dtype=DTYPES[dtype])
    got = decode_cpu(b)
    torch.testing.assert_close(got.double(), naive_paged_attention(as_fp32_batch(b)), atol=ATOL[dtype], rtol=0)


@needs_kernel
def test_decode_kernel_splits_kv_heads_for_few_sequences():
    # One sequence: work is split across KV heads so no thread idles; the result must not change.
    b = make_paged_batch([(1, 50)], 16, 8, 128, 16)
    torch.testing.assert_close(decode_cpu(b).double(),
                               naive_paged_attention(b), atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("kv_per_item", ["auto", "one", "all"])
@pytest.mark.parametrize("name", ["gqa2_mixed", "gqa3_block6_d24", "qwen3_shape_multi_tile", "gqa3_d64", "gqa4_prefix",
                                  "mha_d64"])
def test_decode_kernel_bf16_io_is_the_float32_result_rounded(name, kv_per_item, monkeypatch):
    # bf16 q/out are read and written inside the kernel: bit for bit the float32 call's output
    # rounded to bf16 (what the conversions around the call used to do). On AVX512-BF16 a bf16 q
    # takes the vdpbf16ps loops (head_dim % 32 == 0), whose float32 sums differ in the last bits:
    # there a rare output one bf16 step off, where the float32 value sits on a rounding boundary.
    # kv_per_item: KV heads a work item reads together (one row of each key), as the thread count picks
    # them, or forced to one and to all (the loops' per-head offsets within a row)
    seqs, heads, kv_heads, head_dim, block_size = CASES[name]
    if kv_per_item != "auto":
        monkeypatch.setattr(ca, "kv_heads_per_item", lambda *_: 1 if kv_per_item == "one" else kv_heads)
    b = make_paged_batch([(1, ctx) for _, ctx in seqs], heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16)
    plan = ca.decode_plan(b["block_tables"], b["context_lens"])
    as_float = ca.paged_attention_decode_cpu(LIB, b["q"].float(), b["k_cache"], b["v_cache"], plan, b["scale"])
    got = decode_cpu(b)
    assert as_float.dtype == torch.float32 and got.dtype == torch.bfloat16
    rounded = as_float.to(torch.bfloat16)
    if not (LIB.decode_dpbf16_supported() and head_dim % 32 == 0):
        assert torch.equal(got, rounded)
        return
    off = got != rounded
    assert off.float().mean() < 0.01
    one_step = torch.finfo(torch.bfloat16).eps * as_float.abs().clamp_min(2 ** -126)  # 2^-7 relative: a step
    assert ((got.float() - rounded.float()).abs() <= one_step)[off].all()
    # and within float32 rounding of the float32-q call
    torch.testing.assert_close(got.float(), as_float, atol=1e-6, rtol=2 ** -8)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_varlen_long_queries_run_sdpa_per_sequence(dtype):
    # Past VARLEN_MAX_Q query tokens: SDPA per sequence and per block of SDPA_Q_BLOCK query rows,
    # with and without a cached prefix, a block boundary on and off the last row.
    n, q_block = ca.VARLEN_MAX_Q, ca.SDPA_Q_BLOCK
    seqs = [(n + 5, n + 5), (n + 1, n + 40), (3, 3), (1, 17), (2 * n, 2 * n), (n + 10, n + 12), (2 * n, 3 * n),
            (2 * q_block, 2 * q_block), (2 * q_block + 7, 2 * q_block + 30), (q_block + 1, q_block + 1)]
    b = make_paged_batch(seqs, 8, 2, 32, 8, dtype=DTYPES[dtype])
    got = ca.varlen_sdpa_per_sequence(
        b["q"], b["k_cache"], b["v_cache"], b["cu_seqlens_q"], b["context_lens"], b["block_tables"], b["scale"]
    )
    assert got.dtype == DTYPES[dtype]
    torch.testing.assert_close(got.double(), naive_paged_attention(as_fp32_batch(b)), atol=ATOL[dtype], rtol=0)


PREFILL_DPBF16 = LIB is not None and bool(LIB.prefill_attention_dpbf16_supported())


# P rounded to bf16 for P . V (pooling engines): each weight off by up to 2^-9 of itself
P_BF16_TOL = {False: dict(atol=2e-3, rtol=8e-3), True: dict(atol=6e-3, rtol=1.6e-2)}


@pytest.mark.skipif(not PREFILL_DPBF16, reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("p_bf16", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_dpbf16_prefill_attention_matches_naive(name, p_bf16):
    # bf16 products exact, float32 softmax and P . V: the float64 reference rounded to bf16, to a bf16
    # step. Every case: cached prefixes, GQA 1-4 (3 too), block sizes 1-16, head_dim 16-128.
    seqs, heads, kv_heads, head_dim, block_size = CASES[name]
    b = make_paged_batch(seqs, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16)
    assert ca.prefill_dpbf16_supported(LIB, b["q"], b["k_cache"]) == (head_dim % 16 == 0)
    if head_dim % 16:
        pytest.skip("head_dim not a multiple of 16: the backend keeps the other kernels")
    got = ca.prefill_attention_dpbf16(LIB, b["q"], b["k_cache"], b["v_cache"], b["cu_seqlens_q"], b["context_lens"],
                                      b["block_tables"], b["scale"], p_bf16)
    assert got.dtype == torch.bfloat16 and got.shape == b["q"].shape
    torch.testing.assert_close(got.double(), naive_paged_attention(as_fp32_batch(b)), **P_BF16_TOL[p_bf16])


@pytest.mark.skipif(not PREFILL_DPBF16, reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("p_bf16", [False, True])
def test_dpbf16_prefill_attention_sees_no_key_past_its_position(p_bf16):
    # A huge value row at every key: each query's output must move with exactly the keys up to its
    # own position (a causal off-by-one would pull in the next key's 1000s).
    seqs = [(40, 40), (20, 37), (17, 17)]
    b = make_paged_batch(seqs, 4, 2, 32, 8, dtype=torch.bfloat16)
    b["v_cache"].fill_(0.0)
    b["k_cache"].fill_(0.0)  # every score equal: the output is the mean of the visible values
    cu, ctx = b["cu_seqlens_q"].tolist(), b["context_lens"].tolist()
    for s, (q_len, n) in enumerate(seqs):
        for key in range(n):  # value of key j: j (every channel), at its slot
            block, off = b["block_tables"][s, key // 8].item(), key % 8
            b["v_cache"][block, off] = float(key)
    got = ca.prefill_attention_dpbf16(LIB, b["q"], b["k_cache"], b["v_cache"], b["cu_seqlens_q"], b["context_lens"],
                                      b["block_tables"], b["scale"], p_bf16).float()
    for s, (q_len, n) in enumerate(seqs):
        for i in range(q_len):
            pos = n - q_len + i  # keys 0..pos visible: their mean is pos / 2
            torch.testing.assert_close(got[cu[s] + i], torch.full_like(got[cu[s] + i], pos / 2), atol=0, rtol=4e-3)


@pytest.mark.skipif(not PREFILL_DPBF16, reason="needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("p_bf16", [False, True])
def test_dpbf16_prefill_attention_long_prompts_and_tile_edges(p_bf16):
    # Query runs across many 16-token tiles and 32-key chunks (a last chunk of up to 16 keys computes
    # only its first half), ending on and off their edges, with prefixes; large scores (a sharp
    # softmax) keep the running max honest.
    seqs = [(16, 16), (17, 40), (1, 1), (130, 130), (33, 301), (64, 64), (20, 48), (9, 81), (50, 112)]
    b = make_paged_batch(seqs, 8, 2, 64, 16, dtype=torch.bfloat16)
    b["q"] = (b["q"].float() * 6).bfloat16()
    got = ca.prefill_attention_dpbf16(LIB, b["q"], b["k_cache"], b["v_cache"], b["cu_seqlens_q"], b["context_lens"],
                                      b["block_tables"], b["scale"], p_bf16)
    torch.testing.assert_close(got.double(), naive_paged_attention(as_fp32_batch(b)), **P_BF16_TOL[p_bf16])


def _gemm(path: str, weight: torch.Tensor, bias: torch.Tensor):
    reason = gemm_unavailable(path, weight.dtype, KERNELS)
    if reason is not None:
        pytest.skip(reason)
    if path == "panel":
        return PanelGemm(weight, bias, KERNELS)
    if path == "dpbf16":
        return DotBF16Gemm(weight, bias, KERNELS)
    if path == "native":
        return BucketedLinear(weight, bias)
    return OneDNNGemm(weight, bias, torch.bfloat16 if path == "onednn-bf16" else torch.float32)


@pytest.mark.parametrize("path", ["panel", "dpbf16", "onednn-bf16", "onednn-fp32", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# the panel kernel's 1- to 6-row tiles, dpbf16's 1-8 (two chains a row) and 9-16-row ones, row blocks
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8, 9, 16, 17, 65, 300])
@pytest.mark.parametrize("out_features, in_features", [(101, 64), (96, 60), (33, 7)])  # ragged N; K % 8 != 0, odd K
def test_cpu_gemm_paths_match_f64_linear(path, dtype, rows, out_features, in_features):
    if path == "native" and dtype != torch.float32:
        pytest.skip("F.linear in bf16/fp16 rounds per its own kernel; the reference below is float32 math")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    got = _gemm(path, weight, bias)(x)
    ref = F.linear(x.double(), weight.double(), bias.double())  # exact products of the rounded inputs
    assert got.dtype == dtype and got.shape == (rows, out_features)
    # Float32 accumulation, then one rounding to dtype: at most one ulp of the output dtype off.
    tol = {torch.float32: 1e-4, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("path", ["panel", "dpbf16", "onednn-bf16", "onednn-fp32", "native"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_cpu_gemm_keeps_leading_dims_and_out_dtype(path, out_dtype):
    # The wrappers skip the no-op view and .to(): a [batch, seq, in] input must still come back
    # [batch, seq, out], equal to the 2-D call row for row, in out_dtype (default: the input's).
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=g).bfloat16()
    gemm = _gemm(path, weight, None)
    gemm.out_dtype = out_dtype
    x = torch.randn(2, 3, 24, generator=g).bfloat16()
    got, flat = gemm(x), gemm(x.reshape(6, 24))
    assert got.shape == (2, 3, 40) and got.dtype == (out_dtype or torch.bfloat16)
    assert torch.equal(got.reshape(6, 40), flat)


def test_row_buckets_are_few_and_cover_every_count():
    buckets = {row_bucket(m) for m in range(1, 8193)}
    assert len(buckets) <= 7 + 8192 // 64
    for m in range(1, 8193):
        b = row_bucket(m)
        assert b >= m and (b < 2 * m if m <= 64 else b - m < 64)


def _bf16_mismatches(got: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements that differ; a difference may only be a rounding step (summation order) of an
    intermediate bf16 value, so it is bounded by one bf16 ulp of the largest value."""
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    diff = (got.float() - ref.float()).abs()
    assert diff.max().item() <= ref.float().abs().max().item() * 2 ** -7, f"max diff {diff.max().item()}"
    return int((diff > 0).sum())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_module(rows, with_residual):
    g = torch.Generator().manual_seed(rows)
    weight, eps = (1 + 0.1 * torch.randn(1024, generator=g)).bfloat16(), 1e-6
    x = (3 * torch.randn(rows, 1024, generator=g)).bfloat16()
    residual = torch.randn(rows, 1024, generator=g).bfloat16() if with_residual else None
    with torch.inference_mode():
        got = KERNELS.rms_norm(x, weight, eps, residual)
        if with_residual:
            ref_residual = x + residual
            ref = REFERENCE.rms_norm(ref_residual, weight, eps)
            got, got_residual = got
            assert torch.equal(got_residual, ref_residual)
        else:
            ref = REFERENCE.rms_norm(x, weight, eps)
    assert _bf16_mismatches(got, ref) <= ref.numel() // 1000


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_qk_norm_rope_kernel_matches_modules(tokens):
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim, eps = 16, 8, 128, 1e-6
    q_weight, k_weight = ((1 + 0.1 * torch.randn(head_dim, generator=g)).bfloat16() for _ in range(2))
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6, None, ModelContext(REFERENCE)).cos_sin
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16()
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)  # strided views
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    with torch.inference_mode():
        ref_q, ref_k = REFERENCE.qk_norm_rope(positions, q, k, cos_sin, q_weight, k_weight, eps)
        got_q, got_k = KERNELS.qk_norm_rope(positions, q, k, cos_sin, q_weight, k_weight, eps)
    mismatches = _bf16_mismatches(got_q, ref_q) + _bf16_mismatches(got_k, ref_k)
    assert mismatches <= (ref_q.numel() + ref_k.numel()) // 1000


@needs_kernel
@pytest.mark.parametrize("rows, n", [(1, 3072), (16, 100), (300, 256)])
def test_silu_and_mul_kernel_matches_module(rows, n):
    # n = 100: an AVX2 tail; 300 x 256: the threaded path. Values from -100 to 100 cover e^-g's clamp.
    g = torch.Generator().manual_seed(rows)
    x = (4 * torch.randn(rows, 2 * n, generator=g)).bfloat16()
    x[0, :4] = torch.tensor([-100.0, -89.0, 89.0, 100.0])
    with torch.inference_mode():
        got, ref = KERNELS.silu_and_mul(x), REFERENCE.silu_and_mul(x)
    assert got.shape == ref.shape == (rows, n) and got.dtype == torch.bfloat16
    assert _bf16_mismatches(got, ref) <= max(1, ref.numel() // 1000)


@needs_kernel
def test_small_kernels_decline_what_they_do_not_cover():
    x = torch.randn(4, 64)  # float32: the PyTorch module runs
    assert KERNELS.rms_norm(x, torch.ones(64), 1e-6) is None
    assert KERNELS.silu_and_mul(x) is None


# ---- store_kv -------------------------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("num_tokens, heads, head_dim, block_size", [(9, 1, 16, 4), (40, 8, 128, 16), (12, 4, 80, 1)])
def test_store_kv_c_equals_torch_and_writes_nothing_else(dtype, num_tokens, heads, head_dim, block_size):
    """The C copy writes exactly store_kv_torch's slots (-1 skipped), from K/V rows strided like slices of qkv."""
    from nanoserve.kernels.store_kv import store_kv_torch

    g = torch.Generator().manual_seed(num_tokens + head_dim)
    num_slots = (num_tokens // block_size + 3) * block_size
    slots = torch.randperm(num_slots - 1, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.3] = -1
    qkv = torch.randn(num_tokens, 3 * heads * head_dim, generator=g).to(DTYPES[dtype])
    key, value = (qkv[:, i * heads * head_dim:(i + 1) * heads * head_dim].view(num_tokens, heads, head_dim)
                  for i in (1, 2))
    init = torch.full((num_slots // block_size, block_size, heads, head_dim), 7.0, dtype=DTYPES[dtype])
    k_ref, v_ref, k_c, v_c = init.clone(), init.clone(), init.clone(), init.clone()
    store_kv_torch(key, value, k_ref, v_ref, slots)
    assert KERNELS.store_kv(key, value, k_c, v_c, slots)
    assert torch.equal(k_c, k_ref) and torch.equal(v_c, v_ref)
    # a cache in another dtype than the rows: declined, nothing written
    other = init.to(torch.float16)
    assert not KERNELS.store_kv(key, value, other, other.clone(), slots) and bool((other == 7.0).all())


@needs_kernel
@pytest.mark.parametrize("march", ["haswell", "x86-64-v2"])
def test_kernel_sources_compile_for_older_cpu_classes(march, tmp_path):
    """The library is built with -march=native, so a machine with AVX-512 never compiles the AVX2-only
    code (16 vector registers, no EVEX) or the scalar fallbacks: compile them for an AVX2 class
    (haswell) and for one without AVX (x86-64-v2), -Wall -Wextra as errors."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    flags = [f if f != "-march=native" else f"-march={march}" for f in cpu_kernels.CFLAGS if f != "-shared"]
    for source in cpu_kernels.SOURCES:
        run = subprocess.run([cc, *flags, "-Wall", "-Wextra", "-Werror", "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")],
                             capture_output=True, text=True)
        assert run.returncode == 0, f"{source.name} with -march={march}:\n{run.stderr[-3000:]}"

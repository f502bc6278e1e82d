"""CPU paged attention: the C kernels of cpu_kernels.c behind the torch references' semantics.

Decode runs the C decode kernel. Varlen (prefill, chunks) runs the C kernel over tiles of query
tokens for short query runs and SDPA per sequence for long ones, where SDPA's blocked GEMMs win.
The tiles depend only on the step's metadata, so the CPU backend builds them once per step
(`varlen_tiles`) and every layer reuses them. Both compute in float32 whatever the cache dtype.
"""
from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanoserve.kernels.trace import traced

# Measured on a 2-core AVX2 CPU: from ~64 query tokens per sequence SDPA on the gathered copy wins.
VARLEN_MAX_Q = 32
TILE = 32  # query tokens per prefill work item: each K/V row widened once serves TILE * G query rows
SDPA_Q_BLOCK = 64  # query rows per SDPA call of a long prefill (best of 32-128 at 128-512 tokens)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class VarlenTiles(NamedTuple):
    """Work items of the varlen C kernel: tile t covers `length[t]` query tokens of sequence `seq[t]`
    starting at packed token `start[t]`; its first token sees `nkeys0[t]` keys."""

    seq: torch.Tensor  # [num_tiles] int32
    start: torch.Tensor  # [num_tiles] int32
    length: torch.Tensor  # [num_tiles] int32
    nkeys0: torch.Tensor  # [num_tiles] int32
    max_keys: int  # the most keys any query token sees (sizes the kernel's scratch)

    @property
    def num_tiles(self) -> int:
        return self.seq.shape[0]


def varlen_tiles(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> VarlenTiles:
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    num_tiles = (q_lens + TILE - 1) // TILE
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0]), num_tiles)
    first_tile = torch.cumsum(num_tiles, 0) - num_tiles
    k = torch.arange(seq.shape[0]) - first_tile[seq]  # tile index within its sequence
    start = cu[:-1][seq] + k * TILE
    length = torch.minimum(q_lens[seq] - k * TILE, torch.tensor(TILE))
    nkeys0 = (context_lens.long() - q_lens)[seq] + k * TILE + 1
    max_keys = int((nkeys0 + length - 1).max()) if seq.numel() else 0
    return VarlenTiles(seq.int(), start.int(), length.int(), nkeys0.int(), max_keys)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != v_cache.dtype:
        raise ValueError("the CPU attention kernel needs contiguous K/V cache views of one dtype")


def paged_attention_varlen_cpu(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    tiles: VarlenTiles,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_cache(k_cache, v_cache)
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    if tiles.num_tiles == 0:
        return out.to(q.dtype)
    bt = block_tables.to(torch.int32).contiguous()
    with traced("nanoserve::cpu_paged_attention_varlen"):
        err = lib.paged_attention_f32(
            qf.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), DTYPE_CODES[k_cache.dtype],
            bt.data_ptr(), bt.shape[1], tiles.seq.data_ptr(), tiles.start.data_ptr(), tiles.length.data_ptr(),
            tiles.nkeys0.data_ptr(), tiles.num_tiles, TILE, tiles.max_keys, num_heads, num_kv_heads, head_dim,
            block_size, scale, torch.get_num_threads(),
        )
    if err:
        raise MemoryError("the CPU attention kernel could not allocate its scratch buffers")
    return out.to(q.dtype)


class DecodePlan(NamedTuple):
    """The decode kernel's per-step inputs, the same for every layer."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, contiguous
    context_lens: torch.Tensor  # [num_seqs] int32
    max_keys: int  # sizes the kernel's scratch: taken from the lengths themselves


def decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor) -> DecodePlan:
    lens = context_lens.to(torch.int32).contiguous()
    return DecodePlan(block_tables.to(torch.int32).contiguous(), lens, int(lens.max()) if lens.numel() else 0)


@functools.lru_cache(maxsize=256)
def kv_heads_per_item(num_seqs: int, num_kv_heads: int, threads: int) -> int:
    """Whole rows of KV heads per decode work item (contiguous reads) unless that leaves threads idle."""
    per_item = num_kv_heads
    while per_item > 1 and num_seqs * (num_kv_heads // per_item) < 2 * threads:
        per_item = next(d for d in range(per_item - 1, 0, -1) if num_kv_heads % d == 0)
    return per_item


def paged_attention_decode_cpu(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_cache(k_cache, v_cache)
    # bf16 q and out are read and written by the kernel itself (rounded as .to() rounds): at one
    # sequence the two conversions around the call cost a third of the kernel's time.
    dtype, io_bf16 = q.dtype, q.dtype == torch.bfloat16
    q = q.contiguous() if io_bf16 else q.to(torch.float32).contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype)
    if num_seqs == 0:
        return out if out.dtype == dtype else out.to(dtype)
    threads = torch.get_num_threads()
    bt = plan.block_tables
    with traced("nanoserve::cpu_paged_attention_decode"):
        err = lib.paged_decode_f32(
            q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), DTYPE_CODES[k_cache.dtype],
            bt.data_ptr(), bt.shape[1], plan.context_lens.data_ptr(), num_seqs, plan.max_keys, num_heads,
            num_kv_heads, head_dim, block_size, kv_heads_per_item(num_seqs, num_kv_heads, threads), scale,
            int(io_bf16), threads,
        )
    if err:
        raise MemoryError("the CPU attention kernel could not allocate its scratch buffers")
    return out if out.dtype == dtype else out.to(dtype)  # a no-op .to() costs ~3 us


PREFILL_DPBF16_MAX_HEAD_DIM = 512  # cpu_dpbf16.c's PA_MAX_D


def prefill_dpbf16_supported(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Does cpu_dpbf16.c's prefill attention take this step (AVX512-BF16, bf16 queries and cache, a head
    of whole 16-value chunks)?"""
    head_dim = q.shape[-1]
    return (bool(lib.prefill_attention_dpbf16_supported()) and q.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16 and head_dim % 16 == 0 and head_dim <= PREFILL_DPBF16_MAX_HEAD_DIM)


def prefill_attention_dpbf16(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    p_bf16: bool = False,
) -> torch.Tensor:
    """Causal prefill attention with vdpbf16ps (cpu_dpbf16.c): bf16 dot products for the scores, float32
    softmax and P . V; bf16 out. Long query runs' path on AVX512-BF16 CPUs, where SDPA per sequence
    widened the cache to float32 first. p_bf16: P rounded to bf16 for P . V (vdpbf16ps, two keys an
    instruction, as flash-attn's GPU kernels): ~1.2x faster, but it moved greedy tokens off HF's bf16
    model where two logits were close, so only pooling engines (a vector, not an argmax) take it."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_cache(k_cache, v_cache)
    q = q.contiguous()
    out = torch.empty_like(q)
    bt = block_tables.to(torch.int32).contiguous()
    cu, lens = cu_seqlens_q.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    with traced("nanoserve::cpu_prefill_attention_dpbf16"):
        err = lib.prefill_attention_dpbf16(
            q.data_ptr(), out.data_ptr(), 1, k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.shape[1],
            cu.data_ptr(), lens.data_ptr(), lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale,
            int(p_bf16), torch.get_num_threads(),
        )
    if err == 1:
        raise ValueError(f"the dpbf16 prefill attention needs AVX512-BF16 and head_dim a multiple of 16 up to "
                         f"{PREFILL_DPBF16_MAX_HEAD_DIM}, got {head_dim}")
    if err:
        raise MemoryError("the CPU attention kernel could not allocate its scratch buffers")
    return out


def varlen_sdpa_per_sequence(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
) -> torch.Tensor:
    """SDPA per sequence on its own blocks, in float32, no padding to the longest sequence
    (paged_attention_varlen_torch pads every sequence to the longest and masks explicitly), and
    per block of SDPA_Q_BLOCK query rows against the keys up to the block's last position only.
    torch's CPU flash kernel skips masked keys in blocks of 512 at best, so one causal call over a
    prompt of up to 512 tokens computes the whole square: the query blocks skip ~40% of that work
    (1.2-1.35x faster attention at 256-512 tokens on 2 Zen 1 cores, the same below)."""
    block_size = k_cache.shape[1]
    dtype = torch.float32
    out = torch.empty(q.shape, dtype=dtype)
    cu, ctxs = cu_seqlens_q.tolist(), context_lens.tolist()
    for s, ctx in enumerate(ctxs):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        ids = block_tables[s, : (ctx + block_size - 1) // block_size].long()
        # 4-D [1, heads, len, D]: with 3-D inputs SDPA takes its unfused math path on CPU.
        k = k_cache.index_select(0, ids).flatten(0, 1)[:ctx].to(dtype).transpose(0, 1)[None]  # [1, Hkv, ctx, D]
        v = v_cache.index_select(0, ids).flatten(0, 1)[:ctx].to(dtype).transpose(0, 1)[None]
        qs = q[start:end].to(dtype).transpose(0, 1)[None]  # [1, H, q_len, D]
        past = ctx - q_len  # cached tokens before the chunk: query i sits at position past + i
        for first in range(0, q_len, SDPA_Q_BLOCK):
            last = min(first + SDPA_Q_BLOCK, q_len)
            keys = past + last  # what the block's last query sees
            visible = torch.arange(keys)[None, :] <= torch.arange(past + first, keys)[:, None]
            o = F.scaled_dot_product_attention(qs[:, :, first:last], k[:, :, :keys], v[:, :, :keys],
                                               attn_mask=visible, scale=scale, enable_gqa=True)
            out[start + first : start + last] = o[0].transpose(0, 1)
    return out.to(q.dtype)

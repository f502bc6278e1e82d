"""A stand-in for the flash-attn 2 package on CPU tensors, for contract tests.

It enforces the rules upstream's `csrc/flash_attn/flash_api.cpp` checks (and the semantics its
`flash_attn_interface.py` documents) and computes the result in float32 with plain torch:
  * q/k/v fp16 or bf16, one dtype, last dimension contiguous; head_dim % 8 == 0 and <= 256;
    num_heads a multiple of num_heads_k; dropout 0;
  * cu_seqlens_q / cu_seqlens_k / cache_seqlens int32 and contiguous, of the batch's size;
  * paged KV: k/v [num_blocks, page_block_size, nheads_k, headdim], page_block_size % 256 == 0,
    block_table int32 with a contiguous last dimension, [batch, max_blocks]; every table entry a
    sequence reads (inside its key count) is a real block: padding is never read;
  * q shapes per call ([total_q, H, D] for varlen, [batch, seqlen_q, H, D] with the kv cache);
  * max_seqlen_q / max_seqlen_k at least the real lengths (upstream sizes its grid with them);
  * causal=True aligns the mask to the bottom right; a query row that sees no key outputs zeros.
The one rule not enforced is the device: these are CPU tensors. Every call is recorded in CALLS.
"""
from __future__ import annotations

import torch

__version__ = "2.8.3+fake"
PAGE_MULTIPLE = 256
CALLS: list[str] = []


class ContractError(RuntimeError):
    """What upstream raises as a c10::Error (a RuntimeError) from TORCH_CHECK."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.stride(-1) == 1, f"Input tensor {name} must have contiguous last dimension")
    head_dim = q.shape[-1]
    _check(head_dim % 8 == 0 and head_dim <= 256, f"head_dim must be a multiple of 8 and <= 256, got {head_dim}")
    _check(k.shape[-1] == head_dim and v.shape == k.shape, "k and v must match q's head_dim and each other")
    _check(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")


def _check_int32(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    _check(t.dtype == torch.int32, f"{name} must have dtype int32")
    _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _check_paged(k_cache: torch.Tensor, block_table: torch.Tensor, batch: int, seqlens_k: list[int]) -> None:
    _check(k_cache.dim() == 4, "a paged cache is [num_blocks, page_block_size, nheads_k, headdim]")
    page = k_cache.shape[1]
    _check(page % PAGE_MULTIPLE == 0, "Paged KV cache block size must be divisible by 256")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(block_table.dim() == 2 and block_table.shape[0] == batch, "block_table must be [batch, max_blocks]")
    for b, n in enumerate(seqlens_k):
        used = block_table[b, : -(-n // page)]
        _check(used.numel() == -(-n // page), f"sequence {b}: {n} keys need more block_table columns")
        _check(bool(((used >= 0) & (used < k_cache.shape[0])).all()), f"sequence {b} reads a padding block entry")


def _gather(cache: torch.Tensor, block_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    page = cache.shape[1]
    blocks = block_table[b, : -(-n // page)].long()
    return cache[blocks].flatten(0, 1)[:n]  # [n, nheads_k, headdim]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hk, D] -> [Lq, H, D], float32 inside, bottom-right causal alignment."""
    lq, lk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.float(), kf) * scale  # [H, Lq, Lk]
    if causal:
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)  # [Lq, Lk]
        scores = scores.masked_fill(~visible, float("-inf"))
        empty = ~visible.any(-1)  # rows that see no key: upstream outputs zeros
    else:
        empty = torch.zeros(lq, dtype=torch.bool)
    probs = torch.nan_to_num(scores.softmax(-1))
    out = torch.einsum("hij,jhd->ihd", probs, vf)
    out[empty] = 0.0
    return out.to(q.dtype)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):
    CALLS.append("varlen_paged" if block_table is not None else "varlen")
    _check_qkv(q, k, v)
    _check(dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None,
           "the fake covers dropout-free full attention only")
    batch = cu_seqlens_q.shape[0] - 1
    _check(batch > 0, "batch size must be positive")
    _check_int32("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    _check_int32("cu_seqlens_k", cu_seqlens_k, (batch + 1,))
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lens_q = [cu_q[b + 1] - cu_q[b] for b in range(batch)]
    lens_k = [cu_k[b + 1] - cu_k[b] for b in range(batch)]
    _check(q.dim() == 3 and q.shape[0] == cu_q[-1], f"q must be [total_q={cu_q[-1]}, nheads, headdim]")
    _check(max_seqlen_q >= max(lens_q) and max_seqlen_k >= max(lens_k), "max_seqlen_q/k below a real length")
    if block_table is not None:
        _check_paged(k, block_table, batch, lens_k)
    else:
        _check(k.dim() == 3 and k.shape[0] == cu_k[-1], f"k must be [total_k={cu_k[-1]}, nheads_k, headdim]")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b in range(batch):
        if block_table is not None:
            kb, vb = _gather(k, block_table, b, lens_k[b]), _gather(v, block_table, b, lens_k[b])
        else:
            kb, vb = k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        out[cu_q[b] : cu_q[b + 1]] = _attend(q[cu_q[b] : cu_q[b + 1]], kb, vb, scale, causal)
    return out


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False,
):
    # Upstream after v2.8.3 syncs the host here (seqlens_k.max().item()) when a block table is given.
    CALLS.append("kvcache")
    _check_qkv(q, k_cache, v_cache)
    _check(k is None and v is None and rotary_cos is None, "the fake covers reading the cache only")
    _check(q.dim() == 4, "q must be [batch, seqlen_q, nheads, headdim]")
    batch, seqlen_q = q.shape[:2]
    _check_int32("cache_seqlens", cache_seqlens, (batch,))
    lens_k = cache_seqlens.tolist()
    if block_table is not None:
        _check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        _check_paged(k_cache, block_table, batch, lens_k)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b in range(batch):
        if block_table is not None:
            kb, vb = _gather(k_cache, block_table, b, lens_k[b]), _gather(v_cache, block_table, b, lens_k[b])
        else:
            kb, vb = k_cache[b, : lens_k[b]], v_cache[b, : lens_k[b]]
        out[b] = _attend(q[b], kb, vb, scale, causal)
    return out

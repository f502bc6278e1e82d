"""Causal attention over a paged KV cache in plain PyTorch: the CPU backend and the reference.

Every sequence in a batch has `q_len` new query tokens (cu_seqlens_q) and `context_len` tokens in
the cache, the new ones included (their K/V were stored before this call). Query i of a sequence
sits at position context_len - q_len + i and sees keys 0..that position. One call covers prefill,
prefill on top of a cached prefix, a chunk of a long prompt and decode (q_len = 1).

History is read through block_tables: each sequence's K/V are gathered from the shared cache
for this call only; nothing per sequence is kept between steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int, padded with any index (-1 included)
    max_context_len: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_seqs, num_kv_heads, num_blocks_used * block_size, head_dim] (a transposed view)
    """Copy each sequence's blocks into one padded tensor, converted to `dtype` on the way.

    index_select on whole blocks is a plain row gather (several times faster than advanced
    indexing with a 2-D index); the dtype conversion then runs on a contiguous tensor.
    Padding entries are clamped to block 0: those keys are masked out, but must be finite.
    """
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    num_blocks_used = (max_context_len + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks_used].reshape(-1).long().clamp_(min=0)
    blocks = cache.index_select(0, ids)  # [S * nb, bs, Hkv, D]
    if dtype is not None and dtype != blocks.dtype:
        blocks = blocks.to(dtype)
    return blocks.view(num_seqs, num_blocks_used * block_size, num_kv_heads, head_dim).transpose(1, 2)


def paged_attention_decode_torch(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs]
    max_context_len: int,
    scale: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    dtype = compute_dtype or q.dtype
    k = gather_kv(k_cache, block_tables, max_context_len, dtype)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, max_context_len, dtype)
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = (key_pos[None, :] < context_lens[:, None])[:, None, None, :]  # [S, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.to(dtype).unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [S, H, 1, D]
    return out.squeeze(2).to(q.dtype)


def paged_attention_varlen_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    max_seqlen_q: int,
    max_context_len: int,
    scale: float,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    dtype = compute_dtype or q.dtype
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens, output_size=num_tokens)
    offset_in_seq = torch.arange(num_tokens, device=q.device) - cu_seqlens_q[:-1].long()[seq_of_token]

    q_pad = q.new_zeros(num_seqs, max_seqlen_q, num_heads, head_dim, dtype=dtype)
    q_pad[seq_of_token, offset_in_seq] = q.to(dtype)
    k = gather_kv(k_cache, block_tables, max_context_len, dtype)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, max_context_len, dtype)

    # Query i of sequence s sits at position context_len - q_len + i. Padding rows are clamped
    # to the last real key so no row is fully masked (their output is dropped anyway).
    query_pos = (context_lens - q_lens)[:, None] + torch.arange(max_seqlen_q, device=q.device)[None, :]
    query_pos = torch.minimum(query_pos, (context_lens - 1)[:, None])  # [S, Lq]
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None])[:, None]  # [S, 1, Lq, L]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [S, H, Lq, D]
    return out.transpose(1, 2)[seq_of_token, offset_in_seq].to(q.dtype)

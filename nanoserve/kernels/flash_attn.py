"""Thin wrappers around flash-attn 2 with the signatures of the torch references.

`flash_attn` is imported inside the calls, never at module import, so this module loads on
machines without it (CPU, or CUDA without the wheel); check `flash_attn_available()` first.

Constraints of the upstream flash-attn 2 package (Dao-AILab/flash-attention), as documented in
`flash_attn/flash_attn_interface.py` (flash_attn_with_kvcache docstring: "k_cache: ... or
(num_blocks, page_block_size, nheads_k, headdim) if there's a block_table (i.e. paged KV cache)
page_block_size must be a multiple of 256") and enforced in `csrc/flash_attn/flash_api.cpp`
for both mha_varlen_fwd and mha_fwd_kvcache (`TORCH_CHECK(!paged_KV || page_block_size % 256
== 0, "Paged KV cache block size must be divisible by 256")`):
  * paged KV: the cache's block size must be a multiple of 256 (forks such as vLLM's
    vllm-flash-attn relax this to 16, but the `flash_attn` package does not);
  * q/k/v dtype fp16 or bf16, all the same, last dimension contiguous, head_dim <= 256;
  * cu_seqlens_q, cu_seqlens_k, cache_seqlens and block_table must be int32 (block_table with a
    contiguous last dimension);
  * with a block_table, varlen still needs cu_seqlens_k [num_seqs + 1]: the cumulative
    *context* lengths, which give each sequence's key count (keys are then addressed through
    the block table, not through cu_seqlens_k offsets);
  * causal=True aligns the mask to the bottom right, i.e. query i of a sequence with q_len
    queries and context_len keys sees keys 0..context_len - q_len + i: exactly our semantics.
"""
from __future__ import annotations

import importlib.util

import torch

# Upstream flash-attn 2: paged KV block size must be divisible by this (see module docstring).
FLASH_ATTN_PAGE_BLOCK_MULTIPLE = 256


def flash_attn_available() -> bool:
    """Whether the `flash_attn` package is installed (looked up without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_supports_block_size(block_size: int) -> bool:
    """Whether flash-attn 2 accepts a paged KV cache with this block size.

    flash-attn 2 (Dao-AILab/flash-attention, flash_attn_interface.py: "page_block_size must be a
    multiple of 256"; flash_api.cpp raises "Paged KV cache block size must be divisible by 256"
    in both varlen_fwd and fwd_kvcache) only takes block sizes that are multiples of 256.
    """
    return block_size > 0 and block_size % FLASH_ATTN_PAGE_BLOCK_MULTIPLE == 0


def _check_block_size(k_cache: torch.Tensor) -> None:
    # Fail here with the fix spelled out rather than deep inside the CUDA extension.
    block_size = k_cache.shape[1]
    if not flash_attn_supports_block_size(block_size):
        raise ValueError(
            f"flash-attn 2 needs a KV-cache block size divisible by {FLASH_ATTN_PAGE_BLOCK_MULTIPLE}, "
            f"got {block_size}; use kvcache_block_size=256 or the triton attention backend"
        )


def paged_attention_varlen_flash(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    max_seqlen_q: int,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    from flash_attn import flash_attn_varlen_func

    _check_block_size(k_cache)
    # cu_seqlens_k: [num_seqs + 1] int32, cumulative context lengths starting at 0.
    cu_seqlens_k = torch.cat([context_lens.new_zeros(1), context_lens]).cumsum(0, dtype=torch.int32)
    return flash_attn_varlen_func(
        q, k_cache, v_cache,
        cu_seqlens_q.to(torch.int32), cu_seqlens_k,
        max_seqlen_q, max_context_len,
        softmax_scale=scale,
        causal=True,
        block_table=block_tables.to(torch.int32),
    )


def paged_attention_decode_flash(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs]
    max_context_len: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    from flash_attn import flash_attn_with_kvcache

    _check_block_size(k_cache)
    out = flash_attn_with_kvcache(
        q.unsqueeze(1),  # [num_seqs, 1, num_heads, head_dim]: a batch of length-1 queries
        k_cache, v_cache,
        cache_seqlens=context_lens.to(torch.int32),
        block_table=block_tables.to(torch.int32),
        softmax_scale=scale,
        causal=True,
    )  # [num_seqs, 1, num_heads, head_dim]
    return out.squeeze(1)

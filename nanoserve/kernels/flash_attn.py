"""Thin wrappers around flash-attn 2 (Dao-AILab/flash-attention), with the upstream contract spelled out.

`flash_attn` is imported inside the calls, never at module import, so this module loads on
machines without it; check `flash_attn_unusable_reason()` first. The contract, as enforced in
`csrc/flash_attn/flash_api.cpp` (`mha_varlen_fwd`) and documented in `flash_attn_interface.py`:
  * q/k/v fp16 or bf16, all the same dtype, last dimension contiguous; head_dim a multiple of 8
    and <= 256; compute capability >= 8.0 ("FlashAttention only supports Ampere GPUs or newer");
  * cu_seqlens_q / cu_seqlens_k int32 and contiguous, [batch + 1]; block_table int32 with a
    contiguous last dimension, [batch, max_blocks];
  * paged KV: k/v are [num_blocks, page_block_size, nheads_k, headdim] with page_block_size % 256
    == 0 ("Paged KV cache block size must be divisible by 256"); cu_seqlens_k still gives each
    sequence's key count, the keys themselves are read through block_table;
  * causal=True aligns the mask to the bottom right: query i of a sequence with q_len queries and
    context_len keys sees keys 0..context_len - q_len + i, exactly the engine's semantics.

Everything here goes through `flash_attn_varlen_func`. Decode uses it too (one query per sequence)
instead of `flash_attn_with_kvcache`: after v2.8.3, mha_fwd_kvcache with a block table calls
`seqlens_k.max().item()` (a host sync that breaks CUDA-graph capture); mha_varlen_fwd has none.
Paged varlen arrived in 2.5.7, but up to 2.6.1 the split-KV path (nanoserve's decode: varlen, one
query, GQA) frees its accumulators before the kernel runs ("Fix ima for split-kv kernel", 2.6.2):
MIN_VERSION, also pyproject's `cuda` extra.
"""
from __future__ import annotations

import re

import torch

# Upstream flash-attn 2: paged KV block size must be divisible by this (see module docstring).
FLASH_ATTN_PAGE_BLOCK_MULTIPLE = 256
MIN_COMPUTE_CAPABILITY = (8, 0)
MIN_VERSION = (2, 6, 2)


def flash_attn_unusable_reason() -> str | None:
    """Why the installed flash-attn cannot run (missing, fails to import, too old), or None.

    Imported, not looked up: its prebuilt wheels are per torch version, and one built for another
    torch is found on the path but fails to import (undefined symbol: ImportError or OSError)."""
    try:
        import flash_attn
    except ModuleNotFoundError as exc:
        if exc.name == "flash_attn":
            return "the flash-attn package is not installed (pip install nanoserve[cuda])"
        return f"flash-attn failed to import (ModuleNotFoundError: {exc})"
    except (ImportError, OSError) as exc:  # e.g. a wheel built for another torch
        return f"flash-attn failed to import ({type(exc).__name__}: {exc}); reinstall it for this torch"
    version = getattr(flash_attn, "__version__", "0")
    if tuple(int(x) for x in re.findall(r"\d+", version)[:3]) < MIN_VERSION:
        return f"flash-attn {version} is older than 2.6.2, whose fix the split-KV decode needs"
    return None


def flash_attn_supports_block_size(block_size: int) -> bool:
    return block_size > 0 and block_size % FLASH_ATTN_PAGE_BLOCK_MULTIPLE == 0


def flash_attn_supports_head_dim(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256


def varlen_flash(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] this step's keys, or the paged cache
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor,  # [num_seqs + 1] int32, cumulative key counts
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    block_table: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32: k/v are the paged cache
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    from flash_attn import flash_attn_varlen_func

    if block_table is not None and not flash_attn_supports_block_size(k.shape[1]):
        # Fail here with the fix spelled out rather than deep inside the CUDA extension.
        raise ValueError(
            f"flash-attn 2 needs a KV-cache block size divisible by {FLASH_ATTN_PAGE_BLOCK_MULTIPLE}, "
            f"got {k.shape[1]}; use kvcache_block_size=256 or the triton attention backend"
        )
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale=scale, causal=True, block_table=block_table,
    )


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] int32 offsets starting at 0 (no host sync: CUDA-graph safe)."""
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))

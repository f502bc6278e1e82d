"""Write new tokens' K/V into the paged cache at their slots; slot -1 means "skip".

k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (one layer's views of the
6-D cache). slot = physical_block * block_size + offset, so the flat view
[num_blocks * block_size, num_kv_heads, head_dim] is indexed by slot directly.
"""
from __future__ import annotations

import torch

try:  # triton is optional on CPU-only installs; the kernel below is only defined with it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def store_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not write
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr, key_stride,
        value_ptr, value_stride,
        k_cache_ptr, v_cache_ptr,
        slot_mapping_ptr,
        D: tl.constexpr,  # num_kv_heads * head_dim
        BLOCK_D: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * D + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * D + offs, v, mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if triton is None:
        raise RuntimeError("store_kv_triton needs triton; install it or use store_kv_torch")
    num_tokens, num_kv_heads, head_dim = key.shape
    D = num_kv_heads * head_dim
    # Heads and head_dim must be contiguous so one token is one flat row of D values.
    if key.stride(-1) != 1 or key.stride(1) != head_dim or value.stride(-1) != 1 or value.stride(1) != head_dim:
        key, value = key.contiguous(), value.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV cache views must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        key, key.stride(0), value, value.stride(0), k_cache, v_cache, slot_mapping,
        D=D, BLOCK_D=triton.next_power_of_2(D),
    )

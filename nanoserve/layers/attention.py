"""Paged attention: store this step's K/V at their slots, then attend through block tables.

How is the backend's business (nanoserve/backends/); this layer holds the layer's views of the
engine's single KV tensor, bound by the ModelRunner after the cache is allocated.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.layers.context import ModelContext


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, ctx: ModelContext) -> None:
        super().__init__()
        self.backend = ctx.backend
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # [num_blocks, block_size, num_kv_heads, head_dim] views of the 6-D KV tensor.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        return self.backend.attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)

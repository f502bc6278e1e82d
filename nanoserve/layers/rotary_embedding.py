"""Rotary position embeddings: one cos/sin table per model, shared by every attention layer."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.context import ModelContext


def rope_parameters(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a config.json of transformers 4.x (top-level
    `rope_theta` / `rope_scaling`) or 5.x (nested `rope_parameters`)."""
    nested = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", nested.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or nested
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (scaling if rope_type != "default" else None)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), as Qwen3 uses, with a cos/sin table per position."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None, ctx: ModelContext
    ) -> None:
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (only the default RoPE)")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.backend = ctx.backend
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)  # [max_pos, head_dim/2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        q_norm: nn.Module | None = None,  # per-head RMSNorms applied first (Qwen3)
        k_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, num_heads, head_dim], [num_tokens, num_kv_heads, head_dim]
        qk_norm = None
        if q_norm is not None:
            if q_norm.eps != k_norm.eps:
                raise ValueError(f"q_norm and k_norm must share eps, got {q_norm.eps} and {k_norm.eps}")
            qk_norm = (q_norm.weight, k_norm.weight, q_norm.eps)
        return self.backend.rotary(positions, q, k, self.cos_sin, self.head_dim, qk_norm)

"""Rotary position embeddings: one cos/sin table per model, shared by every attention layer.

Frequencies follow HF transformers' `ROPE_INIT_FUNCTIONS` for the types nanoserve supports:
`default`, `linear` (positions divided by `factor`) and `llama3` (Llama 3.1+: low frequencies
divided by `factor`, high ones kept, a smooth blend between). `dynamic` NTK rescales by the
batch's longest sequence in HF, which chunked prefill and prefix caching cannot reproduce, so it
is refused like any other unknown type.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nanoserve.layers.context import ModelContext

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a config.json of transformers 4.x (top-level
    `rope_theta` / `rope_scaling`) or 5.x (nested `rope_parameters`)."""
    nested = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", nested.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or nested
    return float(theta), (scaling if rope_type(scaling) != "default" else None)


def rope_type(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_rope_scaling(scaling: dict | None) -> None:
    """A clear error for a RoPE variant nanoserve would otherwise compute wrongly."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        hint = " (it rescales by the batch's longest sequence)" if kind == "dynamic" else ""
        raise ValueError(f"rope_scaling type {kind!r} is not supported{hint}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in required.get(kind, ()) if (scaling or {}).get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}")


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] float32 rotation frequencies, after scaling."""
    check_rope_scaling(scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), as Llama and Qwen use, with a cos/sin table per position."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None, ctx: ModelContext
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.backend = ctx.backend
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, base, rope_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)  # [max_pos, head_dim/2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    @classmethod
    def from_config(cls, cfg: dict, head_dim: int, ctx: ModelContext) -> "RotaryEmbedding":
        theta, scaling = rope_parameters(cfg)
        return cls(head_dim, cfg.get("max_position_embeddings", 4096), theta, scaling, ctx)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, num_heads, head_dim], [num_tokens, num_kv_heads, head_dim]
        return self.backend.rotary(positions, q, k, self.cos_sin, self.head_dim)

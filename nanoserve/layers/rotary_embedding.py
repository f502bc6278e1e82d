import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), as Qwen3 uses, with a cos/sin table per position."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (only the default RoPE)")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)  # [max_pos, head_dim/2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, head_dim/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # x: [num_tokens, num_heads, head_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

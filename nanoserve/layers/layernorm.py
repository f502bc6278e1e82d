import torch
from torch import nn

from nanoserve.layers.context import ModelContext


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new residual."""

    def __init__(self, hidden_size: int, eps: float, ctx: ModelContext) -> None:
        super().__init__()
        self.backend = ctx.backend
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.backend.rms_norm(x, self.weight, self.eps, residual)

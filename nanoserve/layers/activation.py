import torch
from torch import nn

from nanoserve.layers.context import ModelContext


class SiluAndMul(nn.Module):
    """silu(gate) * up of a packed [num_tokens, 2 * intermediate] gate_up projection."""

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.backend = ctx.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.silu_and_mul(x)

import torch
from torch import nn

from nanoserve.kernels import cpu_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; with `residual`, adds it first and returns the new residual."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.device.type == "cpu":  # bf16 on CPU: one fused C kernel instead of ~8 ops
            fused = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
            if fused is not None:
                return fused
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

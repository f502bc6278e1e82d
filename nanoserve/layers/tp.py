"""Tensor-parallel rank/size and collectives; a no-op world of one when torch.distributed is idle."""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim_to_rank0(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's slice of the last dim on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if tp_rank() == 0 else None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator

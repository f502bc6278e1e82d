"""Tensor-parallel rank/size and collectives for the layers.

Layers ask `tp_rank()` / `tp_size()` when they are built (to size and load their shard) and call
`all_reduce` / `gather_last_dim_to_rank0` in forward. Both read the *active* `TPGroup`, which the
TP executor (nanoserve/engine/tp_executor.py) installs around model construction and around every
forward with `use_tp_group(group)`; outside one, the world is a single rank and the collectives
are no-ops.

The group is an explicit object holding its own torch.distributed backend (ProcessGroupGloo on
CPU, ProcessGroupNCCL on CUDA), not torch.distributed's global default group: that is what lets
several engines, TP or not, live in one process without seeing each other's world.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    # A torch.distributed backend (ProcessGroupGloo / ProcessGroupNCCL) connecting the `size`
    # ranks; None while it is not connected yet (the model can be built before it is).
    backend: Any = None

    def require_backend(self) -> Any:
        if self.backend is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank}/{self.size} ran a collective before it was connected")
        return self.backend


_SINGLE = TPGroup()
_active: TPGroup = _SINGLE


@contextmanager
def use_tp_group(group: TPGroup) -> Iterator[TPGroup]:
    """Make `group` the one the layers see (for building the model, and for each forward)."""
    global _active
    previous, _active = _active, group
    try:
        yield group
    finally:
        _active = previous


def tp_size() -> int:
    return _active.size


def tp_rank() -> int:
    return _active.rank


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce across the active group ("sum", "min" or "max"); returns x."""
    group = _active
    if group.size > 1:
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        group.require_backend().allreduce([x], opts).wait()
    return x


def gather_last_dim_to_rank0(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's slice of the last dim on rank 0; other ranks get None."""
    group = _active
    if group.size == 1:
        return x
    x = x.contiguous()
    opts = dist.GatherOptions()
    opts.rootRank = 0
    if group.rank == 0:
        parts = [torch.empty_like(x) for _ in range(group.size)]
        group.require_backend().gather([parts], [x], opts).wait()
        return torch.cat(parts, dim=-1)
    group.require_backend().gather([], [x], opts).wait()
    return None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator

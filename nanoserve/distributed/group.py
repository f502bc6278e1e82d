"""The tensor-parallel group a model's layers are built with: rank, size and its collectives.

Every layer gets the group explicitly at construction (inside `ModelContext`): it sizes and loads
its shard from `rank`/`size` and calls `all_reduce` / `gather_last_dim_to_rank0` in forward. A
single-process engine uses `TPGroup()` (rank 0 of 1), where the collectives are no-ops; in a
tensor-parallel engine every rank holds its own group, connected to a torch.distributed backend
of its own (ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA), never torch.distributed's global
default group: that is what lets several engines live in one process without seeing each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    # The torch.distributed process group connecting the `size` ranks; None until connected
    # (a rank builds its model before the group is up).
    process_group: Any = None

    def _connected(self) -> Any:
        if self.process_group is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank}/{self.size} ran a collective before it was connected")
        return self.process_group

    def shard(self, n: int, what: str) -> int:
        """This rank's share of a dimension of size n, which must split evenly."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce ("sum", "min" or "max") across the group; returns x."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = _REDUCE_OPS[op]
            self._connected().allreduce([x], opts).wait()
        return x

    def gather_last_dim_to_rank0(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate each rank's slice of the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._connected().gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=-1)
        self._connected().gather([], [x], opts).wait()
        return None

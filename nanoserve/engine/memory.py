"""How big the KV cache may be on a GPU: measured, the way vLLM and nano-vllm do it.

`gpu_memory_utilization` is the fraction of the device's TOTAL memory this engine may use. After
the weights are loaded, a warm-up forward at `max_num_batched_tokens` tokens (and a sampler pass
at `max_num_seqs` rows, logprobs included) shows the allocator's peak for activations; with CUDA
graphs, a decode of `max_num_seqs` sequences shows what their memory pool holds. The warm-ups
need a KV cache to write to: the scratch one they hold is not activations and is subtracted.
Device memory taken outside torch's allocator while loading and warming up (cuBLAS workspaces,
NCCL buffers) is charged too, as vLLM charges its `non_torch_increase`. Then

    KV cache = min(total * utilization - weights - activations - graphs - non-torch,
                   free now - activations - graphs)

The first term is this engine's share; the second keeps it within what is really free, so memory
another engine (in this process or another) still holds counts as used. Every measurement starts
from `empty_cache()`: memory a closed engine freed but the caching allocator still holds is given
back first, so a second engine in the same process gets what the first got.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

GiB = 2**30


class DeviceMemory(Protocol):
    """The part of torch.cuda's memory API the sizing uses (a fake stands in for it in tests)."""

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes, as the driver sees them
    def memory_allocated(self) -> int: ...  # bytes held by live tensors of this process
    def max_memory_allocated(self) -> int: ...  # peak of memory_allocated since the last reset
    def memory_reserved(self) -> int: ...  # bytes torch's caching allocator holds from the driver
    def reset_peak_memory_stats(self) -> None: ...
    def empty_cache(self) -> None: ...  # give memory cached by the allocator back to the driver


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass
class MemoryProfile:
    total: int
    free: int  # after loading and profiling, with the allocator's cache emptied
    weights: int
    activations: int  # peak of the warm-up forward and sampler pass
    graphs: int  # what the decode CUDA graphs' pool will hold (0 without graphs)
    non_torch: int = 0  # growth of the device memory outside torch's allocator while loading and profiling

    def kv_cache_budget(self, utilization: float) -> int:
        own_share = self.total * utilization - self.weights - self.activations - self.graphs - self.non_torch
        really_free = self.free - self.activations - self.graphs
        return max(0, int(min(own_share, really_free)))

    def describe(self, utilization: float) -> str:
        return (
            f"total {self.total / GiB:.2f} GiB x gpu_memory_utilization {utilization} = "
            f"{self.total * utilization / GiB:.2f} GiB for this engine; weights {self.weights / GiB:.2f} GiB, "
            f"peak activations {self.activations / GiB:.2f} GiB, CUDA graphs {self.graphs / GiB:.2f} GiB, "
            f"outside torch {self.non_torch / GiB:.2f} GiB; "
            f"free on the device {self.free / GiB:.2f} GiB -> {self.kv_cache_budget(utilization) / GiB:.2f} GiB "
            "for the KV cache"
        )


def peak_of(mem: DeviceMemory, run: Callable[[], int | None]) -> int:
    """Bytes `run` allocates at its peak beyond what was allocated before it, less the scratch
    KV cache it says (returns) it held throughout."""
    mem.empty_cache()
    mem.reset_peak_memory_stats()
    before = mem.memory_allocated()
    scratch = run() or 0
    peak = mem.max_memory_allocated() - before - scratch
    mem.empty_cache()
    return max(0, peak)


def profile(
    mem: DeviceMemory,
    load: Callable[[], object],
    warm_up: Callable[[], int | None],
    capture_reserve: Callable[[], int | None] | None,
) -> MemoryProfile:
    """Load the weights, then measure a warm-up (and a graph-sized decode when graphs will run);
    each warm-up returns the bytes of scratch KV cache it held."""
    mem.empty_cache()  # what a closed engine left in the allocator's cache is free again
    non_torch_before = _non_torch(mem)
    before = mem.memory_allocated()
    load()
    weights = mem.memory_allocated() - before
    activations = peak_of(mem, warm_up)
    graphs = peak_of(mem, capture_reserve) if capture_reserve is not None else 0
    free, total = mem.mem_get_info()
    return MemoryProfile(total, free, weights, activations, graphs, max(0, _non_torch(mem) - non_torch_before))


def _non_torch(mem: DeviceMemory) -> int:
    """Device memory in use that torch's allocator does not hold (other processes' included)."""
    free, total = mem.mem_get_info()
    return total - free - mem.memory_reserved()

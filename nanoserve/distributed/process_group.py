"""Process groups for tensor parallelism: one torch.distributed backend object per engine.

ProcessGroupNCCL between GPUs (one GPU per rank: cuda:0 .. cuda:N-1), ProcessGroupGloo on CPU,
rendezvousing through a TCPStore that rank 0 opens on 127.0.0.1 port 0, i.e. a free port the OS
picks. No fixed port, no global default process group: two engines in one process, or on one
machine, never meet. Collectives time out after PROCESS_GROUP_TIMEOUT_S, so a rank that stops
answering turns into an error rather than a hang (a rank that dies errors at once: its sockets
close).
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoserve.distributed.group import TPGroup

PROCESS_GROUP_TIMEOUT_S = 60.0  # a collective waiting longer than this on a silent rank fails


def open_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port."""
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))


def connect(group: TPGroup, device: torch.device, store) -> None:
    """Give `group` its own process group: NCCL between GPUs, gloo on CPU (never the global default)."""
    timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        group.process_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), group.rank, group.size, opts)
    else:
        group.process_group = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo", store), group.rank, group.size, timeout
        )


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def threads_per_rank(size: int) -> int:
    """Split this process's intra-op threads between the ranks, so N processes do not oversubscribe the cores."""
    return max(1, torch.get_num_threads() // size)


@contextmanager
def torch_threads(n: int | None):
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

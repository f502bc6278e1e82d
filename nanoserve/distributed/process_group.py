"""Process groups for tensor parallelism: one torch.distributed backend object per engine.

ProcessGroupNCCL between GPUs (one GPU per rank: cuda:0 .. cuda:N-1), ProcessGroupGloo on CPU.
Nothing is reachable from another host: the ranks rendezvous through a FileStore in a private
(0700) temporary directory that rank 0 creates and deletes on close (a TCPStore's server socket
listens on every interface), gloo's pairs listen on 127.0.0.1, and NCCL's bootstrap sockets on
the loopback interface (NCCL_SOCKET_IFNAME=lo unless set). No fixed port, no global default process
group: two engines in one process, or on one machine, never meet. Collectives time out after
PROCESS_GROUP_TIMEOUT_S, so a rank that stops answering turns into an error rather than a hang (a
rank that dies errors at once: its sockets close).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from nanoserve.distributed.group import TPGroup

PROCESS_GROUP_TIMEOUT_S = 60.0  # a collective waiting longer than this on a silent rank fails
LOOPBACK = "127.0.0.1"


def open_store(size: int) -> dist.FileStore:
    """Rank 0's rendezvous store: a file only this user can reach (see `close_store`)."""
    directory = tempfile.mkdtemp(prefix="nanoserve-tp-")  # mode 0700
    return join_store(os.path.join(directory, "rendezvous"), size)


def join_store(path: str, size: int) -> dist.FileStore:
    store = dist.FileStore(path, size)
    store.set_timeout(timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    return store


def close_store(path: str) -> None:
    """Delete the rendezvous directory that `open_store` made (once every rank has stopped)."""
    directory = os.path.dirname(path)
    if os.path.isdir(directory):
        shutil.rmtree(directory)


def connect(group: TPGroup, device: torch.device, store) -> None:
    """Give `group` its own process group: NCCL between GPUs, gloo on CPU (never the global default)."""
    timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    if device.type == "cuda":
        # NCCL picks its bootstrap interface from this variable only, once per process.
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        group.process_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), group.rank, group.size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        # Pairs listen on loopback (the default device binds whatever the hostname resolves to),
        # connected up front so no rank depends on the store after start-up.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK, lazy_init=False)]
        opts._timeout = timeout
        opts._threads = 2  # what ProcessGroupGloo's default options give one device
        group.process_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), group.rank, group.size, opts)


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

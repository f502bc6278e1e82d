"""Tensor parallelism: the group handed to layers (group.py), the rank-0 -> worker message channel
(channel.py), process groups and their rendezvous (process_group.py), the worker loop (worker.py),
the workers' lifecycle (workers.py) and the engine-side runner that drives all ranks (executor.py)."""
from nanoserve.distributed.group import TPGroup

__all__ = ["TPGroup"]

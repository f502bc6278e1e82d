"""Collectives and transport only: the group handed to layers (group.py), the rank-0 -> worker
message channel (channel.py), process groups and their rendezvous (process_group.py). The runner
that drives the ranks lives with the engine (engine/tp_runner.py); nothing here imports it."""
from nanoserve.distributed.cleanup import cleanup_dist_env_and_memory
from nanoserve.distributed.group import TPGroup

__all__ = ["TPGroup", "cleanup_dist_env_and_memory"]

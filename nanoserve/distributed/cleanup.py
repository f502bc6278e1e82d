"""vLLM's `cleanup_dist_env_and_memory`, which its examples call between two engines."""
from __future__ import annotations

import gc
import sys

import torch


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """After `del llm`: collect the engine now, so its model, KV cache (and tensor-parallel
    workers) are released before the next one is built; optionally stop a Ray session."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if shutdown_ray and "ray" in sys.modules:  # only a script that imported Ray has a session to stop
        sys.modules["ray"].shutdown()

"""Helpers that are not part of the serving path (e.g. building tiny test checkpoints)."""
from nanoserve.utils.argparse_utils import FlexibleArgumentParser  # vLLM < 0.11 imports it from vllm.utils

__all__ = ["FlexibleArgumentParser"]

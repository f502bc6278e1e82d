"""Peer engines run on the same prompts and lengths as nanoserve: HF transformers, vLLM's CPU backend
and llama.cpp (its batched-bench at the workload's mean lengths).

Each peer is started once (load, warm-up), then `run()` as many times as the comparison repeats,
so the repeats of nanoserve and its peers alternate back to back in one process run.
"""
from __future__ import annotations

from dataclasses import dataclass


class PeerUnavailable(Exception):
    """The peer cannot run here (not installed, or it fails on this machine): say why and go on."""


@dataclass(frozen=True)
class PeerSettings:
    """What a peer must match: same checkpoint, dtype, threads, lengths and sampling as nanoserve."""

    model: str
    dtype: str  # "bfloat16" | "float16" | "float32"
    device: str  # "cpu" | "cuda"
    threads: int
    seed: int = 0
    temperature: float = 0.0
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool = True
    warmup: bool = True

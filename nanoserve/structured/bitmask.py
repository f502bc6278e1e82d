"""Token masks for a step's constrained rows, built on the CPU.

llguidance writes one bit per vocabulary entry (int32 words, [rows, ceil(V / 32)]); the sampler
wants a bool [rows, V] of forbidden tokens to fill with -inf before anything else touches the
logits (vLLM's order: grammar mask, then penalties, temperature and filters). The mask is built
in numpy and becomes a tensor once: each torch call on a tiny tensor costs more than the mask.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from nanoserve.structured.matcher import SequenceMatcher

_executor = None  # llguidance's thread pool, made on first use


def _get_executor():
    global _executor
    if _executor is None:
        from nanoserve.structured.grammar import import_llguidance

        # A few threads: a mask takes tens of microseconds, and the model's threads share the cores.
        _executor = import_llguidance().LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))
    return _executor


def fill_bitmask(matchers: list[SequenceMatcher], vocab_size: int) -> np.ndarray:
    """[len(matchers), ceil(V / 32)] int32: bit t of row i set where matcher i allows token t."""
    words = (vocab_size + 31) // 32
    bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
    start = time.perf_counter()
    if len(matchers) == 1:
        matchers[0].llg.unsafe_compute_mask_ptr(bitmask.ctypes.data, words * 4)
    else:  # in parallel, without the GIL
        pairs = [(m.llg, i) for i, m in enumerate(matchers)]
        _get_executor().unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, len(matchers))
    stats = matchers[0].stats
    stats.mask_seconds += time.perf_counter() - start
    stats.num_masks += len(matchers)
    return bitmask


def unpack_forbidden(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 bitmask [R, W] -> uint8 [R, vocab_size], 1 where the token is NOT allowed.

    Little-endian words make bit t of word w bit t % 8 of byte 4w + t // 8: unpackbits' little
    bit order walks the tokens in id order.
    """
    inverted = np.invert(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8))  # [R, 4W]
    return np.unpackbits(inverted, axis=1, count=vocab_size, bitorder="little")  # [R, V]


def forbidden_mask(matchers: list[SequenceMatcher | None], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] bool (True = forbidden) for a step's rows; rows without a matcher forbid nothing."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    assert rows, "forbidden_mask needs at least one constrained row"
    forbidden = unpack_forbidden(fill_bitmask([matchers[i] for i in rows], vocab_size), vocab_size)
    if len(rows) < len(matchers):
        full = np.zeros((len(matchers), vocab_size), dtype=np.uint8)
        full[rows] = forbidden
        forbidden = full
    return torch.from_numpy(forbidden).view(torch.bool).to(device)

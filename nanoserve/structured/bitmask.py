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
# The thread pool pays off only with cores to spare: on a small or busy machine, handing rows to
# threads costs more than computing them in turn (measured: 430 vs 75 us per mask on 2 busy cores).
MIN_CPUS_FOR_THREADS = 8
MIN_ROWS_FOR_THREADS = 4


def _get_executor():
    global _executor
    if _executor is None:
        from nanoserve.structured.grammar import import_llguidance

        # Half the cores, at most 8: a mask takes tens of microseconds.
        _executor = import_llguidance().LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
    return _executor


def fill_bitmask(matchers: list[SequenceMatcher], vocab_size: int, parallel: bool | None = None) -> np.ndarray:
    """[len(matchers), ceil(V / 32)] int32: bit t of row i set where matcher i allows token t.
    parallel: use llguidance's thread pool (None: when the machine and the batch are big enough)."""
    words = (vocab_size + 31) // 32
    bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
    start = time.perf_counter()
    if parallel is None:
        parallel = len(matchers) >= MIN_ROWS_FOR_THREADS and (os.cpu_count() or 1) >= MIN_CPUS_FOR_THREADS
    if parallel:
        pairs = [(m.llg, i) for i, m in enumerate(matchers)]  # in parallel, without the GIL
        _get_executor().unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, len(matchers))
    else:
        row_bytes = words * 4
        for i, m in enumerate(matchers):
            m.llg.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * row_bytes, row_bytes)
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

"""Pool a step's hidden states into one vector per prompt that completes in it.

Pooling requests are prefill-only and may be split into chunks over several steps (chunked
prefill): last-token pooling reads the final chunk's last row; mean and CLS pooling carry a
per-sequence partial (the running sum / the first row) from chunk to chunk. A chunk that starts
at position 0 (a first chunk, or a recompute after preemption) starts the partial afresh. Mean
and CLS need every position's hidden state, so their engines run without prefix-cache hits.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import torch

from nanoserve.pooling.config import POOLING_TYPES


class Pooler:
    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")
        self.pooling_type = pooling_type
        self._partial: dict[int, torch.Tensor] = {}  # seq_id -> MEAN: sum so far; CLS: the first row

    def output_rows(self, num_new: Seq[int], completes: Seq[bool]) -> list[int] | None:
        """LAST: the rows of a step's hidden states it reads, the last of each completing entry, in
        batch order (the model computes just these past the last layer's attention); None for MEAN
        and CLS, which read every row."""
        if self.pooling_type != "LAST":
            return None
        ends = itertools.accumulate(num_new)
        return [end - 1 for end, done in zip(ends, completes) if done]

    def __call__(
        self, hidden: torch.Tensor, seq_ids: Seq[int], starts: Seq[int], num_new: Seq[int], completes: Seq[bool]
    ) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the batch's entries back to back. Returns float32
        [num_completing, hidden_size] on the CPU, one row per entry with `completes`, in batch order."""
        q_lens = torch.tensor(num_new, dtype=torch.int64, device=hidden.device)
        cu = torch.zeros(len(num_new) + 1, dtype=torch.int64, device=hidden.device)
        torch.cumsum(q_lens, 0, out=cu[1:])
        if self.pooling_type == "LAST":
            rows = (cu[1:] - 1)[torch.tensor(list(completes), dtype=torch.bool, device=hidden.device)]
            return hidden[rows].float().cpu()
        if self.pooling_type == "MEAN":
            seq_of_token = torch.repeat_interleave(torch.arange(len(num_new), device=hidden.device), q_lens)
            # sums: [num_entries, hidden_size], float32 so long prompts lose no precision
            sums = torch.zeros(len(num_new), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            sums.index_add_(0, seq_of_token, hidden.float())
            pieces = [sums[i] for i in range(len(num_new))]
        else:  # CLS: the first row of a sequence's first chunk
            pieces = [hidden[int(cu[i])].float() for i in range(len(num_new))]
        out = []
        for seq_id, start, n, piece, done in zip(seq_ids, starts, num_new, pieces, completes):
            partial = self._carry(seq_id, start, piece)
            if done:
                del self._partial[seq_id]
                out.append(partial / (start + n) if self.pooling_type == "MEAN" else partial)
        if not out:
            return torch.empty(0, hidden.shape[1], dtype=torch.float32)
        return torch.stack(out).cpu()

    def _carry(self, seq_id: int, start: int, piece: torch.Tensor) -> torch.Tensor:
        if start == 0:
            self._partial[seq_id] = piece
        elif self.pooling_type == "MEAN":
            assert seq_id in self._partial, f"sequence {seq_id} resumed at {start} without its first chunk"
            self._partial[seq_id] = self._partial[seq_id] + piece
        return self._partial[seq_id]

    def forget(self, seq_ids: Seq[int]) -> None:
        """Drop the partials of sequences that will not resume (aborted requests)."""
        for seq_id in seq_ids:
            self._partial.pop(seq_id, None)

    def reset(self) -> None:
        """Forget every partial (after everything in flight is aborted)."""
        self._partial.clear()

    @property
    def num_partials(self) -> int:
        return len(self._partial)

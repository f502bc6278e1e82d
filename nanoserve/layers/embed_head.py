"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.linear import linear
from nanoserve.layers.tp import all_reduce, gather_last_dim_to_rank0, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # Pad so every rank gets an equal slice; padded rows are never looked up or sampled.
        self.shard_size = (vocab_size + tp_size() - 1) // tp_size()
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    cpu_weight = None  # set by prepare_cpu_gemm on CPU (see kernels/cpu.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits for the rows given ([num_rows, vocab]) on rank 0; None on other ranks."""
        logits = linear(hidden, self.weight, None, self.cpu_weight)  # [num_rows, shard_size]
        logits = gather_last_dim_to_rank0(logits)
        return logits[:, : self.vocab_size] if logits is not None else None

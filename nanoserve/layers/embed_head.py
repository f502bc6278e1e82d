"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

A tied embedding is the LM head's weight. Where the backend's logits GEMM keeps a packed copy
that gives rows back (Backend.logits_rows: bit for bit, or an int8 head's q * scale), the
embedding looks its tokens up there and drops the loaded matrix: one copy of the vocabulary, not
two (on Qwen3-0.6B, 297 MiB in bf16).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.context import ModelContext
from nanoserve.layers.linear import weights_not_loaded
from nanoserve.quantization.weight import QuantizedWeight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext) -> None:
        super().__init__()
        self.tp = ctx.tp
        self.vocab_size = vocab_size
        # Pad so every rank gets an equal slice; padded rows are never looked up or sampled.
        self.shard_size = (vocab_size + self.tp.size - 1) // self.tp.size
        self.vocab_start = self.tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by share_rows

    def share_rows(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look rows up through `rows` (local ids -> [*ids.shape, hidden]: this shard's weight rows,
        as the head's GEMM holds them) from now on, and release the loaded weight."""
        self.rows = rows
        self.weight = None

    def _look_up(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.rows is None else self.rows(ids)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"the checkpoint tensor must have shape {[self.vocab_size, param.shape[1]]} "
                             "(vocab_size x hidden_size of config.json)")
        rows = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._look_up(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        out = self._look_up(local.clamp(0, self.shard_size - 1)) * mine.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: ModelContext) -> None:
        super().__init__(vocab_size, hidden_size, ctx)
        self.backend = ctx.backend
        self.gemm = weights_not_loaded
        # The embedding whose weight this head shares; a plain list, so that nn.Module does not
        # register it a second time as a submodule of the head.
        self._tied_to: list[VocabParallelEmbedding] = []

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Use `embedding`'s weight (the same shard of the same rows) as this head's."""
        self.weight = embedding.weight
        self._tied_to = [embedding]

    def make_quantized(self, group_size: int, act_order: bool) -> None:
        """Hold a quantized checkpoint's head (GPTQ's "lm_head": true, vLLM's lm_head_quantized) as
        its integers [vocab shard, hidden] and per-group scales, sharded by vocabulary rows like the
        float weight. A tied head unties: the embedding keeps the float matrix it was given."""
        hidden, device = self.weight.shape[1], self.weight.device
        self._tied_to = []
        self.group_size = min(group_size, hidden)
        groups = -(-hidden // self.group_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(self.shard_size, groups, device=device), requires_grad=False)
        # Both are [vocab, *] in the file: this shard's rows, like the float weight's.
        self.weight.weight_loader = self.weight_scale.weight_loader = self.weight_loader
        if act_order:  # the input permutation, whole on every rank
            self.weight_perm = nn.Parameter(torch.empty(hidden, dtype=torch.int64, device=device),
                                            requires_grad=False)

    def process_weights_after_loading(self) -> None:
        if self.weight.dtype == torch.int8:  # make_quantized
            perm = self.weight_perm.data if hasattr(self, "weight_perm") else None
            quantized = QuantizedWeight(self.weight.data, self.weight_scale.data, self.group_size, perm)
            self.gemm = self.backend.prepare_quantized_logits(quantized)
            self.weight = self.weight_scale = self.weight_perm = None
            return
        self.gemm = self.backend.prepare_logits(self.weight)
        if not self.backend.packs_weights:
            return
        self.weight = None  # the GEMM holds its own copy
        rows = self.backend.logits_rows(self.gemm)
        if rows is not None:  # otherwise a tied embedding keeps the loaded weight
            for embedding in self._tied_to:
                embedding.share_rows(rows)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits for the rows given ([num_rows, vocab]) on rank 0; None on other ranks."""
        logits = self.tp.gather_last_dim_to_rank0(self.gemm(hidden))  # [num_rows, vocab (padded)]
        return logits[:, : self.vocab_size] if logits is not None else None

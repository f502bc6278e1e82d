"""What attention needs to know about one step: where new K/V go and what each sequence reads.

Built once per step by the engine (nanoserve/engine/model_inputs.py) from the scheduled batch and
passed explicitly through the model to every attention layer. The batch is ordered decodes first
(one query token each), then prefills and prompt chunks, so each part goes to the kernel made
for it. A backend may derive per-step data of its own from it once (`Backend.prepare_metadata`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    num_decode_tokens: int  # the first num_decode_tokens tokens are one-token sequences
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, -1 padded
    decode_context_lens: torch.Tensor  # [num_decodes] int32, cache length including the new token
    decode_max_context_len: int
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, offsets into the prefill tokens
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32, -1 padded
    prefill_context_lens: torch.Tensor  # [num_prefills] int32, cache length including the new tokens
    prefill_max_seqlen_q: int
    prefill_max_context_len: int
    prefills_have_context: bool  # does any prefill sequence start after cached tokens (a known host fact)

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]

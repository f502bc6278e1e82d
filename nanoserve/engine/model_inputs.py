"""A scheduled batch as tensors: token ids, positions, slot_mapping, block tables, sampling rows.

Built on the host (pinned memory on CUDA), so a tensor-parallel engine can send the same bytes to
every rank before any device copy; `to_device` then moves them with non-blocking copies.
Addressing: token position p of a sequence lives at
slot = block_table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.engine.prompt_logprobs import scored_positions
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence


@dataclass
class ModelInputs:
    """Everything one forward pass needs; plain tensors so it can be sent to TP workers."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the hidden states to project: [num_sampling_rows + num_prompt_logprob_rows], the
    # sampling rows first, then the rows scoring prompt tokens (prompt_logprobs.scored_positions).
    logits_indices: torch.Tensor


def build_model_inputs(batch: ScheduledBatch, block_size: int, pin_memory: bool = False) -> ModelInputs:
    seqs, num_new = batch.seqs, batch.num_new_tokens
    starts = [seq.num_computed_tokens for seq in seqs]
    input_ids: list[int] = []
    for seq, start, n in zip(seqs, starts, num_new):
        input_ids.extend(seq.token_ids[start : start + n])

    q_lens = torch.tensor(num_new, dtype=torch.int64)
    context_lens = torch.tensor(starts, dtype=torch.int64) + q_lens
    cu_seqlens_q = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=cu_seqlens_q[1:])
    block_tables = _block_tables(seqs)

    # Positions and slots of every new token, vectorised: token t of sequence s is at
    # position start_s + (t - cu_seqlens_q[s]).
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    positions = torch.arange(len(input_ids)) - cu_seqlens_q[:-1][seq_of_token] + torch.tensor(starts)[seq_of_token]
    physical = block_tables[seq_of_token, positions // block_size].long()
    slot_mapping = physical * block_size + positions % block_size

    nd = batch.num_decode_seqs
    prefill_q_lens = q_lens[nd:]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode_tokens=nd,
        decode_block_tables=block_tables[:nd],
        decode_context_lens=context_lens[:nd].int(),
        decode_max_context_len=int(context_lens[:nd].max()) if nd else 0,
        prefill_cu_seqlens_q=(cu_seqlens_q[nd:] - nd).int(),
        prefill_block_tables=block_tables[nd:],
        prefill_context_lens=context_lens[nd:].int(),
        prefill_max_seqlen_q=int(prefill_q_lens.max()) if len(prefill_q_lens) else 0,
        prefill_max_context_len=int(context_lens[nd:].max()) if len(prefill_q_lens) else 0,
        prefills_have_context=any(start > 0 for start in starts[nd:]),
    )
    sampling = torch.tensor(batch.samples, dtype=torch.bool)
    inputs = ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        meta=meta,
        logits_indices=torch.cat([(cu_seqlens_q[1:] - 1)[sampling], _prompt_logprob_rows(seqs, num_new, starts)]),
    )
    return _map_tensors(inputs, torch.Tensor.pin_memory) if pin_memory else inputs


def _prompt_logprob_rows(seqs: list[Sequence], num_new: list[int], starts: list[int]) -> torch.Tensor:
    """Rows of this step's tokens whose logits score prompt tokens, in batch order."""
    rows: list[int] = []
    offset = 0
    for seq, n, start in zip(seqs, num_new, starts):
        rows.extend(offset + p - start for p in scored_positions(seq, n))
        offset += n
    return torch.tensor(rows, dtype=torch.int64)


def _block_tables(seqs: list[Sequence]) -> torch.Tensor:
    width = max(len(seq.block_table) for seq in seqs)
    rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
    return torch.tensor(rows, dtype=torch.int32)  # [num_seqs, max_blocks], -1 = no block


def to_device(inputs: ModelInputs, device: torch.device) -> ModelInputs:
    if device.type == "cpu":
        return inputs
    return _map_tensors(inputs, lambda t: t.to(device, non_blocking=True))


def _map_tensors(inputs: ModelInputs, fn) -> ModelInputs:
    meta = inputs.meta
    meta = dataclasses.replace(
        meta, **{f.name: fn(getattr(meta, f.name)) for f in dataclasses.fields(meta)
                 if isinstance(getattr(meta, f.name), torch.Tensor)}
    )
    return ModelInputs(fn(inputs.input_ids), fn(inputs.positions), meta, fn(inputs.logits_indices))

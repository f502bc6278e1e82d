"""Dummy steps shaped like the engine's worst case, for measuring peak memory before the KV cache exists.

The sequences of a dummy batch all read and write the same few blocks (one max_model_len sequence's
worth), so a scratch KV cache of that size is enough; their contents are meaningless.
"""
from __future__ import annotations

from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling import SamplingRow, SamplingSpec
from nanoserve.sampling_params import SamplingParams, num_logprobs

# The sampler's most memory-hungry path: penalties ([B, V] tables), top-p (a full sort may be
# needed) and the most logprobs the engine allows (Config.max_logprobs).
HEAVIEST_SAMPLING = SamplingParams(
    temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1
)


def prefill_batch(num_tokens: int, max_seq_len: int, max_seqs: int, num_blocks: int) -> ScheduledBatch:
    """`num_tokens` prompt tokens in as few sequences as max_seq_len allows (long sequences are the
    costliest for attention), at most max_seqs of them."""
    seq_len = min(max_seq_len, num_tokens)
    num_seqs = min(max_seqs, -(-num_tokens // seq_len))
    lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    seqs = [_sequence(i, min(n, seq_len), num_blocks) for i, n in enumerate(lengths)]
    return ScheduledBatch(seqs, [seq.num_tokens for seq in seqs], [True] * len(seqs))


def decode_batch(num_seqs: int, num_blocks: int) -> ScheduledBatch:
    """`num_seqs` sequences decoding their second token."""
    seqs = [_sequence(i, 2, num_blocks) for i in range(num_seqs)]
    for seq in seqs:
        seq.num_computed_tokens = 1
    return ScheduledBatch(seqs, [1] * num_seqs, [True] * num_seqs)


def sampling_rows(num_rows: int, vocab_size: int, max_logprobs: int) -> list[SamplingRow]:
    params = HEAVIEST_SAMPLING.clone()
    params.logprobs = min(num_logprobs(max_logprobs, vocab_size), vocab_size)
    spec = SamplingSpec.from_params(params, vocab_size, [])
    return [SamplingRow(spec, i, [i % vocab_size] * 8, 4) for i in range(num_rows)]


def _sequence(i: int, num_tokens: int, num_blocks: int) -> Sequence:
    seq = Sequence(i, f"warmup-{i}", 0, [0] * num_tokens, HEAVIEST_SAMPLING, num_tokens + 1, i)
    seq.block_table = list(range(num_blocks))
    return seq

"""What the sampler knows about each row: a request's SamplingSpec (normalised and validated once,
when the request is added) and the per-step SamplingMetadata tensors built from the batch's rows.

Nothing here is checked per step: every request field was checked against the model when its
SamplingSpec was made, prompts by the engine, and generated tokens come from the model itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from nanoserve.sampling.bad_words import banned_tokens
from nanoserve.sampling_params import SamplingParams, num_logprobs

if TYPE_CHECKING:
    from nanoserve.structured.matcher import SequenceMatcher

# How many top logits the filters look at when a row has no smaller top_k. Real nuclei are almost
# always far smaller; rows that need more fall back to a full sort / a draw over the whole
# vocabulary, so this changes speed, never results.
NUM_CANDIDATES = 1024
# Temperatures below this are greedy, like vLLM's _SAMPLING_EPS (logits / 1e-6 lose all precision).
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingSpec:
    """A request's sampling parameters, normalised for one model and validated once.

    Greedy specs hold neutral filter values (temperature 1, top_k 0, top_p 1, min_p 0), so a
    greedy row never takes a sampling path; penalties still apply to it.
    """

    greedy: bool  # temperature ~ 0, or top_k == 1 (which keeps the same single token)
    temperature: float  # > 0; 1.0 when greedy
    top_k: int  # 0 = off (also when top_k >= vocab_size, which keeps every token)
    top_p: float  # 1.0 = off
    min_p: float  # 0.0 = off
    repetition_penalty: float  # 1.0 = off
    frequency_penalty: float  # 0.0 = off
    presence_penalty: float  # 0.0 = off
    logprobs: int | None  # top logprobs to return, at most vocab_size (-1 asked: vocab_size); None = none asked
    min_tokens: int  # the suppressed ids are masked while fewer tokens than this were generated
    suppressed_token_ids: tuple[int, ...]  # stop ids + EOS (unless ignore_eos); () if min_tokens == 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    allowed_token_ids: tuple[int, ...] | None = None  # every other token is masked; None = all allowed
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # bad_words.py: each one's last token is banned
    prompt_logprobs: int | None = None  # top logprobs per scored prompt token, as `logprobs`

    @classmethod
    def from_params(cls, params: SamplingParams, vocab_size: int, eos_token_ids: list[int],
                    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()) -> "SamplingSpec":
        """The sampler's view of params that InputProcessor.validate accepted for this model
        (bad_words come tokenized: bad_words.bad_words_token_ids)."""
        # top_k == 1 keeps only the max: exactly greedy, and cheaper (and exact under ties) that way.
        greedy = params.temperature < _MIN_TEMPERATURE or params.top_k == 1
        suppressed: tuple[int, ...] = ()
        if params.min_tokens > 0:
            # An EOS id past the model's logits (a tokenizer larger than the model) is never
            # sampled, so there is nothing to mask.
            eos = [] if params.ignore_eos else [t for t in eos_token_ids if 0 <= t < vocab_size]
            suppressed = tuple(dict.fromkeys([*params.stop_token_ids, *eos]))
        return cls(
            greedy=greedy,
            temperature=1.0 if greedy else params.temperature,
            top_k=0 if greedy or params.top_k >= vocab_size else params.top_k,
            top_p=1.0 if greedy else params.top_p,
            min_p=0.0 if greedy else params.min_p,
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            logprobs=_top_k(params.logprobs, vocab_size),
            min_tokens=params.min_tokens,
            suppressed_token_ids=suppressed,
            logit_bias=tuple((params.logit_bias or {}).items()),
            allowed_token_ids=None if params.allowed_token_ids is None else tuple(params.allowed_token_ids),
            bad_words_token_ids=bad_words_token_ids,
            prompt_logprobs=_top_k(params.prompt_logprobs, vocab_size),
        )

    @property
    def has_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _top_k(asked: int | None, vocab_size: int) -> int | None:
    """The number of top logprobs a request gets: at most the vocabulary, -1 = all of it."""
    return None if asked is None else min(num_logprobs(asked, vocab_size), vocab_size)


class SamplingRow(NamedTuple):
    """One row of a step's batch, as the engine describes it."""

    spec: SamplingSpec
    seed: int  # in [0, 2**63): the user's seed or one the engine drew for the request
    token_ids: list[int]  # the sequence's own list (prompt + output): referenced, never copied
    num_prompt_tokens: int
    matcher: SequenceMatcher | None = None  # structured outputs: the row's grammar state


@dataclass
class SamplingMetadata:
    """Per-step tensors (built once per step from the rows) plus Python flags that let the
    sampler skip whole stages without looking at tensor values."""

    num_rows: int  # B
    vocab_size: int  # V
    # --- which rows take which path (Python flags / sorted int64 row indices into the batch) ---
    all_greedy: bool
    any_greedy: bool
    plain_rows: torch.Tensor | None  # [P] sampled rows with temperature only (no filter); None if P=0
    filtered_rows: torch.Tensor | None  # [F] sampled rows with top_k, top_p or min_p; None if F=0
    # --- per-row sampling parameters, [B] each (greedy rows hold neutral values) ---
    temperature: torch.Tensor | None  # float32; 1.0 for greedy rows so dividing is harmless; None if all are greedy
    top_k: torch.Tensor | None  # int64; 0 = off
    top_p: torch.Tensor | None  # float32; 1.0 = off
    min_p: torch.Tensor | None  # float32; 0.0 = off
    seeds: torch.Tensor | None  # int64 in [0, 2**63)
    steps: torch.Tensor | None  # int64, tokens generated so far: index of the token being sampled
    need_temperature: bool  # some sampled row has temperature != 1
    use_top_k: bool  # some filtered row has top_k
    use_top_p: bool  # some filtered row has top_p < 1
    need_full_lse: bool  # some row has top_p < 1 and no top_k: top-p needs the full softmax
    num_candidates: int  # C, how many top logits the filters look at (<= V)
    # --- penalties: None when no row uses them ---
    repetition_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    seen_mask: torch.Tensor | None = field(repr=False)  # [B, V] bool, in prompt or output (repetition)
    output_counts: torch.Tensor | None = field(repr=False)  # [B, V] float32, count in the output
    # --- suppression and logprobs ---
    suppressed: torch.Tensor | None  # [2, N] int64 (row, token) pairs to set to -inf
    max_num_logprobs: int | None  # K; None when no row asked for logprobs
    # --- logit_bias / allowed_token_ids: None when no row uses them ---
    bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # [2, N] (row, token), [N]
    disallowed: torch.Tensor | None = field(default=None, repr=False)  # [B, V] bool, True outside allowed_token_ids
    # --- structured outputs: [B, V] bool, True where a row's grammar forbids the token; None if no
    # row is constrained (built on the CPU from the constrained rows only, nanoserve/structured/bitmask.py)
    grammar_forbidden: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device,
        num_candidates: int = NUM_CANDIDATES,
    ) -> "SamplingMetadata":
        """Token histories are read only for rows that use a penalty."""
        B, V = len(rows), vocab_size
        specs = [r.spec for r in rows]
        steps = [len(r.token_ids) - r.num_prompt_tokens for r in rows]
        plain = [i for i, s in enumerate(specs) if not s.greedy and not s.has_filter]
        filtered = [i for i, s in enumerate(specs) if s.has_filter]  # never greedy: those hold neutral values

        # A top-k row needs its top k + 1 logits (the extra one tells whether ties at the k-th
        # value continue past the candidates); other filtered rows get num_candidates.
        max_k = max((specs[i].top_k for i in filtered), default=0)
        needs_wide = any(specs[i].top_k == 0 for i in filtered)
        num_cands = min(V, max(max_k + 1, num_candidates if needs_wide else 0))

        all_greedy = all(s.greedy for s in specs)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device)

        def per_row(values, dtype):  # what only a sampled (non-greedy) row needs: none when all are greedy
            return None if all_greedy else tensor(values, dtype)

        any_rep = any(s.repetition_penalty != 1.0 for s in specs)
        any_freq = any(s.frequency_penalty != 0.0 for s in specs)
        any_pres = any(s.presence_penalty != 0.0 for s in specs)
        seen_mask = output_counts = None
        if any_rep or any_freq or any_pres:
            # Rows with neutral penalty values come out bit-identical with or without their
            # tokens counted, so only the rows that use a penalty are read.
            seen_mask, output_counts = _token_tables(
                rows,
                [i for i, s in enumerate(specs) if s.repetition_penalty != 1.0],
                [i for i, s in enumerate(specs) if s.frequency_penalty != 0.0 or s.presence_penalty != 0.0],
                V, device,
            )

        pairs = [
            (i, t)
            for i, (s, step) in enumerate(zip(specs, steps)) if step < s.min_tokens
            for t in s.suppressed_token_ids
        ]
        pairs += [
            (i, t)
            for i, (r, s) in enumerate(zip(rows, specs)) if s.bad_words_token_ids
            for t in banned_tokens(s.bad_words_token_ids, r.token_ids, r.num_prompt_tokens)
        ]
        asked = [s.logprobs for s in specs if s.logprobs is not None]
        temperature = [s.temperature for s in specs]
        top_p = [s.top_p for s in specs]

        return cls(
            num_rows=B,
            vocab_size=V,
            all_greedy=all_greedy,
            any_greedy=any(s.greedy for s in specs),
            plain_rows=tensor(plain, torch.int64) if plain else None,
            filtered_rows=tensor(filtered, torch.int64) if filtered else None,
            temperature=per_row(temperature, torch.float32),
            top_k=per_row([s.top_k for s in specs], torch.int64),
            top_p=per_row(top_p, torch.float32),
            min_p=per_row([s.min_p for s in specs], torch.float32),
            seeds=per_row([r.seed for r in rows], torch.int64),
            steps=per_row(steps, torch.int64),
            need_temperature=any(t != 1.0 for t in temperature),
            use_top_k=max_k > 0,
            use_top_p=any(top_p[i] < 1.0 for i in filtered),
            need_full_lse=any(specs[i].top_p < 1.0 and specs[i].top_k == 0 for i in filtered),
            num_candidates=num_cands,
            repetition_penalty=tensor([s.repetition_penalty for s in specs], torch.float32) if any_rep else None,
            frequency_penalty=tensor([s.frequency_penalty for s in specs], torch.float32) if any_freq else None,
            presence_penalty=tensor([s.presence_penalty for s in specs], torch.float32) if any_pres else None,
            seen_mask=seen_mask,
            output_counts=output_counts,
            suppressed=tensor(pairs, torch.int64).T.contiguous() if pairs else None,  # [2, N]
            max_num_logprobs=max(asked) if asked else None,
            grammar_forbidden=_grammar_forbidden(rows, V, device),
            bias=_bias(specs, device),
            disallowed=_disallowed(specs, V, device),
        )


def _bias(specs: list[SamplingSpec], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    entries = [(i, t, b) for i, s in enumerate(specs) for t, b in s.logit_bias]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    index = torch.tensor([rows, tokens], dtype=torch.int64).to(device)
    return index, torch.tensor(values, dtype=torch.float32).to(device)


def _disallowed(specs: list[SamplingSpec], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    limited = [(i, s.allowed_token_ids) for i, s in enumerate(specs) if s.allowed_token_ids is not None]
    if not limited:
        return None
    # Built on the device from the (row, id) pairs: no [B, V] host tensor to copy over every step.
    rows = torch.tensor([i for i, _ in limited], dtype=torch.int64).to(device)
    pairs = torch.tensor([(i, t) for i, ids in limited for t in ids], dtype=torch.int64).T.to(device)
    mask = torch.zeros(len(specs), vocab_size, dtype=torch.bool, device=device)
    mask[rows] = True
    mask[pairs[0], pairs[1]] = False
    return mask


def _grammar_forbidden(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    if all(r.matcher is None for r in rows):
        return None  # free text only: llguidance is never imported
    from nanoserve.structured.bitmask import forbidden_mask

    return forbidden_mask([r.matcher for r in rows], vocab_size, device)


def _token_tables(
    rows: list[SamplingRow], seen_rows: list[int], count_rows: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """seen_mask [B, V] bool (token in the prompt or the output) filled for seen_rows, and
    output_counts [B, V] float32 (occurrences in the output) filled for count_rows; None where
    the row list is empty. Each history goes from the sequence's list into a tensor once."""
    B, V = len(rows), vocab_size
    history = {i: torch.tensor(rows[i].token_ids, dtype=torch.int64) for i in sorted({*seen_rows, *count_rows})}
    seen_mask = output_counts = None
    if seen_rows:
        flat = _flat_index({i: history[i] for i in seen_rows}, V).to(device)
        seen_mask = torch.zeros(B * V, dtype=torch.bool, device=device)
        seen_mask.index_fill_(0, flat, True)
        seen_mask = seen_mask.view(B, V)
    if count_rows:
        flat = _flat_index({i: history[i][rows[i].num_prompt_tokens :] for i in count_rows}, V).to(device)
        # Counts in one scatter_add over the flattened [B * V] table.
        output_counts = torch.zeros(B * V, dtype=torch.float32, device=device)
        output_counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        output_counts = output_counts.view(B, V)
    return seen_mask, output_counts


def _flat_index(tokens: dict[int, torch.Tensor], vocab_size: int) -> torch.Tensor:
    """{row: [n] int64 tokens} -> [sum of n] int64 indices row * V + token into a flattened [B, V] table."""
    rows = torch.tensor(list(tokens), dtype=torch.int64)
    lengths = torch.tensor([t.numel() for t in tokens.values()], dtype=torch.int64)
    return torch.repeat_interleave(rows, lengths) * vocab_size + torch.cat(list(tokens.values()))

"""Turn a batch of logits into next tokens, with vLLM's sampling semantics.

Per step the engine describes each row with a SamplingRow; SamplingMetadata.build turns the rows
into per-row tensors once; Sampler.forward then works on the whole batch at once, with no Python
loop over rows or over the vocabulary.

Order of operations (vLLM's):
  1. logprobs (if any row asked) from the RAW logits: log_softmax before anything below.
  2. suppressed tokens (EOS / stop ids while min_tokens is not reached) -> -inf.
  3. penalties: repetition (over prompt + output), frequency and presence (over the output).
  4. greedy rows (temperature 0, or top_k 1, which keeps the same single token) take the argmax.
  5. the other rows: logits / temperature, then top_k, top_p, min_p, then a seeded draw.

Filters: each keeps the tokens whose logit is >= a per-row cutoff (ties at the cutoff are kept,
like vLLM's top-k), so they combine into one cutoff per row, found from `torch.topk` candidates
(a top-p nucleus wider than the candidates falls back to a full sort). Rows without any filter
skip all of this.

The draw: inverse CDF with ONE uniform u per row, a counter-based hash (SplitMix64 in int64 torch
ops) of (seed, step) only, step = number of tokens generated so far. With w = exp(x - max) on the
kept tokens and 0 elsewhere, the token is the first whose cumulative weight exceeds u * sum(w).
So a row's draw depends only on its seed, step and logits: not on the batch, its position in it,
or whether the request was preempted and recomputed. The cumulative sum runs in TOKEN-ID order:
a row whose kept tokens are all candidates draws over its candidates sorted back into id order,
others over the whole vocabulary, and both walk the same weights in the same order (the dropped
tokens add exact zeros), so they pick the same token. Which path a row takes can depend on its
batch-mates (C = the largest top_k + 1); its token does not, up to float rounding at a cdf
boundary on devices whose cumsum does not add left to right.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from nanoserve.sampling_params import SamplingParams

# How many top logits the filters look at when a row has no smaller top_k. Real nuclei are almost
# always far smaller; rows that need more fall back to a full sort / a draw over the whole
# vocabulary, so this changes speed, never results.
NUM_CANDIDATES = 1024
# Temperatures below this are greedy, like vLLM's _SAMPLING_EPS (logits / 1e-6 lose all precision).
_MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """What the engine knows about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int  # always set: the user's seed or one the engine drew for the request
    suppressed_token_ids: list[int]  # EOS/stop ids to mask to -inf (min_tokens not reached yet)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, logprob of the sampled token; None if nobody asked
    topk_token_ids: torch.Tensor | None  # [B, K] int64, K = max logprobs asked (may be 0)
    topk_logprobs: torch.Tensor | None  # [B, K] float32


@dataclass
class SamplingMetadata:
    """Per-step tensors (built once per step from the rows) plus Python flags that let forward
    skip whole stages without looking at tensor values."""

    num_rows: int  # B
    vocab_size: int  # V
    # --- which rows take which path (Python flags / sorted int64 row indices into the batch) ---
    all_greedy: bool
    any_greedy: bool
    plain_rows: torch.Tensor | None  # [P] sampled rows with temperature only (no filter); None if P=0
    filtered_rows: torch.Tensor | None  # [F] sampled rows with top_k, top_p or min_p; None if F=0
    # --- per-row sampling parameters, [B] each (greedy rows hold neutral values) ---
    temperature: torch.Tensor  # float32; 1.0 for greedy rows so dividing is harmless
    top_k: torch.Tensor  # int64; 0 = off (values >= V are stored as 0)
    top_p: torch.Tensor  # float32; 1.0 = off
    min_p: torch.Tensor  # float32; 0.0 = off
    seeds: torch.Tensor  # int64 in [0, 2**63)
    steps: torch.Tensor  # int64, len(output_token_ids): index of the token being sampled
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

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device,
        num_candidates: int = NUM_CANDIDATES,
    ) -> "SamplingMetadata":
        B, V = len(rows), vocab_size
        params = [r.params for r in rows]
        for r in rows:
            if not 0 <= r.seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {r.seed}")

        # top_k == 1 keeps only the max: exactly greedy, and cheaper (and exact under ties) that way.
        greedy = [p.temperature < _MIN_TEMPERATURE or p.top_k == 1 for p in params]
        top_k = [0 if g or p.top_k >= V else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        has_filter = [k > 0 or p < 1.0 or m > 0.0 for k, p, m in zip(top_k, top_p, min_p)]
        plain = [i for i in range(B) if not greedy[i] and not has_filter[i]]
        filtered = [i for i in range(B) if has_filter[i]]  # never greedy: those hold neutral values

        # A top-k row needs its top k + 1 logits (the extra one tells whether ties at the k-th
        # value continue past the candidates); other filtered rows get NUM_CANDIDATES.
        max_k = max((top_k[i] for i in filtered), default=0)
        needs_wide = any(top_k[i] == 0 for i in filtered)
        num_cands = min(V, max(max_k + 1, num_candidates if needs_wide else 0))

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device)

        any_rep = any(p.repetition_penalty != 1.0 for p in params)
        any_freq = any(p.frequency_penalty != 0.0 for p in params)
        any_pres = any(p.presence_penalty != 0.0 for p in params)
        output_counts = seen_mask = None
        if any_freq or any_pres or any_rep:
            # Counts in one scatter_add over the flattened [B * V] table: flat index = row * V + token.
            out_flat = _flat_token_index([r.output_token_ids for r in rows], V, device)
            if any_freq or any_pres:
                output_counts = torch.zeros(B * V, dtype=torch.float32, device=device)
                output_counts.scatter_add_(0, out_flat, torch.ones_like(out_flat, dtype=torch.float32))
                output_counts = output_counts.view(B, V)
            if any_rep:
                prompt_flat = _flat_token_index([r.prompt_token_ids for r in rows], V, device)
                seen_mask = torch.zeros(B * V, dtype=torch.bool, device=device)
                seen_mask.index_fill_(0, torch.cat([prompt_flat, out_flat]), True)
                seen_mask = seen_mask.view(B, V)

        suppressed = None
        pairs = [(i, t) for i, r in enumerate(rows) for t in r.suppressed_token_ids]
        if pairs:
            if any(not 0 <= t < V for _, t in pairs):
                raise ValueError(f"suppressed token ids must be in [0, {V})")
            suppressed = tensor(pairs, torch.int64).T.contiguous()  # [2, N]

        asked = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            num_rows=B,
            vocab_size=V,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            plain_rows=tensor(plain, torch.int64) if plain else None,
            filtered_rows=tensor(filtered, torch.int64) if filtered else None,
            temperature=tensor(temperature, torch.float32),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor(top_p, torch.float32),
            min_p=tensor(min_p, torch.float32),
            seeds=tensor([r.seed for r in rows], torch.int64),
            steps=tensor([len(r.output_token_ids) for r in rows], torch.int64),
            need_temperature=any(t != 1.0 for t in temperature),
            use_top_k=max_k > 0,
            use_top_p=any(top_p[i] < 1.0 for i in filtered),
            need_full_lse=any(top_p[i] < 1.0 and top_k[i] == 0 for i in filtered),
            num_candidates=num_cands,
            repetition_penalty=tensor([p.repetition_penalty for p in params], torch.float32) if any_rep else None,
            frequency_penalty=tensor([p.frequency_penalty for p in params], torch.float32) if any_freq else None,
            presence_penalty=tensor([p.presence_penalty for p in params], torch.float32) if any_pres else None,
            seen_mask=seen_mask,
            output_counts=output_counts,
            suppressed=suppressed,
            max_num_logprobs=min(max(asked), V) if asked else None,
        )


def _flat_token_index(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[sum of lengths] int64 indices row * V + token into a flattened [B, V] table."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return (rows * vocab_size + tokens).to(device)


# ---------------------------------------------------------------------------------------------
# Counter-based random numbers: SplitMix64 on int64 tensors.
# int64 multiply wraps mod 2**64 like uint64; `>>` on int64 is arithmetic, so a logical shift
# masks off the copied sign bits afterwards.


def _as_int64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)  # SplitMix64's stream increment
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)
_UNIFORM_BITS = 52  # (k + 0.5) / 2**52 is exact in float64 and lies strictly inside (0, 1)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (as if uint64)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, elementwise on int64 (read as uint64)."""
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    return x ^ _shr(x, 31)


def stream_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[N] int64 key per (seed, step): output number `step` of a SplitMix64 stream seeded by `seed`."""
    return splitmix64(splitmix64(seeds) + (steps + 1) * _GOLDEN)


def row_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[N] float64 U(0, 1), never exactly 0 or 1: the top 52 bits k of the (seed, step) key as
    (k + 0.5) / 2**52."""
    k = _shr(stream_keys(seeds, steps), 64 - _UNIFORM_BITS)
    return (k.double() + 0.5) * 2.0**-_UNIFORM_BITS


# ---------------------------------------------------------------------------------------------
# Processing stages.


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] float32 -> penalised copy (or `logits` itself when no row has a penalty).

    Rows with neutral values (1.0 / 0.0) come out bit-identical, so batch-mates don't matter.
    """
    if meta.repetition_penalty is not None:
        # HF / vLLM: tokens already seen become less likely whatever the sign of their logit.
        pen = meta.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(meta.seen_mask, penalised, logits)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty[:, None] * meta.output_counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty[:, None] * (meta.output_counts > 0)
    return logits


def _cutoffs(
    vals: torch.Tensor,  # [N, L] the L largest scaled logits of each row, descending (L <= V)
    lse: torch.Tensor | None,  # [N] logsumexp of the full rows; needed for top-p rows without top-k
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float32, 1 = off
    min_p: torch.Tensor,  # [N] float32, 0 = off
    use_top_k: bool,  # some row has top_k (lets the common top-p-only case skip work)
    use_top_p: bool,  # some row has top_p
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cutoff: top_k, then top_p, then min_p keep exactly the tokens with logit >= cutoff.

    Returns (cutoff [N], exact [N] bool). exact is False for a top-p row whose answer needs more
    than the L values given (only possible when L < V): its cutoff must be recomputed.
    """
    L = vals.shape[1]
    cutoff = torch.full_like(vals[:, 0], float("-inf"))
    exact = torch.ones_like(top_k, dtype=torch.bool)
    has_k = top_k > 0
    if use_top_k:
        kth = vals.gather(1, (top_k.clamp(1, L) - 1)[:, None]).squeeze(1)  # [N] k-th largest logit
        cutoff = torch.where(has_k, kth, cutoff)
    if use_top_p:
        # Top-p runs on the top-k-renormalised distribution: keep a token while the probability
        # mass strictly above it is < p (vLLM's "drop the tail whose mass is <= 1 - p").
        kept_k = vals.masked_fill(vals < cutoff[:, None], float("-inf")) if use_top_k else vals
        if lse is None:
            z = kept_k.logsumexp(-1)
        elif use_top_k:
            z = torch.where(has_k, kept_k.logsumexp(-1), lse)
        else:
            z = lse
        cum = (kept_k - z[:, None]).exp_().cumsum_(-1)  # [N, L] mass of tokens 0..i
        # Token i is kept iff cum[i - 1] < p (token 0 always): cum is sorted, so count by bisection.
        n_keep = (torch.searchsorted(cum, top_p[:, None]).squeeze(1) + 1).clamp_(max=L)  # [N]
        if use_top_k:
            # Tokens past the top-k carry no mass; keep them out even if rounding left cum < p.
            n_keep = torch.minimum(n_keep, (vals >= cutoff[:, None]).sum(-1))
        last_kept = vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)
        has_p = top_p < 1.0
        cutoff = torch.where(has_p, torch.maximum(cutoff, last_kept), cutoff)
        # Exact if the nucleus ended inside the L values, and z (for top-k rows) saw every token
        # >= the k-th value, i.e. ties at it did not run past the L values.
        ends_inside = n_keep < L
        if use_top_k:
            ends_inside &= ~has_k | (kth > vals[:, -1])
        exact = ~has_p | ends_inside
    # min_p: prob >= min_p * max prob  <=>  logit >= max logit + log(min_p); log(0) = -inf keeps all.
    cutoff = torch.maximum(cutoff, vals[:, 0] + torch.log(min_p))
    return cutoff, exact


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """w: [N, L] weights >= 0 (overwritten), u: [N] float64 in (0, 1) -> [N] index i, the first
    with w[0] + ... + w[i] > u * sum(w). That i has w[i] > 0, so zero-weight entries never win."""
    cdf = w.cumsum_(-1)  # [N, L]
    total = cdf[:, -1:]  # [N, 1] > 0: the row's max is always kept, with weight exp(0) = 1
    target = (u[:, None] * total.double()).to(cdf.dtype)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))  # < total
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _draw_full(x: torch.Tensor, temperature: torch.Tensor | None, u: torch.Tensor, cutoff: torch.Tensor | None):
    """Draw over the whole vocabulary: x [N, V] logits before temperature -> [N] token ids.
    Tokens whose scaled logit is < cutoff [N] (None: no filter) get weight 0."""
    y = x / temperature[:, None] if temperature is not None else x.clone()  # [N, V], ours to write
    if cutoff is not None:
        y.masked_fill_(y < cutoff[:, None], float("-inf"))
    y.sub_(y.amax(-1, keepdim=True)).exp_()  # weights in token-id order
    return _inverse_cdf(y, u)


def _draw_candidates(vals: torch.Tensor, ids: torch.Tensor, u: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Draw over candidates: vals/ids [N, C] (scaled logits, descending) -> [N] token ids. Sorted
    back into token-id order, the weights are those _draw_full walks minus its zeros, so when every
    token >= cutoff is a candidate this draws exactly what _draw_full would."""
    order = ids.argsort(-1)  # [N, C]
    ids, y = ids.gather(1, order), vals.gather(1, order)
    w = (y - vals[:, :1]).masked_fill_(y < cutoff[:, None], float("-inf")).exp_()
    return ids.gather(1, _inverse_cdf(w, u)[:, None]).squeeze(1)


def _draw_filtered(
    x: torch.Tensor,  # [F, V] logits, before temperature
    temperature: torch.Tensor | None,  # [F]; None when all are 1
    u: torch.Tensor,  # [F] float64
    top_k: torch.Tensor,  # [F]
    top_p: torch.Tensor,  # [F]
    min_p: torch.Tensor,  # [F]
    meta: SamplingMetadata,
) -> torch.Tensor:  # [F] int64
    V, C = x.shape[1], meta.num_candidates

    def scale(t: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        # Dividing by T > 0 keeps the order, so x / T is never built for all rows: only the
        # candidates, and the few rows that fall back to the full vocabulary, are scaled.
        if temperature is None:
            return t
        return t / (temperature if rows is None else temperature[rows])[:, None]

    top, ids = x.topk(C, dim=-1)  # [F, C] descending
    vals = scale(top)
    lse = None  # [F] logsumexp(x / T), reusing the max topk found
    if meta.need_full_lse:
        shifted = x - top[:, :1]  # [F, V] <= 0
        if temperature is not None:
            shifted.div_(temperature[:, None])
        lse = vals[:, 0] + shifted.exp_().sum(-1).log()
    cutoff, exact = _cutoffs(vals, lse, top_k, top_p, min_p, meta.use_top_k, meta.use_top_p)

    if C < V and meta.use_top_p and not bool(exact.all()):
        # Flat rows whose nucleus runs past the candidates: sort those rows fully.
        r = (~exact).nonzero().squeeze(1)
        full_vals = scale(x[r].sort(dim=-1, descending=True).values, r)  # [R, V]
        cutoff[r] = _cutoffs(
            full_vals, None if lse is None else lse[r], top_k[r], top_p[r], min_p[r], meta.use_top_k, True
        )[0]

    token_ids = _draw_candidates(vals, ids, u, cutoff)
    if C < V:
        # Rows where tokens outside the candidates pass the cutoff draw over the whole vocabulary
        # instead: the same token, as both walk the kept weights in token-id order.
        wide = cutoff <= vals[:, -1]
        if bool(wide.any()):
            w = wide.nonzero().squeeze(1)
            token_ids[w] = _draw_full(x[w], None if temperature is None else temperature[w], u[w], cutoff[w])
    return token_ids


def _take(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """t[rows] for sorted, unique rows, without copying when they are all of t."""
    return t if t is None or rows.numel() == t.shape[0] else t[rows]


class Sampler(torch.nn.Module):
    """logits [B, V] (any float dtype; computed in float32) + SamplingMetadata -> SamplerOutput."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"logits must be [{meta.num_rows}, {meta.vocab_size}], got {list(logits.shape)}"
            )
        no_processing = (meta.suppressed is None and meta.repetition_penalty is None
                         and meta.frequency_penalty is None and meta.presence_penalty is None)
        if meta.all_greedy and no_processing and meta.max_num_logprobs is None:
            # The common path: float32 conversion is exact and monotone, so skip it for argmax.
            return SamplerOutput(logits.argmax(-1), None, None, None)
        raw = logits.float()  # [B, V]; may be the caller's tensor, so never written in place

        logits = raw
        if meta.suppressed is not None:
            logits = logits.index_put((meta.suppressed[0], meta.suppressed[1]), raw.new_tensor(float("-inf")))
        logits = apply_penalties(logits, meta)
        token_ids = self._sample(logits, meta)

        logprobs = topk_ids = topk_logprobs = None
        if meta.max_num_logprobs is not None:
            # log_softmax(raw) at a few positions only: raw - logsumexp, no [B, V] result.
            lse = raw.logsumexp(-1, keepdim=True)  # [B, 1]
            logprobs = (raw.gather(1, token_ids[:, None]) - lse).squeeze(1)
            top_vals, topk_ids = raw.topk(meta.max_num_logprobs, dim=-1)  # [B, K]
            topk_logprobs = top_vals - lse
        return SamplerOutput(token_ids, logprobs, topk_ids, topk_logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """[B, V] processed logits (never written to) -> [B] int64 token ids."""
        if meta.all_greedy:
            return logits.argmax(-1)  # ties go to the lowest id
        # The greedy rows' answer; the sampled rows are overwritten below.
        token_ids = logits.argmax(-1) if meta.any_greedy else logits.new_empty(meta.num_rows, dtype=torch.int64)
        u = row_uniforms(meta.seeds, meta.steps)  # [B]
        temperature = meta.temperature if meta.need_temperature else None
        if (rows := meta.plain_rows) is not None:  # temperature only: the whole vocabulary
            token_ids[rows] = _draw_full(_take(logits, rows), _take(temperature, rows), u[rows], None)
        if (rows := meta.filtered_rows) is not None:
            token_ids[rows] = _draw_filtered(
                _take(logits, rows), _take(temperature, rows), u[rows],
                meta.top_k[rows], meta.top_p[rows], meta.min_p[rows], meta,
            )
        return token_ids

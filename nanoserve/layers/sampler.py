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

Seeded draws without a torch.Generator per row: the exponential race. If E_v ~ Exp(1) are
independent, argmax_v p_v / E_v is distributed as p, i.e. argmax_v (logit_v - log E_v) (the
Gumbel-max form, which needs no softmax). E_v = -log(U_v) with U_v a counter-based hash of
(seed, step, token id), so a row's draw depends only on its own seed, its step (= number of
tokens generated so far) and its logits: not on the batch, the row's position in it, or whether
the request was preempted and recomputed. The hash is SplitMix64 in int64 torch ops.

Every filter of step 5 keeps the tokens whose logit is >= a per-row cutoff (ties at the cutoff
are kept, like vLLM's top-k), so the filters combine into one cutoff per row and the sorted order
never has to be scattered back. Our noise is bounded, so a token far enough below the row's max
can never win the race either: that is one more cutoff, exact, not an approximation. The cutoffs
only look at the top of each row, so they come from `torch.topk` candidates, and when every token
above the cutoff is a candidate the race runs over the candidates only. Flat rows (a top-p
nucleus wider than the candidates, or a wide race) fall back to a full sort / a full-vocabulary
race, for those rows only; both give the same tokens as the candidate path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.nn.functional as F

from nanoserve.sampling_params import SamplingParams

# How many top logits the filters and the race look at when a row has no smaller top_k. Real
# nuclei are almost always far smaller; rows that need more fall back to a full sort / a race
# over the whole vocabulary, so this changes speed, never results.
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
    # --- which rows take which path (Python flags / int64 row indices into the batch) ---
    all_greedy: bool
    any_greedy: bool
    sampled_rows: torch.Tensor | None  # [S] the non-greedy rows; None if S=0
    # --- per-row sampling parameters, [B] each (greedy rows hold neutral values) ---
    temperature: torch.Tensor  # float32; 1.0 for greedy rows so dividing is harmless
    top_k: torch.Tensor  # int64; 0 = off (values >= V are stored as 0)
    top_p: torch.Tensor  # float32; 1.0 = off
    min_p: torch.Tensor  # float32; 0.0 = off
    seeds: torch.Tensor  # int64 in [0, 2**63)
    steps: torch.Tensor  # int64, len(output_token_ids): index of the token being sampled
    need_temperature: bool  # some sampled row has temperature != 1
    use_top_p: bool  # some sampled row has top_p < 1
    need_full_lse: bool  # some sampled row has top_p < 1 and no top_k: top-p needs the full softmax
    num_candidates: int  # C, how many top logits the filters and the race look at (<= V)
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
        sampled = [i for i in range(B) if not greedy[i]]

        # A top-k row needs its top k + 1 logits (the extra one tells whether ties at the k-th
        # value continue past the candidates); rows without a top_k get NUM_CANDIDATES.
        max_k = max((top_k[i] for i in sampled), default=0)
        needs_wide = any(top_k[i] == 0 for i in sampled)
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
            sampled_rows=tensor(sampled, torch.int64) if sampled else None,
            temperature=tensor(temperature, torch.float32),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor(top_p, torch.float32),
            min_p=tensor(min_p, torch.float32),
            seeds=tensor([r.seed for r in rows], torch.int64),
            steps=tensor([len(r.output_token_ids) for r in rows], torch.int64),
            need_temperature=any(t != 1.0 for t in temperature),
            use_top_p=any(top_p[i] < 1.0 for i in sampled),
            need_full_lse=any(top_p[i] < 1.0 and top_k[i] == 0 for i in sampled),
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
_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 is exact in float32 and lies strictly inside (0, 1)
# So E = -log U lies in [-log(1 - 2**-24), -log(2**-24)] and -log E in [-2.82, 16.64]: a token more
# than 19.46 below the row's max logit can never win the race. 20 leaves room for float rounding.
_RACE_SPAN = 20.0


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


def uniform_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float32, [N, L]: output number `token_id` of a SplitMix64 stream seeded by keys[n].

    keys: [N] int64; token_ids: [N, L] or [L] int64. Never exactly 0 or 1.
    Written in place on two int64 buffers: at [256, 151936] every temporary is ~300 MB.
    """
    x = keys[:, None] + (token_ids + 1) * _GOLDEN  # [N, L]
    tmp = torch.empty_like(x)
    torch.bitwise_right_shift(x, 30, out=tmp).bitwise_and_((1 << 34) - 1)
    x.bitwise_xor_(tmp).mul_(_MIX1)
    torch.bitwise_right_shift(x, 27, out=tmp).bitwise_and_((1 << 37) - 1)
    x.bitwise_xor_(tmp).mul_(_MIX2)
    # SplitMix64 ends with x ^= x >>> 31, which leaves the top 31 bits alone: we only keep the top
    # 23 bits k, so skip it.
    torch.bitwise_right_shift(x, 64 - _UNIFORM_BITS, out=tmp).bitwise_and_((1 << _UNIFORM_BITS) - 1)
    del x
    # Explicit float32: the engine may have set a low-precision default dtype.
    return tmp.to(torch.float32).add_(0.5).mul_(2.0**-_UNIFORM_BITS)  # (k + 0.5) / 2**23, exact


def _log_exponential(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log E with E = -log U ~ Exp(1), [N, L] float32; finite since U is strictly inside (0, 1)."""
    return uniform_noise(keys, token_ids).log_().neg_().log_()


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
    vals: torch.Tensor,  # [N, L] the L largest logits of each row, descending (L <= V)
    lse: torch.Tensor | None,  # [N] logsumexp of the full rows; needed for top-p rows without top-k
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float32, 1 = off
    min_p: torch.Tensor,  # [N] float32, 0 = off
    use_top_p: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cutoff: the tokens that top_k, then top_p, then min_p keep AND that can win the race
    are exactly those with logit >= cutoff.

    Returns (cutoff [N], exact [N] bool). exact is False for a top-p row whose answer needs more
    than the L values given (only possible when L < V): its cutoff must be recomputed.
    """
    L = vals.shape[1]
    neg_inf = torch.tensor(float("-inf"), dtype=vals.dtype, device=vals.device)
    floor = vals[:, 0] - _RACE_SPAN  # below this a token never wins the race, filtered or not
    has_k = top_k > 0
    kth = vals.gather(1, (top_k.clamp(1, L) - 1)[:, None]).squeeze(1)  # [N] k-th largest logit
    cutoff_k = torch.where(has_k, kth, neg_inf)
    cutoff = torch.maximum(floor, cutoff_k)
    exact = torch.ones_like(has_k)
    if use_top_p:
        # Top-p runs on the top-k-renormalised distribution: keep a token while the probability
        # mass strictly above it is < p (vLLM's "drop the tail whose mass is <= 1 - p").
        kept_k = vals.masked_fill(vals < cutoff_k[:, None], float("-inf"))  # [N, L]
        z = kept_k.logsumexp(-1)
        if lse is not None:
            z = torch.where(has_k, z, lse)
        probs = (kept_k - z[:, None]).exp()  # [N, L]
        mass_above = F.pad(probs.cumsum(-1)[:, :-1], (1, 0))  # [N, L] exclusive cumsum
        keep = (mass_above < top_p[:, None]) & (vals >= cutoff_k[:, None])  # a prefix of each row
        n_keep = keep.sum(-1)  # [N] >= 1: position 0 always has mass_above 0 < p
        last_kept = vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)
        has_p = top_p < 1.0
        cutoff = torch.where(has_p, torch.maximum(cutoff, last_kept), cutoff)
        # Exact if the nucleus ended inside the L values, or the values past them lie below the race
        # floor anyway; and z (for top-k rows) saw every token >= the k-th value, i.e. ties at it
        # did not run past the L values.
        ends_inside = (n_keep < L) | (vals[:, -1] < floor)
        k_inside = ~has_k | (kth > vals[:, -1])
        exact = ~has_p | (ends_inside & k_inside)
    # min_p: prob >= min_p * max prob  <=>  logit >= max logit + log(min_p); log(0) = -inf keeps all.
    cutoff = torch.maximum(cutoff, vals[:, 0] + torch.log(min_p))
    return cutoff, exact


def _race_full(x: torch.Tensor, keys: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Exponential race over the whole vocabulary, tokens < cutoff [N] excluded.

    x: [N, V] scaled logits -> [N] token ids.
    """
    token_ids = torch.arange(x.shape[1], device=x.device)
    scores = _log_exponential(keys, token_ids)  # [N, V] log E
    torch.sub(x, scores, out=scores)  # logit - log E; its argmax is distributed as softmax(x)
    scores.masked_fill_(x < cutoff[:, None], float("-inf"))
    return scores.argmax(-1)


def _race_candidates(
    vals: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, cutoff: torch.Tensor
) -> torch.Tensor:
    """Exponential race over candidates: vals/ids [N, C] -> [N] token ids.

    The noise is keyed by token id, so this draws exactly what _race_full would when every token
    >= cutoff is among the candidates.
    """
    scores = vals - _log_exponential(keys, ids)  # [N, C]
    scores.masked_fill_(vals < cutoff[:, None], float("-inf"))
    return ids.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
            raise ValueError(
                f"logits must be [{meta.num_rows}, {meta.vocab_size}], got {list(logits.shape)}"
            )
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
        """[B, V] processed logits -> [B] int64 token ids."""
        if meta.all_greedy:
            return logits.argmax(-1)  # ties go to the lowest id
        rows = meta.sampled_rows  # [S]
        whole = rows.numel() == meta.num_rows  # rows are sorted and unique: "all rows"
        x = logits if whole else logits[rows]  # [S, V]
        if meta.need_temperature:
            x = x / meta.temperature[rows, None]
        keys = stream_keys(meta.seeds[rows], meta.steps[rows])  # [S]
        sampled = self._race(x, keys, meta.top_k[rows], meta.top_p[rows], meta.min_p[rows], meta)
        if whole:
            return sampled
        token_ids = logits.argmax(-1)  # the greedy rows' answer; sampled rows overwritten below
        return token_ids.index_copy_(0, rows, sampled)

    def _race(
        self,
        x: torch.Tensor,  # [S, V] temperature-scaled logits
        keys: torch.Tensor,  # [S] int64
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        meta: SamplingMetadata,
    ) -> torch.Tensor:  # [S] int64
        V, C = x.shape[1], meta.num_candidates
        vals, ids = x.topk(C, dim=-1)  # [S, C] descending
        lse = x.logsumexp(-1) if meta.need_full_lse else None  # [S]
        cutoff, exact = _cutoffs(vals, lse, top_k, top_p, min_p, meta.use_top_p)

        if C < V and meta.use_top_p and not bool(exact.all()):
            # Flat rows whose nucleus runs past the candidates: sort those rows fully.
            r = (~exact).nonzero().squeeze(1)
            full_vals = x[r].sort(dim=-1, descending=True).values  # [R, V]
            cutoff[r] = _cutoffs(full_vals, None if lse is None else lse[r], top_k[r], top_p[r], min_p[r], True)[0]

        token_ids = _race_candidates(vals, ids, keys, cutoff)
        if C < V:
            # Rows where tokens outside the candidates pass the cutoff race over the whole
            # vocabulary instead; the noise is keyed by token id, so the draw is the same.
            wide = cutoff <= vals[:, -1]
            if bool(wide.any()):
                w = wide.nonzero().squeeze(1)
                token_ids[w] = _race_full(x[w], keys[w], cutoff[w])
        return token_ids

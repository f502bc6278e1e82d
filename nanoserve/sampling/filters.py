"""Logit processing and the seeded draw: penalties, the top-k / top-p / min-p cutoff, inverse CDF.

Filters: each keeps the tokens whose logit is >= a per-row cutoff (ties at the cutoff are kept,
like vLLM's top-k), so they combine into one cutoff per row, found from `torch.topk` candidates
(a top-p nucleus wider than the candidates falls back to a full sort). Rows without any filter
skip all of this.

The draw: inverse CDF with ONE uniform u per row (rng.row_uniforms of its seed and step). With
w = exp(x - max) on the kept tokens and 0 elsewhere, the token is the first whose cumulative
weight exceeds u * sum(w). So a row's draw depends only on its seed, step and logits: not on the
batch, its position in it, or whether the request was preempted and recomputed. The cumulative
sum runs in TOKEN-ID order: a row whose kept tokens are all candidates draws over its candidates
sorted back into id order (draw_candidates), others over the whole vocabulary (draw_full), and
both walk the same weights in the same order (the dropped tokens add exact zeros), so they pick
the same token. Which path a row takes can depend on its batch-mates (C = the largest top_k + 1);
its token does not, up to float rounding at a cdf boundary on devices whose cumsum does not add
left to right.
"""
from __future__ import annotations

import torch

from nanoserve.sampling.metadata import SamplingMetadata


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


def cutoffs(
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


def inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """w: [N, L] weights >= 0 (overwritten), u: [N] float64 in (0, 1) -> [N] index i, the first
    with w[0] + ... + w[i] > u * sum(w). That i has w[i] > 0, so zero-weight entries never win."""
    cdf = w.cumsum_(-1)  # [N, L]
    total = cdf[:, -1:]  # [N, 1] > 0: the row's max is always kept, with weight exp(0) = 1
    target = (u[:, None] * total.double()).to(cdf.dtype)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))  # < total
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def draw_full(
    x: torch.Tensor, temperature: torch.Tensor | None, u: torch.Tensor, cutoff: torch.Tensor | None
) -> torch.Tensor:
    """Draw over the whole vocabulary: x [N, V] logits before temperature -> [N] token ids.
    Tokens whose scaled logit is < cutoff [N] (None: no filter) get weight 0."""
    y = x / temperature[:, None] if temperature is not None else x.clone()  # [N, V], ours to write
    if cutoff is not None:
        y.masked_fill_(y < cutoff[:, None], float("-inf"))
    y.sub_(y.amax(-1, keepdim=True)).exp_()  # weights in token-id order
    return inverse_cdf(y, u)


def draw_candidates(vals: torch.Tensor, ids: torch.Tensor, u: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Draw over candidates: vals/ids [N, C] (scaled logits, descending) -> [N] token ids. Sorted
    back into token-id order, the weights are those draw_full walks minus its zeros, so when every
    token >= cutoff is a candidate this draws exactly what draw_full would."""
    order = ids.argsort(-1)  # [N, C]
    ids, y = ids.gather(1, order), vals.gather(1, order)
    w = (y - vals[:, :1]).masked_fill_(y < cutoff[:, None], float("-inf")).exp_()
    return ids.gather(1, inverse_cdf(w, u)[:, None]).squeeze(1)


def draw_filtered(
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
    cutoff, exact = cutoffs(vals, lse, top_k, top_p, min_p, meta.use_top_k, meta.use_top_p)

    if C < V and meta.use_top_p and not bool(exact.all()):
        # Flat rows whose nucleus runs past the candidates: sort those rows fully.
        r = (~exact).nonzero().squeeze(1)
        full_vals = scale(x[r].sort(dim=-1, descending=True).values, r)  # [R, V]
        cutoff[r] = cutoffs(
            full_vals, None if lse is None else lse[r], top_k[r], top_p[r], min_p[r], meta.use_top_k, True
        )[0]

    token_ids = draw_candidates(vals, ids, u, cutoff)
    if C < V:
        # Rows where tokens outside the candidates pass the cutoff draw over the whole vocabulary
        # instead: the same token, as both walk the kept weights in token-id order.
        wide = cutoff <= vals[:, -1]
        if bool(wide.any()):
            w = wide.nonzero().squeeze(1)
            token_ids[w] = draw_full(x[w], None if temperature is None else temperature[w], u[w], cutoff[w])
    return token_ids

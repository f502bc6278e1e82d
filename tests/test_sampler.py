"""Sampler: greedy, filters (statistically), penalties, seeded reproducibility, logprobs, uniforms."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from nanoserve.sampling import NUM_CANDIDATES, Sampler, SamplingMetadata, SamplingRow, SamplingSpec
from nanoserve.sampling.filters import apply_penalties, cutoffs, draw_candidates, draw_full, inverse_cdf
from nanoserve.sampling.rng import row_uniforms, splitmix64, stream_keys
from nanoserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
sampler = Sampler()


def row(params: SamplingParams | None = None, seed: int = 0, prompt=(1, 2, 3), output=(), suppressed=()):
    """A row as the engine describes it, made once the vocabulary size is known. `suppressed` are
    EOS ids, masked because min_tokens is not reached yet."""
    params = params or SamplingParams()
    if suppressed:
        params = dataclasses.replace(params, min_tokens=len(output) + 1, max_tokens=None)

    def at(vocab_size: int) -> SamplingRow:
        spec = SamplingSpec.from_params(params, vocab_size, list(suppressed))
        return SamplingRow(spec, seed, [*prompt, *output], len(prompt))

    return at


def build(rows, vocab_size, **build_kwargs) -> SamplingMetadata:
    return SamplingMetadata.build([r(vocab_size) for r in rows], vocab_size, CPU, **build_kwargs)


def sample(rows, logits, **build_kwargs):
    return sampler(logits, build(rows, logits.shape[1], **build_kwargs))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_greedy_is_argmax(dtype):
    logits = randn(8, 1000).to(dtype)  # low precision: plenty of ties, which go to the lowest id
    out = sample([row(SamplingParams(temperature=0.0)) for _ in range(8)], logits)
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.topk_token_ids is None


def test_greedy_rows_in_a_mixed_batch_and_low_precision():
    logits = randn(6, 500).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9)] * 3
    out = sample([row(p, seed=i) for i, p in enumerate(params)], logits)
    assert torch.equal(out.token_ids[::2], logits.float().argmax(-1)[::2])


def test_greedy_ties_go_to_lowest_id():
    logits = torch.zeros(2, 10)
    logits[:, [3, 7]] = 5.0
    out = sample([row(SamplingParams(temperature=0.0)), row(SamplingParams(top_k=1))], logits)
    assert out.token_ids.tolist() == [3, 3]


def test_top_k_1_equals_greedy():
    logits = randn(16, 300)
    rows = [row(SamplingParams(temperature=t, top_k=1), seed=i) for i, t in enumerate([0.3, 1.0, 1.7, 5.0] * 4)]
    assert torch.equal(sample(rows, logits).token_ids, logits.argmax(-1))
    # vLLM raises a temperature in (0, 0.01) to 0.01 (SamplingParams), so only 0 is greedy
    assert SamplingParams(temperature=1e-6).temperature == 0.01


# ------------------------------------------------------------------------------- statistics


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """The filtered softmax, written plainly: top_k, then top_p on the renormalised rest, then min_p."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[:top_k] if top_k > 0 else order
    z = sum(math.exp(x[i]) for i in keep)
    p = {i: math.exp(x[i]) / z for i in keep}
    if top_p < 1.0:
        nucleus, mass = [], 0.0
        for i in keep:  # descending
            if mass < top_p:
                nucleus.append(i)
                mass += p[i]
        keep = nucleus
    if min_p > 0.0:
        p_max = max(p[i] for i in keep)
        keep = [i for i in keep if p[i] >= min_p * p_max]
    z = sum(p[i] for i in keep)
    return [p[i] / z if i in keep else 0.0 for i in range(len(x))]


FILTER_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
    dict(temperature=2.0, top_p=0.5, min_p=0.2),
]


STAT_CASES = [
    pytest.param(case, nc, id=",".join(f"{k}={v}" for k, v in case.items()) + f"-{name}")
    for case in FILTER_CASES
    for nc, name in [(NUM_CANDIDATES, "candidates"), (3, "fallback")]
]


@pytest.mark.parametrize("case,num_candidates", STAT_CASES)
def test_sampled_distribution_matches_filtered_softmax(case, num_candidates):
    # One logit vector, n rows with distinct seeds: the n draws are independent samples.
    # num_candidates=3 forces the full-sort / full-vocabulary fallbacks on the same rows.
    n, V = 20000, 20
    base = (randn(V, seed=1) * 1.5).tolist()
    params = SamplingParams(**case)
    rows = [row(params, seed=1000 * n + i) for i in range(n)]
    tokens = sample(rows, torch.tensor([base] * n), num_candidates=num_candidates).token_ids
    empirical = torch.bincount(tokens, minlength=V).double() / n
    expected = torch.tensor(reference_probs(base, params.temperature, params.top_k, params.top_p, params.min_p),
                            dtype=torch.float64)
    assert (expected[empirical > 0] > 0).all(), "a filtered-out token was sampled"
    tv = 0.5 * (empirical - expected).abs().sum().item()
    assert tv < 0.02, tv


def full_sort_kept(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cutoff found from its whole vocabulary, sorted (the fallback's way, always exact),
    and how many tokens it keeps. A row keeping >= C tokens does not fit in C candidates."""
    vals = (logits / meta.temperature[:, None]).sort(dim=-1, descending=True).values  # [B, V]
    cutoff, exact = cutoffs(vals, None, meta.top_k, meta.top_p, meta.min_p, True, True)
    assert exact.all()
    return cutoff, (vals >= cutoff[:, None]).sum(-1)


@pytest.mark.parametrize("ties", [False, True])
def test_candidate_and_full_paths_draw_the_same_tokens(ties):
    # The cutoff is the same whichever way it is found, and both paths walk the kept weights in
    # token-id order. With ties (logits on a 0.5 grid, as in low precision) the ties at the k-th
    # value are kept. num_candidates=V: C = V, every row draws over its candidates (all of V);
    # with small C, rows keeping >= C tokens need the full sort and the full-vocabulary draw.
    V = 500
    logits = randn(64, V, seed=3) * 2
    if ties:
        logits = (logits * 2).round() / 2
    with_k = FILTER_CASES[2:] + [dict(temperature=0.8, top_p=0.95), dict(top_k=40, min_p=0.01)]
    without_k = [case for case in with_k if "top_k" not in case]
    for cases in (with_k, without_k):
        rows = [row(SamplingParams(**cases[i % len(cases)]), seed=i, output=[0] * (i % 3)) for i in range(64)]
        every_candidate_meta = build(rows, V, num_candidates=V)
        assert every_candidate_meta.num_candidates == V
        every_candidate = sampler(logits, every_candidate_meta).token_ids
        default = sample(rows, logits).token_ids
        narrow = build(rows, V, num_candidates=2)
        _, kept = full_sort_kept(logits, narrow)
        assert int((kept >= narrow.num_candidates).sum()) > (40 if cases is without_k else 0)
        mostly_full = sampler(logits, narrow).token_ids
        assert torch.equal(default, every_candidate)
        assert torch.equal(mostly_full, every_candidate)


def test_candidate_draw_equals_full_vocabulary_draw():
    # Peaked rows (a few tokens far above the rest): the kept set lies inside the candidates, so
    # the sampler draws over those; a full-vocabulary draw at the same cutoff must agree.
    n, V = 256, 5000
    logits = randn(n, V, seed=7)
    top = torch.randint(0, V, (n, 40), generator=torch.Generator().manual_seed(8))
    logits.scatter_(1, top, 15.0 + 3 * randn(n, 40, seed=9))
    cases = [dict(top_p=0.9), dict(temperature=0.7, top_p=0.95), dict(top_k=20), dict(temperature=1.3, min_p=0.01),
             dict(temperature=0.6, top_k=20, top_p=0.95)]
    rows = [row(SamplingParams(**cases[s % len(cases)]), seed=s, output=[0] * (s % 3)) for s in range(n)]
    meta = build(rows, V)
    C = meta.num_candidates
    cutoff, kept = full_sort_kept(logits, meta)
    assert C < V and (kept < C).all()  # every row's kept tokens are among its C candidates
    u = row_uniforms(meta.seeds, meta.steps)
    assert torch.equal(u, row_uniforms(torch.arange(n), torch.arange(n) % 3))
    full = draw_full(logits, meta.temperature, u, cutoff)
    cand_vals, cand_ids = logits.topk(C, dim=-1)  # [n, C]
    assert torch.equal(draw_candidates(cand_vals / meta.temperature[:, None], cand_ids, u, cutoff), full)
    assert torch.equal(sampler(logits, meta).token_ids, full)


def test_batch_mate_with_a_large_top_k_does_not_change_the_draw():
    # Alone, these flat rows' nuclei run past NUM_CANDIDATES: full sort, full-vocabulary draw. A
    # batch-mate with top_k = V - 1 makes C = V, so the same rows now draw over candidates.
    V = 4000
    probe_logits = randn(8, V, seed=11)
    probes = [row(SamplingParams(temperature=0.9, top_p=0.9), seed=50 + i, output=[1] * i) for i in range(8)]
    alone_meta = build(probes, V)
    _, kept = full_sort_kept(probe_logits, alone_meta)
    assert alone_meta.num_candidates == NUM_CANDIDATES and (kept >= NUM_CANDIDATES).all()
    alone = sampler(probe_logits, alone_meta).token_ids
    mate = row(SamplingParams(top_k=V - 1), seed=1)
    together_meta = build(probes + [mate], V)
    assert together_meta.num_candidates == V
    together = sampler(torch.cat([probe_logits, randn(1, V, seed=12)]), together_meta).token_ids
    assert torch.equal(together[:8], alone)


def test_inverse_cdf_never_picks_a_zero_weight_token():
    # u at its extremes: the target stays inside the kept mass, so dropped tokens (weight 0) at
    # either end of the row can never be picked, even where u * total rounds up to total.
    w = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 1e-30, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0]])
    for u in (2.0**-53, 0.5, 1 - 2.0**-53):
        idx = inverse_cdf(w.clone(), torch.full((4,), u, dtype=torch.float64))
        assert idx[:2].tolist() == [1, 2] and idx[2].item() in (1, 2) and idx[3].item() == 0


# -------------------------------------------------------------------------------- penalties


def reference_penalties(logits: list[float], prompt, output, rep, freq, pres) -> list[float]:
    out = list(logits)
    for v in set(prompt) | set(output):
        out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
    for v in set(output):
        out[v] -= freq * output.count(v)
        out[v] -= pres
    return out


def test_penalties_match_reference():
    rng = random.Random(0)
    B, V = 12, 40
    logits = randn(B, V, seed=4) * 3
    rows, expected = [], []
    for b in range(B):
        prompt = [rng.randrange(V) for _ in range(rng.randrange(0, 15))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 25))]
        # Some rows neutral: they must come out untouched.
        rep = 1.0 if b % 4 == 0 else rng.uniform(0.5, 2.0)
        freq = 0.0 if b % 3 == 0 else rng.uniform(-2.0, 2.0)
        pres = 0.0 if b % 5 == 0 else rng.uniform(-2.0, 2.0)
        params = SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        rows.append(row(params, seed=b, prompt=prompt, output=output))
        expected.append(reference_penalties(logits[b].tolist(), prompt, output, rep, freq, pres))
    expected = torch.tensor(expected)
    meta = build(rows, V)
    torch.testing.assert_close(apply_penalties(logits, meta), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(sampler(logits, meta).token_ids, expected.argmax(-1))


def test_no_penalty_means_no_penalty_tensors():
    meta = build([row(output=[1, 2, 2])], 10)
    assert meta.seen_mask is None and meta.output_counts is None
    logits = randn(1, 10)
    assert apply_penalties(logits, meta) is logits


# ----------------------------------------------------------------------------- reproducibility

PROBE_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=20),
    SamplingParams(min_p=0.05),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5),
]


def test_same_seed_same_token_whatever_the_batch():
    V = 5000
    probe_logits = randn(len(PROBE_PARAMS), V, seed=5) * 2
    probes = [row(p, seed=7 + i, output=[4, 5, 6]) for i, p in enumerate(PROBE_PARAMS)]
    draws = []
    for trial in range(4):
        rng = random.Random(trial)
        fillers = [row(SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0]), top_k=rng.choice([0, 3, 100, 3000]),
                                      top_p=rng.choice([1.0, 0.5]), presence_penalty=rng.choice([0.0, 1.0])),
                       seed=rng.randrange(2**63), output=[1] * rng.randrange(5))
                   for _ in range(rng.randrange(0, 12))]
        filler_logits = randn(len(fillers), V, seed=100 + trial) * 3
        order = list(range(len(probes) + len(fillers)))
        rng.shuffle(order)
        all_rows = probes + fillers
        all_logits = torch.cat([probe_logits, filler_logits])
        tokens = sample([all_rows[i] for i in order], all_logits[order]).token_ids
        where = {j: pos for pos, j in enumerate(order)}
        draws.append([tokens[where[j]].item() for j in range(len(probes))])
    assert all(d == draws[0] for d in draws), draws


def test_different_seeds_draw_differently():
    n, V = 2000, 1000
    logits = torch.zeros(n, V)  # uniform: distinct seeds should spread over the vocabulary
    tokens = sample([row(seed=s) for s in range(n)], logits).token_ids
    # Expected ~ V * (1 - exp(-n / V)) ~ 865 distinct tokens for independent draws.
    assert len(set(tokens.tolist())) > 800
    assert torch.bincount(tokens, minlength=V).max() < 10


def test_step_changes_the_draw():
    n, V = 500, 1000
    logits = torch.zeros(n, V)
    at_step = [sample([row(seed=s, output=[0] * step) for s in range(n)], logits).token_ids for step in range(3)]
    for a, b in [(0, 1), (1, 2), (0, 2)]:
        assert (at_step[a] == at_step[b]).float().mean() < 0.02
    again = sample([row(seed=s, output=[9]) for s in range(n)], logits).token_ids  # step depends on length only
    assert torch.equal(again, at_step[1])


# -------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_come_from_raw_logits(dtype):
    V = 300
    logits = (randn(4, V, seed=6) * 4).to(dtype)
    rows = [
        row(SamplingParams(temperature=0.5, top_p=0.8, repetition_penalty=1.5, logprobs=5), seed=1, output=[1, 2]),
        row(SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0), output=[3, 3, 3], suppressed=[7]),
        row(SamplingParams(temperature=1.5, top_k=10, presence_penalty=-1.0), seed=2, output=[5]),
        row(SamplingParams(min_p=0.3, logprobs=2), seed=3),
    ]
    before = logits.clone()
    out = sample(rows, logits)
    assert torch.equal(logits, before)  # float32 input is used as is: it must not be written to
    ref = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.topk_token_ids.shape == (4, 5) and out.topk_logprobs.dtype == torch.float32
    ref_top = ref.topk(5, dim=-1)
    torch.testing.assert_close(out.topk_logprobs, ref_top.values)
    torch.testing.assert_close(ref.gather(1, out.topk_token_ids), ref_top.values)


def test_logprobs_zero_gives_sampled_token_only():
    out = sample([row(SamplingParams(logprobs=0))], randn(1, 50))
    assert out.logprobs.shape == (1,) and out.topk_token_ids.shape == (1, 0)


# ------------------------------------------------------------------------------ suppression


def test_suppressed_tokens_are_never_sampled():
    V, n = 30, 3000
    logits = torch.zeros(n, V)
    logits[:, [0, 1, 2, V - 1]] = 10.0  # the suppressed ones, at both ends of the ids, are the likeliest
    logits[:, 5] = 9.0
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=5)]
    rows = [row(params[i % 4], seed=i, suppressed=[0, 1, 2, V - 1]) for i in range(n)]
    tokens = sample(rows, logits).token_ids
    assert not torch.isin(tokens, torch.tensor([0, 1, 2, V - 1])).any()
    assert (tokens[::4] == 5).all()  # greedy picks the best unsuppressed token


# --------------------------------------------------------------------------------- uniforms

MASK64 = (1 << 64) - 1


def py_splitmix64(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def to_signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def test_hash_matches_python_splitmix64():
    values = [0, 1, 2**31, 2**62 + 12345, 2**63 - 1, -1, -(2**63), -123456789]
    got = splitmix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [to_signed(py_splitmix64(v)) for v in values]

    seeds, steps = [0, 5, 2**63 - 1], [0, 3, 100]
    keys = stream_keys(torch.tensor(seeds), torch.tensor(steps))
    u = row_uniforms(torch.tensor(seeds), torch.tensor(steps))
    assert u.dtype == torch.float64
    for r, (seed, step) in enumerate(zip(seeds, steps)):
        key = py_splitmix64(py_splitmix64(seed) + (step + 1) * 0x9E3779B97F4A7C15)
        assert keys[r].item() == to_signed(key)
        assert u[r].item() == ((key >> 12) + 0.5) / 2**52  # top 52 bits


def test_row_uniforms_are_uniform():
    seeds = torch.arange(512).repeat_interleave(512)
    steps = torch.arange(512).repeat(512)
    u = row_uniforms(seeds, steps)  # 262144 draws, one per (seed, step)
    n = u.numel()
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=64, min=0, max=1)
    assert ((counts - n / 64).abs() < 5 * math.sqrt(n / 64)).all()  # 5 sigma per bin
    ks = (u.sort().values - (torch.arange(n, dtype=torch.float64) + 0.5) / n).abs().max().item()
    assert ks < 1.95 / math.sqrt(n)  # KS at the 0.1% level
    # Neighbouring seeds and neighbouring steps are not correlated.
    grid = u.view(512, 512) - 0.5  # [seed, step]
    assert (grid[1:] * grid[:-1]).mean().abs() < 0.002
    assert (grid[:, 1:] * grid[:, :-1]).mean().abs() < 0.002


# ---------------------------------------------------------------------------------- errors


def test_user_errors_raise_value_error():
    meta = build([row()], 10)
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 10), meta)
    # Request fields are checked once, never per step: by SamplingParams alone, and against the
    # model (vocab range of prompt and stop ids, n > 1 seeds) by the InputProcessor
    # (tests/test_errors.py); generated tokens come from the model itself.
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63)


def test_spec_is_normalised_for_the_model():
    V = 100
    spec = SamplingSpec.from_params(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, logprobs=500), V, [])
    assert spec.greedy and (spec.temperature, spec.top_k, spec.top_p, spec.min_p) == (1.0, 0, 1.0, 0.0)
    assert spec.logprobs == V
    assert SamplingSpec.from_params(SamplingParams(temperature=0.7, top_k=1), V, []).greedy
    assert SamplingSpec.from_params(SamplingParams(top_k=V), V, []).top_k == 0
    assert SamplingSpec.from_params(SamplingParams(top_k=V - 1), V, []).top_k == V - 1
    # Suppressed until min_tokens: stop ids, then EOS unless ignored; an EOS id past the model's
    # logits can never be sampled, so there is nothing to mask.
    params = SamplingParams(min_tokens=3, stop_token_ids=[7, 2])
    assert SamplingSpec.from_params(params, V, [2, 99, 100]).suppressed_token_ids == (7, 2, 99)
    ignore_eos = dataclasses.replace(params, ignore_eos=True)
    assert SamplingSpec.from_params(ignore_eos, V, [2, 99]).suppressed_token_ids == (7, 2)
    assert SamplingSpec.from_params(dataclasses.replace(params, min_tokens=0), V, [5]).suppressed_token_ids == ()


class UnreadableTokens:
    """A token history whose length may be asked, but whose tokens must not be read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise AssertionError("a token history was read")

    def __getitem__(self, index):
        raise AssertionError("a token history was read")


def test_build_reads_token_histories_only_for_penalised_rows():
    V = 50
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, logprobs=2),
              SamplingParams(top_k=5, min_tokens=4, stop_token_ids=[3]), SamplingParams(min_p=0.2)]
    rows = [
        SamplingRow(SamplingSpec.from_params(p, V, [1]), seed=i, token_ids=UnreadableTokens(n), num_prompt_tokens=4)
        for i, (p, n) in enumerate(zip(params, [6, 7, 7, 9]))
    ]
    meta = SamplingMetadata.build(rows, V, CPU)
    assert meta.steps.tolist() == [2, 3, 3, 5]
    assert meta.suppressed.T.tolist() == [[2, 3], [2, 1]]  # row 2 has 3 < min_tokens tokens
    assert meta.seen_mask is None and meta.output_counts is None
    logits = randn(4, V, seed=13)
    logits[2, [1, 3]] = 100.0
    out = sampler(logits, meta)
    assert out.token_ids[2].item() not in (1, 3) and out.logprobs.shape == (4,)

    # A penalised batch-mate: only its own history is read.
    spec = SamplingSpec.from_params(SamplingParams(repetition_penalty=1.3, presence_penalty=0.5), V, [])
    meta = SamplingMetadata.build(rows + [SamplingRow(spec, 9, [4, 4, 8, 9, 8], 2)], V, CPU)
    assert meta.seen_mask[4].nonzero().squeeze(1).tolist() == [4, 8, 9] and not meta.seen_mask[:4].any()
    assert meta.output_counts[4, [8, 9]].tolist() == [2.0, 1.0] and meta.output_counts.sum().item() == 3.0
    sampler(torch.cat([logits, randn(1, V, seed=14)]), meta)


def test_empty_batch():
    out = sample([], torch.zeros(0, 10))
    assert out.token_ids.shape == (0,)

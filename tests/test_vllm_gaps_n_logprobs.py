"""What vLLM accepts that nanoserve once refused.

1. `SamplingParams(n=k)` with k > max_num_seqs: vLLM fans a request out into k child requests
   that schedule independently, so the samples run in waves. Oracle: the same request under a
   large max_num_seqs (every output and logprob bit for bit, under batch_invariant), with a KV
   pool small enough to preempt, then no block left held.
"""
from __future__ import annotations

import pytest

from helpers import assert_no_leak, make_llm, random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence

N = 7  # samples per request, more than MAX_NUM_SEQS
MAX_NUM_SEQS = 3


# ---- n > max_num_seqs ------------------------------------------------------------------------


def _request(seq_id: int, n: int, prompt: list[int], max_tokens: int) -> Sequence:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    total = len(prompt) + max_tokens
    seqs = [Sequence(seq_id + i, str(seq_id), i, prompt, params, total, seed=i) for i in range(n)]
    seqs[0].children = seqs[1:]
    return seqs[0]


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_scheduler_runs_more_samples_than_max_num_seqs_in_waves(chunked, caching):
    sched = Scheduler(BlockManager(64, 4, caching), max_num_seqs=3, max_num_batched_tokens=64,
                      enable_chunked_prefill=chunked)
    parents = [_request(0, 8, list(range(3, 14)), 4), _request(100, 2, list(range(20, 29)), 3)]
    every = [parents[0], *parents[0].children, parents[1], *parents[1].children]
    for parent in parents:
        sched.add(parent)
    finished, most = [], 0
    while not sched.is_finished():
        batch = sched.schedule()
        most = max(most, len(sched.running))
        assert len(batch.seqs) <= 3
        for seq in sched.postprocess(batch, [7] * sum(batch.samples)):
            if seq.num_tokens >= seq.max_total_tokens:
                sched.finish(seq)
                finished.append(seq)
        assert len(sched.running) <= 3, "a fork went past max_num_seqs"
        sched.block_manager.check_integrity(sched.running)
    assert most == 3
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in every)
    assert all(s.output_token_ids == [7] * (s.max_total_tokens - s.num_prompt_tokens) for s in every)
    assert sched.block_manager.num_free_blocks == 64


def _run(llm: LLM, prompts, params: SamplingParams):
    """generate(), stepping the engine by hand to watch the running set."""
    engine, ids = llm.engine, []
    for p in prompts:
        ids.append(engine.add_request({"prompt_token_ids": p}, params))
    done, most = {}, 0
    while not engine.is_finished():
        for out in engine.step().finished:
            done[out.request_id] = out
        most = max(most, len(engine.scheduler.running))
    return [done[i] for i in ids], most


def _numbers(out):
    return [(c.index, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in out.outputs]


def _assert_close_numbers(got, want) -> None:
    """Same tokens and logprob entries; logprobs within float32 noise. Not bit for bit: a preempted
    sample's K/V is recomputed in a prefill, and without the prefix cache a sample of a later wave
    prefills the whole prompt where a forked one computes only the tail after the shared blocks;
    batch_invariant makes neither bit-identical (the same holds at any max_num_seqs)."""
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.index, g.token_ids, g.finish_reason) == (w.index, w.token_ids, w.finish_reason)
        assert [list(e) for e in g.logprobs] == [list(e) for e in w.logprobs]
        got_lps = [lp.logprob for e in g.logprobs for lp in e.values()]
        assert got_lps == pytest.approx([lp.logprob for e in w.logprobs for lp in e.values()], abs=1e-5)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)


PROMPTS = random_prompts(2, 12, 30, seed=21)
# 9 blocks of 8 (one max_model_len=64 sequence needs 8): 3 samples of up to 50 tokens cannot all fit
PREEMPTING_POOL = dict(num_kvcache_blocks=9)


def _waves_and_reference(tiny_model, params: SamplingParams, caching: bool, pool: dict):
    kw = dict(batch_invariant=True, enable_prefix_caching=caching, max_model_len=64)
    want, _ = _run(make_llm(tiny_model, max_num_seqs=64, **kw), PROMPTS, params)
    small = make_llm(tiny_model, max_num_seqs=MAX_NUM_SEQS, **pool, **kw)
    got, most = _run(small, PROMPTS, params)
    assert most == MAX_NUM_SEQS, "the samples should have run in waves"
    for out in got:
        assert [c.index for c in out.outputs] == list(range(N))
    assert (small.engine.scheduler.num_preemptions > 0) == (pool == PREEMPTING_POOL)
    assert_no_leak(small)
    return got, want


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_n_above_max_num_seqs_is_bit_identical_to_a_large_batch(tiny_model, temperature):
    """With the prefix cache (the default), a sample of a later wave hits the prompt blocks a fork
    would have shared and computes the same tail: every number is the same bits."""
    params = SamplingParams(n=N, temperature=temperature, seed=11, max_tokens=20, ignore_eos=True, logprobs=2)
    got, want = _waves_and_reference(tiny_model, params, caching=True, pool={})
    for g, w in zip(got, want, strict=True):
        assert _numbers(g) == _numbers(w)
    if temperature > 0:  # seed + i per sample: the samples differ
        assert len({tuple(c.token_ids) for c in got[0].outputs}) > 1


@pytest.mark.parametrize("caching, pool", [(False, {}), (True, PREEMPTING_POOL), (False, PREEMPTING_POOL)],
                         ids=["no-cache", "preempting", "no-cache-preempting"])
def test_n_above_max_num_seqs_under_preemption_and_without_prefix_cache(tiny_model, caching, pool):
    """Greedy tokens exact, logprobs within float32 noise (see _assert_close_numbers; seeded draws
    from this random model's flat distributions can flip on that noise, at any max_num_seqs)."""
    params = SamplingParams(n=N, temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    got, want = _waves_and_reference(tiny_model, params, caching, pool)
    for g, w in zip(got, want, strict=True):
        _assert_close_numbers(g, w)


def test_n_above_max_num_seqs_through_generate_and_stream(tiny_model):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 8, 20, seed=22)]
    params = SamplingParams(n=5, temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)
    llm = make_llm(tiny_model, max_num_seqs=2, batch_invariant=True)
    want = make_llm(tiny_model, max_num_seqs=16, batch_invariant=True).generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    streamed = dict(llm.generate_stream(prompts, params))
    for i, w in enumerate(want):
        assert [c.token_ids for c in got[i].outputs] == [c.token_ids for c in w.outputs]
        assert [c.token_ids for c in streamed[i].outputs] == [c.token_ids for c in w.outputs]
    assert_no_leak(llm)

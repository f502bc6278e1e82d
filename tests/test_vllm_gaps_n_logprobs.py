"""Two things vLLM accepts that nanoserve once refused.

1. `SamplingParams(n=k)` with k > max_num_seqs: vLLM fans a request out into k child requests
   that schedule independently, so the samples run in waves. Oracle: the same request under a
   large max_num_seqs (under batch_invariant every output and logprob bit for bit with the prefix
   cache, else greedy tokens exact), with a KV pool small enough to preempt, then no block held.
2. `logprobs=-1` / `prompt_logprobs=-1`: the whole vocabulary, allowed by `max_logprobs=-1` and
   refused under the default cap of 20 (vLLM's processor rule). Oracle: HF transformers'
   float32 log_softmax.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_no_leak, make_llm, needs_batch_invariance, random_prompts
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


@needs_batch_invariance
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


@needs_batch_invariance
@pytest.mark.parametrize("caching, pool", [(False, {}), (True, PREEMPTING_POOL), (False, PREEMPTING_POOL)],
                         ids=["no-cache", "preempting", "no-cache-preempting"])
def test_n_above_max_num_seqs_under_preemption_and_without_prefix_cache(tiny_model, caching, pool):
    """Greedy tokens exact, logprobs within float32 noise (see _assert_close_numbers; seeded draws
    from this random model's flat distributions can flip on that noise, at any max_num_seqs)."""
    params = SamplingParams(n=N, temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    got, want = _waves_and_reference(tiny_model, params, caching, pool)
    for g, w in zip(got, want, strict=True):
        _assert_close_numbers(g, w)
@needs_batch_invariance
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
@needs_batch_invariance
def test_n_above_max_num_seqs_in_a_run_batch_line(tiny_model):
    """A completions line with two prompts and n=4 on max_num_seqs=2: 8 choices, prompt i's at
    i * n ... i * n + n - 1 (vLLM's order), each the sample generate() gives."""
    from nanoserve.engine.request_stream import stream_requests
    from nanoserve.entrypoints.openai_request import RequestBuilder
    from nanoserve.entrypoints.openai_response import result_record

    llm = make_llm(tiny_model, max_num_seqs=2, batch_invariant=True)
    builder = RequestBuilder(llm, tiny_model)
    prompts = random_prompts(2, 6, 12, seed=25)
    body = {"prompt": prompts, "n": 4, "max_tokens": 5, "temperature": 0.8, "seed": 9, "ignore_eos": True}
    line = builder.build({"method": "POST", "url": "/v1/completions", "body": body})
    results = dict(stream_requests(llm.engine, list(enumerate(line.requests)), 2))
    outs = [results[i] for i in range(2)]
    choices = result_record("c", "/v1/completions", outs, "m", llm.get_tokenizer(),
                            num_logprobs=None)["response"]["body"]["choices"]
    params = SamplingParams(n=4, max_tokens=5, temperature=0.8, seed=9, ignore_eos=True)
    want = make_llm(tiny_model, max_num_seqs=16, batch_invariant=True).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [c["index"] for c in choices] == list(range(8))
    assert [c["text"] for c in choices] == [s.text for w in want for s in w.outputs]
    assert_no_leak(llm)


# ---- logprobs = -1 ---------------------------------------------------------------------------


@torch.inference_mode()
def _hf_rows(hf, path, tokens) -> torch.Tensor:
    """[len(tokens), vocab] float32 log_softmax: row p is the distribution of token p + 1."""
    return torch.log_softmax(hf.model(path)(torch.tensor([tokens])).logits[0].float(), dim=-1)


def _assert_whole_vocab(entry: dict, token: int, row: torch.Tensor) -> None:
    """vLLM's layout: `token` first with its rank, then every token of the vocabulary in rank order,
    each logprob equal to HF's."""
    vocab = row.shape[0]
    assert list(entry)[0] == token and len(entry) == vocab
    ids = torch.tensor(list(entry))
    got = torch.tensor([lp.logprob for lp in entry.values()])
    torch.testing.assert_close(got, row[ids], atol=1e-4, rtol=0)
    by_rank = sorted(entry.items(), key=lambda e: e[1].rank)
    assert [lp.rank for _, lp in by_rank] == list(range(1, vocab + 1))
    values = [lp.logprob for _, lp in by_rank]
    assert values == sorted(values, reverse=True)
    # rank: tokens at least as likely; HF values tied within 1e-4 may order either way
    lo, hi = int((row > row[token] + 1e-4).sum()) + 1, int((row >= row[token] - 1e-4).sum())
    assert lo <= entry[token].rank <= hi


@pytest.mark.parametrize("temperature", [0.0, 1.3], ids=["greedy", "seeded"])
def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_model, hf, temperature):
    llm = make_llm(tiny_model, max_logprobs=-1)
    prompt = random_prompts(1, 6, 6, seed=23)[0]
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=4, ignore_eos=True,
                            logprobs=-1, prompt_logprobs=-1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    sample = out.outputs[0]
    rows = _hf_rows(hf, tiny_model, prompt + sample.token_ids)
    assert len(sample.logprobs) == 4
    for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        _assert_whole_vocab(entry, token, rows[len(prompt) - 1 + step])
    assert sample.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(sample.token_ids,
                                                                                         sample.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        _assert_whole_vocab(out.prompt_logprobs[t], prompt[t], rows[t - 1])
    # the same tokens as a request that asks for a few: -1 changes what is returned, not what is sampled
    (few,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=temperature, seed=4, max_tokens=4, ignore_eos=True, logprobs=2), use_tqdm=False)
    assert few.outputs[0].token_ids == sample.token_ids
    assert_no_leak(llm)


def test_minus_one_beside_small_k_in_one_batch(tiny_model):
    """One step serving k=-1 and k=2: each request gets its own number of entries."""
    llm = make_llm(tiny_model, max_logprobs=-1)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 5, 9, seed=24)]
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=k, prompt_logprobs=k)
              for k in (-1, 2)]
    whole, few = llm.generate(prompts, params, use_tqdm=False)
    vocab = llm.engine.vocab_size
    assert all(len(e) == vocab for e in whole.outputs[0].logprobs)
    assert all(len(e) == vocab for e in whole.prompt_logprobs[1:])
    assert all(2 <= len(e) <= 3 for e in few.outputs[0].logprobs)
    assert all(2 <= len(e) <= 3 for e in few.prompt_logprobs[1:])


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("max_logprobs", [None, 5])
def test_minus_one_above_max_logprobs_is_refused_before_any_work(tiny_model, field, max_logprobs):
    llm = make_llm(tiny_model) if max_logprobs is None else make_llm(tiny_model, max_logprobs=max_logprobs)
    cap = 20 if max_logprobs is None else max_logprobs  # vLLM's default
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=rf"{field}=-1 \(the whole vocabulary, {vocab}\) exceeds max_logprobs={cap}"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **{field: -1}), use_tqdm=False)
    assert_no_leak(llm)


def test_max_logprobs_minus_one_caps_at_the_vocabulary(tiny_model):
    llm = make_llm(tiny_model, max_logprobs=-1)
    vocab = llm.engine.vocab_size
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=vocab), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) == vocab
    whole = rf"\(the whole vocabulary, {vocab}\)"
    with pytest.raises(ValueError, match=rf"logprobs={vocab + 1} exceeds max_logprobs=-1 {whole}"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=vocab + 1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"max_logprobs must be >= 0 or -1 \(no cap"):
        make_llm(tiny_model, max_logprobs=-3)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_sampling_params_take_minus_one_and_refuse_other_negatives(field):
    assert getattr(SamplingParams(**{field: -1}), field) == -1
    with pytest.raises(ValueError, match=rf"{field} must be >= 0, -1 \(the whole vocabulary\) or None, got -2"):
        SamplingParams(**{field: -2})


def test_run_batch_bodies_take_minus_one_where_vllms_server_does(tiny_model):
    """vLLM's server: chat `top_logprobs` and `prompt_logprobs` may be -1; completions `logprobs`
    may not. The engine's max_logprobs then decides, as for generate()."""
    from nanoserve.engine.request_stream import stream_requests
    from nanoserve.entrypoints.openai_request import RequestBuilder
    from nanoserve.entrypoints.openai_response import result_record

    llm = make_llm(tiny_model, max_logprobs=-1)
    builder, tok, vocab = RequestBuilder(llm, tiny_model), llm.get_tokenizer(), llm.engine.vocab_size

    def build(url, body):
        return builder.build({"method": "POST", "url": url, "body": {"max_tokens": 2, "temperature": 0, **body}})

    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}
    request = build("/v1/chat/completions", chat)
    assert request.params.logprobs == -1
    [(_, out)] = stream_requests(llm.engine, [(0, request)], 1)
    body = result_record("c", "/v1/chat/completions", out, "m", tok, num_logprobs=-1)["response"]["body"]
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(item["top_logprobs"]) == vocab for item in content)
    with pytest.raises(ValueError, match="`logprobs` must be set to true"):
        build("/v1/chat/completions", {**chat, "logprobs": False})
    with pytest.raises(ValueError, match="`top_logprobs` must be an integer >= 0 or -1"):
        build("/v1/chat/completions", {**chat, "top_logprobs": -2})
    with pytest.raises(ValueError, match="`logprobs` must be an integer >= 0"):
        build("/v1/completions", {"prompt": "hi", "logprobs": -1})
    assert build("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}).params.prompt_logprobs == -1
    echo = build("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 2, "prompt_logprobs": -1})
    assert echo.params.prompt_logprobs == -1
    capped = RequestBuilder(make_llm(tiny_model), tiny_model)  # max_logprobs 20: the engine refuses
    with pytest.raises(ValueError, match="exceeds max_logprobs=20"):
        capped.build({"method": "POST", "url": "/v1/chat/completions", "body": chat})

"""SamplingParams(prompt_logprobs=k): the prompt's own token scores, as vLLM returns them.

Oracle: HF transformers' log_softmax (float32) at every prompt position. Then the engine paths that
must not change the numbers: chunked prefill, the prefix cache (with prompt_logprobs_start), n > 1,
preemption, generate_stream, and other requests sharing the steps (batch invariance)."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_no_leak, make_llm, random_prompts
from nanoserve import SamplingParams

SCORE = dict(temperature=0.0, max_tokens=1, detokenize=False)


def as_numbers(prompt_logprobs):
    """{token: (logprob, rank)} per position: what must match bit for bit."""
    return [None if d is None else {t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in prompt_logprobs]


def assert_close(got, want, atol: float = 1e-4) -> None:
    """Same positions, same tokens and ranks, logprobs within atol (float32 paths that are not
    bit-invariant to how a prompt is chunked: see test_batch_invariance)."""
    assert len(got) == len(want)
    for g, w in zip(as_numbers(got), as_numbers(want)):
        assert (g is None) == (w is None)
        if g is not None:
            assert list(g) == list(w)
            g_ranks, w_ranks = [r for _, r in g.values()], [r for _, r in w.values()]
            assert g_ranks[1:] == w_ranks[1:]  # the top k
            assert abs(g_ranks[0] - w_ranks[0]) <= 0.05 * w_ranks[0] + 1  # the prompt token: near-ties in the tail
            assert [lp for lp, _ in g.values()] == pytest.approx([lp for lp, _ in w.values()], abs=atol)


def generate(llm, prompts, **params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)


@torch.inference_mode()
def hf_log_softmax(hf, path, prompt) -> torch.Tensor:
    """[len(prompt), vocab]: row p is the distribution of token p + 1."""
    return torch.log_softmax(hf.model(path)(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("name", ["tied-gqa2", "untied-gqa4"])
def test_prompt_logprobs_equal_hf_at_every_position(model_dirs, hf, name):
    path = model_dirs[name]
    prompts = random_prompts(4, 2, 40, seed=3)
    outs = generate(make_llm(path), prompts, prompt_logprobs=3, **SCORE)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_log_softmax(hf, path, prompt)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for t in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[t], ref[t - 1]
            token = prompt[t]
            assert list(entry)[0] == token  # vLLM: the prompt token first, then the top k
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            # rank: tokens at least as likely; HF values tied within 1e-4 may order either way
            lo, hi = int((row > row[token] + 1e-4).sum()) + 1, int((row >= row[token] - 1e-4).sum())
            assert lo <= entry[token].rank <= hi
            top = row.topk(3)
            ranked = {tid: lp for tid, lp in entry.items() if lp.rank <= 3}
            assert sorted(lp.rank for lp in ranked.values()) == [1, 2, 3]
            for tid, lp in ranked.items():
                assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-4)
                assert lp.logprob == pytest.approx(top.values[lp.rank - 1].item(), abs=1e-4)


def test_zero_top_k_decoded_token_and_output_tokens(tiny_model, hf):
    llm = make_llm(tiny_model)
    prompt = random_prompts(1, 12, 12, seed=4)[0]
    (out,) = generate(llm, [prompt], prompt_logprobs=0, temperature=0.0, max_tokens=3)
    assert [list(d) for d in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]  # k=0: the prompt token only
    assert out.prompt_logprobs[1][prompt[1]].decoded_token == llm.get_tokenizer().decode([prompt[1]])
    assert out.outputs[0].token_ids == hf.greedy(tiny_model, prompt, 3)  # scoring leaves sampling alone
    (plain,) = generate(llm, [prompt], temperature=0.0, max_tokens=3)
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids
    (out,) = generate(llm, [prompt], prompt_logprobs=1, **SCORE)
    assert all(lp.decoded_token is None for d in out.prompt_logprobs[1:] for lp in d.values())  # detokenize=False


def test_chunked_prefill_and_preemption_give_the_same_numbers(tiny_model):
    prompts = random_prompts(6, 20, 70, seed=5)
    ref = generate(make_llm(tiny_model, enable_prefix_caching=False), prompts, prompt_logprobs=2, **SCORE)
    chunked_llm = make_llm(tiny_model, max_num_batched_tokens=16, enable_prefix_caching=False)
    chunked = generate(chunked_llm, prompts, prompt_logprobs=2, **SCORE)
    # 12 blocks of 8 tokens cannot hold six prompts and their outputs at once: sequences are preempted.
    tight = make_llm(tiny_model, num_kvcache_blocks=12, max_model_len=96, max_num_batched_tokens=32,
                     enable_prefix_caching=False)
    preempted = generate(tight, prompts, prompt_logprobs=2, temperature=0.0, max_tokens=16, ignore_eos=True)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b, c in zip(ref, chunked, preempted, strict=True):
        assert_close(b.prompt_logprobs, a.prompt_logprobs)
        assert_close(c.prompt_logprobs, a.prompt_logprobs)
    assert_no_leak(chunked_llm)
    assert_no_leak(tight)


def test_n_samples_share_one_prompt_score(tiny_model):
    prompt = random_prompts(1, 30, 30, seed=6)[0]
    llm = make_llm(tiny_model, enable_prefix_caching=False)
    (one,) = generate(llm, [prompt], prompt_logprobs=2, **SCORE)
    (many,) = generate(llm, [prompt], prompt_logprobs=2, n=3, temperature=1.0, seed=1, max_tokens=4)
    assert len(many.outputs) == 3
    assert as_numbers(many.prompt_logprobs) == as_numbers(one.prompt_logprobs)


def test_full_prompt_scoring_takes_no_cache_hit_and_equals_cold(tiny_model):
    prompt = random_prompts(1, 50, 50, seed=7)[0]
    llm = make_llm(tiny_model)
    generate(llm, [prompt], temperature=0.0, max_tokens=2)  # caches the prompt's blocks
    (warm,) = generate(llm, [prompt], prompt_logprobs=1, **SCORE)
    assert warm.num_cached_tokens == 0  # every position is scored: no block may stand in for its logits
    (cold,) = generate(make_llm(tiny_model, enable_prefix_caching=False), [prompt], prompt_logprobs=1, **SCORE)
    assert as_numbers(warm.prompt_logprobs) == as_numbers(cold.prompt_logprobs)


def test_continuations_after_a_shared_context_hit_the_cache_with_cold_numbers(tiny_model):
    """The lm-eval shape: one context, several continuations, each scored from its first token."""
    context = random_prompts(1, 61, 61, seed=8)[0]
    continuations = random_prompts(4, 1, 9, seed=9)
    prompts = [context + c for c in continuations]
    params = [SamplingParams(prompt_logprobs=1, prompt_logprobs_start=len(context), **SCORE) for _ in prompts]
    cold_llm = make_llm(tiny_model, enable_prefix_caching=False)
    cold = cold_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = make_llm(tiny_model)
    warm = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # the context's last token is position len-1, whose logits score the first continuation token:
    # blocks wholly before it are hits (block size 8: 56 of 61 context tokens).
    assert [o.num_cached_tokens for o in warm[1:]] == [56] * 3
    for c, w, cont in zip(cold, warm, continuations, strict=True):
        assert w.prompt_logprobs[: len(context)] == [None] * len(context)
        assert len(w.prompt_logprobs) == len(context) + len(cont)
        assert_close(w.prompt_logprobs, c.prompt_logprobs)  # bit-equal on the invariant paths (below)
    full = generate(cold_llm, [prompts[0]], prompt_logprobs=1, **SCORE)[0]
    assert_close(full.prompt_logprobs[len(context):], warm[0].prompt_logprobs[len(context):])
    assert_no_leak(llm)


def test_generate_stream_returns_prompt_logprobs(tiny_model):
    prompts = random_prompts(3, 10, 20, seed=10)
    llm = make_llm(tiny_model)
    batch = generate(llm, prompts, prompt_logprobs=2, **SCORE)
    streamed = dict(llm.generate_stream([{"prompt_token_ids": p} for p in prompts],
                                        SamplingParams(prompt_logprobs=2, **SCORE)))
    for i, out in enumerate(batch):
        assert as_numbers(streamed[i].prompt_logprobs) == as_numbers(out.prompt_logprobs)


@pytest.mark.parametrize("kw, message", [
    (dict(prompt_logprobs=-2), "prompt_logprobs must be >= 0, -1"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs must be an int"),
    (dict(prompt_logprobs_start=2), "prompt_logprobs_start needs prompt_logprobs"),
    (dict(prompt_logprobs=1, prompt_logprobs_start=-1), "prompt_logprobs_start must be >= 0"),
])
def test_bad_prompt_logprobs_params_are_refused(kw, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(**kw)


def test_prompt_logprobs_above_max_logprobs_is_refused_before_any_work(tiny_model):
    llm = make_llm(tiny_model, max_logprobs=5)
    with pytest.raises(ValueError, match="prompt_logprobs=6 exceeds max_logprobs=5"):
        generate(llm, [[1, 2, 3]], prompt_logprobs=6, **SCORE)
    assert_no_leak(llm)


def test_run_batch_echo_and_prompt_logprobs_as_openai_and_vllm(tiny_model):
    from nanoserve.engine.request_stream import stream_requests
    from nanoserve.entrypoints.openai_request import RequestBuilder
    from nanoserve.entrypoints.openai_response import result_record

    llm = make_llm(tiny_model)
    builder, tok = RequestBuilder(llm, tiny_model), llm.get_tokenizer()
    prompt = random_prompts(1, 9, 9, seed=11)[0]
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    request = builder.build({"method": "POST", "url": "/v1/completions", "body": body})
    assert request.params.prompt_logprobs == 2
    [(_, out)] = stream_requests(llm.engine, [(0, request)], 1)
    record = result_record("c", "/v1/completions", out, "m", tok, echo=True, num_logprobs=2)
    choice = record["response"]["body"]["choices"][0]
    sample = out.outputs[0]
    texts = [tok.decode([t]) for t in prompt + sample.token_ids]
    lp = choice["logprobs"]
    assert choice["text"] == tok.decode(prompt) + sample.text
    assert lp["tokens"] == texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(prompt)] == [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    assert lp["token_logprobs"][len(prompt):] == [s[t].logprob for t, s in zip(sample.token_ids, sample.logprobs)]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    # vLLM's body field: per choice, token ids as strings
    body = {"prompt": prompt, "prompt_logprobs": 1, "max_tokens": 1, "temperature": 0}
    [(_, out)] = stream_requests(llm.engine, [(0, builder.build({"method": "POST", "url": "/v1/completions",
                                                                  "body": body}))], 1)
    choice = result_record("c", "/v1/completions", out, "m", tok, num_logprobs=None)["response"]["body"]["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1][str(prompt[1])]["logprob"] == out.prompt_logprobs[1][prompt[1]].logprob
    with pytest.raises(ValueError, match="`prompt_logprobs` must be an integer >= 0 or -1"):
        builder.build({"method": "POST", "url": "/v1/completions", "body": {**body, "prompt_logprobs": -2}})


def test_ray_predictor_rows_ask_for_prompt_logprobs(tiny_model):
    from nanoserve.ray import LLMPredictor

    predictor = LLMPredictor(tiny_model, {"temperature": 0, "max_tokens": 1},
                             {"dtype": "float32", "kvcache_block_size": 8, "num_kvcache_blocks": 64, "max_model_len": 64})
    prompts = random_prompts(2, 6, 6, seed=12)
    out = predictor({"prompt": prompts, "sampling_params": [{"prompt_logprobs": 1}, {}]})
    (want,) = generate(predictor.llm, [prompts[0]], prompt_logprobs=1, **SCORE)
    column = out["prompt_logprobs"]
    assert column[1] is None and column[0][0] is None
    assert [[(e["token_id"], e["logprob"], e["rank"]) for e in step] for step in column[0][1:]] == [
        [(t, lp.logprob, lp.rank) for t, lp in step.items()] for step in want.prompt_logprobs[1:]]
    assert "prompt_logprobs" not in predictor({"prompt": prompts})


def test_bench_mcq_workload_scores_with_and_without_the_cache(tiny_model):
    from nanoserve.bench.cli import main
    from nanoserve.bench.workloads import MCQ_CHOICES, WorkloadSpec, make_requests

    requests = make_requests(WorkloadSpec("mcq", 2, (30, 40), (1, 5)), 1000)
    assert len(requests) == 2 * MCQ_CHOICES
    for i in range(0, len(requests), MCQ_CHOICES):  # the choices of one question share its context
        contexts = {tuple(r.prompt[: r.score_from]) for r in requests[i : i + MCQ_CHOICES]}
        assert len(contexts) == 1 and 30 <= len(contexts.pop()) <= 40
    report = main(["--model", tiny_model, "--workload", "mcq", "--num-seqs", "2", "--input-len", "60", "60",
                   "--output-len", "1", "3", "--dtype", "float32", "--device", "cpu", "--block-size", "8",
                   "--no-warmup"])
    assert report["mcq_caching_on"]["prefix_cache_hit_rate"] > 0.5
    assert report["mcq_caching_off"]["prefix_cache_hit_rate"] == 0

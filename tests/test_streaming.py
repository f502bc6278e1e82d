"""LLM.generate_stream: bounded reading of the input, error results, early close, request abort."""
import pytest

from helpers import assert_no_leak, make_llm, random_prompts
from nanoserve import RequestError, SamplingParams
from nanoserve.engine.sequence import SequenceStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model, num_kvcache_blocks=128, max_model_len=128, max_num_seqs=4)


class CountingIterator:
    """Hands out items and records how many have been taken."""

    def __init__(self, items):
        self._items = list(items)
        self.taken = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken == len(self._items):
            raise StopIteration
        self.taken += 1
        return self._items[self.taken - 1]


def generate_error(llm, prompts, params):
    """The exception LLM.generate raises for these prompts."""
    with pytest.raises((ValueError, TypeError)) as info:
        llm.generate(prompts, params, use_tqdm=False)
    return info.value


def test_reads_input_only_as_room_frees_and_matches_generate(llm):
    prompts = random_prompts(12, 2, 30, seed=3)
    expected = llm.generate(prompts, GREEDY, use_tqdm=False)
    source = CountingIterator(prompts)
    max_inflight = 3
    results = {}
    for index, out in llm.generate_stream(source, GREEDY, max_inflight=max_inflight, use_tqdm=False):
        assert index not in results
        results[index] = out
        # Everything taken is either already yielded or among the (at most max_inflight) in flight.
        assert source.taken <= len(results) + max_inflight
        assert len(llm.engine.requests) <= max_inflight
    assert sorted(results) == list(range(len(prompts)))
    for index, out in results.items():
        assert out.prompt_token_ids == prompts[index]
        assert out.outputs[0].token_ids == expected[index].outputs[0].token_ids
    assert_no_leak(llm)


def test_bad_items_yield_generates_error_and_the_rest_runs(llm):
    good = random_prompts(5, 3, 12, seed=4)
    bad = {1: "", 3: {"text": "no prompt key"}, 4: 7.5, 6: [1, "two"], 7: list(range(200))}
    prompts = list(good)
    for index in sorted(bad):
        prompts.insert(index, bad[index])
    expected = llm.generate(good, GREEDY, use_tqdm=False)
    results = dict(llm.generate_stream(iter(prompts), GREEDY, max_inflight=2, use_tqdm=False))
    assert sorted(results) == list(range(len(prompts)))
    good_results = [results[i] for i in range(len(prompts)) if i not in bad]
    assert [r.outputs[0].token_ids for r in good_results] == [e.outputs[0].token_ids for e in expected]
    for index, prompt in bad.items():
        error = results[index]
        assert isinstance(error, RequestError)
        # The same text and class generate raises for this prompt at the same position.
        raised = generate_error(llm, good[:1] * index + [prompt], GREEDY)
        assert (error.message, error.error_type) == (str(raised), type(raised))
        assert isinstance(error.exception(), type(raised))
    assert_no_leak(llm)


def test_per_prompt_params_and_their_errors(llm):
    prompts = random_prompts(4, 3, 10, seed=5)
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=3), "not params", SamplingParams(logprobs=21)]
    results = dict(llm.generate_stream(prompts, iter(params), use_tqdm=False))
    expected = llm.generate(prompts[:2], params[:2], use_tqdm=False)
    assert [results[i].outputs[0].token_ids for i in range(2)] == [e.outputs[0].token_ids for e in expected]
    assert len(results[1].outputs[0].token_ids) == 3
    raised = generate_error(llm, prompts, params)
    assert (results[2].message, results[2].error_type) == (str(raised), type(raised))
    raised = generate_error(llm, prompts[3:], params[3:])  # logprobs=21 > max_logprobs=20
    assert (results[3].message, results[3].error_type) == (str(raised), type(raised))
    assert "max_logprobs" in results[3].message

    # Too few params: the prompts left over get an error each; too many: raised at the end.
    short = dict(llm.generate_stream(prompts, [GREEDY], use_tqdm=False))
    assert not isinstance(short[0], RequestError)
    assert all(isinstance(short[i], RequestError) and "ran out" in short[i].message for i in (1, 2, 3))
    stream = llm.generate_stream(prompts[:1], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="more entries than prompts"):
        list(stream)
    assert_no_leak(llm)


def test_early_close_aborts_in_flight_and_leaves_engine_usable(llm):
    prompts = random_prompts(6, 20, 40, seed=6)
    # The first request finishes early, while the others are mid-decode.
    params = [SamplingParams(temperature=0, max_tokens=3 if i == 0 else 12, ignore_eos=True, n=2) for i in range(6)]
    stream = llm.generate_stream(prompts, params, max_inflight=3, use_tqdm=False)
    first = [next(stream)]
    assert llm.engine.requests, "requests should still be in flight"
    stream.close()
    assert_no_leak(llm)
    again = llm.generate(prompts, params, use_tqdm=False)
    for index, out in first:
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again[index].outputs]
    assert_no_leak(llm)


def test_failing_input_finishes_in_flight_then_raises(llm):
    prompts = random_prompts(3, 3, 8, seed=7)

    def source():
        yield from prompts
        raise OSError("disk went away")

    stream = llm.generate_stream(source(), GREEDY, use_tqdm=False)
    got = []
    with pytest.raises(OSError, match="disk went away"):
        for index, out in stream:
            got.append(index)
    assert sorted(got) == [0, 1, 2]
    assert_no_leak(llm)


def test_argument_errors_are_raised_at_once(llm):
    with pytest.raises(TypeError, match="iterable of prompts"):
        llm.generate_stream("one prompt")
    with pytest.raises(ValueError, match="max_inflight"):
        llm.generate_stream(["a"], max_inflight=0)
    with pytest.raises(TypeError, match="max_inflight"):
        llm.generate_stream(["a"], max_inflight=2.5)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate_stream(["a"], sampling_params=3)


def test_abort_request_frees_running_waiting_and_unforked_samples(llm):
    engine = llm.engine
    prompts = random_prompts(6, 10, 30, seed=8)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # some prompts prefilled (children forked), others still waiting
    states = {s.status for rid in ids for s in engine.requests[rid].seqs}
    assert {SequenceStatus.RUNNING, SequenceStatus.WAITING} <= states
    doomed = ids[::2]
    seqs = [s for rid in doomed for s in engine.requests[rid].seqs]
    engine.abort_request(doomed)
    assert all(s.status == SequenceStatus.FINISHED and not s.block_table for s in seqs)
    live = [s for rid in ids[1::2] for s in engine.requests[rid].seqs if not s.is_finished]
    engine.block_manager.check_integrity(live)
    engine.abort_request(doomed + ["no-such-id"])  # already gone: ignored
    finished = []
    while not engine.is_finished():
        finished += [o.request_id for o in engine.step().finished]
    assert sorted(finished) == sorted(ids[1::2])
    assert_no_leak(llm)


def test_a_second_caller_is_refused_while_a_stream_holds_the_engine(llm):
    prompts = random_prompts(3, 3, 9, seed=91)
    first = llm.generate_stream(prompts, GREEDY, use_tqdm=False)
    got = [next(first)]  # suspended, with requests in flight
    with pytest.raises(RuntimeError, match="generate\\(\\) was started while a generate_stream\\(\\) stream is running"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    second = llm.generate_stream(prompts[:1], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="is running on this LLM"):
        next(second)
    got += list(first)  # the first stream still gets every one of its results
    assert sorted(i for i, _ in got) == [0, 1, 2]
    assert len(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == 1
    assert_no_leak(llm)

"""Faults mid-generate: an exception in the forward pass or the sampler, a KeyboardInterrupt.

The call raises; the engine stays usable, gives the same tokens as a fresh engine, leaks no
block, and every prefix-cache entry holds K/V that was actually computed for its tokens (checked
against a recomputation by a second engine, see helpers.stale_cache_entries).
"""
import pytest
from helpers import (
    FaultInjectingBackend,
    FaultInjectingSampler,
    assert_no_leak,
    cached_prefixes,
    make_llm,
    random_prompts,
    stale_cache_entries,
)

from nanoserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 4


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that share a prefix (several of them land in the same step) and unrelated ones,
    plus an n=2 request: prefix-cache hits, forks and chunked prefills all happen."""
    system = random_prompts(1, 4 * BLOCK + 1, 4 * BLOCK + 1, seed=70)[0]
    shared = [system + tail for tail in random_prompts(4, 2, 9, seed=71)]
    other = random_prompts(3, 3, 30, seed=72)
    params = [GREEDY] * 7 + [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)]
    return shared + other + [system[:10]], params


def engine(path, chunked=True, **kw):
    return make_llm(
        path, device="cpu", attention_backend=FaultInjectingBackend, kvcache_block_size=BLOCK, num_kvcache_blocks=48,
        max_model_len=64, max_num_batched_tokens=40 if chunked else 64, max_num_seqs=6,
        enable_chunked_prefill=chunked, **kw,
    )


def tokens(outputs):
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """An idle engine that recomputes K/V for the cache check (big enough never to evict)."""
    return make_llm(tiny_model, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=1024, max_model_len=64)


@pytest.fixture(scope="module")
def expected(tiny_model):
    """What a fresh engine generates for the workload, chunked and prefill-first."""
    prompts, params = workload()
    return {chunked: tokens(engine(tiny_model, chunked).generate(prompts, params, use_tqdm=False))
            for chunked in (True, False)}


def test_the_cache_check_finds_unwritten_kv(tiny_model, reference):
    """The check below can fail: a cached block whose K/V is wiped is reported."""
    llm = engine(tiny_model)
    prompts, params = workload()
    llm.generate(prompts, params, use_tqdm=False)
    cached = cached_prefixes(llm)
    assert len(cached) > 10
    assert stale_cache_entries(llm, reference) == []
    victim = max(cached, key=lambda b: len(cached[b]))
    llm.engine.model_runner.kv_cache[:, 1, victim] = 0.0  # the last layer only
    assert stale_cache_entries(llm, reference) == [victim]


# (what raises, after how many of its calls, exception, chunked prefill). Attention runs once per
# layer per step (2 layers); the sampler once per step that samples.
FAULTS = [
    ("attention", 1, RuntimeError, True),  # the first step, inside its second layer
    ("attention", 4, KeyboardInterrupt, True),  # the third step, first layer: a chunked prefill
    ("attention", 15, RuntimeError, False),  # the eighth step, second layer: decodes
    ("sampler", 0, KeyboardInterrupt, False),  # the first step that samples
    ("sampler", 5, RuntimeError, True),
]


@pytest.mark.parametrize("where, after, exc_type, chunked", FAULTS,
                         ids=[f"{w}-{a}-{e.__name__}-{'chunked' if c else 'prefill-first'}" for w, a, e, c in FAULTS])
def test_fault_mid_generate_leaves_a_clean_engine(tiny_model, reference, expected, where, after, exc_type, chunked):
    llm = engine(tiny_model, chunked)
    prompts, params = workload()
    # A first call fills the prefix cache, so the failing one also hits and evicts entries.
    warm = llm.generate(prompts[::2], params[::2], use_tqdm=False)
    assert tokens(warm) == expected[chunked][::2]
    fault = exc_type("injected")
    if where == "attention":
        llm.engine.model_runner.backend.arm(fault, after)
    else:
        llm.engine.model_runner.sampler = FaultInjectingSampler(fault, after)
    with pytest.raises(exc_type, match="injected"):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.is_finished() and not llm.engine.requests
    assert_no_leak(llm)
    assert stale_cache_entries(llm, reference) == []
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected[chunked]
    assert_no_leak(llm)


def test_fault_with_prefix_caching_off(tiny_model, expected):
    llm = engine(tiny_model, enable_prefix_caching=False)
    prompts, params = workload()
    llm.engine.model_runner.backend.arm(RuntimeError("injected"), 6)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    assert not llm.engine.block_manager.pool.hash_index
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected[True]
    assert_no_leak(llm)


def test_fault_in_a_stream_then_generate(tiny_model, reference, expected):
    """generate_stream: the error reaches the consumer; what was in flight is dropped."""
    llm = engine(tiny_model)
    prompts, params = workload()
    llm.engine.model_runner.backend.arm(RuntimeError("injected"), 9)
    stream = llm.generate_stream(prompts, params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in stream:
            pass
    assert llm.engine.is_finished()
    assert_no_leak(llm)
    assert stale_cache_entries(llm, reference) == []
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected[True]

"""Prefix caching through LLM.generate: multi-turn reuse, block-aligned full hits, stats, reset."""
import pytest

from helpers import assert_matches_hf, assert_no_leak, make_llm, random_prompts
from nanoserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_multi_turn_reuses_prompt_and_completion_blocks(tiny_model, hf):
    llm = make_llm(tiny_model, kvcache_block_size=8)
    turn1 = random_prompts(1, 21, 21, seed=31)[0]
    (out1,) = llm.generate([turn1], GREEDY, use_tqdm=False)
    history = turn1 + out1.outputs[0].token_ids  # 45 tokens; the last one's K/V was never computed
    turn2 = history + random_prompts(1, 6, 6, seed=32)[0]
    (out2,) = llm.generate([turn2], GREEDY, use_tqdm=False)
    # Blocks filled during decode were cached too: everything up to the last full computed block.
    assert out2.num_cached_tokens == (len(history) - 1) // 8 * 8 == 40
    assert_matches_hf(hf, tiny_model, [turn1, turn2], [out1, out2], 24)
    assert_no_leak(llm)


@pytest.mark.parametrize("block_size", [4, 16])
def test_block_aligned_prompt_fully_cached_still_generates(tiny_model, hf, block_size):
    llm = make_llm(tiny_model, kvcache_block_size=block_size, num_kvcache_blocks=1024 // block_size)
    prompt = random_prompts(1, 3 * block_size, 3 * block_size, seed=block_size)[0]
    (first,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    (second,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 2 * block_size  # the last block is recomputed to sample
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == hf.greedy(tiny_model, prompt, 24)
    assert_no_leak(llm)


def test_hit_rate_stats_and_reset(tiny_model):
    llm = make_llm(tiny_model, kvcache_block_size=8)
    system = random_prompts(1, 64, 64, seed=41)[0]
    prompts = [system + tail for tail in random_prompts(4, 8, 8, seed=42)]
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    stats = llm.prefix_cache_stats
    assert stats["queries"] == 4 * 72
    assert stats["hits"] == 3 * 64
    assert stats["hit_rate"] == pytest.approx(192 / 288)
    llm.reset_prefix_cache()
    assert not llm.engine.block_manager.pool.hash_index
    (again,) = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 0


def test_reset_refused_while_requests_run(tiny_model):
    llm = make_llm(tiny_model)
    llm.engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="running"):
        llm.reset_prefix_cache()
    llm.engine.abort_all()
    assert_no_leak(llm)


def test_caching_disabled_writes_and_reads_nothing(tiny_model):
    llm = make_llm(tiny_model, enable_prefix_caching=False)
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert not llm.engine.block_manager.pool.hash_index
    assert llm.prefix_cache_hit_rate == 0.0


def test_shared_prefix_within_one_generate_is_computed_once(tiny_model, hf):
    """Blocks are published when scheduled, so prompts in the same step share their prefix."""
    llm = make_llm(tiny_model, kvcache_block_size=8)
    system = random_prompts(1, 40, 40, seed=51)[0]  # five full blocks
    prompts = [system + tail for tail in random_prompts(5, 3, 12, seed=52)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)  # one call: all scheduled in the first step
    assert outputs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in outputs[1:])
    assert llm.prefix_cache_stats["hits"] == 4 * 40
    assert_matches_hf(hf, tiny_model, prompts, outputs, 24)
    assert_no_leak(llm)


class _FailsOnFirstForward(Exception):
    pass


def test_a_failed_step_leaves_no_cache_entry_for_unwritten_kv(tiny_model, hf):
    from nanoserve.backends.base import Backend

    class FailingBackend(Backend):
        fail = True

        def attention(self, *args):
            if FailingBackend.fail:
                raise _FailsOnFirstForward("injected")
            return super().attention(*args)

    llm = make_llm(tiny_model, kvcache_block_size=8, attention_backend=FailingBackend)
    system = random_prompts(1, 40, 40, seed=53)[0]
    prompts = [system + tail for tail in random_prompts(3, 3, 12, seed=54)]
    with pytest.raises(_FailsOnFirstForward):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    bm = llm.engine.block_manager
    assert not bm.pool.hash_index, "blocks published for the failed step are still in the cache"
    bm.check_integrity([])
    assert llm.engine.is_finished()
    FailingBackend.fail = False
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, tiny_model, prompts, outputs, 24)
    assert_no_leak(llm)

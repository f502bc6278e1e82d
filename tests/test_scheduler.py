"""Scheduler policy with a fake model: budgets, chunking, decode priority, preemption, FCFS."""
import random

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(bm, max_num_seqs, budget, chunked)


def make_seqs(lengths, max_tokens, start_id=0, n=1):
    seqs = []
    for i, length in enumerate(lengths):
        tokens = [random.Random(start_id + i).randrange(50) for _ in range(length)]
        params = SamplingParams(n=n, max_tokens=max_tokens)
        seq = Sequence(start_id + i, str(start_id + i), 0, tokens, params, length + max_tokens, seed=0)
        seq.children = [
            Sequence(1000 + 10 * i + k, str(start_id + i), k, tokens, params, length + max_tokens, seed=k)
            for k in range(1, n)
        ]
        seqs.append(seq)
    return seqs


def run_to_completion(sched: Scheduler, on_step=None, max_steps=10_000):
    """Drive the scheduler with a fake model that always samples token 7."""
    finished, steps = [], 0
    while not sched.is_finished():
        batch = sched.schedule()
        if on_step:
            on_step(sched, batch)
        got = sched.postprocess(batch, [7] * sum(batch.samples))
        for seq in got:
            if seq.num_tokens >= seq.max_total_tokens:
                sched.finish(seq)
                finished.append(seq)
        sched.block_manager.check_integrity(sched.running)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    assert sched.block_manager.num_free_blocks == sched.block_manager.pool.num_blocks
    return finished, steps


@pytest.mark.parametrize("chunked", [True, False])
def test_budget_and_max_num_seqs_are_respected(chunked):
    random.seed(0)
    sched = make_scheduler(num_blocks=200, max_num_seqs=3, budget=40, chunked=chunked)
    for seq in make_seqs([random.randint(1, 40) for _ in range(10)], max_tokens=5):
        sched.add(seq)

    def check(sched, batch):
        assert batch.num_tokens <= 40
        assert len(sched.running) <= 3 and len(batch.seqs) <= 3
        assert batch.num_new_tokens[: batch.num_decode_seqs] == [1] * batch.num_decode_seqs

    finished, _ = run_to_completion(sched, check)
    assert len(finished) == 10
    assert all(seq.num_output_tokens == 5 for seq in finished)


def test_long_prompt_is_chunked_and_partial_chunks_never_sample():
    sched = make_scheduler(num_blocks=64, budget=16, chunked=True)
    (seq,) = make_seqs([50], max_tokens=3)
    sched.add(seq)
    chunks = []

    def check(sched, batch):
        for s, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            assert samples == (s.num_computed_tokens + n == s.num_tokens)
            if s.is_prefill:
                chunks.append((n, samples))

    run_to_completion(sched, check)
    assert chunks == [(16, False), (16, False), (16, False), (2, True)]


def test_running_decodes_are_scheduled_every_step_while_a_long_prompt_chunks():
    sched = make_scheduler(num_blocks=128, budget=8, max_num_seqs=8, chunked=True)
    short = make_seqs([3, 3, 3], max_tokens=20)
    for seq in short:
        sched.add(seq)
    sched.postprocess(sched.schedule(), [7, 7, 7])  # all three prefilled, now decoding
    (long,) = make_seqs([60], max_tokens=2, start_id=100)
    sched.add(long)
    for _ in range(10):
        batch = sched.schedule()
        assert all(s in batch.seqs for s in short), "a running decode was starved"
        assert batch.num_tokens <= 8
        sched.postprocess(batch, [7] * sum(batch.samples))


def test_prefill_first_mode_never_mixes():
    sched = make_scheduler(num_blocks=128, budget=64, chunked=False)
    for seq in make_seqs([10, 20, 30], max_tokens=4):
        sched.add(seq)

    def check(sched, batch):
        kinds = {s.is_prefill for s in batch.seqs}
        assert len(kinds) == 1

    run_to_completion(sched, check)


def test_preemption_recomputes_and_loses_nothing():
    random.seed(1)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=8, budget=64, chunked=True)
    seqs = make_seqs([random.randint(5, 12) for _ in range(6)], max_tokens=20)
    for seq in seqs:
        sched.add(seq)
    finished, _ = run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert all(s.num_output_tokens == 20 for s in finished)


def test_fcfs_for_equal_work():
    sched = make_scheduler(num_blocks=200, max_num_seqs=2, budget=64)
    seqs = make_seqs([8] * 6, max_tokens=4)
    for seq in seqs:
        sched.add(seq)
    finished, _ = run_to_completion(sched)
    order = [s.seq_id for s in finished]
    assert order == sorted(order)


def test_n_children_share_prompt_blocks_and_all_finish():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, caching=False)
    (parent,) = make_seqs([10], max_tokens=3, n=3)
    children = list(parent.children)
    sched.add(parent)
    sched.postprocess(sched.schedule(), [7])
    assert parent.children == [] and all(c in sched.running for c in children)
    for child in children:
        assert child.block_table[:2] == parent.block_table[:2]
    used = sched.block_manager.pool.num_blocks - sched.block_manager.num_free_blocks
    assert used == 3  # two shared full prompt blocks + the parent's tail block; children add theirs later
    finished, _ = run_to_completion(sched)
    assert len(finished) == 3


def test_a_later_sequence_hits_blocks_published_in_the_same_step_and_rollback_forgets_them():
    sched = make_scheduler(num_blocks=32, block_size=4, budget=64)
    a, b = make_seqs([12, 12], max_tokens=4)
    b.token_ids = list(a.token_ids)  # same 12-token prompt
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b]
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]  # hit, same step
    assert batch.num_new_tokens == [12, 4]
    bm = sched.block_manager
    bm.check_integrity([a, b])
    bm.rollback()  # the step failed: nothing it published may stay in the cache
    assert not bm.pool.hash_index
    sched.abort_all()
    bm.check_integrity([])
    assert bm.num_free_blocks == 32


def test_aborting_mid_step_forgets_what_the_step_published():
    """A step interrupted after schedule() (an exception, Ctrl-C): aborting is enough to clean up,
    even where a later sequence already hit a block an earlier one published."""
    sched = make_scheduler(num_blocks=32, block_size=4, budget=64)
    a, b = make_seqs([12, 12], max_tokens=4)
    b.token_ids = list(a.token_ids)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert b.block_table[:2] == a.block_table[:2]
    sched.abort_all()
    bm = sched.block_manager
    assert not bm.pool.hash_index
    bm.check_integrity([])
    assert bm.num_free_blocks == 32

"""BlockPool / BlockManager alone: allocation, prefix hits, eviction order, invariants."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.engine.block_manager import BlockManager, hash_block
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(next(_ids), "r", 0, tokens, SamplingParams(), max_total_tokens=10**6, seed=0)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler does for a waiting sequence: adopt cached blocks, allocate the rest, compute."""
    computed = bm.get_computed_blocks(seq)
    if not bm.allocate_slots(seq, seq.num_tokens - computed.num_tokens, computed):
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.commit()
    return True


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(10)))
    assert admit(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    bm.check_integrity([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []
    bm.check_integrity([])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(13)))  # needs 4 blocks
    assert not bm.allocate_slots(seq, 13)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and bm.num_free_blocks == 3


@pytest.mark.parametrize("block_size", [4, 16])
def test_full_prompt_hit_still_computes_last_token(block_size):
    bm = BlockManager(num_blocks=32, block_size=block_size, enable_prefix_caching=True)
    prompt = list(range(3 * block_size))  # exactly k * block_size tokens
    first = make_seq(prompt)
    assert admit(bm, first)
    second = make_seq(prompt)
    computed = bm.get_computed_blocks(second)
    assert computed == (first.block_table[:2], 2 * block_size)  # the last block is recomputed so one token samples
    assert bm.num_hit_tokens == 0 and bm.num_queried_tokens == len(prompt)  # counted on admission only
    assert bm.allocate_slots(second, block_size, computed)
    assert second.block_table[:2] == first.block_table[:2] and len(second.block_table) == 3
    assert bm.num_hit_tokens == 2 * block_size and bm.num_queried_tokens == 2 * len(prompt)
    bm.check_integrity([first, second])


def test_hit_requires_same_prefix_chain():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, a)
    # Same second block, different first block: no hit at all.
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.get_computed_blocks(b) == ([], 0)
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert bm.get_computed_blocks(c) == (a.block_table[:1], 4)


def test_hash_collision_gives_no_wrong_hit(monkeypatch):
    import nanoserve.engine.block_manager as bm_mod

    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3])
    assert admit(bm, a)
    b = make_seq([5, 6, 7])
    assert bm.get_computed_blocks(b) == ([], 0)
    d = make_seq([1, 2, 3])
    assert bm.get_computed_blocks(d) == (a.block_table[:1], 2)


def test_hash_chain_depends_on_parent():
    assert hash_block(None, (1, 2)) != hash_block(hash_block(None, (0, 0)), (1, 2))
    assert hash_block(7, (1, 2)) == hash_block(7, (1, 2))


def test_freed_blocks_are_evicted_tail_first_and_lru():
    """Like vLLM's test_prefill: two requests share a prefix; check the free-queue order."""
    bs = 4
    bm = BlockManager(num_blocks=10, block_size=bs, enable_prefix_caching=True)
    common = list(range(2 * bs))
    a = make_seq(common + [100, 101, 102, 103, 104])  # blocks: c0 c1 a2 a3(partial)
    assert admit(bm, a)
    b = make_seq(common + [200, 201, 202])  # c0 c1 hit, then b2 (partial)
    assert admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens is None
    c0, c1, a2, a3 = a.block_table
    b2 = b.block_table[2]
    untouched = [x for x in range(10) if x not in (c0, c1, a2, a3, b2)]

    bm.free(a)  # c0 c1 still held by b; a2 cached -> tail; a3 partial (no hash) -> head
    assert list(bm.pool.free_queue) == [a3, *untouched, a2]
    bm.free(b)  # tail-first: b2 (no hash) to the head; then c1, c0 to the tail
    assert list(bm.pool.free_queue) == [b2, a3, *untouched, a2, c1, c0]
    # Allocation takes from the head, so the shared prefix (c0, c1) is evicted last.
    d = make_seq([900 + i for i in range(4 * bs)])
    assert bm.allocate_slots(d, 4 * bs)
    assert d.block_table == [b2, a3, *untouched[:2]]
    bm.check_integrity([d])


def test_hit_on_free_block_revives_it():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 9])
    computed = bm.get_computed_blocks(b)
    assert computed.blocks == cached
    assert bm.allocate_slots(b, 1, computed)
    assert all(bm.pool.blocks[x].ref_count == 1 for x in cached)
    assert not any(x in bm.pool.free_queue for x in cached)
    bm.check_integrity([b])


def test_decode_filled_blocks_are_cached():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3])
    assert admit(bm, a)
    for token in (4, 5):  # decode: append a token, compute the previous one
        a.append_token(token)
        assert bm.allocate_slots(a, 1)  # publishes the block this token fills
        a.num_computed_tokens += 1
        bm.commit()
    bm.free(a)
    follow_up = make_seq([1, 2, 3, 4, 5, 6, 7])
    assert bm.get_computed_blocks(follow_up).num_tokens == 4


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, a)
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5])) == ([], 0)
    assert not bm.pool.hash_index


def test_fork_shares_prompt_blocks():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    parent = make_seq([1, 2, 3, 4, 5])
    assert admit(bm, parent)
    child = make_seq([1, 2, 3, 4, 5])
    child.num_computed_tokens = bm.fork(parent, child)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 4
    assert bm.allocate_slots(child, 1)
    bm.check_integrity([parent, child])
    assert bm.num_free_blocks == 8 - 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / free / preempt / fork / hit sequences; invariants after each step."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=3, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.preempted: list[Sequence] = []
        self.written: dict[int, tuple[int, int]] = {}  # slot -> (token, position) last computed there

    def _compute(self, seq: Sequence, start: int) -> None:
        bs = self.bm.block_size
        for p in range(start, seq.num_computed_tokens):
            self.written[seq.block_table[p // bs] * bs + p % bs] = (seq.token_ids[p], p)
        self.bm.commit()

    def _admit(self, seq: Sequence) -> bool:
        bs = self.bm.block_size
        computed = self.bm.get_computed_blocks(seq)
        for i, block in enumerate(computed.blocks):  # a hit must hold exactly our tokens at our positions
            for p in range(i * bs, (i + 1) * bs):
                assert self.written[block * bs + p % bs] == (seq.token_ids[p], p)
        free_before = self.bm.num_free_blocks
        if not self.bm.allocate_slots(seq, seq.num_tokens - computed.num_tokens, computed):
            assert seq.block_table == [] and self.bm.num_free_blocks == free_before
            return False
        seq.num_computed_tokens = seq.num_tokens
        self._compute(seq, computed.num_tokens)
        return True

    @rule(prefix=st.sampled_from([[], [7, 7, 7], [7, 7, 7, 1, 2, 3]]), tail=st.lists(st.integers(0, 3), min_size=1, max_size=8),
          step_fails=st.booleans())
    def publish_then_never_compute(self, prefix, tail, step_fails):
        """Blocks published when scheduled, then the step raises (rollback) or the sequence leaves
        before its forward pass (free): no later hit may find them."""
        seq = make_seq(prefix + tail)
        computed = self.bm.get_computed_blocks(seq)
        if not self.bm.allocate_slots(seq, seq.num_tokens - computed.num_tokens, computed):  # publishes
            return
        if step_fails:
            self.bm.rollback()
        self.bm.free(seq)
        self.bm.forget(seq)

    @rule(prefix=st.sampled_from([[], [7, 7, 7], [7, 7, 7, 1, 2, 3]]), tail=st.lists(st.integers(0, 3), min_size=1, max_size=8))
    def add(self, prefix, tail):
        seq = make_seq(prefix + tail)
        if self._admit(seq):
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.append_token(token)
        if self.bm.allocate_slots(seq, 1):
            seq.num_computed_tokens += 1
            self._compute(seq, seq.num_computed_tokens - 1)
        else:  # out of blocks: preempt it, as the scheduler would
            self._preempt(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.bm.forget(seq)
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(self.live)))

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0  # the scheduler's job: the block manager never writes it
        self.live.remove(seq)
        self.preempted.append(seq)

    @precondition(lambda self: self.preempted)
    @rule()
    def resume(self):
        seq = self.preempted.pop(0)
        if self._admit(seq):
            self.live.append(seq)
        else:
            self.preempted.insert(0, seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = make_seq(parent.token_ids)
        child.num_computed_tokens = self.bm.fork(parent, child)
        n = child.num_uncomputed_tokens
        if self.bm.allocate_slots(child, n):
            start = child.num_computed_tokens
            child.num_computed_tokens += n
            self._compute(child, start)
            self.live.append(child)
        else:
            self.bm.free(child)

    @invariant()
    def integrity(self):
        self.bm.check_integrity(self.live)
        bs = self.bm.block_size
        seen: set[int] = set()
        for seq in self.live:
            # Slots a sequence may still write (its partial tail block) belong to it alone.
            for p in range(seq.num_computed_tokens, len(seq.block_table) * bs):
                block = seq.block_table[p // bs]
                assert self.bm.pool.blocks[block].ref_count == 1, f"{seq} would write a shared block"
                slot = block * bs + p % bs
                assert slot not in seen
                seen.add(slot)

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_integrity([])
        assert self.bm.num_free_blocks == self.bm.pool.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

"""Per-sequence block tables on top of the BlockPool, with hash-chained prefix caching.

A block's hash is xxh64(parent block hash, its token ids), so equal hashes mean equal prefixes
up to that block (verified on a hit). Only full blocks are cached; blocks filled during decode
are cached too, so a later prompt that extends prompt + completion reuses them.

A block is published when the step that fills it is scheduled (as vLLM v1 and nano-vllm do), so
a sequence scheduled later in the same step hits it: its attention reads K/V that the same forward
pass stores before attending. Until that step has run, the block is uncommitted: `rollback` (the
step raised) and `free` (the sequence left before its forward pass) forget it, so the cache never
points at K/V that was not written.
"""
from __future__ import annotations

import array
from typing import NamedTuple

import xxhash

from nanoserve.engine.block_pool import BlockPool
from nanoserve.engine.prompt_logprobs import max_cached_tokens
from nanoserve.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(array.array("q", token_ids).tobytes())
    return h.intdigest()


class ComputedBlocks(NamedTuple):
    blocks: list[int]  # cached blocks holding a sequence's leading tokens
    num_tokens: int  # the tokens they hold


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # seq_id -> hashes of its leading full blocks, computed once (token ids never change).
        self._block_hashes: dict[int, list[int]] = {}
        # seq_id -> how many leading blocks of its table are cached (or were tried).
        self._num_cached_blocks: dict[int, int] = {}
        self._uncommitted: dict[int, int] = {}  # block id -> seq id: published, K/V written by the coming step
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache ---------------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """Cached blocks that hold this sequence's leading tokens, and how many tokens that is.
        Changes nothing (the hit statistics count when allocate_slots admits the sequence).

        Capped so at least one token is left to compute: the step that computes it samples.
        """
        hits: list[int] = []
        # Nor any position whose logits the request needs for its prompt logprobs (prompt_logprobs.py).
        max_tokens = min(seq.num_tokens - 1, max_cached_tokens(seq))
        max_blocks = max_tokens // self.block_size if self.enable_prefix_caching else 0
        parent_uid = None
        for i, block_hash in enumerate(self._hashes(seq, max_blocks)):
            block_id = self.pool.lookup(block_hash, parent_uid, self._block_tokens(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
            parent_uid = self.pool.blocks[block_id].uid
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish every block of `seq` whose tokens will all have K/V once this step has run
        (its first `num_tokens` tokens); they stay uncommitted until `commit`."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(start, num_full):
            block = self.pool.blocks[seq.block_table[i]]
            if block.hash is None:
                parent = self.pool.blocks[seq.block_table[i - 1]] if i else None
                parent_uid = parent.uid if parent is not None else None
                if i and parent_uid is None:
                    break  # parent not cached (a duplicate): children could never be hit
                if self.pool.cache(block.block_id, hashes[i], parent_uid, self._block_tokens(seq, i)):
                    self._uncommitted[block.block_id] = seq.seq_id
        self._num_cached_blocks[seq.seq_id] = num_full

    def commit(self) -> None:
        """The step ran: the K/V of every block published for it is written."""
        self._uncommitted.clear()

    def rollback(self) -> None:
        """The step failed: forget the blocks published for it, whose K/V may not be written."""
        for block_id in self._uncommitted:
            self.pool.uncache(block_id)
        self._uncommitted.clear()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
        self._num_cached_blocks.clear()

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: ComputedBlocks | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq` and publish the blocks they fill.

        `computed` (get_computed_blocks of a sequence with no blocks) admits it: its blocks are
        adopted first and the lookup counts in the hit statistics, once per admission. All or
        nothing: returns False and changes nothing when the blocks are not there.
        """
        hits, num_computed = computed if computed is not None else ([], seq.num_computed_tokens)
        assert not (hits and seq.block_table), "computed blocks are only adopted by a sequence with no blocks"
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(hits)
        if num_needed + sum(self.pool.blocks[b].ref_count == 0 for b in hits) > self.pool.num_free_blocks:
            return False  # (hits that nobody holds come off the free queue too)
        for block_id in hits:
            self.pool.take(block_id)
        seq.block_table.extend(hits)
        seq.block_table.extend(self.pool.allocate() for _ in range(max(num_needed, 0)))
        if computed is not None:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += num_computed
            self._num_cached_blocks[seq.seq_id] = len(hits)
        self._cache_full_blocks(seq, num_computed + num_new_tokens)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Let `child` (same prompt) share the parent's full prompt blocks through ref counts;
        returns the tokens they hold (the child's computed tokens)."""
        num_shared = (child.num_tokens - 1) // self.block_size
        shared = parent.block_table[:num_shared]
        for block_id in shared:
            self.pool.take(block_id)
        child.block_table = list(shared)
        self._num_cached_blocks[child.seq_id] = min(self._num_cached_blocks.get(parent.seq_id, 0), num_shared)
        return num_shared * self.block_size

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks tail-first, so a chain's tail is evicted before its head."""
        for block_id in seq.block_table:
            if self._uncommitted.get(block_id) == seq.seq_id:  # it leaves before its step computes the block
                assert self.pool.blocks[block_id].ref_count == 1, f"block {block_id} was hit before it was written"
                self.pool.uncache(block_id)
                del self._uncommitted[block_id]
        self.pool.release(seq.block_table[::-1])
        seq.block_table = []
        self._num_cached_blocks.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence bookkeeping of a finished sequence."""
        self._block_hashes.pop(seq.seq_id, None)

    def check_integrity(self, seqs: list[Sequence]) -> None:
        self.pool.check_integrity([seq.block_table for seq in seqs])
        for block_id in self._uncommitted:
            assert self.pool.blocks[block_id].hash is not None, f"uncommitted block {block_id} is not cached"
        for seq in seqs:
            assert len(seq.block_table) >= self.num_blocks_for(seq.num_computed_tokens), (
                f"{seq} has computed tokens outside its blocks"
            )

"""The mechanism under the KV cache: blocks, ref counts, an LRU free queue and a hash index.

Policy (which sequence gets which blocks, when to preempt) lives in BlockManager and Scheduler.
No torch here: this is bookkeeping over integer block ids, tested on its own.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once when the block becomes full and is cached; cleared when the block is evicted.
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    # Identity of the cached block this one follows (None for a first block). Compared on a hit
    # so a hash collision anywhere in the chain cannot produce a wrong hit.
    parent_uid: int | None = None
    uid: int | None = None  # unique per caching event, never reused


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the head is the least recently freed block.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_index: dict[int, int] = {}  # block hash -> block id
        self._next_uid = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        """Take the least recently used free block, dropping whatever it cached."""
        if not self.free_queue:
            raise RuntimeError("no free KV blocks; callers must check num_free_blocks first")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_count = 1
        return block_id

    def take(self, block_id: int) -> None:
        """Add a holder to a block, reviving it from the free queue if nobody held it."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one holder from each block, in the order given (callers pass tail-first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:  # holds nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block_id, last=False)

    def lookup(self, block_hash: int, parent_uid: int | None, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.hash_index.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent_uid != parent_uid:
            return None  # a hash collision: the cached content is not ours
        return block_id

    def cache(self, block_id: int, block_hash: int, parent_uid: int | None, token_ids: tuple[int, ...]) -> bool:
        """Record a full block's content; False if that hash is already served by another block."""
        block = self.blocks[block_id]
        assert block.hash is None, f"block {block_id} is already cached"
        if block_hash in self.hash_index:
            return False
        block.hash, block.parent_uid, block.token_ids = block_hash, parent_uid, token_ids
        block.uid = self._next_uid
        self._next_uid += 1
        self.hash_index[block_hash] = block_id
        return True

    def uncache(self, block_id: int) -> None:
        """Forget what a block caches (its K/V will not be written after all)."""
        block = self.blocks[block_id]
        self._evict(block)
        if block.ref_count == 0:  # holds nothing worth keeping now: reuse it first
            self.free_queue.move_to_end(block_id, last=False)

    def reset_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)
        self.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))

    def _evict(self, block: Block) -> None:
        if block.hash is not None:
            del self.hash_index[block.hash]
        block.hash = block.token_ids = block.parent_uid = block.uid = None

    def check_integrity(self, block_tables: list[list[int]]) -> None:
        """Ref counts equal holders; free and used partition the pool; the hash index is exact."""
        holders = [0] * self.num_blocks
        for table in block_tables:
            for block_id in table:
                holders[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != holders {holders[block.block_id]}"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), (
                f"block {block.block_id}: ref_count {block.ref_count} but in free queue: "
                f"{block.block_id in self.free_queue}"
            )
        for block_hash, block_id in self.hash_index.items():
            assert self.blocks[block_id].hash == block_hash, f"hash index entry for block {block_id} is stale"
        cached = sum(block.hash is not None for block in self.blocks)
        assert cached == len(self.hash_index), "a cached block is missing from the hash index"

"""Which sequences run next, and how many new tokens each: the policy over the BlockManager.

Default (vLLM v1 style): every step has a token budget (`max_num_batched_tokens`). Running
sequences are served first (a decode takes one token, an unfinished prompt takes a chunk), then
waiting ones in arrival order, so long prompts are prefilled in chunks next to running decodes.
With `enable_chunked_prefill=False` a step is all-prefill or all-decode, like nano-vllm.
When blocks run out, the most recently admitted running sequence is preempted: its blocks are
freed and it is recomputed later (its cached blocks often survive in the prefix cache).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work. Single-token entries come first so attention can batch them as decodes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    samples: list[bool]  # does this entry reach the end of its known tokens (and so sample)?

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_decode_seqs(self) -> int:
        return sum(n == 1 for n in self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        seqs, num_new = [], []
        if self.enable_chunked_prefill:
            preempted = self._schedule_running(seqs, num_new)
            if not preempted:
                self._schedule_waiting(seqs, num_new, chunked=True)
        else:
            self._schedule_waiting(seqs, num_new, chunked=False)
            if not seqs:
                self._schedule_running(seqs, num_new)
        assert seqs, "schedule() found nothing to run although requests are pending"
        order = sorted(range(len(seqs)), key=lambda i: num_new[i] != 1)  # stable: decodes first
        seqs = [seqs[i] for i in order]
        num_new = [num_new[i] for i in order]
        samples = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(seqs, num_new)]
        return ScheduledBatch(seqs, num_new, samples)

    def _schedule_running(self, seqs: list[Sequence], num_new: list[int]) -> bool:
        """Serve running sequences in order; returns True if anything was preempted."""
        budget = self.max_num_batched_tokens - sum(num_new)
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return preempted
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            i += 1
        return preempted

    def _schedule_waiting(self, seqs: list[Sequence], num_new: list[int], chunked: bool) -> None:
        budget = self.max_num_batched_tokens - sum(num_new)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # Room for its unforked samples too, so they start beside it; a request with more
            # samples than max_num_seqs waits for an empty batch and runs the rest in waves.
            if len(self.running) + min(1 + len(seq.children), self.max_num_seqs) > self.max_num_seqs:
                break
            computed = self.block_manager.get_computed_blocks(seq)
            n = seq.num_tokens - computed.num_tokens
            if n > budget:
                if not chunked:
                    break
                n = budget
            # Its full blocks are published now: a sequence scheduled after it in this step can hit them.
            if not self.block_manager.allocate_slots(seq, n, computed):
                break
            seq.num_computed_tokens = computed.num_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = computed.num_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the forward pass ------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
        """The step ran: commit the blocks it filled, advance computed counts, append sampled tokens.

        Returns the sequences that received a token, in batch order (stop checks are the
        engine's: they need the tokenizer).
        """
        self.block_manager.commit()
        sampled = iter(sampled_token_ids)
        got_token = []
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            seq.num_computed_tokens += n
            if samples:
                seq.append_token(next(sampled))
                got_token.append(seq)
                if seq.children:
                    self._fork_children(seq)
        return got_token

    def postprocess_prefill_only(self, batch: ScheduledBatch) -> list[Sequence]:
        """The step of prefill-only (pooling) sequences ran: commit its blocks, advance computed
        counts, finish every sequence whose prompt is now complete (freeing its blocks; the
        prefix cache keeps what it holds) and return those, in batch order."""
        self.block_manager.commit()
        done = []
        for seq, n, completes in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            seq.num_computed_tokens += n
            if completes:
                self.finish(seq)
                done.append(seq)
        return done

    def _fork_children(self, parent: Sequence) -> None:
        """Start a request's other n-1 samples on the parent's prompt blocks, as many as
        max_num_seqs leaves room for. The rest wait at the head of the queue in sample order, as
        vLLM's child requests do, and are admitted like any prompt (sharing it through the prefix
        cache): each sample's tokens depend only on its own seed, so waves change no output."""
        at = self.running.index(parent) + 1
        room = max(self.max_num_seqs - len(self.running), 0)
        forked, rest = parent.children[:room], parent.children[room:]
        for child in forked:
            child.num_computed_tokens = self.block_manager.fork(parent, child)
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SequenceStatus.RUNNING
        self.running[at:at] = forked
        self.waiting.extendleft(reversed(rest))
        parent.children = []

    def abort_all(self) -> None:
        """Drop every request (after an error mid-generate) and give back all their blocks."""
        self.block_manager.rollback()  # blocks published for a step that never ran (no-op between steps)
        self.abort([*self.running, *self.waiting])

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop these sequences (one request's samples) wherever they are and give back their blocks.

        Samples not yet forked from their parent sit in no queue and hold no blocks; they are
        only marked finished. Called between steps, when nothing published is uncommitted (a step
        that fails mid-way aborts everything through abort_all).
        """
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.block_manager.free(seq)
            self.block_manager.forget(seq)
            seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        self.abort([seq])

"""CUDA graphs for decode steps (CUDA only; `enforce_eager=True` turns them off).

ModelRunner imports this module lazily, only when its device is CUDA and enforce_eager is False,
so a CPU run never imports it; nothing here touches CUDA at import time either, which is what
lets the pure-Python parts (buckets, buffer sizing, padding) be tested on CPU.

* Buckets: `graph_batch_sizes(max_num_seqs)` is 1, 2, 4, 8, 16, then every multiple of 16, then
  max_num_seqs itself, so every batch size from 1 to max_num_seqs has a bucket; a batch of n
  sequences replays the smallest bucket >= n (`select_bucket`), padding the rest.
* Static buffers (`StaticBuffers`): input_ids, positions, slot_mapping [max_num_seqs],
  context_lens [max_num_seqs] and block_tables [max_num_seqs, ceil(max_model_len / block_size)],
  allocated once; every graph reads views of their first `bucket` rows. Padded rows write to slot
  -1 (the store kernels skip it), read a context of 1 token through block 0 (a valid block), and
  their outputs are dropped.
* Capture (`CUDAGraphRunner.capture`): one `torch.cuda.CUDAGraph` per bucket, largest first, all
  in one memory pool (`torch.cuda.graph_pool_handle()`), each after an eager warm-up run on a
  side stream (Triton compiles, cuBLAS and NCCL initialise, outside the capture). Only the
  transformer body is captured; the LM head, its gather and sampling run eagerly on the rows
  that sample. `decode_max_context_len` is baked in as max_model_len, which bounds every context:
  flash-attn picks its number of KV splits from it and never reads keys past it (so it must not
  be smaller than a real context), the Triton decode kernel only uses it to choose its split
  count (it reads each sequence's length from context_lens), the torch reference sizes its gather.
* With tensor parallelism every rank captures and replays the same buckets at the same step (the
  choice depends only on the config and the step's inputs, which all ranks share), so the
  collectives recorded in the graphs meet.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.engine.kv_cache_spec import KVCacheSpec

SMALL_BUCKETS = (1, 2, 4, 8, 16)
BUCKET_STEP = 16


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 32, 48, ... and max_num_seqs itself (ascending)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in SMALL_BUCKETS if s <= max_num_seqs}
    sizes.update(range(2 * BUCKET_STEP, max_num_seqs + 1, BUCKET_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def select_bucket(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= batch_size (buckets ascending); None when the batch is too big."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


def static_buffer_shapes(
    max_num_seqs: int, max_model_len: int, block_size: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every static input buffer, sized for the largest bucket."""
    n, width = max_num_seqs, KVCacheSpec(block_size, max_model_len).blocks_per_seq
    return {
        "input_ids": ((n,), torch.int64),
        "positions": ((n,), torch.int64),
        "slot_mapping": ((n,), torch.int64),
        "context_lens": ((n,), torch.int32),
        "block_tables": ((n, width), torch.int32),
    }


def is_decode_only(inputs) -> bool:
    """A step graphs can replay: decodes only (one token per sequence), at least one."""
    meta = inputs.meta
    n = meta.num_decode_tokens
    return n > 0 and meta.num_prefills == 0 and inputs.input_ids.shape[0] == n


@dataclass
class StaticBuffers:
    """The tensors every captured graph reads; a step's inputs are copied in before a replay."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_model_len: int

    @classmethod
    def allocate(
        cls, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device | str = "cpu"
    ) -> "StaticBuffers":
        tensors = {
            name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in static_buffer_shapes(max_num_seqs, max_model_len, block_size).items()
        }
        buffers = cls(**tensors, max_model_len=max_model_len)
        buffers.slot_mapping.fill_(-1)  # until filled, no row writes the cache
        buffers.context_lens.fill_(1)
        return buffers

    @property
    def max_batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def fits(self, inputs) -> bool:
        """Whether a decode-only step fits these buffers (rows and block-table width)."""
        meta = inputs.meta
        return meta.num_decode_tokens <= self.max_batch_size and meta.decode_block_tables.shape[1] <= self.max_blocks

    def fill(self, inputs, bucket: int) -> int:
        """Copy a decode-only step into rows [0, n) and pad rows [n, bucket); returns n."""
        meta = inputs.meta
        n, width = meta.num_decode_tokens, meta.decode_block_tables.shape[1]
        if not (is_decode_only(inputs) and n <= bucket <= self.max_batch_size and width <= self.max_blocks):
            raise ValueError(
                f"cannot replay a graph of {bucket} rows x {self.max_blocks} blocks for this step "
                f"({n} decode tokens of {inputs.input_ids.shape[0]}, {meta.num_prefills} prefills, "
                f"block tables {width} wide)"
            )
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        tables = self.block_tables[:bucket]
        tables.zero_()  # padding columns and rows: block 0, a valid block nothing reads past context
        tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        tables[:n, :width].clamp_(min=0)  # -1 (no block) beyond a row's context reads as block 0 too
        # Padded rows: token 0 at position 0, written nowhere, attending to 1 key.
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.context_lens[n:bucket].fill_(1)
        return n

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Decode-only attention metadata over the first `bucket` rows (views, no copies)."""
        device = self.input_ids.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode_tokens=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_context_lens=self.context_lens[:bucket],
            decode_max_context_len=self.max_model_len,
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
            prefill_block_tables=torch.zeros(0, self.max_blocks, dtype=torch.int32, device=device),
            prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            prefill_max_seqlen_q=0,
            prefill_max_context_len=0,
            prefills_have_context=False,
        )


class CUDAGraphRunner:
    """Captured decode graphs for one model's forward, one per bucket, replayed with padded static inputs."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, kv_spec: KVCacheSpec, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward  # (input_ids, positions, meta) -> hidden states: the transformer body
        self.device = device
        self.buckets = graph_batch_sizes(max_num_seqs)
        self.buffers = StaticBuffers.allocate(max_num_seqs, kv_spec.max_model_len, kv_spec.block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the hidden states its graph writes
        self.pool = None

    def can_run(self, inputs) -> bool:
        return is_decode_only(inputs) and self.buffers.fits(inputs)

    def _forward(self, bucket: int) -> torch.Tensor:
        b = self.buffers
        return self.forward(b.input_ids[:bucket], b.positions[:bucket], b.metadata(bucket))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        self.pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            # Warm up on a side stream, as the torch.cuda.graphs docs ask: lazy initialisation
            # (Triton compilation, cuBLAS handles, NCCL communicators) must not happen in a capture.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bucket] = self._forward(bucket)
            except Exception as exc:
                raise RuntimeError(
                    f"CUDA graph capture failed for decode batch size {bucket}: {exc}. "
                    "Pass enforce_eager=True to run without CUDA graphs."
                ) from exc
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def run(self, inputs) -> torch.Tensor:
        """Hidden states [num_decode_tokens, hidden] of a decode-only step, by graph replay."""
        bucket = select_bucket(inputs.meta.num_decode_tokens, self.buckets)
        n = self.buffers.fill(inputs, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]

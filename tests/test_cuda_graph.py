"""CUDA-graph logic that needs no GPU: buckets, static-buffer sizing, and padding a decode step.

Capture and replay themselves need CUDA and are not exercised here; the padding test instead
runs the model eagerly on exactly the padded static inputs a captured graph would read.
"""
import logging
import sys

import pytest
import torch
from helpers import make_llm

import nanoserve.engine
from nanoserve import SamplingParams
from nanoserve.engine import cuda_graph
from nanoserve.config import Config
from nanoserve.engine.cuda_graph import (
    CUDAGraphRunner,
    StaticBuffers,
    graph_batch_sizes,
    is_decode_only,
    select_bucket,
    static_buffer_shapes,
)
from nanoserve.engine.kv_cache_spec import KVCacheSpec
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence

@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 8, 16, 17, 100, 255, 256, 512])
def test_every_batch_size_has_the_smallest_bucket_above_it(max_num_seqs):
    buckets = graph_batch_sizes(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        bucket = select_bucket(n, buckets)
        assert bucket is not None and bucket >= n
        assert all(b < n for b in buckets if b < bucket), "not the smallest bucket that fits"
        # Padding stays small: under n rows for small batches, under 16 rows past that.
        assert bucket - n < max(n, 16)
    assert len(buckets) <= 6 + max_num_seqs // 16, "one graph per batch size would capture too many"
    assert select_bucket(max_num_seqs + 1, buckets) is None  # too big: runs eagerly


def test_bucket_arguments_are_checked():
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)
    with pytest.raises(ValueError, match="batch_size"):
        select_bucket(0, [1, 2])


@pytest.mark.parametrize(
    "max_num_seqs, max_model_len, block_size, width",
    [(256, 4096, 16, 256), (3, 100, 16, 7), (1, 1, 1, 1), (8, 17, 16, 2), (5, 64, 256, 1)],
)
def test_static_buffer_sizing(max_num_seqs, max_model_len, block_size, width):
    shapes = static_buffer_shapes(max_num_seqs, max_model_len, block_size)
    assert shapes == {
        "input_ids": ((max_num_seqs,), torch.int64),
        "positions": ((max_num_seqs,), torch.int64),
        "slot_mapping": ((max_num_seqs,), torch.int64),
        "context_lens": ((max_num_seqs,), torch.int32),
        "block_tables": ((max_num_seqs, width), torch.int32),
    }
    buffers = StaticBuffers.allocate(max_num_seqs, max_model_len, block_size)
    for name, (shape, dtype) in shapes.items():
        tensor = getattr(buffers, name)
        assert tuple(tensor.shape) == shape and tensor.dtype == dtype
    # Before any fill, a replay would write nothing and read one valid key per row.
    assert (buffers.slot_mapping == -1).all() and (buffers.context_lens == 1).all()
    assert (buffers.block_tables == 0).all()
    meta = buffers.metadata(max_num_seqs)
    assert meta.num_decode_tokens == max_num_seqs and meta.num_prefills == 0
    assert meta.decode_max_context_len == max_model_len


def test_cuda_graph_runner_refuses_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        CUDAGraphRunner(torch.nn.Identity(), 4, KVCacheSpec(16, 64), torch.device("cpu"))


# ---- padding a real decode step ------------------------------------------------------------


def _runner(path, max_num_seqs=8):
    config = Config(path, device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=40,
                    max_model_len=64, max_num_seqs=max_num_seqs)
    return ModelRunner(config, torch.device("cpu"))


def _decode_inputs(runner, prompt_lens, first_block=0):
    """Prefill sequences of these lengths, then return the inputs of their next decode step."""
    seqs, block = [], first_block
    for i, n in enumerate(prompt_lens):
        seq = Sequence(i, str(i), 0, [(7 * i + j) % 500 + 3 for j in range(n)], SamplingParams(), 64, 0)
        num_blocks = (n + 1 + 3) // 4
        seq.block_table = list(range(block, block + num_blocks))
        block += num_blocks
        seqs.append(seq)
    runner.execute(runner.prepare_inputs(ScheduledBatch(seqs, list(prompt_lens), [True] * len(seqs))))
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(11)
    inputs = runner.prepare_inputs(ScheduledBatch(seqs, [1] * len(seqs), [True] * len(seqs)))
    assert is_decode_only(inputs)
    return inputs


def test_padded_decode_matches_eager(tiny_model):
    """The padded static inputs a graph replays give the eager hidden states and write the same cache."""
    runner = _runner(tiny_model)
    inputs = _decode_inputs(runner, [5, 9, 13])  # block tables 2, 3 and 4 wide
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        eager = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        eager_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)

        buffers = StaticBuffers.allocate(8, 64, 4)
        bucket = select_bucket(3, graph_batch_sizes(8))
        assert bucket == 4
        assert buffers.fill(inputs, bucket) == 3
        padded = runner.model(buffers.input_ids[:bucket], buffers.positions[:bucket], buffers.metadata(bucket))
    assert padded.shape[0] == 4
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.kv_cache, eager_cache, rtol=1e-5, atol=1e-5)
    written = (runner.kv_cache != before).flatten(-2).any(-1).nonzero()[:, 2:]  # (block, offset) per write
    expected = {(s // 4, s % 4) for s in inputs.meta.slot_mapping.tolist()}
    assert {tuple(x) for x in written.tolist()} == expected, "a padded row wrote to the KV cache"

    # The rows: real ones copied, the padded one pointing nowhere harmful.
    assert buffers.input_ids[:3].tolist() == inputs.input_ids.tolist()
    assert buffers.slot_mapping[:4].tolist() == inputs.meta.slot_mapping.tolist() + [-1]
    assert buffers.context_lens[:4].tolist() == inputs.meta.decode_context_lens.tolist() + [1]
    assert (buffers.block_tables[3] == 0).all() and (buffers.block_tables[:4] >= 0).all()
    assert buffers.block_tables[2, :4].tolist() == inputs.meta.decode_block_tables[2].tolist()


def test_refill_with_a_smaller_batch_clears_stale_rows(tiny_model):
    runner = _runner(tiny_model)
    buffers = StaticBuffers.allocate(8, 64, 4)
    big = _decode_inputs(runner, [3, 4, 5, 6, 7])
    buffers.fill(big, select_bucket(5, graph_batch_sizes(8)))
    small = _decode_inputs(runner, [20], first_block=30)
    bucket = select_bucket(1, graph_batch_sizes(8))
    assert bucket == 1
    buffers.fill(small, 8)  # a larger bucket than needed is allowed: rows 1..7 are padding
    assert buffers.slot_mapping.tolist() == small.meta.slot_mapping.tolist() + [-1] * 7
    assert buffers.context_lens.tolist() == [21] + [1] * 7
    assert buffers.block_tables[0, :6].tolist() == list(range(30, 36))
    assert (buffers.block_tables[1:] == 0).all()


def test_fill_refuses_what_a_graph_cannot_replay(tiny_model):
    runner = _runner(tiny_model)
    inputs = _decode_inputs(runner, [5, 9, 13])
    small = StaticBuffers.allocate(2, 64, 4)
    assert not small.fits(inputs)
    with pytest.raises(ValueError):
        small.fill(inputs, 2)
    narrow = StaticBuffers.allocate(8, 8, 4)  # block tables 2 wide; this step needs 4
    assert not narrow.fits(inputs)
    with pytest.raises(ValueError):
        narrow.fill(inputs, 4)
    seq = Sequence(9, "9", 0, [5, 6, 7], SamplingParams(), 64, 0)
    seq.block_table = [39]
    prefill = runner.prepare_inputs(ScheduledBatch([seq], [3], [True]))
    assert not is_decode_only(prefill)


def test_cpu_run_never_imports_the_cuda_graph_module(tiny_model, monkeypatch):
    # Make any import of the module fail, then run a CPU engine through prefill and decode.
    monkeypatch.setitem(sys.modules, "nanoserve.engine.cuda_graph", None)
    monkeypatch.delattr(nanoserve.engine, "cuda_graph", raising=False)
    llm = make_llm(tiny_model, device="cpu", num_kvcache_blocks=64, max_model_len=128)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.model_runner._cuda_graphs is None


# ---- capture at startup --------------------------------------------------------------------


class GraphsOnCPU(ModelRunner):
    """The runner as on CUDA with graphs on; the capture is a fake (monkeypatched in)."""

    uses_cuda_graphs = True


class FakeCapture:
    """Records what it captured with and replays by running the body eagerly; `error` makes capture raise."""

    error: Exception | None = None

    def __init__(self, forward, max_num_seqs, kv_spec, device) -> None:
        self.forward, self.kv_spec, self.replays = forward, kv_spec, 0

    def capture(self) -> None:
        if self.error is not None:
            raise self.error

    def can_run(self, inputs) -> bool:
        return is_decode_only(inputs)

    def run(self, inputs):
        self.replays += 1
        return self.forward(inputs.input_ids, inputs.positions, inputs.meta)


def _graph_runner(path, monkeypatch, error=None):
    monkeypatch.setattr(cuda_graph, "CUDAGraphRunner", type("Capture", (FakeCapture,), {"error": error}))
    config = Config(path, device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=40,
                    max_model_len=64, max_num_seqs=8)
    return GraphsOnCPU(config, torch.device("cpu"))


def test_graphs_are_captured_at_startup_after_the_kv_cache(tiny_model, monkeypatch):
    runner = _graph_runner(tiny_model, monkeypatch)
    graphs = runner._cuda_graphs
    assert graphs is not None and graphs.kv_spec == runner.kv_spec and graphs.kv_spec.num_blocks == 40
    logits = runner.execute(_decode_inputs(runner, [5, 9]))
    assert graphs.replays == 1 and logits.shape[0] == 2  # the prefill ran eagerly, the decode replayed


def test_a_failed_capture_falls_back_to_eager_with_the_reason_logged(tiny_model, monkeypatch, caplog):
    error = RuntimeError("CUDA graph capture failed for decode batch size 8: operation not permitted")
    with caplog.at_level(logging.WARNING, logger="nanoserve.engine.model_runner"):
        runner = _graph_runner(tiny_model, monkeypatch, error)
    assert runner._cuda_graphs is None
    assert "operation not permitted" in caplog.text and "run eagerly" in caplog.text
    assert runner.execute(_decode_inputs(runner, [5, 9])).shape[0] == 2

"""KV-cache sizing on a GPU, driven by a fake CUDA memory API on the CPU.

`FakeDevice` behaves like torch.cuda's caching allocator: freed tensors stay reserved (counted as
used by `mem_get_info`) until `empty_cache`, other processes hold some memory, and the allocator
tracks a peak. Engines are simulated by the callables the real `memory.profile` runs.
"""
from __future__ import annotations

import pytest
import torch

from nanoserve.config import Config
from nanoserve.engine import memory
from nanoserve.engine.kv_cache_spec import KVCacheSpec
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.warmup import decode_batch, prefill_batch
from nanoserve.models import head_dim_of

GiB = 2**30
BLOCK_BYTES = 2**20  # 1 MiB per KV block
BLOCKS_PER_SEQ = 64


class FakeDevice:
    def __init__(self, total: int, used_by_others: int = 0) -> None:
        self.total, self.others = total, used_by_others
        self.allocated = self.cached = self.peak = 0
        self.non_torch = 0  # this process's memory outside torch's allocator (cuBLAS, NCCL)
        self.empty_cache_calls = 0

    # what the engine's code allocates through
    def alloc(self, n: int) -> None:
        take = min(n, self.cached)  # the caching allocator reuses what it holds
        self.cached -= take
        if self.free_now() < n - take:
            raise MemoryError("CUDA out of memory")
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def release(self, n: int) -> None:
        self.allocated -= n
        self.cached += n  # kept by the allocator, not given back to the driver

    def free_now(self) -> int:
        return self.total - self.others - self.non_torch - self.allocated - self.cached

    # the DeviceMemory protocol
    def mem_get_info(self) -> tuple[int, int]:
        return self.free_now(), self.total

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return self.allocated + self.cached

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated

    def empty_cache(self) -> None:
        self.cached = 0
        self.empty_cache_calls += 1


class FakeEngine:
    """What an engine does to device memory: weights, a warm-up, graphs, then the KV cache."""

    def __init__(self, device: FakeDevice, weights: int, activations: int, graphs: int, non_torch: int = 0) -> None:
        self.device, self.weights, self.activations, self.graphs = device, weights, activations, graphs
        self.non_torch = non_torch  # taken outside torch by the first forward (a cuBLAS workspace, NCCL buffers)
        self.kv_bytes = 0

    def transient(self, n: int) -> None:
        self.device.non_torch += self.non_torch
        self.non_torch = 0
        self.device.alloc(n)
        self.device.release(n)

    def start(self, utilization: float, use_graphs: bool = True) -> int:
        profile = memory.profile(
            self.device, lambda: self.device.alloc(self.weights), lambda: self.transient(self.activations),
            (lambda: self.transient(self.graphs)) if use_graphs else None,
        )
        available = profile.kv_cache_budget(utilization) // BLOCK_BYTES
        spec = KVCacheSpec(1024 // BLOCKS_PER_SEQ, 1024)
        spec = spec.sized(available, 1024, BLOCK_BYTES, profile.describe(utilization))
        blocks = spec.num_blocks  # 1024 sequences: never capped here
        self.kv_bytes = blocks * BLOCK_BYTES
        self.device.alloc(self.kv_bytes)
        return blocks

    def close(self) -> None:  # what garbage collection leaves behind: everything freed, still cached
        self.device.release(self.weights + self.kv_bytes)


def test_budget_is_the_engines_share_of_total_memory():
    device = FakeDevice(total=16 * GiB, used_by_others=1 * GiB)
    blocks = FakeEngine(device, weights=2 * GiB, activations=GiB // 2, graphs=GiB // 4).start(0.9)
    expected = (int(16 * GiB * 0.9) - 2 * GiB - GiB // 2 - GiB // 4) // BLOCK_BYTES
    assert blocks == expected
    # Activations and graphs still fit next to the cache: the first big prefill does not run out.
    device.alloc(GiB // 2 + GiB // 4)


def test_a_second_engine_after_the_first_is_dropped_gets_the_same_cache():
    device = FakeDevice(total=16 * GiB)
    first = FakeEngine(device, weights=2 * GiB, activations=GiB, graphs=GiB // 4)
    blocks = first.start(0.9)
    first.close()
    assert device.cached > 10 * GiB, "the fake must keep freed memory cached, as torch's allocator does"
    second = FakeEngine(device, weights=2 * GiB, activations=GiB, graphs=GiB // 4)
    assert second.start(0.9) == blocks


def test_a_second_engine_while_the_first_lives_gets_what_remains_or_a_clear_error():
    device = FakeDevice(total=16 * GiB)
    first = FakeEngine(device, weights=2 * GiB, activations=GiB // 2, graphs=0)
    first.start(0.625)  # 10 GiB for it: it holds 2 GiB of weights and 7.5 GiB of KV cache
    assert device.allocated == 2 * GiB + 15 * GiB // 2
    second = FakeEngine(device, weights=2 * GiB, activations=GiB // 2, graphs=0)
    blocks = second.start(0.5)  # its own share would leave 5.5 GiB for the cache, but less is free
    remaining = 16 * GiB - device.allocated + second.kv_bytes  # free after the second engine's weights
    assert blocks == (remaining - GiB // 2) // BLOCK_BYTES < (8 * GiB - 2 * GiB - GiB // 2) // BLOCK_BYTES
    third = FakeEngine(device, weights=GiB // 4, activations=GiB // 5, graphs=0)  # 0.5 GiB are free
    with pytest.raises(ValueError, match=r"not enough GPU memory.*free on the device.*max_model_len=1024"):
        third.start(0.9)


def test_memory_taken_outside_torch_is_charged_to_the_engine():
    """A workspace the first forward takes from the driver (not through torch's allocator) comes
    out of this engine's share, as vLLM's non_torch_increase does: the total stays within
    gpu_memory_utilization."""
    device = FakeDevice(total=16 * GiB, used_by_others=GiB)
    engine = FakeEngine(device, weights=2 * GiB, activations=GiB // 2, graphs=GiB // 4, non_torch=GiB)
    blocks = engine.start(0.5)
    assert blocks == (8 * GiB - 2 * GiB - GiB // 2 - GiB // 4 - GiB) // BLOCK_BYTES
    assert device.allocated + device.non_torch + GiB // 2 + GiB // 4 <= 8 * GiB


def test_the_warm_up_scratch_kv_cache_is_not_counted_as_activations(tiny_model):
    """The real runner, its KV-cache allocations made on the fake device: the scratch cache its
    warm-up writes to is freed before the real cache exists, so it costs the real cache nothing."""
    device = FakeDevice(total=GiB)

    class KVOnFakeDevice(ModelRunner):
        def _allocate_kv_cache(self, num_blocks: int) -> None:
            device.release(self.num_kvcache_blocks * self.kv_block_bytes)
            super()._allocate_kv_cache(num_blocks)
            device.alloc(num_blocks * self.kv_block_bytes)

    config = Config(tiny_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256,
                    max_num_seqs=64, max_num_batched_tokens=300, gpu_memory_utilization=0.5)
    cfg = config.hf_config
    block_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim_of(cfg) * 16 * 4
    device.total = 2 * 200 * block_bytes  # half of it: 200 blocks, under the cap of 64 x 16
    runner = KVOnFakeDevice(config, torch.device("cpu"), memory=device)
    assert runner.kv_block_bytes == block_bytes
    assert runner.num_kvcache_blocks == 200
    assert device.allocated == 200 * block_bytes


def test_too_small_a_budget_names_the_numbers():
    device = FakeDevice(total=4 * GiB)
    with pytest.raises(ValueError) as info:
        FakeEngine(device, weights=3 * GiB + GiB // 4, activations=GiB // 2, graphs=0).start(0.9, use_graphs=False)
    message = str(info.value)
    for part in ("gpu_memory_utilization 0.9", "weights 3.25 GiB", "peak activations 0.50 GiB",
                 f"needs {BLOCKS_PER_SEQ * BLOCK_BYTES / GiB:.3f} GiB", "Raise gpu_memory_utilization"):
        assert part in message


def test_the_runner_profiles_its_worst_step_before_sizing(tiny_model):
    """The real ModelRunner with a fake device: weights are loaded inside the profile, the warm-up
    runs (on the CPU), and the cache is sized from what the device reports."""
    device = FakeDevice(total=GiB)
    config = Config(tiny_model, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256,
                    max_num_seqs=4, max_num_batched_tokens=300, gpu_memory_utilization=0.5)
    runner = ModelRunner(config, torch.device("cpu"), memory=device)
    assert device.empty_cache_calls >= 2  # before loading and around the warm-up
    blocks_for_half = int(GiB * 0.5) // runner.kv_block_bytes
    assert runner.num_kvcache_blocks == min(blocks_for_half, 4 * (256 // 16))


def test_warm_up_batches_are_the_worst_case_shapes():
    batch = prefill_batch(8192, 4096, 256, num_blocks=4)
    assert batch.num_new_tokens == [4096, 4096] and all(s.block_table == [0, 1, 2, 3] for s in batch.seqs)
    batch = prefill_batch(1000, 64, 8, num_blocks=4)  # capped by max_num_seqs: 8 sequences of 64
    assert batch.num_new_tokens == [64] * 8
    batch = prefill_batch(100, 4096, 256, num_blocks=1)
    assert batch.num_new_tokens == [100] and batch.samples == [True]
    decode = decode_batch(5, num_blocks=1)
    assert decode.num_new_tokens == [1] * 5 and decode.num_decode_seqs == 5


def test_close_releases_the_model_and_cache(tiny_model):
    from helpers import make_llm

    from nanoserve import SamplingParams

    llm = make_llm(tiny_model, num_kvcache_blocks=32, max_model_len=128)
    runner = llm.engine.model_runner
    llm.close()
    assert runner.model is None and runner.kv_cache.numel() == 0
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()  # again, as `with LLM(...)` does after an explicit close()

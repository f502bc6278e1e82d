"""Helpers shared by several test modules (tests never import from each other, nor from
conftest.py, which holds only fixtures)."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

from nanoserve import LLM
from nanoserve.backends.cpu import CPUBackend
from nanoserve.sampling.sampler import Sampler

# ---- checkpoints, prompts and the HF oracle ---------------------------------------------------

# Two shapes unlike each other: tied embeddings with GQA 2, and untied with GQA 4 and a
# head_dim that is not a power of two.
TEST_DEVICE = os.environ.get("NANOSERVE_TEST_DEVICE", "cpu")  # see make_llm
# batch_invariant=True is refused off the CPU backend (nanoserve.backends.select_backend)
needs_batch_invariance = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="batch_invariant=True runs on the CPU only")

MODEL_CONFIGS = {
    "tied-gqa2": dict(seed=0),
    "untied-gqa4": dict(
        seed=1, hidden_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
        intermediate_size=160, num_hidden_layers=3, tie_word_embeddings=False,
    ),
}


def random_prompts(num: int, min_len: int, max_len: int, vocab: int = 900, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


class HFOracle:
    """HF transformers' own model classes (float32 unless asked), with results memoised across tests."""

    def __init__(self) -> None:
        self._models = {}
        self._cache = {}

    def model(self, path: str, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        if (path, dtype) not in self._models:
            self._models[path, dtype] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return self._models[path, dtype]

    @torch.inference_mode()
    def greedy_with_gaps(self, path: str, prompt: list[int], max_new_tokens: int, dtype: torch.dtype):
        """Greedy tokens in `dtype`, and at each step the gap between HF's top-2 logits."""
        out = self.model(path, dtype).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
        gaps = [float(top[0] - top[1]) for top in (s[0].float().topk(2).values for s in out.logits)]
        return out.sequences[0, len(prompt):].tolist(), gaps

    @torch.inference_mode()
    def greedy(self, path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (path, tuple(prompt), max_new_tokens)
        if key not in self._cache:
            model = self.model(path)
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
            )
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]

    @torch.inference_mode()
    def logprobs(self, path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
        """log_softmax over the vocabulary at each output position: [len(output), vocab]."""
        ids = torch.tensor([prompt + output])
        logits = self.model(path)(ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1)


# ---- engines -----------------------------------------------------------------------------------


def make_llm(path, **kw) -> LLM:
    """A small float32 engine: block size 8, 256 blocks, max_model_len 512 unless overridden
    (None for any of the last three gives the engine's own default). On the CPU unless
    NANOSERVE_TEST_DEVICE names another device: on a GPU machine, NANOSERVE_TEST_DEVICE=cuda runs
    the engine-level tests there (tests of CPU-only paths then fail, as they should)."""
    kw = {"device": TEST_DEVICE, "dtype": "float32", "kvcache_block_size": 8, "num_kvcache_blocks": 256,
          "max_model_len": 512, **kw}
    return LLM(path, **kw)


def assert_no_leak(llm: LLM) -> None:
    """Nothing left in the engine; every block is free or held only by the prefix cache."""
    bm = llm.engine.block_manager
    assert llm.engine.is_finished() and not llm.engine.requests
    assert all(block.ref_count == 0 for block in bm.pool.blocks)
    assert bm.num_free_blocks == bm.pool.num_blocks
    bm.check_integrity([])


def assert_matches_hf(hf, path, prompts, outputs, max_tokens) -> None:
    assert prompts, "nothing to compare"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf.greedy(path, prompt, max_tokens)


def rss_mb() -> float:
    """This process's resident memory (VmRSS) in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child_pids(pid: int | None = None) -> set[int]:
    """Live child processes of `pid` (default: this process), from /proc, except multiprocessing's
    resource tracker: the standard library starts one per process with the first spawned child
    and keeps it, shared by every later one, until the interpreter exits."""
    pid = os.getpid() if pid is None else pid
    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children.update(int(c) for c in f.read().split())
    return {c for c in children if not _is_resource_tracker(c)}


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except FileNotFoundError:  # exited meanwhile
        return False


# ---- fault injection ---------------------------------------------------------------------------


class FaultInjectingBackend(CPUBackend):
    """The default CPU backend, counting its attention calls (one per layer per step) and raising
    an armed exception at a chosen one. Passed to the engine as `attention_backend`, the seam the
    engine offers for new devices and test doubles; reach the instance as
    `llm.engine.model_runner.backend`."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self.calls = 0
        self._fail_at: int | None = None
        self._fault: BaseException | None = None

    def arm(self, fault: BaseException, after: int = 0) -> None:
        """Raise `fault` (once) at the attention call `after` calls from now (0 = the next one)."""
        self._fail_at, self._fault = self.calls + after + 1, fault

    def attention(self, q, k, v, k_cache, v_cache, meta, scale):
        self.calls += 1
        if self._fail_at is not None and self.calls == self._fail_at:
            self._fail_at = None
            raise self._fault
        return super().attention(q, k, v, k_cache, v_cache, meta, scale)


class FaultInjectingSampler(Sampler):
    """The engine's sampler, raising an armed exception at a chosen call (set it as
    `llm.engine.model_runner.sampler`)."""

    def __init__(self, fault: BaseException, after: int = 0) -> None:
        super().__init__()
        self.calls = 0
        self._fail_at: int | None = after + 1
        self._fault = fault

    def forward(self, logits, meta):
        self.calls += 1
        if self.calls == self._fail_at:
            self._fail_at = None
            raise self._fault
        return super().forward(logits, meta)


# ---- the prefix cache holds what it claims ----------------------------------------------------------


def cached_prefixes(llm: LLM) -> dict[int, list[int]]:
    """Every prefix-cache entry a lookup can reach: block id -> the token ids its K/V encodes
    (the whole chain from the sequence start to the end of that block)."""
    pool = llm.engine.block_manager.pool
    by_uid = {block.uid: block for block in pool.blocks if block.hash is not None}
    prefixes: dict[int, list[int]] = {}
    for block in by_uid.values():
        chain, current = [], block
        while current is not None:
            chain.append(current.token_ids)
            if current.parent_uid is None:
                break
            current = by_uid.get(current.parent_uid)  # None: the parent was evicted
        if current is None:
            continue  # no lookup can reach a block whose parent is gone
        prefixes[block.block_id] = [t for tokens in reversed(chain) for t in tokens]
    return prefixes


def stale_cache_entries(llm: LLM, reference: LLM, atol: float = 1e-4) -> list[int]:
    """The prefix-cache blocks of `llm` whose K/V differ from a recomputation of their tokens.

    `reference` (same checkpoint, dtype and block size, prefix caching on, otherwise idle)
    prefills each cached prefix; its own cache then holds the same hashes, and every layer's K/V
    of each block is compared. A block published before its K/V was written holds zeros or
    another sequence's values, and shows up here.
    """
    from nanoserve.sampling_params import SamplingParams

    prefixes = cached_prefixes(llm)
    if not prefixes:
        return []
    assert reference.engine.block_size == llm.engine.block_size
    chains = {tuple(p) for p in prefixes.values()}
    leaves = [c for c in chains if not any(len(o) > len(c) and o[: len(c)] == c for o in chains)]
    # One at a time: prompts sharing blocks within one step would not all be cached (duplicates).
    for leaf in leaves:
        reference.generate([list(leaf)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ref_pool = reference.engine.block_manager.pool
    stale = []
    for block_id in prefixes:
        ref_block = ref_pool.hash_index[llm.engine.block_manager.pool.blocks[block_id].hash]
        ours = llm.engine.model_runner.kv_cache[:, :, block_id].float()  # [2, layers, block_size, kv_heads, head_dim]
        theirs = reference.engine.model_runner.kv_cache[:, :, ref_block].float()
        if not torch.allclose(ours, theirs, atol=atol, rtol=1e-3):
            stale.append(block_id)
    return stale


# ---- paged attention batches -------------------------------------------------------------------


def make_paged_batch(
    seqs: list[tuple[int, int]],  # (q_len, context_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    q_noncontiguous: bool = False,
) -> dict:
    """Random q and a random-filled cache whose blocks are handed out in shuffled order.

    The whole cache is random (not zero), so reading a wrong block, a slot past context_len or a
    padded -1 table entry changes the result instead of silently adding zeros.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(ctx / block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)

    physical = torch.randperm(num_blocks, generator=g).tolist()  # non-contiguous, out of order
    max_blocks = max(blocks_per_seq) + 1  # one extra column so every row has -1 padding
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor(physical[used:used + n], dtype=torch.int32)
        used += n

    q_lens = [q_len for q_len, _ in seqs]
    num_tokens = sum(q_lens)
    if q_noncontiguous:  # q as a column slice of a fused projection output, like qkv.split()
        fused = torch.randn(num_tokens, 2 * num_heads, head_dim, generator=g).to(dtype)
        q = fused[:, :num_heads]  # q: [num_tokens, num_heads, head_dim], stride(0) = 2*H*D
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32),
        block_tables=block_tables,
        max_seqlen_q=max(q_lens),
        max_context_len=max(ctx for _, ctx in seqs),
        scale=head_dim ** -0.5,
    )


def naive_paged_attention(b: dict) -> torch.Tensor:
    """softmax(QK^T)V per sequence in float64, reading the cache slot by slot through the table."""
    q, k_cache, v_cache = b["q"], b["k_cache"], b["v_cache"]
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    cu = b["cu_seqlens_q"].tolist()
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, ctx in enumerate(b["context_lens"].tolist()):
        q_len = cu[s + 1] - cu[s]
        blocks = [b["block_tables"][s, pos // block_size].item() for pos in range(ctx)]
        offsets = [pos % block_size for pos in range(ctx)]
        k = k_cache[blocks, offsets].double()  # k: [ctx, num_kv_heads, head_dim]
        v = v_cache[blocks, offsets].double()
        k = k.repeat_interleave(group, dim=1)  # k: [ctx, num_heads, head_dim], head h -> kv h // group
        v = v.repeat_interleave(group, dim=1)
        qs = q[cu[s]:cu[s + 1]].double()  # qs: [q_len, num_heads, head_dim]
        scores = torch.einsum("ihd,jhd->hij", qs, k) * b["scale"]  # [num_heads, q_len, ctx]
        query_pos = torch.arange(q_len)[:, None] + (ctx - q_len)
        visible = torch.arange(ctx)[None, :] <= query_pos  # [q_len, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[s]:cu[s + 1]] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v)
    return out


def as_fp32_batch(b: dict) -> dict:
    """The same batch with q/caches upcast, to compute a reference for low-precision kernels."""
    return {**b, "q": b["q"].float(), "k_cache": b["k_cache"].float(), "v_cache": b["v_cache"].float()}


def varlen_args(b: dict) -> tuple:
    return (b["q"], b["k_cache"], b["v_cache"], b["cu_seqlens_q"], b["context_lens"], b["block_tables"],
            b["max_seqlen_q"], b["max_context_len"], b["scale"])


def decode_args(b: dict) -> tuple:
    return (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"],
            b["max_context_len"], b["scale"])



"""Helpers shared by several test modules (tests never import from each other)."""
from __future__ import annotations

import math

import torch

from nanoserve import LLM


# ---- engines -----------------------------------------------------------------------------------


def make_llm(path, **kw) -> LLM:
    """A small float32 CPU engine: block size 8, 256 blocks, max_model_len 512 unless overridden."""
    kw = {"device": "cpu", "dtype": "float32", "kvcache_block_size": 8, "num_kvcache_blocks": 256,
          "max_model_len": 512, **kw}
    return LLM(path, **kw)


def assert_no_leak(llm: LLM) -> None:
    """Every block is free or held only by the prefix cache; nothing is referenced."""
    bm = llm.engine.block_manager
    assert all(block.ref_count == 0 for block in bm.pool.blocks)
    assert bm.num_free_blocks == bm.pool.num_blocks
    bm.check_integrity([])


def assert_matches_hf(hf, path, prompts, outputs, max_tokens) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf.greedy(path, prompt, max_tokens)


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



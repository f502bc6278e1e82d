"""Causal attention over a paged KV cache in Triton: the CUDA backend when flash-attn is missing.

Same signatures and semantics as the PyTorch references in `paged_attention.py`: sequence s has
q_len new query tokens (their K/V already stored in the cache) and context_len cached tokens in
total; query i sits at position context_len - q_len + i and sees keys 0..that position. K/V are
read through the block table: key n of a sequence lives in physical block
block_tables[s, n // block_size] at offset n % block_size. Looking the block up per key is what
lets any block size work, 1, 16, 256 or 6 alike; the decode kernel and the old prefill path do
that. The prefill's default path (power-of-2 block sizes >= 16) tiles the keys by KV block: each
key tile lies inside one block, looked up once, its rows one stride apart; tiles every query row
of the program sees whole skip the causal mask; the registers the per-key pointer tiles held
buy larger key tiles. NANOSERVE_TRITON_PREFILL=key selects the per-key path (backends/triton.py).

Two kernels:
  * varlen (prefill, prefix-cached prefill, chunked prefill, mixed batches): one program per
    (tile of query tokens, kv head, sequence). The rows of a tile are (token, query head) pairs
    of one GQA group, so each K/V tile is loaded once for all query heads sharing it.
  * decode (q_len = 1): one program per (sequence, kv head, kv split) handling the whole GQA
    group; long contexts are split along the keys (split-K / flash-decoding) so that small
    batches still fill the GPU, and a second small kernel merges the splits by log-sum-exp.

Softmax is online (running max and sum) in float32, in the exp2 domain: scale * log2(e) is
folded into the scores once. Inputs may be fp32, fp16 or bf16; the output has q's dtype.
"""
from __future__ import annotations


import torch

try:  # triton is optional on CPU-only installs; the kernels below are only defined with it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

_LOG2E = 1.4426950408889634
# A decode split below this many keys costs more in the merge than it wins in parallelism.
_MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 64  # a power of 2: the merge kernel's fixed tile


if triton is not None:

    @triton.jit
    def _block_tile(k_cache_ptr, v_cache_ptr, bt_row, n_start, kv_end, block_size, kv_head, offs_t, offs_d, d_mask,
                    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                    AT_END: tl.constexpr):
        """K and V of keys n_start + offs_t, a tile inside one block: its table entry is loaded once.
        n_start < kv_end, so the block is real. AT_END: the tile may reach past kv_end, into slots
        that hold another request's stale values (inf in an fp16 model that overflowed) or none:
        those load as 0, since a masked score's p = 0 times an inf V would still be NaN."""
        block = tl.load(bt_row + n_start // block_size).to(tl.int64)
        slot = (n_start % block_size + offs_t).to(tl.int64)
        k_rows = block * stride_k_block + kv_head * stride_k_head + slot * stride_k_slot
        v_rows = block * stride_v_block + kv_head * stride_v_head + slot * stride_v_slot
        mask = d_mask[None, :]
        if AT_END:
            mask = mask & (n_start + offs_t < kv_end)[:, None]
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
        return k, v  # [BLOCK_N, BLOCK_D] each

    @triton.jit
    def _attend(q, k, v, m_i, l_i, acc, visible, scale_log2, MASKED: tl.constexpr,
                DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        """One online-softmax step over a key tile (k, v: [BLOCK_N, BLOCK_D]); without MASKED every
        score is visible and the mask is skipped."""
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N], 0 where masked
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    # Integer arguments that change from step to step must not be specialised on (Triton compiles a
    # variant per value class: == 1, divisible by 16, other): the block-table width changes every step.
    @triton.jit(do_not_specialize=["stride_bt_seq"])
    def _paged_attn_varlen_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr,
        scale_log2,  # softmax scale * log2(e)
        block_size,
        stride_q_tok, stride_q_head,
        stride_o_tok, stride_o_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_bt_seq,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of 2 (>= 16 for tl.dot)
        GROUP: tl.constexpr,  # query heads per kv head
        TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP
        BLOCK_M: tl.constexpr,  # rows per tile = (token, head-in-group) pairs
        BLOCK_N: tl.constexpr,  # keys per inner step
        DOT_PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr,  # upcast dot operands (CPU interpreter + bf16 only, see _dot_fp32)
        TILE_BY_BLOCK: tl.constexpr,  # BLOCK_N divides block_size: one block-table load per key tile
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.program_id(2)

        q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
        tok0 = tile * TOKENS_PER_TILE
        if tok0 >= q_len:  # the grid is sized for the longest sequence
            return
        context_len = tl.load(context_lens_ptr + seq).to(tl.int32)

        # Row m of the tile is query head (kv_head * GROUP + m % GROUP) of token tok0 + m // GROUP.
        offs_m = tl.arange(0, BLOCK_M)
        tok = tok0 + offs_m // GROUP  # [BLOCK_M] token index within the sequence
        head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
        row_valid = (offs_m < TOKENS_PER_TILE * GROUP) & (tok < q_len)
        q_pos = context_len - q_len + tok  # [BLOCK_M] absolute position of each row's query

        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q_rows = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
        q = tl.load(
            q_ptr + q_rows[:, None] + offs_d[None, :],
            mask=row_valid[:, None] & d_mask[None, :], other=0.0,
        )  # q: [BLOCK_M, BLOCK_D]
        if DOT_FP32:
            q = q.to(tl.float32)

        # Finite stand-in for -inf: with a true -inf, a row that has seen only masked scores would
        # compute exp2(-inf - -inf) = NaN. Real scores are never this small.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Causal: no row of this tile sees past the position of its last token.
        last_tok = tl.minimum(tok0 + TOKENS_PER_TILE, q_len) - 1
        kv_end = context_len - q_len + last_tok + 1
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
        if TILE_BY_BLOCK:
            offs_t = tl.arange(0, BLOCK_N)
            # Keys [0, full_end) are visible to every row (the first row's position bounds them).
            full_end = (context_len - q_len + tok0 + 1) // BLOCK_N * BLOCK_N
            for n_start in range(0, full_end, BLOCK_N):
                k, v = _block_tile(k_cache_ptr, v_cache_ptr, bt_row, n_start, kv_end, block_size, kv_head, offs_t,
                                   offs_d, d_mask, stride_k_block, stride_k_slot, stride_k_head,
                                   stride_v_block, stride_v_slot, stride_v_head, False)
                m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, None, scale_log2, False, DOT_PRECISION, DOT_FP32)
            for n_start in range(full_end, kv_end, BLOCK_N):  # the causal edge: masked
                k, v = _block_tile(k_cache_ptr, v_cache_ptr, bt_row, n_start, kv_end, block_size, kv_head, offs_t,
                                   offs_d, d_mask, stride_k_block, stride_k_slot, stride_k_head,
                                   stride_v_block, stride_v_slot, stride_v_head, True)
                offs_n = n_start + offs_t
                visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n < kv_end)[None, :]
                m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, visible, scale_log2, True, DOT_PRECISION, DOT_FP32)
        else:
            for n_start in range(0, kv_end, BLOCK_N):
                offs_n = n_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
                n_valid = offs_n < kv_end
                # Beyond kv_end the table may hold -1 padding: the mask keeps those entries unread.
                block = tl.load(bt_row + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
                slot = (offs_n % block_size).to(tl.int64)
                k_rows = block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
                v_rows = block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
                kv_mask = n_valid[:, None] & d_mask[None, :]
                k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
                m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, visible, scale_log2, True, DOT_PRECISION, DOT_FP32)

        # Padding rows saw no key (l_i == 0); keep them finite, they are not stored anyway.
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_i[:, None]
        o_rows = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )

    @triton.jit(do_not_specialize=["stride_bt_seq", "num_splits"])
    def _paged_attn_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        mid_out_ptr, mid_lse_ptr,  # [num_seqs, num_heads, num_splits(, BLOCK_D)] fp32 partials
        context_lens_ptr, block_tables_ptr,
        scale_log2,
        block_size,
        stride_q_seq, stride_q_head,
        stride_o_seq, stride_o_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_bt_seq,
        num_heads,
        num_splits,  # runtime: the split count changes with batch size and context length
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of 2 (>= 16 for tl.dot)
        BLOCK_N: tl.constexpr,
        SPLIT_KV: tl.constexpr,  # write per-split partials for the merge kernel (num_splits > 1)
        DOT_PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
        # Split the keys into num_splits chunks of whole BLOCK_N steps; trailing splits of a short
        # sequence may be empty and then report lse = -inf, which the merge weighs as zero.
        keys_per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
        kv_start = split * keys_per_split
        kv_end = tl.minimum(kv_start + keys_per_split, context_len)

        offs_g = tl.arange(0, BLOCK_G)
        head = kv_head * GROUP + offs_g  # [BLOCK_G] the query heads sharing this kv head
        g_valid = offs_g < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + seq.to(tl.int64) * stride_q_seq + head[:, None] * stride_q_head + offs_d[None, :],
            mask=g_valid[:, None] & d_mask[None, :], other=0.0,
        )  # q: [BLOCK_G, BLOCK_D]
        if DOT_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
        for n_start in range(kv_start, kv_end, BLOCK_N):
            offs_n = n_start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_end
            block = tl.load(bt_row + offs_n // block_size, mask=n_valid, other=0).to(tl.int64)
            slot = (offs_n % block_size).to(tl.int64)
            k_rows = block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
            v_rows = block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
            kv_mask = n_valid[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            # k, v: [BLOCK_N, BLOCK_D]
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)

            # The decode query is the last position: every key below context_len is visible.
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [BLOCK_G, BLOCK_D]
        if not SPLIT_KV:
            tl.store(
                out_ptr + seq.to(tl.int64) * stride_o_seq + head[:, None] * stride_o_head + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g_valid[:, None] & d_mask[None, :],
            )
        else:
            # Partials are normalised per split; lse (log2 domain) says how much each one weighs.
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            mid_row = (seq * num_heads + head).to(tl.int64) * num_splits + split  # [BLOCK_G]
            tl.store(mid_lse_ptr + mid_row, lse, mask=g_valid)
            tl.store(
                mid_out_ptr + mid_row[:, None] * BLOCK_D + offs_d[None, :],
                out, mask=g_valid[:, None] & d_mask[None, :],
            )

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_kv_splits_kernel(
        mid_out_ptr, mid_lse_ptr, out_ptr,
        stride_o_seq, stride_o_head,
        num_heads,
        num_splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,  # the most splits there can be, a power of 2: one compiled variant
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        s_valid = offs_s < num_splits
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        mid_row = (seq * num_heads + head).to(tl.int64) * num_splits + offs_s  # [BLOCK_S]
        lse = tl.load(mid_lse_ptr + mid_row, mask=s_valid, other=float("-inf"))
        part = tl.load(
            mid_out_ptr + mid_row[:, None] * BLOCK_D + offs_d[None, :],
            mask=s_valid[:, None] & d_mask[None, :], other=0.0,
        )  # part: [BLOCK_S, BLOCK_D]
        # Split 0 always holds key 0 (context_len >= 1), so the max is finite.
        w = tl.exp2(lse - tl.max(lse, axis=0))  # [BLOCK_S], 0 for empty splits
        out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + offs_d,
            out.to(out_ptr.dtype.element_ty), mask=d_mask,
        )


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate shapes/dtypes shared by both entry points; return (block_size, num_kv_heads, group)."""
    if triton is None:
        raise RuntimeError("the triton paged-attention kernels need triton; install it or use the torch backend")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"expected q [tokens, heads, head_dim] and k/v caches [blocks, block_size, kv_heads, head_dim] "
            f"of equal shape, got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}; expected float32, float16 or bfloat16")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and the KV cache ({k_cache.dtype}/{v_cache.dtype}) must share a dtype")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    # Rows are addressed as base + d, so the innermost dimension must be dense.
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache must have a contiguous last (head_dim) dimension")
    return block_size, num_kv_heads, num_heads // num_kv_heads


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_fp32(q: torch.Tensor) -> bool:
    # Triton's CPU interpreter (TRITON_INTERPRET=1, the only way these kernels run on CPU
    # tensors) stores bf16 as uint16 and its tl.dot multiplies those raw bit patterns (seen with
    # triton 3.9), so bf16 dots are upcast to fp32 there. Compiled GPU kernels dot bf16 natively.
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _dot_precision(q: torch.Tensor) -> str | None:
    # fp32 inputs would otherwise run tl.dot in TF32 on Ampere+ (~1e-3 relative error); keep them
    # exact so the fp32 path matches the reference. fp16/bf16 dots keep the backend default.
    return "ieee" if q.dtype == torch.float32 or _dot_fp32(q) else None


def paged_attention_varlen_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks], -1 padded
    max_seqlen_q: int,
    max_context_len: int,
    scale: float,
    tile_by_block: bool = True,  # False: the per-key path (always where block_size is not a power of 2 >= 16)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    block_size, num_kv_heads, group = _check_inputs(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert block_tables.stride(-1) == 1, "block_tables rows must be contiguous"

    block_d = _block_d(head_dim)
    # A tile holds whole GQA groups. Tile sizes and 8 warps were picked by compiling for sm_90
    # (bf16, ptxas -v) and keeping register use spill-free up to head_dim 128: the gathered K/V
    # tiles carry one 64-bit pointer per element, which is what limits BLOCK_N. Tiled by block,
    # a tile's rows are one stride apart and those pointers are gone: 64 keys up to head_dim 128,
    # 32 at 256 (chosen by that register count, not yet measured on a GPU; the smoke test runs both).
    block_m = max(64, triton.next_power_of_2(group))
    by_block = tile_by_block and block_size >= 16 and block_size & (block_size - 1) == 0
    if by_block:
        block_n = min(block_size, 64 if block_d <= 128 else 32)
    else:
        block_n = 64 if block_d <= 64 else (32 if block_d <= 128 else 16)
    tokens_per_tile = block_m // group
    grid = (triton.cdiv(max_seqlen_q, tokens_per_tile), num_kv_heads, num_seqs)
    _paged_attn_varlen_kernel[grid](
        q, k_cache, v_cache, out,
        cu_seqlens_q, context_lens, block_tables,
        scale * _LOG2E,
        block_size,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, TOKENS_PER_TILE=tokens_per_tile,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q), DOT_FP32=_dot_fp32(q),
        TILE_BY_BLOCK=by_block, num_warps=8,
    )
    return out


def decode_constexprs(q: torch.Tensor, k_cache: torch.Tensor, num_kv_splits: int) -> dict:
    """The decode kernel's compile-time arguments: fixed by the model and dtype, plus whether the
    keys are split. Everything that changes with the batch or context is a runtime argument, so a
    run compiles at most two decode variants (and one merge variant)."""
    head_dim, group = q.shape[2], q.shape[1] // k_cache.shape[2]
    block_d = _block_d(head_dim)
    return dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if block_d <= 128 else 32,  # spill-free with 8 warps on sm_90 (see the varlen note)
        SPLIT_KV=num_kv_splits > 1, DOT_PRECISION=_dot_precision(q), DOT_FP32=_dot_fp32(q),
    )


def default_num_kv_splits(num_sms: int, num_seqs: int, num_kv_heads: int, max_context_len: int) -> int:
    """Enough (sequence, kv head, split) programs for ~2 waves on the GPU, splits >= 256 keys."""
    by_occupancy = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    by_length = triton.cdiv(max_context_len, _MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_KV_SPLITS))


def paged_attention_decode_triton(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks], -1 padded
    context_lens: torch.Tensor,  # [num_seqs]
    max_context_len: int,
    scale: float,
    *,
    num_kv_splits: int | None = None,  # None = heuristic; tests force > 1 to exercise the merge
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    block_size, num_kv_heads, group = _check_inputs(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    assert block_tables.stride(-1) == 1, "block_tables rows must be contiguous"

    if num_kv_splits is None:
        # The interpreter runs programs one by one: parallelism buys nothing there.
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_kv_splits = default_num_kv_splits(num_sms, num_seqs, num_kv_heads, max_context_len)
    if not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")
    block_d = _block_d(head_dim)
    if num_kv_splits > 1:
        # fp32 partials: normalised output and log2-sum-exp of each (sequence, head, split).
        mid_out = torch.empty(num_seqs, num_heads, num_kv_splits, block_d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(num_seqs, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel; any tensor will do as a pointer argument
        mid_out = mid_lse = out

    _paged_attn_decode_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, out,
        mid_out, mid_lse,
        context_lens, block_tables,
        scale * _LOG2E,
        block_size,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        num_kv_splits,
        **decode_constexprs(q, k_cache, num_kv_splits),
        num_warps=8,
    )
    if num_kv_splits > 1:
        _merge_kv_splits_kernel[(num_seqs, num_heads)](
            mid_out, mid_lse, out,
            out.stride(0), out.stride(1),
            num_heads,
            num_kv_splits,
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_S=MAX_KV_SPLITS,
        )
    return out

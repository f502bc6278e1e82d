"""Mixture-of-experts MLPs in Triton (CUDA): the kernel behind TritonBackend.prepare_moe.

Same signature and semantics as `fused_moe_torch` (fused_moe.py), its reference. The (token, k)
entries are grouped by expert into a padded order where every BLOCK_M rows belong to one expert
(`align_by_expert`, plain torch ops with no host sync, so decode can be captured in CUDA graphs);
then one grouped GEMM kernel runs each block of rows against its expert's weights: up (gate and
up projections), SiLU-and-mul, down (scaled by the routing weight), and a sum over each token's k.
The tile is picked by tokens per expert (`moe_tile`): decode rows are few per expert, a long
prefill's are many. NANOSERVE_TRITON_MOE_TILES=fixed keeps the one 16 x 64 x 64 tile for every shape.
"""
from __future__ import annotations

import torch

from nanoserve.kernels.fused_moe import silu_and_mul

try:  # triton is optional on CPU-only installs; the kernel below is only defined with it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

BLOCK_M = 16  # rows of one expert per program (tl.dot's minimum): the fixed tile's
# (most tokens per expert, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)), first match. vLLM ships tuned
# tables per GPU and shape; this follows the shape of its default heuristic (small M while experts
# see few rows, 64-row tiles past that), to be tuned on a GPU (the smoke test runs both paths).
MOE_TILES = ((16, (16, 64, 64, 4)), (128, (32, 64, 64, 4)), (float("inf"), (64, 128, 64, 8)))
FIXED_TILE = (BLOCK_M, 64, 64, 4)


def moe_tile(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for this many (token, k) rows per expert on average."""
    per_expert = num_tokens * top_k / num_experts
    return next(tile for limit, tile in MOE_TILES if per_expert <= limit)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries (token * top_k + k) ordered by expert, each expert's run padded to a multiple of
    block_m with the sentinel num_entries; and the expert of every block_m rows (num_experts past
    the used blocks). Sizes are upper bounds known on the host: no device -> host sync."""
    flat = topk_ids.flatten()  # [num_entries]
    num_entries = flat.numel()
    # [E] entries per expert; not bincount, which sizes its output from the ids' max (a host sync on CUDA)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E] end of each expert's padded run
    order = flat.argsort(stable=True)  # entries sorted by expert
    expert_of = flat[order]
    rank = torch.arange(num_entries, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    capacity = -(-(num_entries + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_entries = torch.full((capacity,), num_entries, dtype=torch.int64, device=flat.device)
    sorted_entries[(padded_end - padded)[expert_of] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)  # == num_experts past the end
    return sorted_entries, block_expert


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, b_ptr, c_ptr, scale_ptr, sorted_entries_ptr, block_expert_ptr,
        num_entries, num_experts, N, K,
        stride_am, stride_be, stride_bn, stride_cm,
        A_ROW_DIV: tl.constexpr,  # row of a for entry i: i // A_ROW_DIV (top_k for the token's x, 1 after)
        SCALE_ROWS: tl.constexpr,  # multiply each output row by scale[entry] (the routing weight)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= num_experts:  # a block past every expert's rows
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        entry = tl.load(sorted_entries_ptr + offs_m)  # [BLOCK_M]
        valid = entry < num_entries
        a_rows = (entry // A_ROW_DIV).to(tl.int64) * stride_am
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < N
        b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_valid = offs_k < K
            a = tl.load(a_ptr + a_rows[:, None] + offs_k[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(b_base + offs_k[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0.0)  # [K, N]
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b, input_precision="ieee" if DOT_FP32 else None)
        if SCALE_ROWS:
            acc *= tl.load(scale_ptr + entry, mask=valid, other=0.0).to(tl.float32)[:, None]
        c_rows = entry.to(tl.int64) * stride_cm
        tl.store(c_ptr + c_rows[:, None] + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_valid[None, :])


def _grouped_gemm(a, b, out, scale, sorted_entries, block_expert, a_row_div: int, scale_rows: bool, tile) -> None:
    """out[entry] = a[entry // a_row_div] @ b[expert of entry].T (* scale[entry])."""
    num_experts, n, k = b.shape
    block_m, block_n, block_k, num_warps = tile
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, scale, sorted_entries, block_expert,
        out.shape[0], num_experts, n, k,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, SCALE_ROWS=scale_rows, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # Triton's CPU interpreter multiplies bf16 as raw bits (see triton_paged_attention._dot_fp32).
        DOT_FP32=a.device.type == "cpu", num_warps=num_warps,
    )


def fused_moe_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    tile_table: bool = True,  # False: FIXED_TILE for every shape
) -> torch.Tensor:  # [num_tokens, hidden]
    if triton is None:
        raise RuntimeError("fused_moe_triton needs triton; install it or use the torch backend")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe_triton needs contiguous x, w13 and w2")
    num_tokens, top_k = topk_ids.shape
    tile = moe_tile(num_tokens, top_k, w13.shape[0]) if tile_table else FIXED_TILE
    sorted_entries, block_expert = align_by_expert(topk_ids, w13.shape[0], tile[0])
    weights = topk_weights.flatten().contiguous()
    up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, up, weights, sorted_entries, block_expert, top_k, False, tile)
    act = silu_and_mul(up).contiguous()  # [num_entries, intermediate]
    down = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, weights, sorted_entries, block_expert, 1, True, tile)
    return down.view(num_tokens, top_k, -1).sum(dim=1)

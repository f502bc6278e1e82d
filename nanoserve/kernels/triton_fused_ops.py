"""The small per-token ops around attention and the MLP, fused in Triton (CUDA): each one kernel
launch instead of a chain of memory-bound torch ops with float32 casts and `cat`.

Same signatures and results as the torch references in backends/base.py (`Backend.rms_norm`,
`Backend.qk_norm_rope`, `Backend.silu_and_mul`), rounding to the model's dtype where they round:
math in float32, the residual sum, the normalised row and each product rounded as torch rounds
them. Rows may be strided (q and k are slices of the qkv projection); the last dim is contiguous.
"""
from __future__ import annotations

import torch

try:  # triton is optional on CPU-only installs; the kernels below are only defined with it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, new_res_ptr, w_ptr, out_ptr, stride_x, stride_res, N, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # the sum, rounded to the dtype, is both the new residual and what is normalised
            x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(out_ptr.dtype.element_ty)
            tl.store(new_res_ptr + row * N + offs, x, mask=mask)
        xf = x.to(tl.float32)
        y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * N + offs, out, mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr,
                             stride_q, stride_k, num_q_heads, eps, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # q heads first, then k heads
        half = HEAD_DIM // 2
        offs = tl.arange(0, BLOCK)  # over one half of the head
        mask = offs < half
        if head < num_q_heads:
            src = q_ptr + token * stride_q + head * HEAD_DIM
            dst = q_out_ptr + (token * num_q_heads + head) * HEAD_DIM
            w_ptr = qw_ptr
        else:
            num_k_heads = tl.num_programs(1) - num_q_heads
            src = k_ptr + token * stride_k + (head - num_q_heads) * HEAD_DIM
            dst = k_out_ptr + (token * num_k_heads + head - num_q_heads) * HEAD_DIM
            w_ptr = kw_ptr
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        dtype = q_out_ptr.dtype.element_ty
        # RMSNorm as the reference rounds it: normalised row to the dtype, times the weight, rounded.
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + offs, mask=mask, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + half + offs, mask=mask, other=0.0)
        tl.store(dst + offs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(dst + half + offs, (x2 * cos + x1 * sin).to(dtype), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds to the dtype
        tl.store(out_ptr + row * N + offs, (act * up).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with a contiguous last dimension (a view where the strides allow)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Backend.rms_norm in one kernel: with `residual`, (norm(x + residual), x + residual)."""
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = _rows(residual) if residual is not None else rows
    new_res = torch.empty_like(out) if residual is not None else out
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res, new_res, weight, out, rows.stride(0), res.stride(0), n, eps,
                                           HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_res.view(x.shape)


def qk_norm_rope_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, num_heads, head_dim], [num_tokens, num_kv_heads, head_dim]
    """Backend.qk_norm_rope in one kernel: a program per (token, head) of q and k."""
    head_dim = q_weight.shape[0]
    q, k = _rows(q), _rows(k)
    tokens, hq, hk = q.shape[0], q.shape[1] // head_dim, k.shape[1] // head_dim
    q_out = torch.empty(tokens, hq, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, hk, head_dim, dtype=k.dtype, device=k.device)
    if tokens:
        _qk_norm_rope_kernel[(tokens, hq + hk)](
            q, k, q_out, k_out, q_weight, k_weight, positions, cos_sin, q.stride(0), k.stride(0), hq, eps,
            HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim // 2),
        )
    return q_out, k_out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Backend.silu_and_mul in one kernel: x [num_tokens, 2 * n] -> silu(gate) * up [num_tokens, n]."""
    rows = _rows(x)
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)

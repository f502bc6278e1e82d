"""Mixture-of-experts MLPs: every token through its top-k experts, weighted by the router.

`grouped_experts` is the PyTorch path (and reference): tokens are sorted by expert once, then each
expert that got tokens runs its GEMMs over all of them at once (a grouped GEMM: one Python
iteration per expert, none per token). Experts are accumulated in ascending order, as HF
transformers does, so float32 results match it up to GEMM summation order.

Weights: w13 [num_experts, 2 * intermediate, hidden] (gate rows, then up rows), w2 [num_experts,
hidden, intermediate]; topk_ids / topk_weights [num_tokens, top_k].
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

Gemm = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    topk_weights: torch.Tensor,  # [num_tokens, top_k], in x's dtype
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64
    up: Sequence[Gemm],  # per expert: x -> [rows, 2 * intermediate]
    down: Sequence[Gemm],  # per expert: [rows, intermediate] -> [rows, hidden]
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:  # [num_tokens, hidden]
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()  # [num_tokens * top_k]: entry i is token i // top_k
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(up)).tolist()
    weights = topk_weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        entries = order[start : start + n]
        start += n
        tokens = entries // top_k
        h = down[expert](act(up[expert](x[tokens])))  # [n, hidden]
        out.index_add_(0, tokens, (h * weights[entries, None]).to(out.dtype))
    return out


def fused_moe_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The reference, with the signature of the Triton kernel."""
    up = [partial(F.linear, weight=w) for w in w13]
    down = [partial(F.linear, weight=w) for w in w2]
    return grouped_experts(x, topk_weights, topk_ids, up, down)

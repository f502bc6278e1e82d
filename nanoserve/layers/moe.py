"""A mixture-of-experts MLP layer: the experts' weights packed per layer, computed by the backend.

Tensor parallelism shards each expert's intermediate dimension (gate/up rows and down columns),
so every rank runs every expert on its slice and the outputs are all-reduced, as for a dense MLP.
Checkpoints name experts one by one (`experts.{e}.gate_proj.weight`, ...); transformers 5 may also
write them stacked (`experts.gate_up_proj`, `experts.down_proj`). Both load.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.context import ModelContext
from nanoserve.layers.linear import expect_shards, shard_of, weights_not_loaded


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (in float32) over the experts, top_k of them, optionally renormalised to sum to 1.

    Returns (topk_weights in the logits' dtype, topk_ids), as HF's Qwen3-MoE router does; ties
    between experts go the way torch.topk breaks them there too.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class FusedMoE(nn.Module):
    dequantized = False  # as LinearBase's: experts loaded dequantized from a quantized checkpoint

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
        ctx: ModelContext,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.backend, self.tp = ctx.backend, ctx.tp
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate = ctx.tp.shard(intermediate_size, "moe_intermediate_size")  # per rank
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        expect_shards(self.w13, [(e, part) for e in range(num_experts) for part in ("gate", "up")])
        expect_shards(self.w2, [(e, "down") for e in range(num_experts)])
        self.experts = weights_not_loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, str]) -> None:
        """shard_id = (expert, "gate" | "up" | "down"), expert None for a stacked [num_experts, ...] tensor."""
        expert, part = shard_id
        experts = range(self.num_experts) if expert is None else [expert]
        n, rank = self.intermediate, self.tp.rank
        full, hidden = n * self.tp.size, param.shape[-2 if part == "down" else -1]
        stacked = (self.num_experts,) if expert is None else ()
        if expert is None:  # stacked: gate_up is [E, 2 * I, hidden] (gate rows first), down [E, hidden, I]
            if part == "gate_up":
                loaded = shard_of(loaded, (*stacked, 2 * full, hidden), 1, 0, 2 * full)
                self.weight_loader(param, loaded[:, :full], (None, "gate"))
                self.weight_loader(param, loaded[:, full:], (None, "up"))
                return
            dest = param.data
        else:
            dest = param.data[expert]
        if part == "down":  # [hidden, intermediate]: this rank's columns
            dest.copy_(shard_of(loaded, (*stacked, hidden, full), -1, rank, n))
        else:  # [intermediate, hidden]: this rank's rows, into the gate or the up half
            rows = shard_of(loaded, (*stacked, full, hidden), -2, rank, n)
            dest.narrow(-2, 0 if part == "gate" else n, n).copy_(rows)
        param.loaded_shards.update((e, part) for e in experts)

    def process_weights_after_loading(self) -> None:
        extra = {"quantize": False} if self.dequantized else {}  # as LinearBase: older subclasses
        self.experts = self.backend.prepare_moe(self.w13, self.w2, **extra)
        if self.backend.packs_weights:
            self.w13 = self.w2 = None  # the expert GEMMs hold their own copies

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route(router_logits, self.top_k, self.renormalize)  # [num_tokens, top_k] each
        return self.tp.all_reduce(self.experts(x, topk_weights, topk_ids))

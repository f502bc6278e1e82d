"""Qwen3-MoE (Qwen3MoeForCausalLM checkpoints, e.g. Qwen3-30B-A3B): Qwen3 with sparse MoE MLPs.

Layer i has a MoE block when it is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0,
else a dense MLP of `intermediate_size`. A MoE block routes each token to `num_experts_per_tok`
of `num_experts` SiLU MLPs of `moe_intermediate_size` (softmax router, `norm_topk_prob` renormalises
the top-k weights).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from nanoserve.layers.context import ModelContext
from nanoserve.layers.linear import ReplicatedLinear
from nanoserve.layers.moe import FusedMoE
from nanoserve.models.qwen3 import Qwen3ForCausalLM

# Per-expert and stacked (transformers 5) expert tensor names -> (expert, part).
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up|down)_proj$")


def num_experts_of(cfg: dict) -> int:
    """Checkpoints of the transformers 4.x era write `num_experts`, transformers 5 `num_local_experts`."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_sparse_layer(cfg: dict, layer_index: int) -> bool:
    """Does layer `layer_index` route to experts (else it has a dense MLP of intermediate_size)?"""
    return (
        layer_index not in (cfg.get("mlp_only_layers") or [])
        and num_experts_of(cfg) > 0
        and (layer_index + 1) % (cfg.get("decoder_sparse_step") or 1) == 0
    )


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: dict, ctx: ModelContext) -> None:
        super().__init__()
        hidden, num_experts = cfg["hidden_size"], num_experts_of(cfg)
        self.gate = ReplicatedLinear(hidden, num_experts, False, ctx)  # the router
        self.experts = FusedMoE(
            num_experts, cfg["num_experts_per_tok"], hidden, cfg["moe_intermediate_size"],
            bool(cfg.get("norm_topk_prob", False)), ctx,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # router logits: [num_tokens, num_experts]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    required_fields = Qwen3ForCausalLM.required_fields + ("num_experts_per_tok", "moe_intermediate_size")
    sharded_fields = Qwen3ForCausalLM.sharded_fields + ("moe_intermediate_size",)  # each expert's MLP is sharded

    @classmethod
    def check_config(cls, cfg: dict, source: str, tensor_parallel_size: int = 1) -> None:
        super().check_config(cfg, source, tensor_parallel_size)
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if not isinstance(experts, int) or isinstance(experts, bool) or not 1 <= cfg["num_experts_per_tok"] <= experts:
            raise ValueError(
                f"{source}: num_experts_per_tok={cfg['num_experts_per_tok']} must be in [1, num_experts], "
                f"and num_experts (or num_local_experts) a positive int, got {experts!r}"
            )

    def make_mlp(self, cfg: dict, layer_index: int, ctx: ModelContext) -> nn.Module:
        if is_sparse_layer(cfg, layer_index):
            return Qwen3MoeSparseBlock(cfg, ctx)
        return super().make_mlp(cfg, layer_index, ctx)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object]:
        if m := _EXPERT.search(name):
            param = "w2" if m[2] == "down" else "w13"
            return name[: m.start()] + f".mlp.experts.{param}", (int(m[1]), m[2])
        if m := _STACKED.search(name):
            param = "w13" if m[1] == "gate_up" else "w2"
            return name[: m.start()] + f".mlp.experts.{param}", (None, m[1])
        return super().checkpoint_name_to_param(name)

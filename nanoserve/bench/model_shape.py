"""What one engine step of a model costs: FLOPs and the bytes it must read, from config.json.

The cost model counts the linear layers (attention projections, MLP or routed experts, LM head)
and attention's QK^T and PV; norms, RoPE and activations are small beside them. A step reads
every weight it multiplies (each once, whatever the number of tokens) and the K/V of every
context token of every scheduled sequence.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from nanoserve.models import head_dim_of
from nanoserve.models.qwen3_moe import is_sparse_layer, num_experts_of


class StepCost(NamedTuple):
    flops: float
    bytes: float


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int  # dense MLP intermediate size
    vocab: int
    num_dense_mlp_layers: int
    num_experts: int = 0
    experts_per_token: int = 0
    moe_inter: int = 0

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        experts = num_experts_of(cfg)
        moe_layers = sum(is_sparse_layer(cfg, i) for i in range(layers))
        return cls(
            hidden=cfg["hidden_size"], layers=layers, heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim_of(cfg),
            inter=cfg.get("intermediate_size") or 0, vocab=cfg["vocab_size"],
            num_dense_mlp_layers=layers - moe_layers, num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok") or 0,
            moe_inter=cfg.get("moe_intermediate_size") or 0,
        )

    @property
    def num_moe_layers(self) -> int:
        return self.layers - self.num_dense_mlp_layers

    # ---- weights (in elements) -----------------------------------------------------------

    def attention_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's attention projections: qkv, o."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.hidden, q + 2 * kv), (q, self.hidden)]

    def mlp_shapes(self, inter: int) -> list[tuple[int, int]]:
        """(in, out) of one MLP (or one expert): gate_up, down."""
        return [(self.hidden, 2 * inter), (inter, self.hidden)]

    def linear_shapes(self) -> list[tuple[int, int]]:
        """One layer's projections as GEMM shapes (dense MLP, or one expert of an MoE layer)."""
        return self.attention_shapes() + self.mlp_shapes(self.inter or self.moe_inter)

    def _params(self, shapes: list[tuple[int, int]]) -> int:
        return sum(i * o for i, o in shapes)

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Distinct experts a layer reads for num_tokens tokens, if routing were uniform."""
        if not self.num_experts or num_tokens == 0:
            return 0.0
        miss = (1 - self.experts_per_token / self.num_experts) ** num_tokens
        return self.num_experts * (1 - miss)

    def weight_params_read(self, num_tokens: int, samples: bool) -> float:
        """Weight elements a step with num_tokens tokens must read (LM head only if it samples)."""
        attn = self.layers * self._params(self.attention_shapes())
        dense = self.num_dense_mlp_layers * self._params(self.mlp_shapes(self.inter))
        expert = self._params(self.mlp_shapes(self.moe_inter))
        moe = self.num_moe_layers * (self.hidden * self.num_experts
                                     + self.expected_experts_touched(num_tokens) * expert)
        return attn + dense + moe + (self.lm_head_params if samples else 0)

    # ---- FLOPs -----------------------------------------------------------------------------

    @property
    def linear_flops_per_token(self) -> int:
        attn = self.layers * self._params(self.attention_shapes())
        dense = self.num_dense_mlp_layers * self._params(self.mlp_shapes(self.inter))
        moe = self.num_moe_layers * (self.hidden * self.num_experts
                                     + self.experts_per_token * self._params(self.mlp_shapes(self.moe_inter)))
        return 2 * (attn + dense + moe)

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.lm_head_params

    def attention_flops(self, num_keys: int) -> int:
        """QK^T and PV over num_keys (query, key) pairs, all layers."""
        return 4 * self.layers * self.heads * self.head_dim * num_keys

    @property
    def kv_elements_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim

    # ---- a step ----------------------------------------------------------------------------

    def step_cost(self, entries: Iterable, itemsize: int) -> StepCost:
        """entries: per scheduled sequence (num_computed_tokens, num_new_tokens, sampled), e.g.
        nanoserve's StepStats.entries. itemsize: bytes per weight / KV element."""
        flops, kv_elems, tokens, samples = 0.0, 0.0, 0, False
        for entry in entries:
            start, n, sampled = entry[-3], entry[-2], entry[-1]
            keys = n * start + n * (n + 1) // 2  # query i (0-based) sees start + i + 1 keys
            flops += n * self.linear_flops_per_token + self.attention_flops(keys) + sampled * self.lm_head_flops
            kv_elems += (start + 2 * n) * self.kv_elements_per_token  # read the context, write the new
            tokens += n
            samples = samples or bool(sampled)
        if tokens == 0:
            return StepCost(0.0, 0.0)
        return StepCost(flops, itemsize * (self.weight_params_read(tokens, samples) + kv_elems))

    def request_cost(self, prompt_len: int, max_tokens: int, itemsize: int) -> StepCost:
        """A whole request computed at once (how a peer's run is costed: FLOPs only are exact)."""
        flops = self.step_cost([(0, prompt_len + max_tokens - 1, False)], itemsize).flops
        return StepCost(flops + max_tokens * self.lm_head_flops, 0.0)

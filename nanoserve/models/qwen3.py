"""Qwen3 (Qwen3ForCausalLM checkpoints) built from nanoserve layers."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import Attention
from nanoserve.layers.context import ModelContext
from nanoserve.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict, rope: RotaryEmbedding, ctx: ModelContext) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or hidden // num_heads
        bias = cfg.get("attention_bias", False)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias, ctx)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias, ctx)
        self.q_norm = RMSNorm(head_dim, eps, ctx)
        self.k_norm = RMSNorm(head_dim, eps, ctx)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5, ctx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [num_tokens, num_kv_heads, head_dim]
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)  # per-head norm, then RoPE
        out = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict, ctx: ModelContext) -> None:
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Qwen3 uses 'silu')")
        inter = cfg["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(cfg["hidden_size"], [inter, inter], False, ctx)
        self.down_proj = RowParallelLinear(inter, cfg["hidden_size"], False, ctx)
        self.act_fn = SiluAndMul(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, rope: RotaryEmbedding, ctx: ModelContext) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Qwen3Attention(cfg, rope, ctx)
        self.mlp = Qwen3MLP(cfg, ctx)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, ctx)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, ctx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: dict, ctx: ModelContext) -> None:
        super().__init__()
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta, scaling = rope_parameters(cfg)
        rope = RotaryEmbedding(head_dim, cfg.get("max_position_embeddings", 4096), theta, scaling, ctx)
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], ctx)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rope, ctx) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Qwen3ForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our parameter name fragment, shard id of a packed weight)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict, ctx: ModelContext) -> None:
        super().__init__()
        self.model = Qwen3Model(cfg, ctx)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], ctx)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

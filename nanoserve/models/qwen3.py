"""Qwen3 (Qwen3ForCausalLM checkpoints) built from nanoserve layers."""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.kernels import cpu_kernels
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.layers.rotary_embedding import RotaryEmbedding


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or hidden // num_heads
        bias = cfg.get("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, cfg.get("rms_norm_eps", 1e-6))
        self.k_norm = RMSNorm(head_dim, cfg.get("rms_norm_eps", 1e-6))
        # transformers 5 nests RoPE settings under rope_parameters; older configs keep them at the top.
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        self.rotary_emb = RotaryEmbedding(head_dim, cfg.get("max_position_embeddings", 4096), rope_theta, rope_scaling)
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, scale=head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        fused = None
        if x.device.type == "cpu" and self.q_norm.eps == self.k_norm.eps:  # bf16 on CPU: one C kernel
            fused = cpu_kernels.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                             positions, self.rotary_emb.cos_sin, self.head_dim)
        if fused is not None:
            q, k = fused
        else:
            q = self.q_norm(q.unflatten(-1, (self.num_heads, self.head_dim)))  # [num_tokens, num_heads, head_dim]
            k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))  # [num_tokens, num_kv_heads, head_dim]
            q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Qwen3 uses 'silu')")
        inter = cfg["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(cfg["hidden_size"], [inter, inter])
        self.down_proj = RowParallelLinear(inter, cfg["hidden_size"])
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

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
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

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

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.model = Qwen3Model(cfg)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

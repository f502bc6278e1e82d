"""Llama (LlamaForCausalLM checkpoints: Llama 2, 3, 3.1, 3.2), and the decoder Qwen2/Qwen3/Mistral share.

A pre-norm decoder: RMSNorm -> attention (RoPE, GQA) -> RMSNorm -> SiLU MLP, residuals fused into
the norms. The variants differ only in small switches, set as class attributes by their model
files: biases on the projections, a per-head q/k RMSNorm (Qwen3), the MLP of a layer (Qwen3-MoE).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import Attention
from nanoserve.layers.context import ModelContext
from nanoserve.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.layernorm import RMSNorm
from nanoserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.layers.rotary_embedding import RotaryEmbedding, check_rope_scaling, rope_parameters
from nanoserve.models import head_dim_of


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: dict, rope: RotaryEmbedding, ctx: ModelContext, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, qkv_bias, ctx)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, o_bias, ctx)
        if qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps, ctx), RMSNorm(head_dim, eps, ctx)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rope
        self.backend = ctx.backend
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5, ctx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, out_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out_rows: the rows to return (every row's K/V is still stored), None for all."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [num_tokens, num_kv_heads, head_dim]
        if self.q_norm is None:
            q, k = self.rotary_emb(positions, q, k)  # [num_tokens, heads, head_dim] each
        else:  # Qwen3: one op, fused where the backend can (one eps for both norms)
            q, k = self.backend.qk_norm_rope(positions, q, k, self.rotary_emb.cos_sin, self.q_norm.weight,
                                             self.k_norm.weight, self.q_norm.eps)
        out = self.attn(q, k, v, meta)  # [num_tokens, num_heads, head_dim]
        if out_rows is not None:
            out = out[out_rows]
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ctx: ModelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, ctx)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, ctx)
        self.act_fn = SiluAndMul(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, self_attn: nn.Module, mlp: nn.Module, ctx: ModelContext) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, ctx)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, ctx)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
        out_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, out_rows)
        if out_rows is not None:
            residual = residual[out_rows]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict, layers: list[LlamaDecoderLayer], ctx: ModelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], ctx)
        self.layers = nn.ModuleList(layers)
        self.backend = ctx.backend
        self.fused_decode = None  # unbuilt; then the backend's fused decode run, or False
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), ctx)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden], or only rows `out_rows` of them: the last layer then
        runs its o_proj and MLP on those rows alone (last-token pooling reads one row a prompt)."""
        x, residual = self.embed_tokens(input_ids), None
        fused = self._fused_decode(meta, out_rows)
        done = fused(positions, x, meta) if fused is not None else None
        if done is not None:
            x, residual = done
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x, residual = layer(positions, x, residual, meta, out_rows if i == last else None)
        x, _ = self.norm(x, residual)
        return x

    def _fused_decode(self, meta: AttentionMetadata, out_rows: torch.Tensor | None):
        """The backend's run of every layer at once for a decode-only step (the CPU backend's single C
        call, kernels/cpu_decode_layers.py), built on first use, once the weights are packed; None
        where it has none and the layers run one by one."""
        if out_rows is not None or meta.num_prefills or not meta.num_decode_tokens:
            return None
        if self.fused_decode is None:
            self.fused_decode = self.backend.fuse_decode_layers(self) or False
        return self.fused_decode or None


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our parameter name fragment, shard id of a packed weight)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False  # per-head RMSNorm of q and k before RoPE
    has_lm_head = True  # False for runner="pooling", which returns hidden states
    # config.json fields read as shapes, each a positive int: the ones that must be there, then
    # the ones with a default (num_attention_heads, hidden_size / num_attention_heads, 4096).
    required_fields = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    optional_fields = ("num_key_value_heads", "head_dim", "max_position_embeddings")
    # Shapes split across tensor-parallel ranks (each rank holds field / tensor_parallel_size).
    sharded_fields = ("num_key_value_heads", "num_attention_heads", "intermediate_size")

    @classmethod
    def check_config(cls, cfg: dict, source: str, tensor_parallel_size: int = 1) -> None:
        """Refuse a config.json this model would run wrongly, naming `source` and the field, before
        anything is built from it."""
        for name in cls.required_fields:
            if cfg.get(name) is None:
                raise ValueError(f"{source} lacks the required field {name!r}")
        for name in cls.required_fields + cls.optional_fields:
            value = cfg.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{source}: {name} must be a positive int, got {value!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads} "
                "(each KV head serves a whole group of query heads)"
            )
        if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
            raise ValueError(
                f"{source}: hidden_size={cfg['hidden_size']} is not a multiple of num_attention_heads={heads}, "
                "and there is no head_dim field"
            )
        if (head_dim := head_dim_of(cfg)) % 2:
            raise ValueError(f"{source}: the head dimension ({head_dim}) must be even: RoPE rotates pairs of channels")
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list) and len(layer_types) != cfg["num_hidden_layers"]:
            raise ValueError(
                f"{source}: layer_types has {len(layer_types)} entries but num_hidden_layers={cfg['num_hidden_layers']}"
            )
        cls._check_scalars(cfg, source)
        for name in cls.sharded_fields:
            value = kv_heads if name == "num_key_value_heads" else cfg.get(name)
            if value and value % tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} must divide the checkpoint's {name}={value} "
                    f"(each rank holds {name} / tensor_parallel_size of them)"
                )

    @staticmethod
    def _check_scalars(cfg: dict, source: str) -> None:
        eps = cfg.get("rms_norm_eps")
        if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0):
            raise ValueError(f"{source}: rms_norm_eps must be a positive number, got {eps!r}")
        if not isinstance(cfg.get("tie_word_embeddings", False), bool):
            raise ValueError(f"{source}: tie_word_embeddings must be true or false, got {cfg['tie_word_embeddings']!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        try:
            theta, scaling = rope_parameters(cfg)
        except (TypeError, ValueError, AttributeError):
            theta = None
        if theta is None or not theta > 0:
            raise ValueError(f"{source}: rope_theta must be a positive number")
        try:
            check_rope_scaling(scaling)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def __init__(self, cfg: dict, ctx: ModelContext) -> None:
        super().__init__()
        rope = RotaryEmbedding.from_config(cfg, head_dim_of(cfg), ctx)  # one table for all layers
        qkv_bias, o_bias = self.attention_biases(cfg)
        layers = [
            LlamaDecoderLayer(
                cfg, LlamaAttention(cfg, rope, ctx, qkv_bias, o_bias, self.qk_norm), self.make_mlp(cfg, i, ctx), ctx
            )
            for i in range(cfg["num_hidden_layers"])
        ]
        self.model = LlamaModel(cfg, layers, ctx)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if not self.has_lm_head:  # an embedding model (nanoserve/pooling/model.py): never built, never packed
            return
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], ctx)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    @classmethod
    def attention_biases(cls, cfg: dict) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o)."""
        bias = bool(cfg.get("attention_bias", False))
        return bias, bias

    def make_mlp(self, cfg: dict, layer_index: int, ctx: ModelContext) -> nn.Module:
        return LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"], bool(cfg.get("mlp_bias", False)), ctx)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, object]:
        """Our parameter name for a checkpoint tensor, and the shard it fills in a packed weight (or None)."""
        for hf_fragment, (ours, shard_id) in self.packed_modules_mapping.items():
            pattern = rf"\.{hf_fragment}\."
            if re.search(pattern, name):
                return re.sub(pattern, f".{ours}.", name), shard_id
        return name, None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, out_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

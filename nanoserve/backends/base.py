"""The pure-PyTorch backend: the reference every other backend is compared with.

A backend owns everything that depends on the device: storing K/V in the paged cache, attention
(decode and varlen), how linear weights are prepared and multiplied, and the small ops a device
may fuse (RMSNorm, q/k norm + RoPE, SiLU-and-mul). One is chosen at startup
(nanoserve.backends.select_backend) and handed to every layer; layers and models never test the
device themselves. A faster backend subclasses this one and replaces what it has kernels for.

This one computes in the model's own dtype with plain torch ops, on any device.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.kernels.fused_moe import grouped_experts
from nanoserve.kernels.paged_attention import paged_attention_decode_torch, paged_attention_varlen_torch
from nanoserve.kernels.store_kv import store_kv_torch
from nanoserve.quantization.weight import QuantizedWeight

LinearFn = Callable[[torch.Tensor], torch.Tensor]
# ids [*] int64 -> [*ids.shape, in_features]: rows of the weight a GEMM was prepared from
RowsFn = Callable[[torch.Tensor], torch.Tensor]
# (x [num_tokens, hidden], topk_weights [num_tokens, top_k], topk_ids [num_tokens, top_k]) -> [num_tokens, hidden]
MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Backend:
    name = "torch"
    # The block size the engine uses when the user sets none (flash-attn needs 256).
    preferred_block_size = 16
    # Whether decode steps may be captured in CUDA graphs with this backend.
    supports_cuda_graphs = True
    # Whether prepare_linear/prepare_logits/prepare_moe keep their own (packed) copy of the weights,
    # so that the layers can drop the loaded ones instead of holding every weight twice.
    packs_weights = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def describe(self) -> dict[str, str]:
        """What runs, for logs and benchmarks."""
        return {"backend": self.name, "gemm": f"F.linear {_short(self.dtype)}", "attention": "torch SDPA (reference)"}

    # ---- linear layers ------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool = True) -> LinearFn:
        """Called once per linear layer after its weights are loaded; returns x -> x @ weight.T + bias.
        quantize=False: a weight dequantized from a quantized checkpoint, which a backend that
        quantizes weights at load (CPU, quantization="int8") runs in float: never rounded twice."""
        return partial(F.linear, weight=weight, bias=bias)

    def prepare_quantized_linear(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearFn:
        """A pre-quantized checkpoint's linear layer (int8 values, group scales). Here it is
        dequantized once into the model dtype and runs like any float weight; a backend with
        integer kernels runs the integers."""
        return self.prepare_linear(weight.dequantize().to(self.dtype), bias, quantize=False)

    def prepare_logits(self, weight: torch.Tensor) -> LinearFn:
        """The LM head: hidden states -> float32 logits (what the sampler works in)."""
        gemm = self.prepare_linear(weight, None)
        return lambda x: gemm(x).float()

    def prepare_quantized_logits(self, weight: QuantizedWeight) -> LinearFn:
        """A checkpoint's quantized LM head (GPTQ's "lm_head": true): float32 logits through the
        backend's quantized GEMM, like any quantized linear layer's."""
        gemm = self.prepare_quantized_linear(weight, None)
        return lambda x: gemm(x).float()

    def logits_rows(self, logits: LinearFn) -> RowsFn | None:
        """Rows of the weight `logits` (from prepare_logits) was prepared from, read back from the
        GEMM's own copy where it can (bit for bit, or as a quantized head multiplies them); None
        otherwise. A tied embedding then looks its tokens up there instead of keeping a second copy
        of the vocabulary matrix."""
        return None

    def prepare_moe(self, w13: torch.Tensor, w2: torch.Tensor, quantize: bool = True) -> MoEFn:
        """Called once per MoE layer after loading: the experts as grouped GEMMs, each expert's
        weights prepared like any linear layer's (w13 [E, 2 * inter, hidden], w2 [E, hidden, inter];
        quantize as for prepare_linear)."""
        up = [self.prepare_linear(w, None, quantize) for w in w13]
        down = [self.prepare_linear(w, None, quantize) for w in w2]
        return partial(grouped_experts, up=up, down=down, act=self.silu_and_mul)

    # ---- small ops ----------------------------------------------------------------------------

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm in float32; with `residual`, adds it first and also returns the sum (the new residual)."""
        if residual is None:
            return _rms_norm(x, weight, eps)
        residual = x + residual
        return _rms_norm(residual, weight, eps), residual

    def rotary(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim], rows may be strided (a slice of qkv)
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        cos_sin: torch.Tensor,  # [max_positions, head_dim] float32: cos of each frequency, then sin
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, num_heads, head_dim], [num_tokens, num_kv_heads, head_dim]
        """Neox-style RoPE (rotate halves)."""
        return _rope(positions, q.unflatten(-1, (-1, head_dim)), k.unflatten(-1, (-1, head_dim)), cos_sin)

    def qk_norm_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
        q_weight: torch.Tensor,  # [head_dim]
        k_weight: torch.Tensor,
        eps: float,  # one for both norms
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A per-head RMSNorm of q and k, then RoPE (Qwen3), as one op a backend may fuse; shapes as `rotary`."""
        q, k = q.unflatten(-1, (-1, q_weight.shape[0])), k.unflatten(-1, (-1, k_weight.shape[0]))
        return _rope(positions, _rms_norm(q, q_weight, eps), _rms_norm(k, k_weight, eps), cos_sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # x: [num_tokens, 2 * intermediate]
        return F.silu(gate) * up

    # ---- attention ----------------------------------------------------------------------------

    def fuse_decode_layers(self, body: torch.nn.Module):
        """A callable (positions, x, meta) -> (x, residual) | None running every layer of `body` (a
        LlamaModel) for a decode-only step at once, or None: its layers then run one by one."""
        return None

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Derive, once per step, whatever this backend's kernels need beyond the common metadata."""
        return meta

    def attention(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's keys
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store this step's K/V at their slots, then attend: decodes first, then prefills."""
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return self.decode(q, k_cache, v_cache, meta, scale)
        if nd == 0:
            return self.prefill(q, k, v, k_cache, v_cache, meta, scale)
        decoded = self.decode(q[:nd], k_cache, v_cache, meta, scale)
        return torch.cat([decoded, self.prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale)])

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_decode_torch(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_max_context_len, scale
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Prefills and prompt chunks; `k`/`v` are this step's (already stored) keys and values."""
        return paged_attention_varlen_torch(
            q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
            meta.prefill_max_seqlen_q, meta.prefill_max_context_len, scale,
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, head_dim / 2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # x: [num_tokens, num_heads, head_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

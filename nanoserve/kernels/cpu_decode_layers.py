"""Every decoder layer of a decode-only CPU step in one C call (cpu_decode_layers.c).

At a few decode rows a layer's C kernels take tens of microseconds and the Python around them
(module calls, wrappers, ctypes argument conversion, tensor allocation) ~300 us: 8-10 ms of a
one-sequence step on 28 layers. Like a CUDA graph replay, `DecodeLayers` runs the same kernels in
the same order on the same bf16 rows without returning to Python, so its result is the module
path's bit for bit (models/llama.py is its reference in tests/test_fused_decode.py).

It applies to what the loop was written for, and `build` returns None for anything else (the
module path runs): Llama-style pre-norm layers with Qwen3's q/k RMSNorm, bf16 activations and
cache, one tensor-parallel rank, GEMMs of the C library (bf16 panels, int8 W8A16, int4 without an
act-order permutation).
"""
from __future__ import annotations

import ctypes

import torch

from nanoserve.kernels import cpu_attention
from nanoserve.kernels.cpu_gemm import DotBF16Gemm, Int4Gemm, Int8Gemm, PanelGemm

GEMM_PANEL, GEMM_W8A16, GEMM_W4A16, GEMM_W4A8, GEMM_VNNI8, GEMM_DPBF16 = 0, 1, 2, 3, 4, 5  # cpu_decode_layers.c
_I64, _P = ctypes.c_int64, ctypes.c_void_p


class _Gemm(ctypes.Structure):
    _fields_ = [("kind", _I64), ("in_features", _I64), ("out_features", _I64), ("padded_in", _I64),
                ("group", _I64), ("panels", _P), ("scales", _P), ("offsets", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Gemm), ("o", _Gemm), ("gate_up", _Gemm), ("down", _Gemm), ("input_norm", _P),
                ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("k_cache", _P), ("v_cache", _P)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("rows", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                          "intermediate", "block_size", "bt_stride", "max_keys", "kv_per_item",
                                          "cache_dtype", "num_threads")] + \
               [("eps", ctypes.c_float), ("qk_eps", ctypes.c_float), ("scale", ctypes.c_float)] + \
               [(name, _P) for name in ("cos_sin", "positions", "slots", "block_tables", "context_lens", "h", "qkv",
                                        "q", "k", "attn", "o", "gate_up", "act")]


_SCRATCH = ("h", "qkv", "q", "k", "attn", "o", "gate_up", "act")
_MODULES = ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP")  # models/llama.py


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _gemm(linear) -> _Gemm | None:
    """The C view of a linear layer's GEMM object, or None where the loop cannot run it."""
    g, bias = linear.gemm, getattr(linear.gemm, "bias", None)
    if type(g) is PanelGemm and g.out_dtype is None:
        n, k = g.out_features, g.panels.shape[1]
        return _Gemm(GEMM_PANEL, k, n, k, k, _ptr(g.panels), None, None, _ptr(bias))
    if type(g) is DotBF16Gemm and g.out_dtype is None:
        n, k = g.out_features, g.in_features
        return _Gemm(GEMM_DPBF16, k, n, k, k, _ptr(g.panels), None, None, _ptr(bias))
    if type(g) is Int8Gemm and g.vnni and g.perm is None and g.out_dtype is None:
        w = g.weight
        return _Gemm(GEMM_VNNI8, w.in_features, w.out_features, w.in_features, w.group_size, _ptr(w.panels),
                     _ptr(w.scales), _ptr(w.offsets), _ptr(bias))
    if type(g) is Int8Gemm and not g.vnni and g.w8a8_min_rows is None and g.perm is None and g.out_dtype is None:
        w = g.weight
        return _Gemm(GEMM_W8A16, w.in_features, w.out_features, w.padded_in, g.kernels._group(w),
                     _ptr(w.panels), _ptr(w.scales), None, _ptr(bias))
    if type(g) is Int4Gemm and g.perm is None and g.out_dtype is None:
        w = g.weight
        return _Gemm(GEMM_W4A8 if w.w4a8 else GEMM_W4A16, w.in_features, w.out_features, w.in_features,
                     w.group_size, _ptr(w.panels), _ptr(w.scales), _ptr(w.offsets), _ptr(bias))
    return None


class DecodeLayers:
    """Runs every layer of `body` (a LlamaModel) for a decode-only step; see the module docstring."""

    def __init__(self, lib: ctypes.CDLL, body, layers: list[_Layer]) -> None:
        self.fn = lib.decode_layers_bf16  # argtypes set by cpu_kernels.load (SIGNATURES)
        first = body.layers[0]
        attn = first.self_attn
        self.attn_modules = [layer.self_attn.attn for layer in body.layers]
        self.layers = (_Layer * len(layers))(*layers)
        self.cache_ptrs: list[tuple[int, int]] = []  # the K/V cache views self.layers points at
        self.steps_run = 0  # decode steps this ran (the others fell back to the modules)
        self.hidden = first.input_layernorm.weight.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = layers[0].down.in_features
        self.eps, self.qk_eps, self.scale = first.input_layernorm.eps, attn.q_norm.eps, attn.attn.scale
        self.cos_sin = attn.rotary_emb.cos_sin
        widths = {"h": self.hidden, "qkv": (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                  "q": self.num_heads * self.head_dim, "k": self.num_kv_heads * self.head_dim,
                  "attn": self.num_heads * self.head_dim, "o": self.hidden, "gate_up": 2 * self.intermediate,
                  "act": self.intermediate}
        self.widths = [widths[name] for name in _SCRATCH]

    def _bind_caches(self) -> bool:
        """Point the layers at the KV cache views the model runner bound last (it reallocates them
        for its warm-up and on resize). Addresses, not tensors, are kept: a reference would keep an
        old cache alive."""
        views = [(a.k_cache, a.v_cache) for a in self.attn_modules]
        ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in views]
        if ptrs == self.cache_ptrs:
            return True
        if any(t.dtype != torch.bfloat16 or not t.is_contiguous() or t.dim() != 4 for kv in views for t in kv):
            return False
        for (k, v), layer in zip(ptrs, self.layers):
            layer.k_cache, layer.v_cache = k, v
        self.cache_ptrs = ptrs
        self.block_size = views[0][0].shape[1]
        return True

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x after the last layer's MLP, the residual) for a decode-only step, or None if this step
        cannot run here (the caller then runs the modules)."""
        if x.dtype != torch.bfloat16 or not self._bind_caches():
            return None
        rows = x.shape[0]
        plan = meta.decode_plan  # CPUBackend.prepare_metadata's, for every step with decodes
        threads = torch.get_num_threads()
        x = x.contiguous().clone()  # written in place
        residual = torch.empty_like(x)
        scratch = torch.empty(rows * sum(self.widths), dtype=torch.bfloat16)
        positions = positions if positions.dtype == torch.int64 else positions.long()
        slots = meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.long()
        step = _Step(rows, self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
                     self.block_size, plan.block_tables.shape[1], plan.max_keys,
                     cpu_attention.kv_heads_per_item(rows, self.num_kv_heads, threads),
                     cpu_attention.DTYPE_CODES[torch.bfloat16], threads, self.eps, self.qk_eps, self.scale,
                     self.cos_sin.data_ptr(), positions.contiguous().data_ptr(), slots.contiguous().data_ptr(),
                     plan.block_tables.data_ptr(), plan.context_lens.data_ptr())
        at = scratch.data_ptr()
        for name, width in zip(_SCRATCH, self.widths):
            setattr(step, name, at)
            at += rows * width * 2
        failed = ctypes.c_int64(-1)
        rc = self.fn(self.layers, len(self.layers), ctypes.byref(step), x.data_ptr(), residual.data_ptr(),
                     ctypes.byref(failed))
        if rc:
            raise MemoryError(f"the fused decode layers failed in layer {failed.value} (code {rc}): out of memory")
        self.steps_run += 1
        return x, residual


def _same_shapes(gemms: list[_Gemm], attn, first_attn, hidden: int) -> bool:
    """The layer has the first layer's attention shape and its GEMMs chain as the loop's scratch rows
    are sized (from the first layer)."""
    qkv, o, gate_up, down = gemms
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (first_attn.num_heads, first_attn.num_kv_heads,
                                                              first_attn.head_dim):
        return False
    q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    return (qkv.in_features == hidden and qkv.out_features == q_width + 2 * kv_width and o.in_features == q_width
            and o.out_features == hidden and gate_up.in_features == hidden
            and gate_up.out_features == 2 * down.in_features and down.out_features == hidden)


def build(body, lib: ctypes.CDLL) -> DecodeLayers | None:
    """DecodeLayers for `body` (a LlamaModel), or None where one of its layers is not the kind the C
    loop runs (the module path then runs every step)."""
    layers, first = [], body.layers[0]
    for layer in body.layers:
        # exactly the modules whose forward the loop repeats (by name: kernels/ does not import models/)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (type(layer).__name__, type(attn).__name__, type(mlp).__name__) != _MODULES or attn.q_norm is None:
            return None
        if attn.o_proj.tp.size != 1 or mlp.down_proj.tp.size != 1:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
        if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms):
            return None
        if {n.eps for n in (layer.input_layernorm, layer.post_attention_layernorm)} != {first.input_layernorm.eps} \
                or {attn.q_norm.eps, attn.k_norm.eps} != {first.self_attn.q_norm.eps}:
            return None  # one eps for the layer norms and one for q/k, as the loop takes them
        cos_sin = attn.rotary_emb.cos_sin
        if cos_sin.dtype != torch.float32 or cos_sin is not first.self_attn.rotary_emb.cos_sin:
            return None
        gemms = [_gemm(linear) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        hidden = first.input_layernorm.weight.shape[0]
        if any(g is None for g in gemms) or not _same_shapes(gemms, attn, first.self_attn, hidden):
            return None
        layers.append(_Layer(*gemms, *(n.weight.data_ptr() for n in norms), None, None))
    return DecodeLayers(lib, body, layers) if layers else None

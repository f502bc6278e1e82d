"""The CPU backend: C kernels for attention and the small fused ops, and a GEMM path per CPU class.

GEMMs (nanoserve/kernels/cpu_gemm.py), chosen once at startup:
  dpbf16       bf16 models on CPUs with AVX512-BF16: the C kernel of cpu_dpbf16.c (vdpbf16ps over bf16
               weight panels); 1.1-1.4x oneDNN's GEMM at a decode step's 1-64 rows, 0.95x at a prefill's
               hundreds, and the fused decode loop can call it
  onednn-bf16  bf16 models on CPUs with bf16 dot products (AVX512-BF16, AMX): oneDNN-prepacked bf16
  panel        bf16 models elsewhere (AVX2): the C kernel over bf16 weight panels, float32 math.
               There PyTorch's own bf16 GEMM falls back to a slow kernel, 5-10x below float32.
  onednn-fp32  float32 models, and fp16 models on CPUs without fp16 math: a prepacked float32 copy
  native       F.linear in the model's dtype (fp16 models on CPUs with fp16 math)
  int8         `quantization="int8"`, any model dtype: weights quantized per output channel at load
               (LM head included), the kernels of cpu_int8.c: on CPUs with AVX512-VNNI in a bf16/fp16
               model, vpdpbusd with activations quantized with a scale per 128 inputs (outliers,
               found per block of 32, exact);
               elsewhere W8A16 (int8 weights widened to float32 in registers, float32 math); W8A8
               (activations quantized per token, int16 multiply-adds) on request, see w8a8_min_rows.
               The same kernels run a pre-quantized checkpoint's integer layers (GPTQ, AWQ,
               compressed-tensors) with its group scales; its float layers take the path above.
Products of bf16 values are exact in float32 and every path accumulates in float32, so rounding to
bf16 gives a bf16 GEMM's answer up to summation order.

Attention runs the C kernels in float32 whatever the cache dtype; without them (no compiler, or
switched off) the torch reference runs, widened to float32 where bf16 matmuls are slow.

Switches, read once at startup (`CPUOptions.from_env`):
  NANOSERVE_CPU_GEMM=auto|panel|dpbf16|onednn-bf16|onednn-fp32|native   (fp32: onednn-fp32)
  NANOSERVE_CPU_KERNELS=1|0             build and use the C kernels
  NANOSERVE_CPU_ATTENTION=auto|torch    the C attention kernels, or the torch reference
  NANOSERVE_CPU_FUSED_DECODE=1|0        decode-only steps run every layer in one C call (the same kernels)
  VLLM_BATCH_INVARIANT=1                batch-invariant kernels (as LLM(batch_invariant=True))
  NANOSERVE_CPU_INT8=auto|w8a16|w8a8|vnni|w4a8|w4a16
                                        with quantization="int8": the default (VNNI where the CPU has
                                        it and the model is bf16/fp16, else W8A16), or one int8 path
                                        always. An int4 checkpoint: w4a8 (and auto, unless the model
                                        dtype is float32) runs W4A8 where its groups are whole blocks
                                        of 32 inputs (W4A16 elsewhere), w4a16 (and auto in float32)
                                        always W4A16 (exact activations), w8a16/w8a8 its integers
                                        through that int8 path
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nanoserve.backends.base import Backend, LinearFn, RowsFn
from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.kernels import cpu_attention, cpu_decode_layers, cpu_kernels
from nanoserve.kernels.cpu_gemm import BucketedLinear, DotBF16Gemm, Int4Gemm, Int8Gemm, OneDNNGemm, PanelGemm
from nanoserve.kernels.cpu_int8 import Int4Kernels, Int8Kernels, fits_int4, w4a8_supported
from nanoserve.kernels.paged_attention import paged_attention_decode_torch, paged_attention_varlen_torch
from nanoserve.quantization.weight import QuantizedWeight

logger = logging.getLogger(__name__)

GEMM_PATHS = ("panel", "dpbf16", "onednn-bf16", "onednn-fp32", "native")
INT8_PATHS = ("w8a16", "w8a8", "vnni")
INT4_PATHS = ("w4a8", "w4a16")
QUANTIZATIONS = ("int8",)


def w8a8_min_rows(requested: str) -> int | None:
    """From how many rows W8A8 runs (None: never). `auto` never picks it, on any CPU class: on
    AVX2 without VNNI its int16 multiply-adds run at the float32 FMA rate (bench.py's instruction
    peaks), so it only adds the activations' rounding; and where vpdpbusd (VNNI) would make it
    faster, per-token activation quantization still loses accuracy on the outlier channels of
    real checkpoints (bench.py --accuracy) until the activations are smoothed. NANOSERVE_CPU_INT8=
    w8a8 runs it at every row count."""
    if requested == "w8a8":
        return 1
    return None


# The backend ops a decode step's layers call, which the fused decode runs in C instead.
FUSED_DECODE_OPS = ("rms_norm", "qk_norm_rope", "silu_and_mul", "prepare_metadata", "attention", "store_kv", "decode")


@dataclass(frozen=True)
class CPUOptions:
    gemm: str = "auto"
    kernels: bool = True
    attention: str = "auto"
    # Prefill always through the C varlen kernel, never SDPA (see prepare_metadata and
    # tests/test_batch_invariance.py).
    batch_invariant: bool = False
    int8: str = "auto"
    fused_decode: bool = True  # decode-only steps run every layer in one C call (kernels/cpu_decode_layers.py)
    # no decode steps (runner="pooling"): GEMMs of hundreds of rows only; a pooled vector, no argmax,
    # so prefill attention may round P to bf16 for P . V (cpu_attention.prefill_attention_dpbf16)
    prefill_only: bool = False

    def __post_init__(self) -> None:
        if self.int8 not in ("auto", *INT8_PATHS, *INT4_PATHS):
            raise ValueError(f"NANOSERVE_CPU_INT8 must be one of auto, {', '.join(INT8_PATHS + INT4_PATHS)}, "
                             f"got {self.int8!r}")
        if self.gemm not in ("auto", *GEMM_PATHS):
            raise ValueError(f"NANOSERVE_CPU_GEMM must be one of auto, {', '.join(GEMM_PATHS)}, got {self.gemm!r}")
        if self.attention not in ("auto", "torch"):
            raise ValueError(f"NANOSERVE_CPU_ATTENTION must be auto or torch, got {self.attention!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "CPUOptions":
        kernels = environ.get("NANOSERVE_CPU_KERNELS", "1")
        if kernels not in ("0", "1"):
            raise ValueError(f"NANOSERVE_CPU_KERNELS must be 0 or 1, got {kernels!r}")
        fused = environ.get("NANOSERVE_CPU_FUSED_DECODE", "1")
        if fused not in ("0", "1"):
            raise ValueError(f"NANOSERVE_CPU_FUSED_DECODE must be 0 or 1, got {fused!r}")
        gemm = environ.get("NANOSERVE_CPU_GEMM", "auto")
        return cls("onednn-fp32" if gemm == "fp32" else gemm, kernels == "1",
                   environ.get("NANOSERVE_CPU_ATTENTION", "auto"), environ.get("VLLM_BATCH_INVARIANT", "0") == "1",
                   environ.get("NANOSERVE_CPU_INT8", "auto"), fused == "1")


def native_lowp_gemm(dtype: torch.dtype) -> bool:
    """Does this CPU have dot-product instructions for `dtype` (AVX512-BF16/FP16, AMX)?"""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def gemm_unavailable(path: str, dtype: torch.dtype, kernels: cpu_kernels.CPUKernels | None) -> str | None:
    """Why `path` cannot run a `dtype` model on this CPU, or None if it can."""
    if path == "panel":
        if dtype != torch.bfloat16:
            return "the panel GEMM takes bf16 weights"
        if kernels is None or not kernels.lib.panel_gemm_supported():
            return "the panel GEMM needs the C kernels built with AVX2 and FMA"
    if path == "dpbf16":
        if dtype != torch.bfloat16:
            return "the dpbf16 GEMM takes bf16 weights"
        if kernels is None or not kernels.lib.dpbf16_supported():
            return "the dpbf16 GEMM needs the C kernels built for a CPU with AVX512-BF16"
    if path == "onednn-bf16":
        if dtype != torch.bfloat16:
            return "onednn-bf16 takes bf16 weights"
        if not native_lowp_gemm(torch.bfloat16):
            return "oneDNN's bf16 GEMM needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT"
    if path.startswith("onednn") and not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    return None


def choose_gemm(requested: str, dtype: torch.dtype, kernels: cpu_kernels.CPUKernels | None,
                batch_invariant: bool = False, prefill_only: bool = False) -> str:
    """The GEMM path: `requested`, or for auto the fastest this CPU has for `dtype`; with batch_invariant,
    for bf16 the panel GEMM, the one whose per-row sums do not depend on the rows beside them (dpbf16
    splits a row's sums into two chains in tiles of up to 8 rows, one above). prefill_only (a pooling
    engine): oneDNN's bf16 GEMM before dpbf16 where it runs, 1.15x dpbf16 at 512 rows (Zen 5), where
    dpbf16 wins at a decode step's few rows."""
    if requested != "auto":
        reason = gemm_unavailable(requested, dtype, kernels)
        if reason is not None:
            raise ValueError(f"NANOSERVE_CPU_GEMM={requested} cannot run here: {reason}")
        return requested
    if dtype == torch.bfloat16 and batch_invariant:
        candidates = ("panel", "onednn-fp32")
    elif dtype == torch.bfloat16 and prefill_only and native_lowp_gemm(dtype):
        candidates = ("onednn-bf16", "dpbf16", "panel", "onednn-fp32")
    elif dtype == torch.bfloat16:
        candidates = ("dpbf16",) + (("onednn-bf16", "panel", "onednn-fp32") if native_lowp_gemm(dtype)
                                    else ("panel", "onednn-fp32"))
    elif dtype == torch.float16 and native_lowp_gemm(dtype):
        candidates = ("native",)
    else:
        candidates = ("onednn-fp32", "native")
    for path in candidates:
        if gemm_unavailable(path, dtype, kernels) is None:
            return path
    return "native"


class CPUBackend(Backend):
    name = "cpu"

    def __init__(
        self, device: torch.device, dtype: torch.dtype, options: CPUOptions | None = None,
        quantization: str | None = None,
    ) -> None:
        if torch.device(device).type != "cpu":  # a subclass passed as attention_backend with device="cuda"
            raise ValueError(f"{type(self).__name__} is a CPU backend: it runs with device='cpu', got {device}")
        super().__init__(device, dtype)
        self.options = options or CPUOptions()
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
        lib = cpu_kernels.load() if self.options.kernels else None
        if self.options.kernels and lib is None:
            logger.info("the CPU kernels could not be built: PyTorch paths run instead")
        self.kernels = cpu_kernels.CPUKernels(lib) if lib is not None else None
        self.attention_lib = lib if self.options.attention == "auto" and dtype in cpu_attention.DTYPE_CODES else None
        self.gemm = choose_gemm(self.options.gemm, dtype, self.kernels, self.options.batch_invariant,
                                self.options.prefill_only)
        self.float_gemm = self.gemm  # what a weight runs that is not to be quantized (prepare_linear)
        # The int8 GEMMs: every linear with quantization="int8", a pre-quantized checkpoint's
        # integer weights (prepare_quantized_linear) otherwise.
        self.int8 = self.int4 = None
        if self.kernels is not None and self.kernels.lib.int8_gemm_supported():
            self.int8, self.int4 = Int8Kernels(self.kernels.lib), Int4Kernels(self.kernels.lib)
        self.w8a8_min_rows = w8a8_min_rows(self.options.int8)
        # Where the CPU has AVX512-VNNI, int8 weights run its kernel by default in a bf16/fp16 model
        # (vpdpbusd does four times the float32 FMA's multiply-adds there; activations quantized with a
        # scale per 128 inputs and the outliers exact, within the bf16 activations' own error: README,
        # int8 weights). A float32 model asked for exact activations: auto keeps W8A16 there, as W4A16
        # for int4.
        wants_vnni = self.options.int8 == "vnni" or (self.options.int8 == "auto" and dtype != torch.float32)
        self.int8_vnni = self.int8 is not None and wants_vnni and bool(self.kernels.lib.vnni_supported())
        self.checkpoint_paths: set[str] = set()  # what prepare_quantized_linear chose, for describe()
        if quantization == "int8":
            self._check_vnni_request(None, None)
            if self.int8 is None:
                raise ValueError("quantization='int8' needs the CPU kernels built with AVX2 and FMA "
                                 "(a C compiler, NANOSERVE_CPU_KERNELS=1)")
            self.gemm = "int8"
        self.packs_weights = self.gemm != "native"
        # Attention without the C kernels: widen where bf16/fp16 matmuls are slow.
        lowp = dtype in (torch.bfloat16, torch.float16)
        self.attention_dtype = torch.float32 if lowp and not native_lowp_gemm(dtype) else None

    def describe(self) -> dict[str, str]:
        attention = "C paged attention" if self.attention_lib is not None else "torch SDPA"
        gemm = self._int8_path_name() if self.gemm == "int8" else self.gemm
        out = {"backend": self.name, "gemm": gemm, "attention": attention,
               "fused ops": "C" if self.kernels is not None else "torch"}
        if self.checkpoint_paths:  # a pre-quantized checkpoint's linears (the rest run `gemm`)
            out["quantized linears"] = ", ".join(sorted(self.checkpoint_paths))
        return out

    def _check_vnni_request(self, group_size: int | None, in_features: int | None) -> None:
        """NANOSERVE_CPU_INT8=vnni for int8 weights that cannot run it here: a ValueError, never W8A16 instead."""
        if self.options.int8 != "vnni":
            return
        if not self.int8_vnni:
            raise ValueError("NANOSERVE_CPU_INT8=vnni needs a CPU with AVX512-VNNI and the C kernels built for it")
        if group_size is not None and not w4a8_supported(group_size, in_features):
            raise ValueError(f"NANOSERVE_CPU_INT8=vnni needs group_size a multiple of 32 (or one group per row); "
                             f"this checkpoint's is {group_size}")

    def _int8_path_name(self) -> str:
        if self.int8_vnni:
            return "int8 W8A8 VNNI (activations scaled per 128 inputs, outliers exact)"
        return ("int8 W8A16" if self.w8a8_min_rows is None else "int8 W8A8" if self.w8a8_min_rows <= 1
                else f"int8 W8A16 below {self.w8a8_min_rows} rows, W8A8 from there")

    # ---- linear layers ------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool = True) -> LinearFn:
        return self._gemm(weight, bias, None, quantize)

    def prepare_logits(self, weight: torch.Tensor) -> LinearFn:
        return self._gemm(weight, None, torch.float32)

    def logits_rows(self, logits: LinearFn) -> RowsFn | None:
        # The panels hold the bf16 bits as loaded, in a layout rows are read from by indexing.
        # The int8 head's rows are q * scale: with quantization="int8" the embedding shares them
        # rather than keep the float vocabulary (2x the head's bytes), as llama.cpp's quantized
        # files do. oneDNN's blocked layout is its own.
        if isinstance(logits, (PanelGemm, DotBF16Gemm)):
            return logits.rows
        if isinstance(logits, Int8Gemm) and logits.per_channel:
            return lambda ids: logits.rows(ids).to(self.dtype)
        return None

    def prepare_quantized_linear(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> LinearFn:
        """A checkpoint's integers as they are (exact: no requantization): 4-bit ones through the int4
        kernels (half the int8 bytes) unless NANOSERVE_CPU_INT8 names an int8 path, the others through
        the int8 GEMMs; without the kernels, dequantized into the float path. Int4 runs W4A8 by
        default in bf16/fp16: its integer multiply-adds beat W4A16's float32 FMAs at every row count
        (1.2x at 64+ rows, 2-3x at 1-2 on AVX2), for llama.cpp's Q8_0 rounding of the activations
        (README); a float32 model runs W4A16 unless w4a8 is asked for."""
        if self.int8 is None:
            self.checkpoint_paths.add(f"dequantized, {self.gemm}")
            return super().prepare_quantized_linear(weight, bias)
        if self.options.int8 not in INT8_PATHS and fits_int4(weight.qweight, weight.group_size):
            w4a8 = self._int4_rounds_activations() and w4a8_supported(weight.group_size, weight.qweight.shape[1])
            self.checkpoint_paths.add("int4 W4A8" if w4a8 else "int4 W4A16")
            return Int4Gemm(weight, bias, self.int4, w4a8)
        self._check_vnni_request(weight.group_size, weight.qweight.shape[1])
        vnni = self.int8_vnni and w4a8_supported(weight.group_size, weight.qweight.shape[1])
        self.checkpoint_paths.add(self._int8_path_name() if vnni or not self.int8_vnni else "int8 W8A16")
        return Int8Gemm(weight, bias, self.int8, self.w8a8_min_rows, vnni=vnni)  # each path's float32 result, not rounded and widened

    def _int4_rounds_activations(self) -> bool:
        """W4A8 for int4 weights: when asked for (w4a8), or by default in a low-precision model dtype,
        where its Q8_0 rounding stays within the bf16 activations' own error (README). A float32 model
        asked for exact activations: auto runs W4A16 there, the checkpoint's weights exactly."""
        if self.options.int8 in INT4_PATHS:
            return self.options.int8 == "w4a8"
        return self.dtype != torch.float32

    def _gemm(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
              quantize: bool = True) -> LinearFn:
        gemm = self.gemm if quantize else self.float_gemm
        if gemm == "int8":
            return Int8Gemm(weight, bias, self.int8, self.w8a8_min_rows, out_dtype, vnni=self.int8_vnni)
        if gemm == "panel":
            return PanelGemm(weight, bias, self.kernels, out_dtype)
        if gemm == "dpbf16":
            return DotBF16Gemm(weight, bias, self.kernels, out_dtype)
        if gemm == "onednn-bf16":
            return OneDNNGemm(weight, bias, torch.bfloat16, out_dtype)
        if gemm == "onednn-fp32":
            return OneDNNGemm(weight, bias, torch.float32, out_dtype)
        return BucketedLinear(weight, bias, out_dtype)

    # ---- small ops ----------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps, residual=None):
        if self.kernels is not None:
            fused = self.kernels.rms_norm(x, weight, eps, residual)
            if fused is not None:
                return fused
        return super().rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        if self.kernels is not None:
            fused = self.kernels.silu_and_mul(x)
            if fused is not None:
                return fused
        return super().silu_and_mul(x)

    def qk_norm_rope(self, positions, q, k, cos_sin, q_weight, k_weight, eps):
        if self.kernels is not None:
            fused = self.kernels.qk_norm_rope(positions, q, k, cos_sin, q_weight, k_weight, eps)
            if fused is not None:
                return fused
        return super().qk_norm_rope(positions, q, k, cos_sin, q_weight, k_weight, eps)

    # ---- attention ----------------------------------------------------------------------------

    def fuse_decode_layers(self, body):
        # The C loop calls the C kernels the module path would: only where those are the ones running,
        # so not for a subclass that replaces one of these ops (a new device, a test double).
        if not self.options.fused_decode or self.kernels is None or self.attention_lib is None:
            return None
        if any(getattr(type(self), op) is not getattr(CPUBackend, op) for op in FUSED_DECODE_OPS):
            return None
        return cpu_decode_layers.build(body, self.kernels.lib)

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self.attention_lib is None:
            return meta
        # Past VARLEN_MAX_Q query tokens SDPA is faster, but which one a prompt meets would then
        # depend on the longest prefill sharing its step: batch_invariant keeps the C kernel.
        tiles = None
        if meta.num_prefills and (meta.prefill_max_seqlen_q <= cpu_attention.VARLEN_MAX_Q
                                  or self.options.batch_invariant):
            tiles = cpu_attention.varlen_tiles(meta.prefill_cu_seqlens_q, meta.prefill_context_lens)
        plan = None
        if meta.num_decode_tokens:
            plan = cpu_attention.decode_plan(meta.decode_block_tables, meta.decode_context_lens)
        return CPUAttentionMetadata(**vars(meta), prefill_tiles=tiles, decode_plan=plan)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if self.kernels is None or not self.kernels.store_kv(k, v, k_cache, v_cache, slot_mapping):
            super().store_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta, scale):
        if self.attention_lib is None:
            return paged_attention_decode_torch(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                meta.decode_max_context_len, scale, self.attention_dtype,
            )
        plan = getattr(meta, "decode_plan", None) or cpu_attention.decode_plan(
            meta.decode_block_tables, meta.decode_context_lens)
        return cpu_attention.paged_attention_decode_cpu(self.attention_lib, q, k_cache, v_cache, plan, scale)

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        if self.attention_lib is None:
            return paged_attention_varlen_torch(
                q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
                meta.prefill_max_seqlen_q, meta.prefill_max_context_len, scale, self.attention_dtype,
            )
        tiles = getattr(meta, "prefill_tiles", None)
        if tiles is None and cpu_attention.prefill_dpbf16_supported(self.attention_lib, q, k_cache):
            return cpu_attention.prefill_attention_dpbf16(  # long query runs, AVX512-BF16: bf16 dot products
                self.attention_lib, q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                meta.prefill_block_tables, scale, p_bf16=self.options.prefill_only,
            )
        if tiles is None:  # long query runs: SDPA's blocked GEMMs beat the C kernel
            return cpu_attention.varlen_sdpa_per_sequence(
                q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
                scale,
            )
        return cpu_attention.paged_attention_varlen_cpu(
            self.attention_lib, q, k_cache, v_cache, meta.prefill_block_tables, tiles, scale
        )


@dataclass
class CPUAttentionMetadata(AttentionMetadata):
    prefill_tiles: cpu_attention.VarlenTiles | None = None  # the varlen C kernel's work items for this step
    decode_plan: cpu_attention.DecodePlan | None = None  # the decode kernel's tables, once per step not per layer

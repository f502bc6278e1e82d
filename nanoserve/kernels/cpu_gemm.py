"""Linear layers on the CPU: weights prepared once, multiplied every step, one class per GEMM path.

  PanelGemm    bf16 weights packed in 16-column panels for the C kernel of cpu_kernels.c, which
               widens them to float32 in registers: float32 math at near the FMA peak for any row
               count, with half the weight bytes of a float32 copy (the path of CPUs without bf16
               dot products, AVX2). The panels hold the weight's bits as loaded, so its rows read
               back exactly (`rows`): a tied embedding looks its tokens up there.
  DotBF16Gemm  bf16 weights in 16-column panels of input pairs for the C kernel of cpu_dpbf16.c
               (vdpbf16ps, CPUs with AVX512-BF16): a decode step's rows multiply each weight as it
               streams in; the default bf16 path there. Rows read back exactly (`rows`), as PanelGemm's.
  OneDNNGemm   the weight reordered once into oneDNN's blocked layout, in bf16 (CPUs with bf16 dot
               products: AVX512-BF16, AMX) or as a float32 copy (float32 models; F.linear's MKL call
               would repack it on every call).
  BucketedLinear  plain F.linear in the model's dtype.
  Int8Gemm     `quantization="int8"`: the weight quantized per output channel to int8 (half the bf16
               bytes) for the kernels of cpu_int8.c, W8A16 (float32 math, weights widened in
               registers) below `w8a8_min_rows` rows and W8A8 (activations quantized per token,
               int16 multiply-adds) from there on. A pre-quantized checkpoint's integers
               (nanoserve/quantization) run through the same kernels as they are, with the
               format's group scales.
  Int4Gemm     a pre-quantized int4 checkpoint (GPTQ, AWQ, compressed-tensors): 4-bit weights with
               group zero points and scales, half the int8 bytes, q - z as the checkpoint stores it.
               W4A8 (activations quantized to int8, a scale per run of up to 128 inputs, integer
               multiply-adds on the nibbles) where the groups allow it; W4A16 (nibbles widened to
               float32, exact activations) otherwise or on request.

oneDNN keeps state for every distinct row count it sees, so resident memory grows without bound
when each step has a new token count; the oneDNN and F.linear paths therefore pad the rows to a
small set of sizes (`row_bucket`). The panel kernel keeps no state. Every path accumulates in
float32 and rounds to the activations' dtype; the reference is F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.kernels.cpu_int8 import (VNNI_ZERO, Int4Kernels, Int8Kernels, pack_int4, pack_int8_vnni,
                                        quantize_weight_int8, split_int4)
from nanoserve.kernels.cpu_kernels import PANEL, CPUKernels, panel_slot
from nanoserve.quantization.weight import QuantizedWeight

SMALL_BUCKETS = 64  # up to here, row counts round up to a power of two; past it, to a multiple of 64


def row_bucket(rows: int) -> int:
    """The padded row count: at most 2x for small batches, at most 63 extra rows past 64."""
    if rows <= SMALL_BUCKETS:
        return 1 << (rows - 1).bit_length()
    return -(-rows // SMALL_BUCKETS) * SMALL_BUCKETS


def _pad_rows(x2: torch.Tensor) -> torch.Tensor:
    rows = x2.shape[0]
    padded = row_bucket(rows)
    return x2 if padded == rows else torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])


def _result(y: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [rows, out] shaped as x's leading dims in dtype. The no-op view and .to() are skipped: each
    costs ~3 us through torch's dispatch, ~0.4 ms a one-sequence decode step over ~140 GEMMs."""
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
    return y if y.dtype == dtype else y.to(dtype)


class PanelGemm:
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CPUKernels, out_dtype: torch.dtype | None = None
    ) -> None:
        """out_dtype: the result's dtype (None: the activations')."""
        self.kernels = kernels
        self.out_dtype = out_dtype
        self.out_features = weight.shape[0]
        self.panels = kernels.pack_panels(weight.detach())
        if self.panels is None:
            raise ValueError("the panel GEMM needs bf16 weights and an AVX2/FMA build of the CPU kernels")
        self.bias = bias.detach().float().contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype or x.dtype
        y = self.kernels.panel_gemm(x.reshape(-1, x.shape[-1]), self.panels, self.out_features, self.bias, out_dtype)
        return _result(y, x, out_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (each in [0, out_features)) of the packed weight, [*ids.shape, in] bf16, bit for
        bit: a tied embedding looks its tokens up here instead of keeping its own copy."""
        column = ids % PANEL
        # Two index tensors around a slice: their broadcast shape comes first, then K.
        return self.panels[ids // PANEL, :, panel_slot(column)]


class DotBF16Gemm:
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CPUKernels, out_dtype: torch.dtype | None = None
    ) -> None:
        """bf16 weights in the vdpbf16ps layout of cpu_dpbf16.c (CPUs with AVX512-BF16). out_dtype: the
        result's dtype (None: the activations')."""
        self.kernels, self.out_dtype = kernels, out_dtype
        self.out_features, self.in_features = weight.shape
        self.panels = kernels.pack_dpbf16(weight.detach())
        if self.panels is None:
            raise ValueError("the dpbf16 GEMM needs bf16 weights and an AVX512-BF16 build of the CPU kernels")
        self.bias = bias.detach().float().contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype or x.dtype
        y = self.kernels.dpbf16_gemm(x.reshape(-1, x.shape[-1]), self.panels, self.out_features, self.bias, out_dtype)
        return _result(y, x, out_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the packed weight, [*ids.shape, in] bf16, bit for bit (a tied embedding's lookup)."""
        picked = self.panels[ids // PANEL, :, ids % PANEL, :]  # [*ids.shape, K / 2, 2]
        return picked.reshape(*ids.shape, -1)[..., : self.in_features].contiguous()


class OneDNNGemm:
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        """out_dtype: the result's dtype (None: the activations')."""
        self.compute_dtype, self.out_dtype = compute_dtype, out_dtype
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(compute_dtype).contiguous(), None)
        self.bias = bias.detach().to(compute_dtype).contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(self.compute_dtype).contiguous()  # [rows, in]
        y = torch.ops.mkldnn._linear_pointwise(_pad_rows(x2), self.weight, self.bias, "none", [], "")
        return _result(y[: x2.shape[0]], x, self.out_dtype or x.dtype)


class BucketedLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
        self.weight, self.bias, self.out_dtype = weight, bias, out_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = F.linear(_pad_rows(x2), self.weight, self.bias)
        return _result(y[: x2.shape[0]], x, self.out_dtype or x.dtype)


class Int8Gemm:
    def __init__(
        self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, kernels: Int8Kernels,
        w8a8_min_rows: int | None, out_dtype: torch.dtype | None = None, vnni: bool = False,
    ) -> None:
        """weight: a float weight, quantized here per output channel, or a checkpoint's QuantizedWeight,
        packed as it is. w8a8_min_rows: the row count from which W8A8 runs (None: never). out_dtype:
        the result's dtype (None: the activations'). vnni: the AVX512-VNNI kernel at every row count
        instead (cpu_int8.vnni_supported)."""
        self.kernels, self.w8a8_min_rows, self.out_dtype, self.vnni = kernels, w8a8_min_rows, out_dtype, vnni
        self.perm = None  # act-order: the input columns in the order of the packed weight's
        pack = pack_int8_vnni if vnni else kernels.pack
        if isinstance(weight, QuantizedWeight):
            self.weight = pack(weight.qweight, weight.scales, weight.group_size)
            self.perm = weight.perm
        else:
            self.weight = pack(*quantize_weight_int8(weight))
        self.bias = bias.detach().float().contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype or x.dtype
        x2 = x.reshape(-1, x.shape[-1])  # [rows, in]
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)  # groups contiguous, as the weight was packed
        if self.vnni:
            y = self.kernels.vnni(x2, self.weight, self.bias, out_dtype)
        elif self.w8a8_min_rows is not None and x2.shape[0] >= self.w8a8_min_rows:
            y = self.kernels.w8a8(x2.to(torch.float32), self.weight, self.bias)
        else:
            y = self.kernels.w8a16(x2, self.weight, self.bias, out_dtype)
        return _result(y, x, out_dtype)

    @property
    def per_channel(self) -> bool:
        """One scale per output row and no input permutation: what `rows` reads back."""
        return self.perm is None and self.weight.group_size >= self.weight.in_features

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight as the kernels multiply them, q * scale ([*ids.shape, in] float32):
        a tied embedding of quantization="int8" looks its tokens up here instead of keeping the float
        matrix (the vocabulary's bytes halve; its rows carry the head's rounding). Per channel only."""
        if not self.per_channel:
            raise ValueError("Int8Gemm.rows reads per-channel weights without an input permutation")
        w, k = self.weight, self.weight.in_features
        if self.vnni:  # [P, Kp / 4, 16, 4] bytes q + 128
            q = w.panels[ids // PANEL, :, ids % PANEL, :].reshape(*ids.shape, -1).int() - VNNI_ZERO
        else:  # [P, Kp, 16] int8
            q = w.panels[ids // PANEL, :, ids % PANEL]
        return q[..., :k].float() * w.scales[0, ids].unsqueeze(-1)


class Int4Gemm:
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels: Int4Kernels, w4a8: bool,
                 out_dtype: torch.dtype | None = None) -> None:
        """weight: a checkpoint's integers that fit 4 bits per group (cpu_int8.fits_int4). w4a8: run W4A8
        (cpu_int8.w4a8_supported), else W4A16."""
        self.kernels, self.out_dtype, self.perm = kernels, out_dtype, weight.perm
        q, zeros = split_int4(weight.qweight, weight.group_size)
        self.weight = pack_int4(q, zeros, weight.scales, weight.group_size, w4a8)
        self.bias = bias.detach().float().contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype or x.dtype
        x2 = x.reshape(-1, x.shape[-1])  # [rows, in]
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)  # groups contiguous, as the weight was packed
        y = self.kernels(x2, self.weight, self.bias, out_dtype)
        return _result(y, x, out_dtype)

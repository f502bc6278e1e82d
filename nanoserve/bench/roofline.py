"""The roofline as a model of the run, measured on this machine in the same run.

Two figures bound every step: the best GEMM FLOP/s at the model's shapes (over every GEMM path
this machine has) and the weight-streaming bandwidth (model-dtype weight bytes per second through
a decode-sized GEMM, one row, on a buffer far bigger than any cache). A step cannot take less
than max(bytes it must read / bandwidth, FLOPs / peak); the run's floor is the sum over its steps.

Under both, the instruction peaks (`measure_instruction_peaks`): register-only loops of the
instructions the CPU kernels are built from (float32 FMA; int16 multiply-add pairs, what W8A8
runs; u8 x s8 multiply-adds, llama.cpp's AVX2 dot product), so each C GEMM path is reported as
achieved / the peak of its own instruction (`gemm_efficiency`).
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.bench.model_shape import ModelShape

GemmPath = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]  # weight -> (x -> x @ w.T)

# The bandwidth buffer: the model's weights up to this size (a 0.6B bf16 model is 1.2 GB);
# far bigger than any last-level cache, small enough to sit beside the loaded model.
BANDWIDTH_BUFFER_BYTES = 256 * 2**20


def _time_call(fn: Callable[[], object], min_time: float = 0.2) -> float:
    """Seconds per call of fn, with Python's cyclic garbage collector held off: a collection over a
    process that imported torch takes milliseconds, the size of a whole 64-row pass here."""
    fn()
    collecting = gc.isenabled()
    gc.disable()
    try:
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed > min_time and n >= 3:
                return elapsed / n
    finally:
        if collecting:
            gc.enable()


def _panel_gemm() -> GemmPath | None:
    """nanoserve's C panel GEMM (bf16 weight panels, float32 math), where its library builds."""
    from nanoserve.kernels import cpu_kernels
    from nanoserve.kernels.cpu_gemm import PanelGemm

    lib = cpu_kernels.load()
    if lib is None or not lib.panel_gemm_supported():
        return None
    kernels = cpu_kernels.CPUKernels(lib)
    return lambda w: PanelGemm(w, None, kernels)


def _int8_gemms() -> dict[str, GemmPath]:
    """nanoserve's int8 GEMMs (weights quantized per channel here), where its library builds."""
    from nanoserve.kernels import cpu_kernels
    from nanoserve.kernels.cpu_gemm import Int8Gemm
    from nanoserve.kernels.cpu_int8 import Int8Kernels

    lib = cpu_kernels.load()
    if lib is None or not lib.int8_gemm_supported():
        return {}
    kernels = Int8Kernels(lib)
    paths = {INT8_W8A16: lambda w: Int8Gemm(w, None, kernels, None),
             INT8_W8A8: lambda w: Int8Gemm(w, None, kernels, 1)}
    if lib.vnni_supported():
        paths[INT8_VNNI] = lambda w: Int8Gemm(w, None, kernels, None, vnni=True)
    return paths


def _int4_gemm() -> dict[str, GemmPath]:
    """nanoserve's W4A8 GEMM (an int4 checkpoint's default path) on the weight rounded to 4 bits in
    groups of 128 here, where its library builds."""
    from nanoserve.kernels import cpu_kernels
    from nanoserve.kernels.cpu_gemm import Int4Gemm
    from nanoserve.kernels.cpu_int8 import Int4Kernels
    from nanoserve.quantization.weight import QuantizedWeight

    lib = cpu_kernels.load()
    if lib is None or not lib.int8_gemm_supported():
        return {}
    kernels = Int4Kernels(lib)

    def prepare(w: torch.Tensor):
        n, k = w.shape
        group = 128 if k % 128 == 0 else k
        groups = w.float().view(n, k // group, group)
        scales = (groups.abs().amax(-1) / 7).clamp(min=1e-8)
        q = torch.round(groups / scales[..., None]).clamp(-8, 7).to(torch.int8).view(n, k)
        return Int4Gemm(QuantizedWeight(q, scales, group), None, kernels, w4a8=True)

    return {INT4_W4A8: prepare}


def _dpbf16_gemm() -> GemmPath | None:
    """nanoserve's vdpbf16ps GEMM (bf16 weight panels of input pairs), where the CPU has AVX512-BF16."""
    from nanoserve.kernels import cpu_kernels
    from nanoserve.kernels.cpu_gemm import DotBF16Gemm

    lib = cpu_kernels.load()
    if lib is None or not lib.dpbf16_supported():
        return None
    kernels = cpu_kernels.CPUKernels(lib)
    return lambda w: DotBF16Gemm(w, None, kernels)


def _onednn_packed(dtype: torch.dtype) -> GemmPath:
    def prepare(w: torch.Tensor):
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).contiguous(), None)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], "")
    return prepare


PANEL = "panel bf16-weight (C)"
INT8_W8A16 = "int8 W8A16 (C)"
INT8_W8A8 = "int8 W8A8 (C)"
INT4_W4A8 = "int4 W4A8 (C)"
INT8_VNNI = "int8 W8A8 VNNI (C)"
DPBF16 = "dpbf16 bf16-weight (C)"
ONEDNN_BF16 = "oneDNN packed bfloat16"
# instruction loop (cpu_int8.c) -> what it is; the zmm ones only where the CPU has them
INSTRUCTIONS = {
    "peak_loop_fma_f32": "float32 FMA (vfmadd231ps)",
    "peak_loop_madd_i16": "int16 pairs (vpmaddwd + vpaddd)",
    "peak_loop_maddubs_u8s8": "u8 x s8 (vpmaddubsw + vpmaddwd)",
    "peak_loop_maddubs_i16": "u8 x s8, int16 sums (vpmaddubsw + vpaddw)",
    "peak_loop_fma_f32_zmm": "float32 FMA, zmm (AVX-512)",
    "peak_loop_dpbusd": "u8 x s8 into int32, zmm (vpdpbusd, AVX512-VNNI)",
    "peak_loop_dpbf16": "bf16 pairs into float32, zmm (vdpbf16ps, AVX512-BF16)",
}


def path_instruction(vnni: bool) -> dict[str, str]:
    """The GEMM paths measured against an instruction peak, and the instruction each is bound by (W4A8
    runs on vpdpbusd where the CPU has VNNI)."""
    out = {PANEL: "peak_loop_fma_f32", INT8_W8A16: "peak_loop_fma_f32", INT8_W8A8: "peak_loop_madd_i16",
           INT4_W4A8: "peak_loop_dpbusd" if vnni else "peak_loop_maddubs_i16"}
    if vnni:
        out[INT8_VNNI] = "peak_loop_dpbusd"
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        out[ONEDNN_BF16] = "peak_loop_dpbf16"
    out[DPBF16] = "peak_loop_dpbf16"  # measured only where the CPU has it (its peak is then measured too)
    return out


def measure_instruction_peaks(threads: int | None = None, repeats: int = 30) -> dict[str, float]:
    """FLOP/s (2 per multiply-add) of each instruction loop on `threads` threads (default torch's):
    the best of `repeats` short runs, so a slice of time lost to another process does not set it.
    Empty where the kernel library is not built with AVX2/FMA."""
    from nanoserve.kernels import cpu_kernels

    lib = cpu_kernels.load()
    if lib is None or not lib.int8_gemm_supported():
        return {}
    threads = threads or torch.get_num_threads()
    peaks = {}
    for name in INSTRUCTIONS:
        loop, best = getattr(lib, name), 0.0
        loop(10_000, threads)  # wake the threads
        for _ in range(repeats):
            start = time.perf_counter()
            macs = loop(200_000, threads)
            best = max(best, 2 * macs / (time.perf_counter() - start))
        if best > 0:  # 0: not on this CPU
            peaks[name] = best
    return peaks


def gemm_paths(dtype: torch.dtype, device: torch.device, rows: int, int8: bool = False) -> dict[str, GemmPath]:
    """Every GEMM path worth measuring for `dtype` weights at `rows` rows on `device` (with
    `int8`, nanoserve's int8 GEMMs too)."""
    name = str(dtype).removeprefix("torch.")
    paths: dict[str, GemmPath] = {f"F.linear {name}": lambda w: (lambda x: F.linear(x, w))}
    if device.type != "cpu":
        return paths
    lowp = dtype in (torch.bfloat16, torch.float16)
    if lowp:  # CPUs without bf16 dot products run these far faster in float32
        paths["F.linear float32"] = lambda w: (lambda x, w32=w.float(): F.linear(x.float(), w32))
    if torch.backends.mkldnn.is_available():
        paths["oneDNN packed float32"] = _onednn_packed(torch.float32)
        if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            paths[ONEDNN_BF16] = _onednn_packed(torch.bfloat16)
    panel = _panel_gemm() if dtype == torch.bfloat16 else None
    if panel is not None:
        paths[PANEL] = panel
    dpbf16 = _dpbf16_gemm() if dtype == torch.bfloat16 else None
    if dpbf16 is not None:
        paths[DPBF16] = dpbf16
    if int8:
        paths.update(_int8_gemms())
    return paths


def _best_of_paths(paths: dict[str, GemmPath], weights: list[torch.Tensor], rows: int, work: float,
                   device: torch.device) -> dict[str, float]:
    """work per second (FLOPs or bytes of one pass over `weights`) for each path, best of two."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = weights[0].dtype
    out = {}
    for name, prepare in paths.items():
        calls = [(prepare(w), torch.randn(rows, w.shape[1], device=device).to(dtype)) for w in weights]

        def one_pass(calls=calls) -> None:
            for call, x in calls:
                call(x)
            sync()

        # Best of two: a peak, so a pass slowed by anything else running must not set it.
        out[name] = max(work / _time_call(one_pass) for _ in range(2))
        del calls
    return out


@torch.inference_mode()
def measure_gemm_peak(shape: ModelShape, dtype: torch.dtype, device: torch.device, rows: int = 256,
                      int8: bool = False) -> dict:
    """FLOP/s of one layer's projections at `rows` tokens, per GEMM path; the peak is the best."""
    weights = [torch.randn(n, k, device=device).to(dtype) for k, n in shape.linear_shapes()]
    flops = sum(2 * rows * k * n for k, n in shape.linear_shapes())
    per_path = _best_of_paths(gemm_paths(dtype, device, rows, int8), weights, rows, flops, device)
    best = max(per_path, key=per_path.get)
    return {"rows": rows, "per_path_flops": per_path, "best_path": best, "peak_flops": per_path[best]}


@torch.inference_mode()
def measure_weight_bandwidth(shape: ModelShape, dtype: torch.dtype, device: torch.device,
                             buffer_bytes: int = BANDWIDTH_BUFFER_BYTES) -> dict:
    """Model-dtype weight bytes per second through a one-row GEMM, per decode path.

    The buffer holds copies of one layer's weights, as many as fit in buffer_bytes (at least
    one layer, at most the model's layer count). Paths that read a float32 copy of bf16 weights
    read twice the bytes, and their figure shows it.
    """
    layer = [torch.randn(n, k, device=device).to(dtype) for k, n in shape.linear_shapes()]
    layer_bytes = sum(w.numel() * w.element_size() for w in layer)
    copies = max(1, min(shape.layers, buffer_bytes // layer_bytes))
    weights = layer + [w.clone() for _ in range(copies - 1) for w in layer]
    paths = gemm_paths(dtype, device, rows=1)
    if dtype != torch.float32:  # float32 copies are not how a bf16 decode should read its weights
        paths = {k: v for k, v in paths.items() if "float32" not in k}
    per_path = _best_of_paths(paths, weights, 1, copies * layer_bytes, device)
    best = max(per_path, key=per_path.get)
    return {"buffer_bytes": copies * layer_bytes, "per_path_bytes_s": per_path, "best_path": best,
            "bandwidth": per_path[best]}


@dataclass(frozen=True)
class Roofline:
    shape: ModelShape
    itemsize: int  # bytes per weight / KV element (the model dtype)
    peak_flops: float
    bandwidth: float  # bytes/s

    def step_floor(self, entries) -> float:
        cost = self.shape.step_cost(entries, self.itemsize)
        return max(cost.bytes / self.bandwidth, cost.flops / self.peak_flops)

    def step_bound(self, entries) -> str:
        cost = self.shape.step_cost(entries, self.itemsize)
        return "memory" if cost.bytes / self.bandwidth >= cost.flops / self.peak_flops else "compute"


@torch.inference_mode()
def gemm_efficiency(shape: ModelShape, dtype: torch.dtype, device: torch.device, peaks: dict[str, float],
                    rows_list: tuple[int, ...] = (16, 64, 256)) -> dict:
    """Per row count and C GEMM path: FLOP/s at the model's shapes and the fraction of the peak of
    the instruction that path is built from (path_instruction)."""
    if device.type != "cpu" or not peaks:
        return {}
    weights = [torch.randn(n, k).to(dtype) for k, n in shape.linear_shapes()]
    from nanoserve.kernels import cpu_kernels

    instruction = path_instruction(bool(cpu_kernels.load().vnni_supported()))
    out = {}
    for rows in rows_list:
        paths = {**gemm_paths(dtype, device, rows, int8=True), **_int4_gemm()}
        paths = {k: v for k, v in paths.items() if k in instruction and instruction[k] in peaks}
        flops = sum(2 * rows * k * n for k, n in shape.linear_shapes())
        per_path = _best_of_paths(paths, weights, rows, flops, device)
        out[rows] = {name: {"flops": f, "of_peak": f / peaks[instruction[name]], "instruction": instruction[name]}
                     for name, f in per_path.items()}
    return out


def measure_roofline(shape: ModelShape, dtype: torch.dtype, device: torch.device,
                     int8: bool = False) -> tuple[Roofline, dict]:
    """Measure both bounds now (with `int8`, the int8 GEMMs count for the peak); returns the model
    and the figures for the report: also the instruction peaks and each C path's share of its own."""
    peak = measure_gemm_peak(shape, dtype, device, int8=int8)
    bandwidth = measure_weight_bandwidth(shape, dtype, device)
    roof = Roofline(shape, dtype.itemsize, peak["peak_flops"], bandwidth["bandwidth"])
    figures = {"gemm_peak": peak, "weight_bandwidth": bandwidth}
    if device.type == "cpu":
        figures["instruction_peaks"] = measure_instruction_peaks()
        figures["gemm_efficiency"] = gemm_efficiency(shape, dtype, device, figures["instruction_peaks"])
    return roof, figures

"""Build, load and call the C kernels in cpu_kernels.c (CPU only).

The sources (SOURCES: cpu_kernels.c, cpu_int8.c, cpu_dpbf16.c, cpu_decode_layers.c; one library) are compiled once
per machine with the system C compiler (`cc -O3 -march=native -fopenmp`) into $NANOSERVE_CACHE/kernels (default ~/.cache/nanoserve/kernels, keyed by the source,
the flags and the CPU) and loaded with ctypes; it links the OpenMP runtime torch has already
loaded. Where no compiler is found or the build fails, `load()` returns None and the CPU backend
keeps its PyTorch paths (it also decides whether to load them at all: NANOSERVE_CPU_KERNELS).

`CPUKernels` binds the small fused ops (RMSNorm with residual, q/k norm + RoPE) and the GEMMs over
packed bf16 weights (the AVX2 panel GEMM, AVX512-BF16's dpbf16) to a loaded library; attention lives
in cpu_attention.py, the int8/int4 GEMMs in cpu_int8.py.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from nanoserve.cache import cache_root
from nanoserve.kernels.trace import traced

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_kernels.c", "cpu_int8.c", "cpu_dpbf16.c", "cpu_decode_layers.c"))
HEADERS = (Path(__file__).with_name("cpu_simd.h"),)  # included by the sources: part of the build's key
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "paged_attention_f32": [_P] * 4 + [_I32, _P, _I64] + [_P] * 4 + [_I64] * 7 + [_F, _I32],
    "paged_decode_f32": [_P] * 4 + [_I32, _P, _I64, _P] + [_I64] * 7 + [_F, _I32, _I32],
    "rms_norm_bf16": [_P] * 5 + [_I64, _I64, _F, _I32],
    "silu_mul_bf16": [_P, _P, _I64, _I64, _I32],
    "qk_norm_rope_bf16": [_P, _P, _I64] + [_P] * 6 + [_I64] * 4 + [_F, _I32],
    "pack_bf16_panels": [_P, _I64, _I64, _P, _I32],
    "store_kv_rows": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64],
    "panel_gemm_bf16": [_P, _I64, _I64, _P, _I64, _P, _P, _I32, _I32],
    "panel_gemm_supported": [],
    # cpu_decode_layers.c (driven by cpu_decode_layers.py)
    "decode_layers_bf16": [_P, _I64, _P, _P, _P, _P],
    # cpu_int8.c (bound in cpu_int8.py)
    "int8_gemm_supported": [],
    "pack_int8_panels": [_P, _I64, _I64, _I64, _P, _I32],
    "quantize_rows_int8": [_P, _I64, _I64, _I64, _P, _P, _I32],
    "int8_gemm_w8a16": [_P, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, _P, _I32, _I32],
    "int8_gemm_w8a8": [_P, _P, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, _P, _I32],
    "int4_gemm_w4a16": [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I32, _I32],
    "quantize_blocks_int8": [_P, _I64, _I64, _I64, _I64, ctypes.c_double, _I64] + [_P] * 6 + [_I32],
    "int4_gemm_w4a8": [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I32, _I32],
    "vnni_supported": [],
    "activation_run_blocks": [_I64, _I64],
    "dpbf16_supported": [],
    "pack_dpbf16_panels": [_P, _I64, _I64, _P, _I32],
    "dpbf16_gemm": [_P, _I64, _I64, _P, _I64, _P, _P, _I32, _I32],
    "prefill_attention_dpbf16_supported": [],
    "decode_dpbf16_supported": [],
    "prefill_attention_dpbf16": [_P, _P, _I32, _P, _P, _P, _I64, _P, _P] + [_I64] * 5 + [_F, _I32, _I32],
    "set_w4a8_vnni": [_I32],
    "int8_gemm_vnni": [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I32, _I32],
    "peak_loop_fma_f32": [_I64, _I32],
    "peak_loop_madd_i16": [_I64, _I32],
    "peak_loop_maddubs_u8s8": [_I64, _I32],
    "peak_loop_maddubs_i16": [_I64, _I32],
    "peak_loop_fma_f32_zmm": [_I64, _I32],
    "peak_loop_dpbusd": [_I64, _I32],
    "peak_loop_dpbf16": [_I64, _I32],
}
RETURNS_INT = ("paged_attention_f32", "paged_decode_f32", "panel_gemm_bf16", "panel_gemm_supported",
               "decode_layers_bf16", "int8_gemm_supported", "int8_gemm_w8a16", "int8_gemm_w8a8", "int4_gemm_w4a16",
               "int4_gemm_w4a8", "vnni_supported", "activation_run_blocks", "int8_gemm_vnni", "dpbf16_supported", "dpbf16_gemm",
               "prefill_attention_dpbf16_supported", "prefill_attention_dpbf16", "decode_dpbf16_supported")
RETURNS_DOUBLE = ("peak_loop_fma_f32", "peak_loop_madd_i16", "peak_loop_maddubs_u8s8", "peak_loop_maddubs_i16",
                  "peak_loop_fma_f32_zmm", "peak_loop_dpbusd", "peak_loop_dpbf16")
PANEL = 16  # output columns per packed weight panel (cpu_kernels.c)


def panel_slot(column: torch.Tensor) -> torch.Tensor:
    """Where column j (0-15) of a panel sits in its 16-weight row, as panel_slot in cpu_kernels.c:
    columns 0-7 in the even slots, 8-15 in the odd ones."""
    half = PANEL // 2
    return torch.where(column < half, 2 * column, 2 * (column - half) + 1)

_lib: ctypes.CDLL | None = None
_load_attempted = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    return Path(cache_root()) / "kernels"


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(cc: str) -> Path:
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join([cc, *CFLAGS]).encode() + _cpu_fingerprint().encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)  # atomic: a concurrent build of the same source is just as good
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, built on the first call; None where it cannot be built."""
    global _lib, _load_attempted
    with _lock:
        if _load_attempted:
            return _lib
        _load_attempted = True
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            logger.info("no C compiler found: the CPU kernels fall back to PyTorch")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("building the CPU kernels failed, falling back to PyTorch: %s", detail[-2000:])
            return None
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if name in RETURNS_INT else ctypes.c_double if name in RETURNS_DOUBLE else None
        _lib = lib
        return _lib


IO_X_BF16, IO_Y_BF16 = 1, 2  # the GEMM kernels' io flags: x, y bf16 rather than float32 (cpu_kernels.c)


def gemm_operands(x: torch.Tensor, n: int, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x [M, K] as a GEMM kernel reads it (bf16 or float32, contiguous), its result [M, n] (bf16 if
    out_dtype is, else float32) and the io flags saying which of them are bf16: the kernel converts
    bf16 rows itself, where two torch conversions around a few-row call cost more than its overhead."""
    if x.dtype != torch.bfloat16:
        x = x.to(torch.float32)
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    return x, y, (IO_X_BF16 if x.dtype == torch.bfloat16 else 0) | (IO_Y_BF16 if y.dtype == torch.bfloat16 else 0)


def _usable(*tensors: torch.Tensor) -> bool:
    """bf16 CPU tensors outside autograd (the kernels write raw memory). Runs ~85 times a decode
    step: a loop over `is_cpu` is 2.4x faster than a generator over `device.type`."""
    for t in tensors:
        if t.dtype != torch.bfloat16 or not t.is_cpu:
            return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


class CPUKernels:
    """The fused ops of cpu_kernels.c on a loaded library. Each returns None where it does not
    apply (dtype, layout), and the caller runs its PyTorch path."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """RMSNorm over the last dim (residual added first, as the reference does) for bf16."""
        if not (_usable(x, weight) and (residual is None or _usable(residual))):
            return None
        dim = x.shape[-1]
        x = x.contiguous()
        out = torch.empty_like(x)
        new_residual = None
        if residual is not None:
            residual = residual.contiguous()
            new_residual = torch.empty_like(x)
        with traced("nanoserve::cpu_rms_norm"):
            self.lib.rms_norm_bf16(
                x.data_ptr(), residual.data_ptr() if residual is not None else None,
                new_residual.data_ptr() if new_residual is not None else None, weight.contiguous().data_ptr(),
                out.data_ptr(), x.numel() // dim, dim, eps, torch.get_num_threads(),
            )
        return out if residual is None else (out, new_residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for x = [gate | up] along the last dim, bf16; None otherwise."""
        if not _usable(x) or x.shape[-1] % 2 or x.shape[-1] == 0:
            return None
        x = x.contiguous()
        n = x.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        with traced("nanoserve::cpu_silu_and_mul"):
            self.lib.silu_mul_bf16(x.data_ptr(), out.data_ptr(), x.numel() // (2 * n), n, torch.get_num_threads())
        return out

    def qk_norm_rope(
        self,
        positions: torch.Tensor,  # [tokens] int64
        q: torch.Tensor,  # [tokens, num_q_heads * head_dim], rows may be strided (a slice of qkv)
        k: torch.Tensor,  # [tokens, num_k_heads * head_dim], same row stride as q
        cos_sin: torch.Tensor,  # [max_pos, head_dim] float32
        q_weight: torch.Tensor,  # [head_dim]
        k_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q_norm / k_norm per head then RoPE, for bf16; q [T, Hq, D], k [T, Hk, D] out, or None."""
        head_dim = q_weight.shape[0]
        if not _usable(q, k, q_weight, k_weight) or cos_sin.dtype != torch.float32:
            return None
        if q.stride(-1) != 1 or k.stride(-1) != 1 or q.stride(0) != k.stride(0):
            return None
        tokens = q.shape[0]
        hq, hk = q.shape[1] // head_dim, k.shape[1] // head_dim
        q_out = torch.empty(tokens, hq, head_dim, dtype=q.dtype)
        k_out = torch.empty(tokens, hk, head_dim, dtype=k.dtype)
        if positions.dtype != torch.int64 or not positions.is_contiguous():  # a no-op .to() costs ~3 us
            positions = positions.to(torch.int64).contiguous()
        with traced("nanoserve::cpu_qk_norm_rope"):
            self.lib.qk_norm_rope_bf16(
                q.data_ptr(), k.data_ptr(), q.stride(0), q_out.data_ptr(), k_out.data_ptr(),
                q_weight.contiguous().data_ptr(), k_weight.contiguous().data_ptr(), positions.data_ptr(),
                cos_sin.contiguous().data_ptr(), tokens, hq, hk, head_dim, eps, torch.get_num_threads(),
            )
        return q_out, k_out

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        """store_kv_torch's semantics (key/value [T, H, D], caches [blocks, block_size, H, D], slots [T],
        -1 = skip) in one C call; False (nothing written) where the layouts or dtypes do not allow it."""
        if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype or key.device.type != "cpu":
            return False
        heads, dim = key.shape[1:]
        rows_contiguous = all(t.stride(2) == 1 and t.stride(1) == dim for t in (key, value))
        if not (rows_contiguous and k_cache.is_contiguous() and v_cache.is_contiguous()) or slots.dtype != torch.int64:
            return False
        self.lib.store_kv_rows(key.data_ptr(), key.stride(0) * key.element_size(), value.data_ptr(),
                               value.stride(0) * value.element_size(), k_cache.data_ptr(), v_cache.data_ptr(),
                               slots.data_ptr(), key.shape[0], heads * dim * key.element_size())
        return True

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A bf16 weight [N, K] packed for `panel_gemm` ([ceil(N / 16), K, 16]); None where the
        build has no AVX2/FMA or the weight is not bf16."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not self.lib.panel_gemm_supported():
            return None
        n, k = weight.shape
        weight = weight.contiguous()
        panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.bfloat16)
        self.lib.pack_bf16_panels(weight.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
        return panels

    def pack_dpbf16(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A bf16 weight [N, K] packed for `dpbf16_gemm` ([ceil(N / 16), ceil(K / 2), 16, 2]: per pair of
        inputs, 16 columns' two weights); None where the build has no AVX512-BF16 or the weight is not bf16."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not self.lib.dpbf16_supported():
            return None
        n, k = weight.shape
        panels = torch.empty(-(-n // PANEL), -(-k // 2), PANEL, 2, dtype=torch.bfloat16)
        self.lib.pack_dpbf16_panels(weight.contiguous().data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
        return panels

    def dpbf16_gemm(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [M, K] (bf16; others are rounded to it) @ (the weight packed in `panels`, [n, K] bf16)^T
        (+ bias float32) -> [M, n] bf16, or float32 for out_dtype float32. vdpbf16ps: float32 sums of
        bf16 products (AVX512-BF16)."""
        if x.dtype != torch.bfloat16:  # a no-op .to() costs ~3 us a call (see cpu_gemm._result)
            x = x.to(torch.bfloat16)
        if not x.is_contiguous():
            x = x.contiguous()
        y_bf16 = out_dtype == torch.bfloat16
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16 if y_bf16 else torch.float32)
        with traced("nanoserve::cpu_dpbf16_gemm"):
            err = self.lib.dpbf16_gemm(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), n,
                                       bias.data_ptr() if bias is not None else None, y.data_ptr(), int(y_bf16),
                                       torch.get_num_threads())
        if err == 2:
            raise MemoryError("dpbf16_gemm: no memory for the rearranged activations")
        if err:
            raise RuntimeError("dpbf16_gemm is not available in this build (no AVX512-BF16)")
        return y

    def panel_gemm(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """x [M, K] (bf16 or float32; other dtypes are converted) @ (the weight packed in `panels`, [n, K]
        bf16)^T (+ bias float32) -> [M, n] in out_dtype if bf16, else float32. Math in float32."""
        x, y, io = gemm_operands(x, n, out_dtype)
        with traced("nanoserve::cpu_panel_gemm"):
            err = self.lib.panel_gemm_bf16(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), n,
                                           bias.data_ptr() if bias is not None else None, y.data_ptr(), io,
                                           torch.get_num_threads())
        if err == 2:
            raise MemoryError("panel_gemm_bf16: no memory for the float32 copies of bf16 activations")
        if err:
            raise RuntimeError("panel_gemm_bf16 is not available in this build (no AVX2/FMA)")
        return y

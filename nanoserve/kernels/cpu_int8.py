"""int8 weights on the CPU: quantization, packing, the two GEMMs of cpu_int8.c and their references.

Weights are quantized once at load, symmetric, one scale per output channel and group of
`group_size` input channels (None: the whole row, i.e. per channel):
    scale[n, g] = max |w[n, k in g]| / 127,   q[n, k] = round(w[n, k] / scale[n, g])   in [-127, 127]
Two GEMMs read the same packed weights (cpu_int8.c says how):
  W8A16  y = x . (q * scale)^T in float32                  (activations untouched)
  W8A8   y = sx[m] * sum_g scale[n, g] * (qx . q)_g         (activations quantized per token:
         sx[m] = max |x[m]| / 127, qx = round(x * 127 / max |x[m]|); the group sums are exact int32)
Each `*_torch` function is the reference the C kernel is tested against, same arguments.

A third kernel, W4A16, runs 4-bit weights with zero points (int4 checkpoints: GPTQ, AWQ,
compressed-tensors), half the int8 bytes: w = (q - z) * s per group, q in [0, 15]. It takes the
integers a checkpoint decodes to (nanoserve/quantization/weight.py: q - z as int8) whenever each
group of them spans at most 16 values (split_int4 recovers q and z; every genuine int4 group does).
A fourth, W4A8, runs the same 4-bit weights against activations quantized to int8 (one scale per run
of up to four blocks of 32 inputs: activation_run_blocks), with integer multiply-adds, except for
outliers (values far above their 32-input block's mean |x|), which stay exact in float32:
  W4A8   y = x_hat . ((q - z) * s)^T, x_hat = qx * xs per block (one xs a run), x at the outliers.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nanoserve.kernels.cpu_kernels import gemm_operands
from nanoserve.kernels.trace import traced

QMAX = 127  # symmetric: -128 is never produced, so |q| * |q| products and their negation are exact
PANEL = 16  # output columns per packed panel (cpu_int8.c)


# ---- quantization (used at load, and the references' first step) -----------------------------

def check_group_size(group_size: int | None, in_features: int) -> int:
    """The effective group size: `in_features` for None (per channel); else an even positive int."""
    if group_size is None or group_size >= in_features:
        return in_features
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even int >= 2 (or None for per channel), got {group_size!r}")
    return group_size


def quantize_weight_int8(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (q [N, K] int8, scales [N, ceil(K / group)] float32)."""
    n, k = weight.shape
    group = check_group_size(group_size, k)
    groups = -(-k // group)
    w = weight.detach().float()
    padded = torch.nn.functional.pad(w, (0, groups * group - k)).view(n, groups, group)
    scales = padded.abs().amax(dim=-1) / QMAX  # [N, groups]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / safe.unsqueeze(-1)).clamp_(-QMAX, QMAX).view(n, -1)[:, :k]
    return q.to(torch.int8).contiguous(), scales.contiguous()


def dequantize_weight_int8(q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """The float32 weight the int8 one stands for ([N, K])."""
    k = q.shape[1]
    group = check_group_size(group_size, k)
    return q.float() * scales.repeat_interleave(group, dim=1)[:, :k]


def quantize_rows_int8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K] int16 holding int8 values, scales [M] float32), per token.
    The same float operations as quantize_rows_int8 in C: q = round-half-even(x * (127 / amax))."""
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))  # 127.0f / amax, as C
    return torch.round(x * inv[:, None]).to(torch.int16), amax / QMAX


def _group_sums(qx: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """sum_g scales[n, g] * (qx . q) over group g, the group dot products exact (int64 matmul)."""
    k = q.shape[1]
    group = check_group_size(group_size, k)
    out = torch.zeros(qx.shape[0], q.shape[0], dtype=torch.float64)
    for g, k0 in enumerate(range(0, k, group)):
        part = qx[:, k0:k0 + group].long() @ q[:, k0:k0 + group].long().T  # [M, N] exact
        out += part.double() * scales[:, g].double()
    return out


def int8_gemm_w8a16_torch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 . (q * scales)^T (+ bias) -> [M, N] float32."""
    y = x.double() @ dequantize_weight_int8(q, scales, group_size).double().T
    return (y + bias.double() if bias is not None else y).float()


def int8_gemm_w8a8_torch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32, quantized per token, times the int8 weight -> [M, N] float32."""
    qx, sx = quantize_rows_int8_torch(x.float())
    y = _group_sums(qx, q, scales, group_size) * sx.double()[:, None]
    return (y + bias.double() if bias is not None else y).float()


# ---- the C kernels ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight packed for cpu_int8.c: panels [ceil(N / 16), Kp, 16] int8 and scales
    [groups, ceil(N / 16) * 16] float32 (Kp = K rounded up to even)."""
    panels: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group_size: int  # effective: in_features when per channel

    @property
    def padded_in(self) -> int:
        return self.panels.shape[1]

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size() + self.scales.numel() * self.scales.element_size()


class Int8Kernels:
    """The int8 GEMMs of a loaded kernel library (cpu_kernels.load())."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if not lib.int8_gemm_supported():
            raise ValueError("the int8 GEMMs need the CPU kernels built with AVX2 and FMA")
        self.lib = lib

    def pack(self, q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> PackedInt8:
        """q [N, K] int8 and scales [N, groups] (quantize_weight_int8 with this group_size) -> the packed weight."""
        n, k = q.shape if q.dim() == 2 else (0, 0)
        group = check_group_size(group_size, k)
        if q.dtype != torch.int8 or q.dim() != 2 or tuple(scales.shape) != (n, -(-k // group)):
            raise ValueError("pack takes q [N, K] int8 and scales [N, ceil(K / group_size)] from quantize_weight_int8")
        kp = k + k % 2
        panels = torch.empty(-(-n // PANEL), kp, PANEL, dtype=torch.int8)
        self.lib.pack_int8_panels(q.contiguous().data_ptr(), n, k, kp, panels.data_ptr(), torch.get_num_threads())
        padded = torch.zeros(scales.shape[1], panels.shape[0] * PANEL, dtype=torch.float32)
        padded[:, :n] = scales.float().T
        return PackedInt8(panels, padded, n, k, group)

    def vnni(self, x: torch.Tensor, w: PackedInt8VNNI, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] bf16 or float32, quantized in the kernel (int8_gemm_vnni_torch says how) -> [M, N] (bf16
        if out_dtype is, else float32; bias float32). Needs AVX512-VNNI (vnni_supported)."""
        x, y, io = gemm_operands(x, w.out_features, out_dtype)
        with traced("nanoserve::cpu_int8_vnni"):
            rc = self.lib.int8_gemm_vnni(x.data_ptr(), x.shape[0], w.in_features, w.panels.data_ptr(),
                                         w.scales.data_ptr(), w.offsets.data_ptr(), w.group_size, w.out_features,
                                         bias.data_ptr() if bias is not None else None, y.data_ptr(), io,
                                         torch.get_num_threads())
        if rc == 1:
            raise ValueError("int8_gemm_vnni needs the CPU kernels built with AVX512-VNNI")
        if rc != 0:
            raise MemoryError(f"int8_gemm_vnni failed ({rc}): no memory for the quantized activations")
        return y

    def _group(self, w: PackedInt8) -> int:
        # one group (per channel) spans the padded width, so the W8A8 pairs never straddle it
        return w.padded_in if w.group_size >= w.in_features else w.group_size

    def quantize_rows(self, x: torch.Tensor, padded_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32 -> (q [M, padded_in] int16, zero past K; scales [M] float32)."""
        x = x.contiguous()
        m, k = x.shape
        q = torch.empty(m, padded_in, dtype=torch.int16)
        s = torch.empty(m, dtype=torch.float32)
        self.lib.quantize_rows_int8(x.data_ptr(), m, k, padded_in, q.data_ptr(), s.data_ptr(), torch.get_num_threads())
        return q, s

    def w8a16(self, x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] bf16 or float32 -> [M, N] (bf16 if out_dtype is, else float32; bias float32)."""
        x, y, io = gemm_operands(x, w.out_features, out_dtype)
        with traced("nanoserve::cpu_int8_w8a16"):
            rc = self.lib.int8_gemm_w8a16(x.data_ptr(), x.shape[0], w.in_features, w.panels.data_ptr(), w.padded_in,
                                          w.scales.data_ptr(), self._group(w), w.out_features,
                                          bias.data_ptr() if bias is not None else None, y.data_ptr(), io,
                                          torch.get_num_threads())
        if rc == 2:
            raise MemoryError("int8_gemm_w8a16: no memory for the float32 copies of bf16 activations")
        return y

    def w8a8(self, x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32, quantized per token here -> [M, N] float32 (bias float32)."""
        y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
        with traced("nanoserve::cpu_int8_w8a8"):
            xq, xs = self.quantize_rows(x, w.padded_in)
            self.lib.int8_gemm_w8a8(xq.data_ptr(), xs.data_ptr(), x.shape[0], w.in_features, w.panels.data_ptr(),
                                    w.padded_in, w.scales.data_ptr(), self._group(w), w.out_features,
                                    bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                    torch.get_num_threads())
        return y


# ---- W4A16 --------------------------------------------------------------------------------------

INT4_LEVELS = 16


def _group_view(values: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> [N, G, group], the last group padded by repeating its first column (no new values)."""
    n, k = values.shape
    groups = -(-k // group)
    pad = groups * group - k
    if pad:
        values = torch.cat([values, values[:, (groups - 1) * group:][:, :1].expand(n, pad)], dim=1)
    return values.view(n, groups, group)


def fits_int4(values: torch.Tensor, group: int) -> bool:
    """Do the int8 values (a checkpoint's q - z) span at most 16 levels in every group?"""
    g = _group_view(values, group)
    return bool(((g.amax(-1).int() - g.amin(-1).int()) < INT4_LEVELS).all())


def split_int4(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values [N, K] int8 (fits_int4) -> (q [N, K] uint8 in [0, 15], z [N, G] int32) with q - z = values:
    z = -min of the group, the smallest zero point that makes every q non-negative."""
    n, k = values.shape
    z = -_group_view(values, group).amin(-1).int()  # [N, G]
    q = values.int() + z.repeat_interleave(group, dim=1)[:, :k]
    assert 0 <= int(q.min()) and int(q.max()) < INT4_LEVELS, "split_int4 needs values that fit_int4"
    return q.to(torch.uint8), z


def int4_gemm_w4a16_torch(x: torch.Tensor, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 . ((q - z) * s)^T (+ bias) -> [M, N] float32; q [N, K] uint8, zeros/scales [N, G]."""
    k = q.shape[1]
    per_k = lambda t: t.repeat_interleave(group_size, dim=1)[:, :k]  # noqa: E731
    w = (q.double() - per_k(zeros).double()) * per_k(scales).double()
    y = x.double() @ w.T
    return (y + bias.double() if bias is not None else y).float()


W4A8_BLOCK = 32  # inputs per outlier block; a run of activation_run_blocks shares a scale (cpu_int8.c's W4_BLOCK)
W4A8_OUTLIER = 8.0  # an activation above this times its block's mean |x| stays exact (cpu_int8.c's W4_OUTLIER)
W4A8_MAX_OUTLIERS = 8  # per block, at most (cpu_int8.c's W4_MAX_OUTLIERS)


def w4a8_supported(group_size: int, in_features: int) -> bool:
    """W4A8 needs each weight group to be whole activation blocks (or one group spanning K)."""
    return group_size % W4A8_BLOCK == 0 or group_size >= in_features


ACTIVATION_RUN_BLOCKS = 4  # blocks of 32 inputs per activation scale, W4A8 and int8 VNNI (cpu_int8.c says why)


def activation_run_blocks(group: int, in_features: int) -> int:
    """Blocks per activation scale of the W4A8 and int8 VNNI kernels: ACTIVATION_RUN_BLOCKS, halved until
    no run spans two weight groups (cpu_int8.c's activation_run_blocks, which the kernels call)."""
    if group >= in_features:
        return ACTIVATION_RUN_BLOCKS
    run = ACTIVATION_RUN_BLOCKS
    while (group // W4A8_BLOCK) % run:
        run //= 2
    return run


def quantize_blocks_int8_torch(x: torch.Tensor, outlier: float = W4A8_OUTLIER,
                               scale_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (qx [M, Kp] int8, zero past K and at outliers; xs [M, Kp / 32] float32;
    outliers [M, K] bool), Kp = K rounded up to 32. The same float operations as quantize_blocks_int8
    in C: per block of 32 inputs, a value above `outlier` times the block's mean |x| is an outlier
    (kept exactly, out of qx); of the rest, per run of `scale_blocks` blocks (each block of a run
    takes its scale), qx = round-half-even(x * (127 / amax)), xs = amax / 127."""
    m, k = x.shape
    kp = -(-k // W4A8_BLOCK) * W4A8_BLOCK
    blocks = torch.cat([x, x.new_zeros(m, kp - k)], dim=1).view(m, kp // W4A8_BLOCK, W4A8_BLOCK)
    real = (torch.arange(kp) < k).view(kp // W4A8_BLOCK, W4A8_BLOCK).sum(-1).double()  # inputs per block
    limit = outlier * blocks.double().abs().sum(-1) / real
    outlier = blocks.abs().double() > limit[..., None]
    kept = torch.where(outlier, torch.zeros_like(blocks), blocks)
    amax = kept.abs().amax(dim=2)  # [M, blocks]
    runs = -(-amax.shape[1] // scale_blocks)
    padded = torch.cat([amax, amax.new_zeros(m, runs * scale_blocks - amax.shape[1])], dim=1)
    amax = padded.view(m, runs, scale_blocks).amax(dim=2).repeat_interleave(scale_blocks, dim=1)[:, : amax.shape[1]]
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))  # 127.0f / amax, as C
    qx = torch.round(kept * inv[..., None]).to(torch.int8).view(m, kp)
    return qx, amax / QMAX, outlier.view(m, kp)[:, :k]


def int4_gemm_w4a8_torch(x: torch.Tensor, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int, bias: torch.Tensor | None = None,
                         outlier_factor: float = W4A8_OUTLIER, scale_blocks: int | None = None) -> torch.Tensor:
    """x [M, K] float32, quantized per block of 32 inputs (a scale per `scale_blocks` blocks, by default
    the kernels' activation_run_blocks; outliers exact), times the 4-bit weight -> [M, N]."""
    m, k = x.shape
    if scale_blocks is None:
        scale_blocks = activation_run_blocks(group_size, k)
    qx, xs, outlier = quantize_blocks_int8_torch(x.float(), outlier_factor, scale_blocks)
    x_hat = (qx.double().view(m, -1, W4A8_BLOCK) * xs.double()[..., None]).view(m, -1)[:, :k]
    x_hat = torch.where(outlier, x.double(), x_hat)
    return int4_gemm_w4a16_torch(x_hat, q, zeros, scales, group_size, bias)


@dataclass(frozen=True)
class PackedInt4:
    """A 4-bit weight packed for one of the int4 kernels. W4A16: panels [ceil(N / 16), K, 8] uint8
    (byte j: column j low nibble, column j + 8 high). W4A8: panels [ceil(N / 16), Kp / 8, 2, 32] uint8
    (Kp = K rounded up to 32; cpu_int8.c's W4A8 section says which nibble is which). Scales and
    offsets (-z * s), float32: W4A16 [groups, ceil(N / 16) * 16]; W4A8 panel-major [ceil(N / 16),
    groups, 16]."""
    panels: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int
    in_features: int
    group_size: int
    w4a8: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.panels, self.scales, self.offsets))


def pack_int4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
              w4a8: bool = False) -> PackedInt4:
    """q [N, K] uint8 in [0, 15], zeros and scales [N, ceil(K / group_size)] -> the packed weight,
    for W4A8 (w4a8_supported(group_size, K)) or W4A16."""
    n, k = q.shape
    group = min(group_size, k)
    if q.dtype != torch.uint8 or tuple(scales.shape) != (n, -(-k // group)) or zeros.shape != scales.shape:
        raise ValueError("pack_int4 takes q [N, K] uint8 and zeros, scales [N, ceil(K / group_size)]")
    if w4a8 and not w4a8_supported(group, k):
        raise ValueError(f"W4A8 needs group_size a multiple of {W4A8_BLOCK} or >= in_features ({k}), got {group}")
    num_panels = -(-n // PANEL)
    kp = -(-k // W4A8_BLOCK) * W4A8_BLOCK if w4a8 else k
    padded = torch.zeros(num_panels * PANEL, kp, dtype=torch.uint8)
    padded[:n, :k] = q
    if w4a8:  # [P, h, column, step, nibble, input] -> [P, step, h, column, input] bytes
        quads = padded.view(num_panels, 2, PANEL // 2, kp // 8, 2, 4).permute(0, 3, 1, 2, 5, 4)
        panels = (quads[..., 0] | (quads[..., 1] << 4)).reshape(num_panels, kp // 8, 2, 32).contiguous()
    else:
        cols = padded.view(num_panels, PANEL, k).transpose(1, 2)  # [P, K, 16]
        panels = (cols[..., : PANEL // 2] | (cols[..., PANEL // 2:] << 4)).contiguous()  # [P, K, 8]
    s = torch.zeros(scales.shape[1], num_panels * PANEL, dtype=torch.float32)
    o = torch.zeros_like(s)
    s[:, :n] = scales.float().T
    o[:, :n] = -(zeros.float() * scales.float()).T
    if w4a8:  # panel-major [P, groups, 16]: a panel's group scales in one run of bytes (cpu_int8.c says why)
        s, o = (t.view(-1, num_panels, PANEL).transpose(0, 1).contiguous() for t in (s, o))
    return PackedInt4(panels, s, o, n, k, group, w4a8)


# ---- int8 weights through VNNI ------------------------------------------------------------------

VNNI_ZERO = 128  # int8 weights are stored as q + 128: the unsigned operand of vpdpbusd, 128 its zero point


def vnni_supported(group_size: int, in_features: int, lib: ctypes.CDLL) -> bool:
    """Does the int8 VNNI kernel run this weight here (AVX512-VNNI, groups of whole activation blocks)?"""
    return bool(lib.vnni_supported()) and w4a8_supported(group_size, in_features)


def int8_gemm_vnni_torch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32, quantized as for W4A8 (outliers exact, found per block of 32 inputs, a scale per
    activation_run_blocks blocks), times the int8 weight q [N, K] with scales [N, groups] -> [M, N]
    float32."""
    group = check_group_size(group_size, q.shape[1])
    u = (q.int() + VNNI_ZERO).to(torch.uint8)
    return int4_gemm_w4a8_torch(x, u, torch.full_like(scales, VNNI_ZERO), scales, group, bias)


@dataclass(frozen=True)
class PackedInt8VNNI:
    """An int8 weight for the VNNI kernel: panels [ceil(N / 16), Kp / 4, 16, 4] uint8 holding q + 128
    (Kp = K rounded up to 32; padding 128, i.e. 0): per 4 inputs, 16 columns of 4 bytes, the operand of
    vpdpbusd. scales and offsets (-128 * s) [groups, ceil(N / 16) * 16] float32."""
    panels: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int
    in_features: int
    group_size: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.panels, self.scales, self.offsets))


def pack_int8_vnni(q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> PackedInt8VNNI:
    """q [N, K] int8 and scales [N, ceil(K / group_size)] (quantize_weight_int8) -> the VNNI layout;
    group_size a multiple of 32 or None (per channel)."""
    n, k = q.shape if q.dim() == 2 else (0, 0)
    group = check_group_size(group_size, k)
    if q.dtype != torch.int8 or q.dim() != 2 or tuple(scales.shape) != (n, -(-k // group)):
        raise ValueError("pack_int8_vnni takes q [N, K] int8 and scales [N, ceil(K / group_size)]")
    if not w4a8_supported(group, k):
        raise ValueError(f"the VNNI kernel needs group_size a multiple of {W4A8_BLOCK} or None, got {group_size}")
    num_panels, kp = -(-n // PANEL), -(-k // W4A8_BLOCK) * W4A8_BLOCK
    u = torch.full((num_panels * PANEL, kp), VNNI_ZERO, dtype=torch.uint8)
    u[:n, :k] = (q.int() + VNNI_ZERO).to(torch.uint8)
    # [P, column, step, input] -> [P, step, column, input]
    panels = u.view(num_panels, PANEL, kp // 4, 4).transpose(1, 2).contiguous()
    s = torch.zeros(scales.shape[1], num_panels * PANEL, dtype=torch.float32)
    s[:, :n] = scales.float().T
    return PackedInt8VNNI(panels, s, -VNNI_ZERO * s, n, k, group)


class Int4Kernels:
    """The W4A16 and W4A8 GEMMs of a loaded kernel library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        if not lib.int8_gemm_supported():
            raise ValueError("the int4 GEMM needs the CPU kernels built with AVX2 and FMA")
        self.lib = lib

    def __call__(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The kernel `w` was packed for."""
        return (self.w4a8 if w.w4a8 else self.w4a16)(x, w, bias, out_dtype)

    def quantize_blocks(self, x: torch.Tensor, group_size: int, outlier: float = W4A8_OUTLIER,
                        scale_blocks: int | None = None) -> tuple[torch.Tensor, ...]:
        """x [M, K] float32 -> (qx [M, Kp] int8, xs [M, Kp / 32], xg [M, groups] float32, and the outliers:
        count [M] int32, inputs [M, E] int32, values [M, E] float32): quantize_blocks_int8_torch's qx and
        xs, xg the zero-point term's sums of xs * qx per group. scale_blocks: blocks per scale (None: the
        kernels' activation_run_blocks)."""
        x = x.contiguous()
        if scale_blocks is None:
            scale_blocks = activation_run_blocks(group_size, x.shape[1])
        m, k = x.shape
        kp = -(-k // W4A8_BLOCK) * W4A8_BLOCK
        capacity = kp // W4A8_BLOCK * W4A8_MAX_OUTLIERS
        qx = torch.empty(m, kp, dtype=torch.int8)
        xs = torch.empty(m, kp // W4A8_BLOCK, dtype=torch.float32)
        xg = torch.empty(m, -(-k // group_size), dtype=torch.float32)
        count = torch.empty(m, dtype=torch.int32)
        inputs = torch.empty(m, capacity, dtype=torch.int32)
        values = torch.empty(m, capacity, dtype=torch.float32)
        self.lib.quantize_blocks_int8(x.data_ptr(), m, k, kp, group_size, outlier, scale_blocks, qx.data_ptr(), xs.data_ptr(), xg.data_ptr(),
                                      count.data_ptr(), inputs.data_ptr(), values.data_ptr(), torch.get_num_threads())
        return qx, xs, xg, count, inputs, values

    def w4a8(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] bf16 or float32, quantized in the kernel (a scale per activation_run_blocks blocks of
        32 inputs) -> [M, N] (bf16 if out_dtype is, else float32; bias float32)."""
        if not w.w4a8:
            raise ValueError("w4a8 takes a weight packed with pack_int4(..., w4a8=True)")
        x, y, io = gemm_operands(x, w.out_features, out_dtype)
        with traced("nanoserve::cpu_int4_w4a8"):
            rc = self.lib.int4_gemm_w4a8(x.data_ptr(), x.shape[0], w.in_features, w.panels.data_ptr(),
                                         w.scales.data_ptr(), w.offsets.data_ptr(), w.group_size, w.out_features,
                                         bias.data_ptr() if bias is not None else None, y.data_ptr(), io,
                                         torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"int4_gemm_w4a8 failed ({rc}): no memory for the quantized activations")
        return y

    def w4a16(self, x: torch.Tensor, w: PackedInt4, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] bf16 or float32 -> [M, N] (bf16 if out_dtype is, else float32; bias float32)."""
        if w.w4a8:
            raise ValueError("w4a16 takes a weight packed with pack_int4(..., w4a8=False)")
        x, y, io = gemm_operands(x, w.out_features, out_dtype)
        with traced("nanoserve::cpu_int4_w4a16"):
            rc = self.lib.int4_gemm_w4a16(x.data_ptr(), x.shape[0], w.in_features, w.panels.data_ptr(),
                                          w.scales.data_ptr(), w.offsets.data_ptr(), w.group_size, w.out_features,
                                          bias.data_ptr() if bias is not None else None, y.data_ptr(), io,
                                          torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"int4_gemm_w4a16 failed ({rc}): no memory for the per-group sums of x")
        return y

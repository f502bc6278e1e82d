"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: "gptq"`), 4 or 8 bits.

Per linear module (K inputs, N outputs, G = ceil(K / group_size) groups, f = 32 / bits):
  qweight  int32 [K / f, N]   packed along K: q[k, n] is bits b*(k % f) .. of qweight[k // f, n]
  qzeros   int32 [G, N / f]   packed along N the same way
  scales   float [G, N]
  g_idx    int32 [K]          the group of each input column (k // group_size unless desc_act; int64 read too)
and w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n], where the v1 convention
(`checkpoint_format` "gptq", AutoGPTQ's pack) stores z - 1 (decoded as stored + 1, unmasked, as
AutoGPTQ's own dequantization does) and v2 ("gptq_v2", GPTQModel) stores z. At 8 bits with zero points
other than 128, q - z spans [-255, 255], more than the int8 kernels hold: such a module runs in float.
"""
from __future__ import annotations

import torch

from nanoserve.quantization.common import (
    F16, F32, BF16, I32, I64, ModuleSpec, QuantFormat, TensorMeta, act_order, config_error, dequantize, expect,
    input_order, require, to_int8, trivial_g_idx, unpack_int32,
)
from nanoserve.quantization.weight import QuantizedWeight

BITS = (4, 8)
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 2}  # -> the zero-point convention


def check_group_size(value, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or (value >= 2 and value % 2 == 0)):
        raise config_error(source, "group_size", value, "-1 (per channel) or an even int >= 2, e.g. 32, 64, 128")
    return value


class GPTQ(QuantFormat):
    method = "gptq"
    marker = "qweight"

    def __init__(self, qcfg: dict, source: str) -> None:
        super().__init__(qcfg, source)
        self.bits = qcfg.get("bits")
        if self.bits not in BITS:
            raise config_error(source, "bits", self.bits, "4 or 8")
        self.group_size = check_group_size(qcfg.get("group_size", 128), source)
        fmt = qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))
        if not isinstance(fmt, str) or fmt not in CHECKPOINT_FORMATS:
            raise config_error(source, "checkpoint_format", fmt, f"one of {', '.join(CHECKPOINT_FORMATS)}")
        self.version = CHECKPOINT_FORMATS[fmt]
        if qcfg.get("is_marlin_format"):  # older AutoGPTQ's quantize_config.json flag for its Marlin repack
            raise config_error(source, "is_marlin_format", qcfg["is_marlin_format"], "the Marlin layout is not read")
        self.desc_act = qcfg.get("desc_act", False)
        if not isinstance(self.desc_act, bool):
            raise config_error(source, "desc_act", self.desc_act, "true or false")
        if qcfg.get("dynamic"):
            raise config_error(source, "dynamic", qcfg["dynamic"], "per-module overrides are not read: none")
        self.per_word = 32 // self.bits

    def suffixes(self, metas):
        return ("qweight", "qzeros", "scales") + (("g_idx",) if "g_idx" in metas else ())

    def check(self, module: str, metas: dict[str, TensorMeta], read=None) -> ModuleSpec:
        qweight = metas["qweight"]
        require(metas, module, ("qzeros", "scales"), qweight.path)
        if qweight.dtype != I32 or len(qweight.shape) != 2:
            raise ValueError(f"{qweight.path}: tensor {qweight.name!r} must be a 2-D int32 tensor "
                             f"(K * bits / 32, N), got {qweight.dtype} {list(qweight.shape)}")
        k, n = qweight.shape[0] * self.per_word, qweight.shape[1]
        group = k if self.group_size == -1 else self.group_size
        groups = -(-k // group)
        why = f"bits={self.bits}, group_size={self.group_size} as {self.source} declares; qweight {list(qweight.shape)}"
        if n % self.per_word:
            raise ValueError(f"{qweight.path}: tensor {qweight.name!r}: N={n} is not a multiple of "
                             f"{self.per_word}, so qzeros cannot be packed ({why})")
        expect(metas["scales"], (groups, n), (F16, BF16, F32), why)
        expect(metas["qzeros"], (groups, n // self.per_word), (I32,), why)
        if "g_idx" in metas:
            expect(metas["g_idx"], (k,), (I32, I64), why)
        order = input_order(read("g_idx"), k, min(group, k)) if self.desc_act and "g_idx" in metas else None
        # desc_act with g_idx in input order (static groups) runs, and shards, as a plain grouped weight
        return ModuleSpec(n, k, min(group, k), order is not None, decodes_to_float=not self._fits_int8(read),
                          input_order=order)

    def _zeros(self, qzeros: torch.Tensor) -> torch.Tensor:
        z = unpack_int32(qzeros, self.bits, dim=1)  # [G, N]
        return z + 1 if self.version == 1 else z

    def _fits_int8(self, read) -> bool:
        """Whether q - z fits the int8 kernels for every q: always at 4 bits; at 8 bits only with every zero
        point 128 (symmetric), else the module is run in float."""
        return self.bits == 4 or bool((self._zeros(read("qzeros")) == 1 << (self.bits - 1)).all())

    def decode(self, module, tensors, metas, spec) -> QuantizedWeight | torch.Tensor:
        q = unpack_int32(tensors["qweight"], self.bits, dim=0)  # [K, N] in [0, 2**bits)
        z = self._zeros(tensors["qzeros"])  # [G, N]
        k, group = spec.in_features, spec.group_size
        g_idx = tensors["g_idx"].long() if "g_idx" in tensors else trivial_g_idx(k, group)
        if g_idx.min() < 0 or g_idx.max() >= z.shape[0]:
            raise ValueError(f"{metas['g_idx'].path}: tensor {metas['g_idx'].name!r} holds group indices "
                             f"outside [0, {z.shape[0]})")
        scales = tensors["scales"].float().T.contiguous()  # [N, G]
        if not self.desc_act and not torch.equal(g_idx, trivial_g_idx(k, group)):
            raise ValueError(f"{metas['g_idx'].path}: tensor {metas['g_idx'].name!r} is not in input order "
                             f"(k // group_size) but {self.source} declares desc_act=false")
        if spec.decodes_to_float:
            return dequantize((q - z[g_idx]).T, scales, g_idx)
        values = to_int8((q - z[g_idx]).T, metas["qweight"])  # [N, K]
        return act_order(values.contiguous(), scales, g_idx, group, metas.get("g_idx", metas["qweight"]))

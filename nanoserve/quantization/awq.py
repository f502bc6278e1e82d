"""AWQ checkpoints (AutoAWQ's GEMM layout, `quant_method: "awq"`, `version: "gemm"`), 4 bits with zero points.

Per linear module (K inputs, N outputs, G = ceil(K / group_size) groups):
  qweight  int32 [K, N / 8]   packed along N: word i of row k holds columns 8i .. 8i+7, the field
                              at bits 4j holding column 8i + ORDER[j] (AutoAWQ's pack order)
  qzeros   int32 [G, N / 8]   the zero points, packed the same way
  scales   float [G, N]
and w[n, k] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n].
"""
from __future__ import annotations

import torch

from nanoserve.quantization.common import (
    F16, F32, BF16, I32, ModuleSpec, QuantFormat, TensorMeta, config_error, expect, require, to_int8, unpack_int32,
)
from nanoserve.quantization.gptq import check_group_size
from nanoserve.quantization.weight import QuantizedWeight

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field j of a word holds column ORDER[j]
UNDO_ORDER = tuple(ORDER.index(c) for c in range(8))  # column c sits in field UNDO_ORDER[c]
BITS = 4
PER_WORD = 32 // BITS


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] int32 -> [R, N] int32 in [0, 16), columns in their natural order."""
    fields = unpack_int32(packed, BITS, dim=1).unflatten(1, (-1, PER_WORD))  # [R, N / 8, 8] in field order
    return fields[:, :, list(UNDO_ORDER)].flatten(1)


class AWQ(QuantFormat):
    method = "awq"
    marker = "qweight"

    def __init__(self, qcfg: dict, source: str) -> None:
        super().__init__(qcfg, source)
        bits = qcfg.get("bits", qcfg.get("w_bit"))
        if bits != BITS:
            raise config_error(source, "bits", bits, "4")
        self.group_size = check_group_size(qcfg.get("group_size", qcfg.get("q_group_size", 128)), source)
        version = qcfg.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise config_error(source, "version", version, "'gemm' (AutoAWQ's GEMM layout); GEMV, Marlin and "
                               "exllama layouts are not read")
        zero_point = qcfg.get("zero_point", True)
        if zero_point is not True:
            raise config_error(source, "zero_point", zero_point, "true")
        if qcfg.get("modules_to_not_convert") is not None and not isinstance(qcfg["modules_to_not_convert"], list):
            raise config_error(source, "modules_to_not_convert", qcfg["modules_to_not_convert"], "a list of names")

    def suffixes(self, metas):
        return ("qweight", "qzeros", "scales")

    def check(self, module: str, metas: dict[str, TensorMeta], read=None) -> ModuleSpec:
        qweight = metas["qweight"]
        require(metas, module, ("qzeros", "scales"), qweight.path)
        if qweight.dtype != I32 or len(qweight.shape) != 2:
            raise ValueError(f"{qweight.path}: tensor {qweight.name!r} must be a 2-D int32 tensor (K, N / 8), "
                             f"got {qweight.dtype} {list(qweight.shape)}")
        k, n = qweight.shape[0], qweight.shape[1] * PER_WORD
        group = k if self.group_size == -1 else self.group_size
        groups = -(-k // group)
        why = f"bits=4, group_size={self.group_size} as {self.source} declares; qweight {list(qweight.shape)}"
        expect(metas["scales"], (groups, n), (F16, BF16, F32), why)
        expect(metas["qzeros"], (groups, n // PER_WORD), (I32,), why)
        return ModuleSpec(n, k, min(group, k), False)

    def decode(self, module, tensors, metas, spec) -> QuantizedWeight:
        q = unpack_awq(tensors["qweight"])  # [K, N]
        z = unpack_awq(tensors["qzeros"])  # [G, N]
        k, group = spec.in_features, spec.group_size
        values = to_int8((q - z.repeat_interleave(group, dim=0)[:k]).T, metas["qweight"])  # [N, K]
        return QuantizedWeight(values.contiguous(), tensors["scales"].float().T.contiguous(), group)

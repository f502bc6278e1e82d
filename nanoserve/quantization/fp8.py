"""Block-scaled FP8 checkpoints (Qwen's official FP8 releases, `quant_method: "fp8"`).

Per linear module: weight float8_e4m3fn [N, K] and weight_scale_inv float [ceil(N / bn), ceil(K / bk)]
for `weight_block_size` [bn, bk] (128 x 128), w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk];
activations `dynamic` (quantized per token group at run time on GPUs; here never: they stay float).
On CPU the weight is decoded once at load into the model dtype (bf16) and runs the float GEMM path:
int8 with group 128 along K cannot hold an e4m3 block (its values can span 2**17): requantized,
the teacher-forced logprob error is 3-4x that of bf16 weights (README, pre-quantized checkpoints).
`modules_to_not_convert` / `ignored_layers` (and any module stored in float) stay float.
"""
from __future__ import annotations

import torch

from nanoserve.quantization.common import (
    BF16, F16, F32, F8_E4M3, ModuleSpec, QuantFormat, TensorMeta, config_error, expect, require, tensor_error,
)


class FP8(QuantFormat):
    method = "fp8"
    marker = "weight_scale_inv"

    def __init__(self, qcfg: dict, source: str) -> None:
        super().__init__(qcfg, source)
        fmt = qcfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise config_error(source, "fmt", fmt, "'e4m3'")
        scheme = qcfg.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise config_error(source, "activation_scheme", scheme, "'dynamic' (static input scales are not read)")
        block = qcfg.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise config_error(source, "weight_block_size", block, "[rows, columns] of positive ints, e.g. [128, 128]; "
                               "per-tensor FP8 is not read")
        self.block = tuple(block)

    def suffixes(self, metas):
        return ("weight", "weight_scale_inv")

    def check(self, module: str, metas: dict[str, TensorMeta], read=None) -> ModuleSpec:
        scale = metas["weight_scale_inv"]
        require(metas, module, ("weight",), scale.path)
        weight = metas["weight"]
        if weight.dtype != F8_E4M3 or len(weight.shape) != 2:
            raise tensor_error(weight, "must be a 2-D float8_e4m3fn tensor [N, K]")
        n, k = weight.shape
        bn, bk = self.block
        expect(scale, (-(-n // bn), -(-k // bk)), (F32, BF16, F16), f"weight_block_size {list(self.block)}, "
               f"weight {[n, k]}")
        return ModuleSpec(n, k, k, False, decodes_to_float=True)

    def decode(self, module, tensors, metas, spec) -> torch.Tensor:
        """The float32 weight [N, K]: each e4m3 value times its block's scale, rounded once to float32
        (as transformers' and vLLM's dequantization compute it)."""
        n, k = spec.out_features, spec.in_features
        bn, bk = self.block
        scale = tensors["weight_scale_inv"].float()
        scale = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return tensors["weight"].float() * scale

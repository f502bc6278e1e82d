"""compressed-tensors checkpoints (llm-compressor, `quant_method: "compressed-tensors"`): integer weights.

Schemes (`config_groups`, each with `targets` and a `format`, or the top-level `format`):
  pack-quantized  weight_packed int32 [N, ceil(K * bits / 32)]: K packed densely, value j at bits
                  bits*j, stored offset-binary (signed q + 2**(bits-1)); weight_shape [N, K];
                  weight_zero_point (asymmetric only) int32 [ceil(N * bits / 32), G] packed along N
                  (per tensor: an int8 [1], unpacked)
  int-quantized   weight int8 [N, K] (4- or 8-bit values; the library's format whenever activations are
                  quantized too, W4A8 included); weight_zero_point int8 [N, G] (asymmetric only)
both with weight_scale float [N, G] (G = 1 per channel, ceil(K / group_size) per group; a
per-tensor scale [1] is the same scale on every channel) and, for `actorder: group`, weight_g_idx
int32 [K]. w[n, k] = (q[n, k] - zp[n, g(k)]) * scale[n, g(k)]. Activations: none (W4A16, W8A16)
or int8, dynamic, symmetric, per token (W8A8; the int8 kernels' W8A8 path computes exactly that,
W8A16 the same weights with unquantized activations). Modules matched by `ignore`, or by no
scheme's targets, are float.
"""
from __future__ import annotations

import torch

from nanoserve.quantization.common import (
    BF16, F16, F32, I8, I32, I64, ModuleSpec, QuantFormat, TensorMeta, act_order, config_error, dequantize, expect,
    input_order, matches, require, tensor_error, to_int8, unpack_int32,
)
from nanoserve.quantization.weight import QuantizedWeight

# int-quantized (what the library picks for any int scheme with activations, W4A8 included) stores 4-bit values
# unpacked, one per int8, like 8-bit ones
FORMATS = {"pack-quantized": (4, 8), "int-quantized": (4, 8), "naive-quantized": (4, 8)}
STRATEGIES = ("channel", "group", "tensor")
ACTORDERS = (None, False, "weight", "static", "group", "dynamic")


def _names(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_scheme(name: str, scheme: dict, default_format, source: str) -> dict:
    where = f"config_groups.{name}"
    if not isinstance(scheme, dict) or not _names(scheme.get("targets")):
        raise config_error(source, f"{where}.targets", scheme.get("targets") if isinstance(scheme, dict) else scheme,
                           "a list of module names, regexes ('re:...') or 'Linear'")
    fmt = scheme.get("format") or default_format
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise config_error(source, f"{where}.format", fmt, f"one of {', '.join(FORMATS)}")
    w = scheme.get("weights")
    if not isinstance(w, dict):
        raise config_error(source, f"{where}.weights", w, "a weight quantization scheme")
    if w.get("type", "int") != "int":
        raise config_error(source, f"{where}.weights.type", w.get("type"), "'int' (float formats are not read)")
    if w.get("num_bits") not in FORMATS[fmt]:
        raise config_error(source, f"{where}.weights.num_bits", w.get("num_bits"),
                           f"{' or '.join(map(str, FORMATS[fmt]))} with format {fmt}")
    strategy = w.get("strategy") or ("group" if w.get("group_size") else "channel")
    if strategy not in STRATEGIES:
        raise config_error(source, f"{where}.weights.strategy", strategy, f"one of {', '.join(STRATEGIES)}")
    group = w.get("group_size")
    if strategy == "group" and (isinstance(group, bool) or not isinstance(group, int) or group < 2 or group % 2):
        raise config_error(source, f"{where}.weights.group_size", group, "an even int >= 2 for strategy 'group'")
    if w.get("dynamic", False) is not False:
        raise config_error(source, f"{where}.weights.dynamic", w.get("dynamic"), "false")
    if w.get("actorder") not in ACTORDERS:
        raise config_error(source, f"{where}.weights.actorder", w.get("actorder"), "null, 'weight' or 'group'")
    if w.get("block_structure") is not None:
        raise config_error(source, f"{where}.weights.block_structure", w["block_structure"], "null")
    act = scheme.get("input_activations")
    if act is not None and not (isinstance(act, dict) and act.get("type", "int") == "int" and act.get("num_bits") == 8
                                and act.get("strategy") == "token" and act.get("dynamic") is True
                                and act.get("symmetric", True) is True):
        raise config_error(source, f"{where}.input_activations", act,
                           "null, or int8 symmetric dynamic per token (W8A8)")
    if scheme.get("output_activations") is not None:
        raise config_error(source, f"{where}.output_activations", scheme["output_activations"], "null")
    return {"targets": scheme["targets"], "format": fmt, "bits": w["num_bits"], "symmetric": w.get("symmetric", True),
            "strategy": strategy, "group_size": group}


class CompressedTensors(QuantFormat):
    method = "compressed-tensors"
    marker = "weight_packed"

    def __init__(self, qcfg: dict, source: str) -> None:
        super().__init__(qcfg, source)
        status = qcfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise config_error(source, "quantization_status", status, "'compressed'")
        for name in ("kv_cache_scheme", "transform_config"):
            if qcfg.get(name) is not None:
                raise config_error(source, name, qcfg[name], "null")
        sparsity = qcfg.get("sparsity_config")
        if sparsity and not isinstance(sparsity, dict):
            raise config_error(source, "sparsity_config", sparsity, "null or an object")
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise config_error(source, "sparsity_config.format", sparsity.get("format"), "'dense'")
        groups = qcfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise config_error(source, "config_groups", groups, "one or more schemes")
        self.schemes = [_check_scheme(name, s, qcfg.get("format"), source) for name, s in groups.items()]
        self.ignore = qcfg.get("ignore") or []
        if not _names(self.ignore):
            raise config_error(source, "ignore", self.ignore, "a list of module names or regexes")

    def scheme_for(self, module: str) -> dict | None:
        if matches(module, self.ignore):
            return None
        for scheme in self.schemes:
            if "Linear" in scheme["targets"] or matches(module, scheme["targets"]):
                return scheme
        return None

    def is_quantized(self, module, metas):
        return "weight_packed" in metas or ("weight" in metas and metas["weight"].dtype == I8)

    def suffixes(self, metas):
        names = ("weight_packed", "weight_shape") if "weight_packed" in metas else ("weight",)
        return names + tuple(s for s in ("weight_scale", "weight_zero_point", "weight_g_idx") if s in metas)

    def check(self, module: str, metas: dict[str, TensorMeta], read=None) -> ModuleSpec:
        first = metas.get("weight_packed") or metas["weight"]
        scheme = self.scheme_for(module)
        if scheme is None:
            raise tensor_error(first, f"is quantized but {self.source} lists {module!r} in `ignore` or in no "
                               "scheme's targets")
        packed = scheme["format"] == "pack-quantized"
        if packed != ("weight_packed" in metas):
            raise tensor_error(first, f"does not match format {scheme['format']!r} of its scheme")
        require(metas, module, ("weight_scale",) + (("weight_shape",) if packed else ()), first.path)
        bits = scheme["bits"]
        if packed:
            expect(metas["weight_shape"], (2,), (I64, I32), "[N, K]")
            n, k = (int(v) for v in read("weight_shape"))
            expect(first, (n, -(-k * bits // 32)), (I32,), f"num_bits={bits}, weight_shape {[n, k]}")
        else:
            if len(first.shape) != 2:
                raise tensor_error(first, "must be 2-D [N, K]")
            n, k = first.shape
        group = {"group": scheme["group_size"], "channel": k, "tensor": k}[scheme["strategy"]]
        group = min(group, k)
        groups = -(-k // group)
        why = f"strategy {scheme['strategy']}, group_size {scheme['group_size']}, weight [N, K] = {[n, k]}"
        scale_shape = (1,) if scheme["strategy"] == "tensor" and len(metas["weight_scale"].shape) == 1 else (
            (1, 1) if scheme["strategy"] == "tensor" else (n, groups))
        expect(metas["weight_scale"], scale_shape, (F32, F16, BF16), why)
        if not scheme["symmetric"]:
            require(metas, module, ("weight_zero_point",), first.path)
            zp = metas["weight_zero_point"]
            if self._packs_zero_points(scheme):
                expect(zp, (-(-n * bits // 32), groups), (I32,), f"asymmetric, {why}")
            else:
                expect(zp, (1,) * len(zp.shape) if scheme["strategy"] == "tensor" else scale_shape, (I8, I32),
                       f"asymmetric, {why}")
        elif "weight_zero_point" in metas:
            raise tensor_error(metas["weight_zero_point"], "is present but the scheme is symmetric")
        order = None
        if "weight_g_idx" in metas:
            expect(metas["weight_g_idx"], (k,), (I32, I64), why)
            order = input_order(read("weight_g_idx"), k, group)
        # 8 bits with zero points: q - zp spans [-255, 255], more than the int8 kernels hold: run in float
        fits_int8 = bits == 4 or scheme["symmetric"] or not bool(self._zero_points(
            read("weight_zero_point"), self._packs_zero_points(scheme), bits, n).any())
        return ModuleSpec(n, k, group, order is not None, decodes_to_float=not fits_int8, input_order=order)

    @staticmethod
    def _packs_zero_points(scheme: dict) -> bool:
        """pack-quantized packs per-group and per-channel zero points along N; a per-tensor one stays
        an int8 scalar (compressed-tensors' PACK_ZP_STRATS)."""
        return scheme["format"] == "pack-quantized" and scheme["strategy"] != "tensor"

    @staticmethod
    def _zero_points(zp: torch.Tensor, packed: bool, bits: int, n: int) -> torch.Tensor:
        """[N, G] signed zero points (or [1, G], per tensor)."""
        return unpack_int32(zp, bits, dim=0)[:n] - (1 << (bits - 1)) if packed else zp.to(torch.int32)

    def decode(self, module, tensors, metas, spec) -> QuantizedWeight | torch.Tensor:
        scheme = self.scheme_for(module)
        n, k, group = spec.out_features, spec.in_features, spec.group_size
        bits = scheme["bits"]
        offset = 1 << (bits - 1)
        if "weight_packed" in tensors:
            q = unpack_int32(tensors["weight_packed"], bits, dim=1)[:, :k] - offset  # [N, K] signed
        else:
            q = tensors["weight"].to(torch.int32)
        scales = tensors["weight_scale"].float().reshape(-1, tensors["weight_scale"].shape[-1])
        scales = scales.expand(n, -1).contiguous()  # a per-tensor scale on every channel
        g_idx = tensors.get("weight_g_idx")
        g_idx = g_idx.long() if g_idx is not None else torch.arange(k) // group
        if "weight_zero_point" in tensors:
            zp = tensors["weight_zero_point"]
            zp = self._zero_points(zp, self._packs_zero_points(scheme), bits, n).reshape(-1, zp.shape[-1]).expand(n, -1)
            q = q - zp[:, g_idx]
        if spec.decodes_to_float:
            return dequantize(q, scales, g_idx)
        first = metas.get("weight_packed") or metas["weight"]
        values = to_int8(q, first).contiguous()
        return act_order(values, scales, g_idx, group, metas.get("weight_g_idx", first))

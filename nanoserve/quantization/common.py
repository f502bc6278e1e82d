"""What the format readers share: the tensors' headers, the errors, bit unpacking and act-order.

A format reader (gptq.py, awq.py, compressed_tensors.py, fp8.py) is built from config.json's
`quantization_config` or AutoGPTQ's / AutoAWQ's own file (checkpoint.CONFIG_FILES), refusing what it
cannot run, by field; then for each linear module of the checkpoint: `check` its tensors' shapes and
dtypes from the file headers (before any weight is read) and `decode` them into a QuantizedWeight
(or a float weight, for formats run in float).
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import torch

from nanoserve.quantization.weight import QuantizedWeight

# safetensors' dtype names (the header's) of the tensors the readers meet
I32, I8, I64, F32, F16, BF16, F8_E4M3 = "I32", "I8", "I64", "F32", "F16", "BF16", "F8_E4M3"


@dataclass(frozen=True)
class TensorMeta:
    """One tensor's header: where it is, its shape and dtype, without its data."""
    path: str
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModuleSpec:
    """A quantized linear module as its headers declare it."""
    out_features: int
    in_features: int
    group_size: int  # in_features when per channel
    act_order: bool  # the input columns are reordered (GPTQ desc_act, compressed-tensors g_idx not in k order)
    decodes_to_float: bool = False  # run as a float weight (FP8; 8-bit integers whose q - z overflow int8)
    # act-order: a digest of g_idx (None in input order); a fused layer runs one order, so its parts must agree
    input_order: bytes | None = None


def config_error(source: str, field: str, value, allowed: str) -> ValueError:
    # config.json nests the fields under quantization_config; AutoGPTQ's / AutoAWQ's own file holds them at its top
    where = f"quantization_config.{field}" if os.path.basename(source) == "config.json" else field
    return ValueError(f"{source}: {where}={value!r} is not supported ({allowed})")


def tensor_error(meta: TensorMeta, what: str) -> ValueError:
    return ValueError(f"{meta.path}: tensor {meta.name!r} (shape {list(meta.shape)}, dtype {meta.dtype}) {what}")


def expect(meta: TensorMeta, shape: tuple[int, ...], dtypes: tuple[str, ...], why: str) -> None:
    """Refuse a tensor whose shape or dtype is not what the declared config implies."""
    if meta.dtype not in dtypes:
        raise tensor_error(meta, f"must have dtype {' or '.join(dtypes)} ({why})")
    if tuple(meta.shape) != tuple(shape):
        raise tensor_error(meta, f"must have shape {list(shape)} ({why})")


def require(metas: dict[str, TensorMeta], module: str, suffixes: tuple[str, ...], path: str) -> None:
    missing = [s for s in suffixes if s not in metas]
    if missing:
        raise ValueError(f"{path}: quantized module {module!r} lacks tensor(s) {', '.join(missing)}")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-wide fields of int32 words, the lowest bits first, laid out along `dim`:
    [.., W, ..] int32 -> [.., W * 32 / bits, ..] int32 in [0, 2**bits)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    x = packed.movedim(dim, -1).unsqueeze(-1)  # [..., W, 1]
    fields = (x >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then the mask drops the sign bits
    out = fields.flatten(-2)  # [..., W * per_word]
    assert out.shape[-1] == packed.shape[dim] * per_word
    return out.movedim(-1, dim)


def to_int8(values: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """q - z (or q) as int8, refusing values an int8 cannot hold (an 8-bit format with zero points)."""
    lo, hi = int(values.min()), int(values.max())
    if lo < -128 or hi > 127:
        raise tensor_error(meta, f"decodes to integers in [{lo}, {hi}] (q - zero point), outside int8's range")
    return values.to(torch.int8)


def trivial_g_idx(k: int, group: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int64) // group


def input_order(g_idx: torch.Tensor, k: int, group: int) -> bytes | None:
    """ModuleSpec.input_order of a module with this g_idx: None in input order, else a digest of it (equal
    digests, equal orders; kept small, as every module's spec is held until the load ends)."""
    g_idx = g_idx.long()
    if torch.equal(g_idx, trivial_g_idx(k, group)):
        return None
    return hashlib.blake2b(g_idx.numpy().tobytes(), digest_size=16).digest()


def dequantize(values: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of integers values [N, K] (q - z) and scales [N, G], column k in group g_idx[k]:
    for a module whose q - z does not fit the int8 kernels (ModuleSpec.decodes_to_float)."""
    return values.float() * scales.float()[:, g_idx.long()]


def act_order(q: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, group: int,
              meta: TensorMeta) -> QuantizedWeight:
    """A weight whose input column k belongs to group g_idx[k] (any order) as a QuantizedWeight:
    columns sorted by group (stable), so each group is contiguous, and perm says where each came from.
    Every group must have as many columns as in input order: `group`, the last one the remainder when
    group_size does not divide K (GPTQ's desc_act assigns them so: g_idx[perm[i]] = i // group_size)."""
    n, k = q.shape
    g_idx = g_idx.long()
    groups = scales.shape[1]
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise tensor_error(meta, f"holds group indices outside [0, {groups})")
    in_order = trivial_g_idx(k, group)
    if torch.equal(g_idx, in_order):
        return QuantizedWeight(q, scales, group)
    if not torch.equal(torch.bincount(g_idx, minlength=groups), torch.bincount(in_order, minlength=groups)):
        last = k - (groups - 1) * group
        raise tensor_error(meta, f"does not assign group_size={group} input columns to every group"
                           + (f" (the last one: {last})" if last != group else ""))
    perm = torch.argsort(g_idx, stable=True)
    return QuantizedWeight(q[:, perm].contiguous(), scales, group, perm)


def matches(name: str, patterns) -> bool:
    """vLLM's / compressed-tensors' module patterns: "re:<regex>" (re.match), else an exact
    module name or a trailing part of one (e.g. "lm_head")."""
    for pattern in patterns or ():
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


class QuantFormat:
    """A reader of one `quant_method`. Subclasses set `method` and `marker` (the tensor suffix that
    makes a module quantized) and implement check and decode."""

    method = ""
    marker = ""
    # suffixes a quantized module may carry that no layer takes (read only by check / decode)
    extra_suffixes: tuple[str, ...] = ()

    def __init__(self, qcfg: dict, source: str) -> None:
        self.qcfg, self.source = qcfg, source

    def suffixes(self, metas: dict[str, TensorMeta]) -> tuple[str, ...]:
        """The tensors of a quantized module that decode consumes."""
        raise NotImplementedError

    def is_quantized(self, module: str, metas: dict[str, TensorMeta]) -> bool:
        return self.marker in metas

    def check(self, module: str, metas: dict[str, TensorMeta], read=None) -> ModuleSpec:
        """The module's shape and grouping, its headers checked against the config. read(suffix)
        returns one of its (small) tensors, for a format that stores shapes as data."""
        raise NotImplementedError

    def decode(self, module: str, tensors: dict[str, torch.Tensor], metas: dict[str, TensorMeta],
               spec: ModuleSpec) -> QuantizedWeight | torch.Tensor:
        raise NotImplementedError

    def field(self, name: str, default=None):
        return self.qcfg.get(name, default)

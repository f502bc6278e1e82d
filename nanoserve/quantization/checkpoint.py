"""A pre-quantized checkpoint: its format from config.json, its modules from the file headers, and
the stream of decoded tensors the model loader reads instead of the raw ones.

Every module's tensors are checked against the declared config from the headers alone
(`QuantizedCheckpoint.__init__`), before any weight is read; a disagreement is a ValueError naming
the file, the tensor and the field. Decoding then replaces each quantized module's tensors by
  <module>.weight        int8 [N, K]   (QuantizedWeight.qweight)
  <module>.weight_scale  float32 [N, G]
  <module>.weight_perm   int64 [K]     (act-order only)
or, for a module the model runs in float, by <module>.weight as float32.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from nanoserve.checkpoint import read_json
from nanoserve.quantization.awq import AWQ
from nanoserve.quantization.common import ModuleSpec, QuantFormat, TensorMeta
from nanoserve.quantization.compressed_tensors import CompressedTensors
from nanoserve.quantization.fp8 import FP8
from nanoserve.quantization.gptq import GPTQ
from nanoserve.quantization.weight import QuantizedWeight

logger = logging.getLogger(__name__)

FORMATS: dict[str, type[QuantFormat]] = {f.method: f for f in (GPTQ, AWQ, CompressedTensors, FP8)}
LOAD_TIME = "int8"  # quantization=LOAD_TIME quantizes a float checkpoint at load (nanoserve/kernels/cpu_int8.py)
# vLLM's names for its GPU kernels of a format: a user switching over may pass them for that format.
KERNEL_ALIASES = {"gptq_marlin": "gptq", "gptq_marlin_24": "gptq", "awq_marlin": "awq"}
QUANTIZATIONS = (LOAD_TIME, *FORMATS, *KERNEL_ALIASES)  # every value Config.quantization takes besides None


# vLLM's get_config_filenames(): where AutoGPTQ / GPTQModel and AutoAWQ wrote the quantization config
# before it moved into config.json. vLLM reads these only for quantization="gptq" / "awq" given (its
# get_quant_config) when config.json has none; exactly one of a method's files may be present.
CONFIG_FILES = {"gptq": ("quantize_config.json",), "awq": ("quant_config.json", "quantize_config.json")}
ALL_CONFIG_FILES = tuple(sorted({name for names in CONFIG_FILES.values() for name in names}))


def _standalone_config(requested: str, model_dir: str, config_json: str) -> tuple[dict, str]:
    """The quantization config of format `requested` (or a kernel name for it) from its own file in
    `model_dir` (config.json has none)."""
    method = KERNEL_ALIASES.get(requested, requested)
    present = [name for name in CONFIG_FILES[method] if os.path.isfile(os.path.join(model_dir, name))]
    if not present:
        raise ValueError(f"quantization={requested!r} is not supported ({config_json} has no quantization_config "
                         f"and {model_dir} no {' or '.join(CONFIG_FILES[method])}: a float checkpoint takes None, "
                         "or 'int8' to quantize it at load)")
    if len(present) > 1:
        raise ValueError(f"quantization={requested!r}: {model_dir} holds several quantization configs "
                         f"({', '.join(present)}): keep one")
    path = os.path.join(model_dir, present[0])
    qcfg = read_json(path, "a JSON object (the quantization config)")
    declared = qcfg.get("quant_method", method)  # AutoAWQ and older AutoGPTQ do not write it
    if not isinstance(declared, str) or declared.lower() != method:
        raise ValueError(f"{path}: quant_method={declared!r} disagrees with quantization={requested!r}")
    return {**qcfg, "quant_method": method}, path


def find_quantization_config(hf_config: dict, source: str, requested: str | None = None
                             ) -> tuple[dict, str] | None:
    """(the quantization config, the file it came from): config.json's quantization_config, else, with
    quantization="gptq" / "awq" (or a kernel name for them) given, AutoGPTQ's / AutoAWQ's own file
    (CONFIG_FILES), as vLLM; None for a float checkpoint. Without the argument such a file is refused
    by name rather than the checkpoint loaded as a float one (vLLM would fail on its first qweight)."""
    qcfg = hf_config.get("quantization_config")
    if qcfg is not None:
        return qcfg, source
    model_dir = os.path.dirname(source)
    if KERNEL_ALIASES.get(requested, requested) in CONFIG_FILES:
        return _standalone_config(requested, model_dir, source)
    present = [name for name in ALL_CONFIG_FILES if os.path.isfile(os.path.join(model_dir, name))]
    if present and _has_packed_weights(model_dir):
        raise ValueError(f"{os.path.join(model_dir, present[0])}: a quantized checkpoint's config outside "
                         f"config.json (AutoGPTQ / AutoAWQ) is read with quantization='gptq' or 'awq' given, as in "
                         f"vLLM; got quantization={requested!r}")
    if present:  # float weights beside a leftover file (e.g. a dequantized copy): vLLM loads them as float too
        logger.warning("%s ignored: %s has float weights and no quantization_config in config.json",
                       os.path.join(model_dir, present[0]), model_dir)
    return None


def _has_packed_weights(model_dir: str) -> bool:
    """Whether the directory's safetensors hold GPTQ / AWQ packed weights (a `*.qweight` tensor)."""
    files = [os.path.join(model_dir, n) for n in sorted(os.listdir(model_dir)) if n.endswith(".safetensors")]
    return any(name.endswith(".qweight") for name in read_headers(files))


def checkpoint_format(hf_config: dict, source: str, requested: str | None = None) -> QuantFormat | None:
    """The reader of the checkpoint's quantization config (find_quantization_config; None for a float
    checkpoint); refuses an unknown quant_method or a config the reader cannot run, by file and field."""
    found = find_quantization_config(hf_config, source, requested)
    if found is None:
        return None
    qcfg, source = found
    if not isinstance(qcfg, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {type(qcfg).__name__}")
    method = qcfg.get("quant_method")
    if not isinstance(method, str) or method not in FORMATS:
        raise ValueError(f"{source}: quantization_config.quant_method={method!r} is not supported "
                         f"(one of {', '.join(FORMATS)})")
    return FORMATS[method](qcfg, source)


def resolve_quantization(requested: str | None, hf_config: dict, source: str) -> str | None:
    """Config.quantization: the checkpoint's own format when it has one (`requested` must then be
    None, the same name or one of vLLM's kernel names for it, as in vLLM), else `requested` (None, or "int8" to
    quantize at load). "int8" on a pre-quantized checkpoint stays "int8": its integer layers run as
    they are and the float ones it left (its LM head, layers it does not quantize) are quantized at
    load, as llama.cpp's 4-bit files carry a 6-bit head. A checkpoint whose config is in AutoGPTQ's /
    AutoAWQ's own file needs `requested` (find_quantization_config)."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization={requested!r} is not supported (None, {', '.join(map(repr, QUANTIZATIONS))}; "
                         "a pre-quantized checkpoint's format is read from its config.json)")
    fmt = checkpoint_format(hf_config, source, requested)
    if fmt is None:
        if requested not in (None, LOAD_TIME):
            raise ValueError(f"quantization={requested!r} is not supported ({source} has no quantization_config: "
                             "a float checkpoint takes None, or 'int8' to quantize it at load)")
        return requested
    if requested == LOAD_TIME:
        return LOAD_TIME
    if KERNEL_ALIASES.get(requested, requested) not in (None, fmt.method):
        raise ValueError(f"quantization={requested!r} disagrees with {fmt.source}, whose quantization_config."
                         f"quant_method is {fmt.method!r}: pass quantization={fmt.method!r}, None, or "
                         f"{LOAD_TIME!r} to quantize its float layers too")
    return fmt.method


def read_headers(files: Iterable[str]) -> dict[str, TensorMeta]:
    """Every tensor's header, by name, without reading any data."""
    metas: dict[str, TensorMeta] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    metas[name] = TensorMeta(path, name, tuple(s.get_shape()), s.get_dtype())
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    return metas


def _read_one(meta: TensorMeta) -> torch.Tensor:
    with safe_open(meta.path, framework="pt", device="cpu") as f:
        return f.get_tensor(meta.name)


class QuantizedCheckpoint:
    def __init__(self, fmt: QuantFormat, files: list[str]) -> None:
        self.format = fmt
        by_module: dict[str, dict[str, TensorMeta]] = {}
        for name, meta in read_headers(files).items():
            module, _, suffix = name.rpartition(".")
            by_module.setdefault(module, {})[suffix] = meta
        self.specs: dict[str, ModuleSpec] = {}
        self._suffixes: dict[str, tuple[str, ...]] = {}
        self._metas: dict[str, dict[str, TensorMeta]] = {}
        for module, metas in sorted(by_module.items()):
            if not fmt.is_quantized(module, metas):
                continue
            self.specs[module] = fmt.check(module, metas, read=lambda suffix, m=metas: _read_one(m[suffix]))
            self._suffixes[module] = fmt.suffixes(metas)
            self._metas[module] = metas
        if not self.specs:
            raise ValueError(f"{fmt.source} declares quant_method {fmt.method!r} but no tensor of the checkpoint "
                             f"is quantized in that format (no {fmt.marker!r} tensors)")

    def decode(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight | torch.Tensor:
        return self.format.decode(module, tensors, self._metas[module], self.specs[module])

    def stream(self, tensors: Iterable[tuple[str, str, torch.Tensor]], as_float: set[str]
               ) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The checkpoint's (file, name, tensor) with each quantized module's tensors decoded (see the
        module docstring); modules in `as_float` (or formats run in float) come out as float32 weights."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for path, name, tensor in tensors:
            module, _, suffix = name.rpartition(".")
            if module not in self.specs or suffix not in self._suffixes[module]:
                yield path, name, tensor
                continue
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor
            if len(parts) < len(self._suffixes[module]):
                continue
            decoded = self.decode(module, pending.pop(module))
            if isinstance(decoded, torch.Tensor):
                yield path, f"{module}.weight", decoded
            elif module in as_float:
                yield path, f"{module}.weight", decoded.dequantize()
            else:
                yield path, f"{module}.weight", decoded.qweight
                yield path, f"{module}.weight_scale", decoded.scales
                if self.specs[module].act_order:  # the layer holds the input permutation (g_idx not in k order)
                    perm = decoded.perm if decoded.perm is not None else torch.arange(decoded.shape[1])
                    yield path, f"{module}.weight_perm", perm
        assert not pending, f"modules left undecoded: {sorted(pending)[:4]}"  # the headers listed every part


def open_checkpoint(model_dir: str, hf_config: dict, files: list[str], quantization: str | None = None
                    ) -> QuantizedCheckpoint | None:
    """quantization: Config.quantization (resolve_quantization's), which finds a config outside config.json."""
    fmt = checkpoint_format(hf_config, os.path.join(model_dir, "config.json"), quantization)
    return QuantizedCheckpoint(fmt, files) if fmt is not None else None

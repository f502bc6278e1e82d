"""Which checkpoint a benchmark runs: a directory (--model), or a cached random-weight checkpoint
of a real architecture's exact shape (--arch), built by nanoserve.utils.tiny_checkpoint.

Adding an architecture is one line in ARCHS; an entry whose shape or builder that module does not
provide (yet) is not offered.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

DEFAULT_ARCH = "qwen3-0.6b"


@dataclass(frozen=True)
class RandomArch:
    shape: str  # name of the shape dict in nanoserve.utils.tiny_checkpoint
    builder: str = "ensure_tiny_qwen3"  # its function builder(name, **shape) -> cached checkpoint dir


ARCHS: dict[str, RandomArch] = {
    "qwen3-0.6b": RandomArch("QWEN3_0_6B"),
    "llama-3.2-1b": RandomArch("LLAMA_3_2_1B", "ensure_tiny_checkpoint"),
    "qwen2.5-0.5b": RandomArch("QWEN2_5_0_5B", "ensure_tiny_checkpoint"),
    "qwen3-moe": RandomArch("QWEN3_MOE_SMALL", "ensure_tiny_checkpoint"),
}


def _tiny_checkpoint():
    return importlib.import_module("nanoserve.utils.tiny_checkpoint")


def available_archs() -> list[str]:
    module = _tiny_checkpoint()
    return [name for name, arch in ARCHS.items() if hasattr(module, arch.shape) and hasattr(module, arch.builder)]


def resolve_model(model: str | None, arch: str | None) -> str:
    """The checkpoint directory to run: `model` as given, else the cached random checkpoint of `arch`."""
    if model is not None and arch is not None:
        raise ValueError("pass --model PATH or --arch NAME, not both")
    if model is not None:
        return model
    arch = arch or DEFAULT_ARCH
    available = available_archs()
    if arch not in available:
        raise ValueError(f"--arch must be one of {', '.join(available)} (what nanoserve.utils.tiny_checkpoint "
                         f"provides here), got {arch!r}")
    module, spec = _tiny_checkpoint(), ARCHS[arch]
    print(f"building/using the random-weight {arch} checkpoint ({arch}-random) ...", flush=True)
    return getattr(module, spec.builder)(f"{arch}-random", **getattr(module, spec.shape))

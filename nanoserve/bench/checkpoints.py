"""Which checkpoint a benchmark runs: a directory (--model), or a cached random-weight checkpoint
of a real architecture's exact shape (--arch), built with HF's own classes by
nanoserve.utils.tiny_checkpoint. The shapes are nanoserve.utils.tiny_configs.REAL_SHAPES: adding
an architecture there adds it here.
"""
from __future__ import annotations

from nanoserve.utils.tiny_checkpoint import ensure_tiny_checkpoint
from nanoserve.utils.tiny_configs import REAL_SHAPES

DEFAULT_ARCH = "qwen3-0.6b"


def available_archs() -> list[str]:
    return list(REAL_SHAPES)


def resolve_model(model: str | None, arch: str | None) -> str:
    """The checkpoint directory to run: `model` as given, else the cached random checkpoint of `arch`."""
    if model is not None and arch is not None:
        raise ValueError("pass --model PATH or --arch NAME, not both")
    if model is not None:
        return model
    arch = arch or DEFAULT_ARCH
    if arch not in REAL_SHAPES:
        raise ValueError(f"--arch must be one of {', '.join(REAL_SHAPES)}, got {arch!r}")
    model_type, shape = REAL_SHAPES[arch]
    print(f"building/using the random-weight {arch} checkpoint ({arch}-random) ...", flush=True)
    return ensure_tiny_checkpoint(f"{arch}-random", arch=model_type, **shape)

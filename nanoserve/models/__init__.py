"""Model architectures by the name HF checkpoints give in config.json's `architectures`.

Adding one: a model file composed from nanoserve.layers, and one line here. Modules are imported
only when their architecture is built.
"""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under nanoserve.models, class)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    module, name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(f"nanoserve.models.{module}"), name)

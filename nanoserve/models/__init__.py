"""Model architectures by the name HF checkpoints give in config.json's `architectures`.

Adding one: a model file composed from nanoserve.layers, and one line here. Modules are imported
only when their architecture is built. Each model class checks the config.json fields it reads
(`check_config`), so a checkpoint is refused at startup, naming the file and the field.
"""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under nanoserve.models, class)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    # Base models (HF's AutoModel, e.g. e5-mistral's MistralModel): the same decoder without an
    # LM head, which only runner="pooling" runs (nanoserve/pooling/model.py).
    "LlamaModel": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("mistral", "MistralForCausalLM"),
    "Qwen2Model": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Model": ("qwen3", "Qwen3ForCausalLM"),
    # Sequence classifiers (rewards, rerankers, labels): the decoder and a `score` head on the last
    # token, which only runner="pooling" runs (nanoserve/pooling/model.py).
    "LlamaForSequenceClassification": ("llama", "LlamaForCausalLM"),
    "MistralForSequenceClassification": ("mistral", "MistralForCausalLM"),
    "Qwen2ForSequenceClassification": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def head_dim_of(hf_config: dict) -> int:
    """config.json's head_dim, or hidden_size / num_attention_heads where it is absent (or null)."""
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def model_class(hf_config: dict, source: str = "config.json") -> type[nn.Module]:
    """The class that runs this checkpoint: the one place config.json's `architectures` is checked."""
    archs = hf_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"{source}: architectures must be a list naming the model class, got {archs!r}")
    if archs[0] not in MODEL_REGISTRY:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"unsupported architecture {archs[0]!r} in {source}; supported: {supported}")
    module, name = MODEL_REGISTRY[archs[0]]
    return getattr(importlib.import_module(f"nanoserve.models.{module}"), name)


def sliding_window(hf_config: dict) -> int | None:
    """The attention window, or None for full attention (Qwen2/3 keep `sliding_window` but switch it off)."""
    if hf_config.get("use_sliding_window") is False:
        return None
    window = hf_config.get("sliding_window")
    return int(window) if window else None

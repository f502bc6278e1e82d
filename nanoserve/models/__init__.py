"""Model architectures by the name HF checkpoints give in config.json's `architectures`.

Adding one: a model file composed from nanoserve.layers, and one line here. Modules are imported
only when their architecture is built.
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
}

SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def head_dim_of(hf_config: dict) -> int:
    """config.json's head_dim, or hidden_size / num_attention_heads where it is absent (or null)."""
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    module, name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(f"nanoserve.models.{module}"), name)


def check_supported(hf_config: dict, max_model_len: int, source: str) -> None:
    """Refuse, with a clear ValueError, a checkpoint nanoserve would run wrongly."""
    from nanoserve.layers.rotary_embedding import check_rope_scaling, rope_parameters

    arch = (hf_config.get("architectures") or [None])[0]
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r} in {source}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        check_rope_scaling(rope_parameters(hf_config)[1])
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    window = sliding_window(hf_config)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"{source} uses sliding-window attention (sliding_window={window}), which nanoserve does not "
            f"implement; pass max_model_len <= {window} (got {max_model_len}), where full attention is the same"
        )


def sliding_window(hf_config: dict) -> int | None:
    """The attention window, or None for full attention (Qwen2/3 keep `sliding_window` but switch it off)."""
    if hf_config.get("use_sliding_window") is False:
        return None
    window = hf_config.get("sliding_window")
    return int(window) if window else None

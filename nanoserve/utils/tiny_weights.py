"""Random weights for HF's own model classes, re-scaled by parameter name.

The model is built on the meta device (HF's init then costs nothing) and each parameter is
replaced by seeded noise whose scale depends on its role, so that tiny random models give
varied, non-degenerate greedy outputs instead of echoing their input.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nanoserve.utils.tiny_configs import resolve_arch


def _scaled_noise(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Random values for HF's parameter `name`, scaled by its role (tuned on greedy outputs)."""
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)  # scaled in place: big tensors
    if name.endswith("norm.weight"):
        # RMSNorm gains near 1 with visible noise, so a bug that skips a norm changes outputs.
        return noise.mul_(0.1).add_(1.0)
    if name.endswith(".bias"):
        # Small next to the projections' outputs (std ~2) but visible: dropping them shows.
        return noise.mul_(0.5)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        # With the final norm's output at unit RMS, logits get a std of about
        # 0.5 * sqrt(hidden_size): decisive for greedy, still soft enough to sample from.
        return noise.mul_(0.5)
    if len(shape) >= 2:
        # A linear weight [out, in], or HF's packed experts [num_experts, out, in]: the last
        # dim is the fan-in. Twice the variance-preserving scale, so every block writes more
        # into the residual stream than the token embedding holds; with weaker blocks the
        # tied embedding dominates the final hidden state and the model echoes its input.
        return noise.mul_(2.0 / math.sqrt(shape[-1]))
    raise RuntimeError(f"no scale rule for parameter {name} of shape {tuple(shape)}")


def empty_model(arch: str, config) -> nn.Module:
    """HF's model class for `arch` built from `config` on the meta device: no memory, no time."""
    import transformers  # lazily: slow to import, only needed when building

    model_class = getattr(transformers, resolve_arch(arch).model_class)
    with torch.device("meta"):
        return model_class(config)


def random_model(arch: str, config, seed: int, dtype: torch.dtype) -> nn.Module:
    """HF's model with every parameter drawn from one seeded generator in HF's parameter order.

    The values are drawn in float32 and then cast, so a seed gives the same weights whatever
    the dtype. Tied parameters (lm_head and embed_tokens) stay one tensor. Non-persistent
    buffers (RoPE frequencies) stay on the meta device: save_pretrained never writes them.
    """
    return fill_random(empty_model(arch, config), seed, dtype)


def fill_random(model: nn.Module, seed: int, dtype: torch.dtype) -> nn.Module:
    """`model` (built on the meta device) with every parameter seeded noise, as random_model."""
    generator = torch.Generator().manual_seed(seed)
    named = list(model.named_parameters(remove_duplicate=False))  # keeps the meta tensors alive
    filled: dict[int, nn.Parameter] = {}
    for name, param in named:
        if id(param) not in filled:
            values = _scaled_noise(name, param.shape, generator).to(dtype)
            filled[id(param)] = nn.Parameter(values, requires_grad=False)
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, filled[id(param)])
    unfilled = set(model.state_dict()) - {name for name, _ in named}
    if unfilled:
        raise RuntimeError(f"{type(model).__name__} has persistent buffers this builder does not fill: {unfilled}")
    return model

"""Load HF safetensors checkpoints (single file or sharded) through the layers' weight loaders.

Only safetensors are read (never pickle). Every problem is a ValueError naming the file and the
tensor: an unknown tensor, one of the wrong shape (the layers' loaders check the full, unsharded
shape, so a larger tensor is never cut to fit) or of a non-float dtype, a weight the model needs
that no file holds (including one part of a packed weight, e.g. a missing k_proj or one expert
of a MoE layer).
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanoserve.checkpoint import read_json

# Tensors a checkpoint may carry that the engine recomputes or never uses.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(
                f"{index}: weight_map must map tensor names to file names, got {type(weight_map).__name__}"
            )
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} is missing weight files: {missing}")
    if not names:
        raise ValueError(f"checkpoint {model_dir!r} has no *.safetensors weights")
    return [os.path.join(model_dir, n) for n in names]


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, tensor name, tensor) for every tensor of the checkpoint."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield path, name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Copy every checkpoint tensor into its parameter; fail loudly on anything missing or misfit."""
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for path, name, tensor in iter_checkpoint(model_dir):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = model.checkpoint_name_to_param(name)
        if target is None:  # a tensor this model does not use (an embedding model's LM head)
            continue
        if target not in params:
            raise ValueError(f"{path}: tensor {name!r} has no matching parameter ({target!r}) in the model")
        param = params[target]
        if not tensor.is_floating_point():  # copy_ would convert it silently into a wrong model
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}; weights must be "
                "floating point (float32, bfloat16 or float16)"
            )
        try:
            _load_one(param, tensor, shard_id)
        except (ValueError, RuntimeError, IndexError) as e:  # a shape that does not fit the parameter
            raise ValueError(
                f"{path}: tensor {name!r} of shape {list(tensor.shape)} does not fit parameter {target!r} "
                f"of shape {list(param.shape)} ({e})"
            ) from None
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    missing += [f"{n} (parts {sorted(p.expected_shards - p.loaded_shards, key=str)[:8]})"
                for n, p in params.items() if n in loaded and getattr(p, "expected_shards", None)
                and p.expected_shards - p.loaded_shards]
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
    loader = getattr(param, "weight_loader", None)
    if shard_id is not None:
        loader(param, tensor, shard_id)
    elif loader is not None:
        loader(param, tensor)
    elif param.shape != tensor.shape:
        raise RuntimeError("shapes differ")
    else:
        param.data.copy_(tensor)


def prepare_weights(model: nn.Module) -> None:
    """Let every layer turn its loaded weights into what its backend runs (e.g. prepacked GEMMs)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()

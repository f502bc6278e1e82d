"""Load HF safetensors checkpoints (single file or sharded) through the layers' weight loaders."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

# Tensors a checkpoint may carry that the engine recomputes or never uses.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} is missing weight files: {missing}")
    if not names:
        raise ValueError(f"checkpoint {model_dir!r} has no *.safetensors weights")
    return [os.path.join(model_dir, n) for n in names]


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Copy every checkpoint tensor into its parameter; fail loudly on anything missing."""
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(model_dir):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = _map_name(name, mapping)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter ({target!r}) in the model")
        param = params[target]
        loader = getattr(param, "weight_loader", None)
        if shard_id is not None:
            loader(param, tensor, shard_id)
        elif loader is not None:
            loader(param, tensor)
        else:
            param.data.copy_(tensor)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def prepare_weights(model: nn.Module) -> None:
    """Let every layer turn its loaded weights into what its backend runs (e.g. prepacked GEMMs)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()


def _map_name(name: str, mapping: dict) -> tuple[str, object]:
    for hf_fragment, (ours, shard_id) in mapping.items():
        if f".{hf_fragment}." in name:
            return name.replace(f".{hf_fragment}.", f".{ours}."), shard_id
    return name, None

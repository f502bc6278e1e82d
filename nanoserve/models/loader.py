"""Load HF safetensors checkpoints (single file or sharded) through the layers' weight loaders.

Only safetensors are read (never pickle). Every problem is a ValueError naming the file and the
tensor: an unknown tensor, one of the wrong shape (the layers' loaders check the full, unsharded
shape, so a larger tensor is never cut to fit) or of a non-float dtype, a weight the model needs
that no file holds (including one part of a packed weight, e.g. a missing k_proj or one expert
of a MoE layer).

A pre-quantized checkpoint (config.json's quantization_config) is checked from its headers first,
then read through its format's decoder (nanoserve/quantization/checkpoint.py): each linear layer
whose parts are all quantized alike holds the integers (LinearBase.make_quantized); any other
quantized module (a fused layer quantized in part, an LM head, MoE experts) loads dequantized.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanoserve.checkpoint import read_json
from nanoserve.quantization.checkpoint import QuantizedCheckpoint, open_checkpoint

logger = logging.getLogger(__name__)

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


def bind_quantized_layers(model: nn.Module, quantized: QuantizedCheckpoint) -> set[str]:
    """Turn every linear layer whose checkpoint parts are all quantized alike into an integer one;
    return the quantized modules that load as float instead (their layers marked `dequantized`)."""
    by_layer: dict[str, list] = {}
    for module, spec in quantized.specs.items():
        target, shard_id = model.checkpoint_name_to_param(f"{module}.weight")
        if target is None:
            continue
        if spec.decodes_to_float:
            _mark_dequantized(model, target.rpartition(".")[0])
            continue
        by_layer.setdefault(target.rpartition(".")[0], []).append((module, shard_id, spec))
    as_float: set[str] = set()
    for layer_name, parts in by_layer.items():
        try:
            layer = model.get_submodule(layer_name)
        except AttributeError:
            continue  # the loader names the tensor that has no parameter
        shards = getattr(getattr(layer, "weight", None), "expected_shards", None)
        # the layer runs one grouping and one input order (act-order g_idx) for all its parts
        kinds = {(spec.group_size, spec.act_order, spec.input_order) for _, _, spec in parts}
        complete = (len(parts) == 1) if shards is None else shards == {shard for _, shard, _ in parts}
        if hasattr(layer, "make_quantized") and complete and len(kinds) == 1:
            group_size, act_order, _ = kinds.pop()
            layer.make_quantized(group_size, act_order)
            continue
        why = ("not a linear layer" if not hasattr(layer, "make_quantized") else
               "only some of its parts are quantized" if not complete else
               "its parts use different groups or act-order input orders (g_idx)")
        logger.info("%s loads dequantized to float: %s", layer_name, why)
        as_float.update(module for module, _, _ in parts)
        layer.dequantized = True
    return as_float


def _mark_dequantized(model: nn.Module, layer_name: str) -> None:
    """The layer's weights come from a quantized checkpoint's tensors, decoded to float."""
    try:
        model.get_submodule(layer_name).dequantized = True
    except AttributeError:
        pass  # the loader names the tensor that has no parameter


def load_weights(model: nn.Module, model_dir: str, quantization: str | None = None) -> None:
    """Copy every checkpoint tensor into its parameter; fail loudly on anything missing or misfit.
    quantization: Config.quantization (a config outside config.json is read only when it is given)."""
    tensors = iter_checkpoint(model_dir)
    quantized = open_checkpoint(model_dir, read_json(os.path.join(model_dir, "config.json")),
                                checkpoint_files(model_dir), quantization)
    if quantized is not None:
        tensors = quantized.stream(tensors, bind_quantized_layers(model, quantized))
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    # A tied head shares the embedding's parameter (listed once, under the embedding's name); a
    # quantized head is its own (ParallelLMHead.make_quantized unties it).
    tied = getattr(model, "tie_word_embeddings", False) and "lm_head.weight" not in params
    loaded: set[str] = set()
    for path, name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard_id = model.checkpoint_name_to_param(name)
        if target is None:  # a tensor this model does not use (an embedding model's LM head)
            continue
        if target not in params:
            raise ValueError(f"{path}: tensor {name!r} has no matching parameter ({target!r}) in the model")
        param = params[target]
        # copy_ would convert it silently into a wrong model (integers only reach integer parameters)
        if not tensor.is_floating_point() and tensor.dtype != param.dtype:
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

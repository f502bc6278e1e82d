"""Tiny random sequence classifiers (`*ForSequenceClassification`), for tests and examples.

HF's own classifier class for the architecture (the decoder and a bias-free `score` head on the
last token) with seeded random weights (tiny_weights.py), saved with the tokenizer; the config
carries the label names and, when given, HF's `problem_type`.
"""
from __future__ import annotations

import os

import torch

from nanoserve.utils.tiny_checkpoint import DTYPES, _remove_old_weights, _tokenizer_and_config
from nanoserve.utils.tiny_configs import resolve_arch
from nanoserve.utils.tiny_tokenizer import DEFAULT_TOKENIZER_VOCAB_SIZE
from nanoserve.utils.tiny_weights import fill_random


def build_tiny_classifier_checkpoint(
    path: str | os.PathLike,
    arch: str = "qwen3",
    seed: int = 0,
    num_labels: int = 3,
    problem_type: str | None = None,
    dtype: str = "float32",
    **config_overrides,
) -> str:
    """Write the checkpoint into `path` (config.json architectures: e.g. Qwen3ForSequenceClassification)."""
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    tokenizer, config = _tokenizer_and_config(arch, dtype, config_overrides, DEFAULT_TOKENIZER_VOCAB_SIZE)
    config.num_labels = num_labels
    config.problem_type = problem_type
    config.pad_token_id = tokenizer.pad_token_id
    name = resolve_arch(arch).model_class.replace("ForCausalLM", "ForSequenceClassification")
    config.architectures = [name]
    with torch.device("meta"):
        model = getattr(transformers, name)(config)
    fill_random(model, seed, DTYPES[dtype])
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _remove_old_weights(path)
    model.save_pretrained(path, max_shard_size="1000GB")
    tokenizer.save_pretrained(path)
    return path

"""Tiny random embedding checkpoints shaped like Qwen3-Embedding, for tests and benchmarks.

HF's own Qwen3 decoder with seeded random weights (tiny_checkpoint.py), saved as the base model
(`Qwen3Model`: weights without the `model.` prefix, no LM head) or as a causal LM, with a
tokenizer that appends <|endoftext|> to every text (as Qwen3-Embedding's does: last-token
pooling reads that token) and the sentence-transformers files that say how to pool:
modules.json, sentence_bert_config.json, 1_Pooling/config.json and optionally 2_Normalize.
"""
from __future__ import annotations

import json
import os


from nanoserve.utils.tiny_checkpoint import (
    DTYPES,
    _fingerprint,
    _remove_old_weights,
    _tokenizer_and_config,
    _write_json,
    build_cached,
)
from nanoserve.utils.tiny_tokenizer import DEFAULT_TOKENIZER_VOCAB_SIZE, ENDOFTEXT
from nanoserve.utils.tiny_weights import random_model

ST_POOLING_MODES = ("lasttoken", "mean", "cls")


def build_tiny_embedding_checkpoint(
    path: str | os.PathLike,
    seed: int = 0,
    dtype: str = "float32",
    *,
    pooling_mode: str = "lasttoken",
    normalize: bool = True,
    base_model: bool = True,
    matryoshka: bool | list[int] = True,
    max_seq_length: int = 512,
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB_SIZE,
    **config_overrides,
) -> str:
    """Write the checkpoint into `path` and return it. matryoshka: True writes config.json
    `is_matryoshka: true`, a list writes `matryoshka_dimensions`, False neither."""
    if pooling_mode not in ST_POOLING_MODES:
        raise ValueError(f"pooling_mode must be one of {ST_POOLING_MODES}, got {pooling_mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    tokenizer, config = _tokenizer_and_config("qwen3", dtype, config_overrides, tokenizer_vocab_size)
    model = random_model("qwen3", config, seed, DTYPES[dtype])
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _remove_old_weights(path)
    (model.model if base_model else model).save_pretrained(path, max_shard_size="1000GB")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config_json = json.load(f)
    if matryoshka is True:
        config_json["is_matryoshka"] = True
    elif matryoshka:
        config_json["matryoshka_dimensions"] = list(matryoshka)
    _write_json(config_path, config_json)
    _append_end_of_text(tokenizer)
    tokenizer.save_pretrained(path)
    _write_sentence_transformers_files(path, config.hidden_size, pooling_mode, normalize, max_seq_length)
    return path


def _append_end_of_text(tokenizer) -> None:
    from tokenizers import processors

    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {ENDOFTEXT}:0", pair=f"$A:0 {ENDOFTEXT}:0 $B:1 {ENDOFTEXT}:1",
        special_tokens=[(ENDOFTEXT, eot)],
    )


def _write_sentence_transformers_files(path: str, hidden: int, mode: str, normalize: bool, max_len: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    _write_json(os.path.join(path, "modules.json"), modules)
    _write_json(os.path.join(path, "sentence_bert_config.json"), {"max_seq_length": max_len, "do_lower_case": False})
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    # The older one-boolean-per-mode format, as Qwen3-Embedding ships it.
    pooling = {"word_embedding_dimension": hidden, "include_prompt": True}
    for key, name in (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                      ("pooling_mode_max_tokens", "max"), ("pooling_mode_mean_sqrt_len_tokens", None),
                      ("pooling_mode_weightedmean_tokens", None), ("pooling_mode_lasttoken", "lasttoken")):
        pooling[key] = name == mode
    _write_json(os.path.join(path, "1_Pooling", "config.json"), pooling)


def ensure_tiny_embedding_checkpoint(name: str, **kwargs) -> str:
    """build_tiny_embedding_checkpoint once into default_model_dir(name), reused while kwargs match
    (built in a temporary sibling and renamed into place, as ensure_tiny_checkpoint does)."""
    fingerprint = _fingerprint("qwen3-embedding", kwargs)
    return build_cached(name, fingerprint, lambda tmp: build_tiny_embedding_checkpoint(tmp, **kwargs))

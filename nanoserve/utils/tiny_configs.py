"""The configs of the tiny checkpoints: a small default per architecture, real-shape presets,
and the checks that turn keyword overrides into an HF config object.

Every preset is a plain dict of HF config fields, written with the 4.x names real checkpoints
use (`rope_theta`, `rope_scaling`, `torch_dtype`, `num_experts`), so it reads like the
config.json of the checkpoint it imitates.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from nanoserve.models import model_class


@dataclass(frozen=True)
class TinyArch:
    model_type: str  # config.json "model_type"; what `arch=` takes, besides the class name
    model_class: str  # the transformers class, config.json "architectures"[0]
    config_class: str
    defaults: dict
    # Fields real config.json files have that the config class keeps as plain attributes.
    extra_fields: tuple[str, ...] = ()


# The tiny shapes share one pattern: 2 layers, hidden 64, 4 query heads over 2 KV heads
# (GQA), head_dim 16. vocab_size is deliberately absent: it defaults to the tokenizer's size.
_TINY_COMMON: dict = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
}
TINY_QWEN3: dict = {**_TINY_COMMON, "head_dim": 16, "tie_word_embeddings": True, "rope_theta": 1000000.0,
                    "rms_norm_eps": 1e-6}
TINY_LLAMA: dict = {**_TINY_COMMON, "head_dim": 16, "tie_word_embeddings": False, "rope_theta": 500000.0,
                    "rms_norm_eps": 1e-5}
# Qwen2 has no head_dim field (it is hidden_size / num_attention_heads) and always has
# biases on q/k/v.
TINY_QWEN2: dict = {**_TINY_COMMON, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
# MistralConfig defaults to a 4096-token sliding window; Mistral 7B v0.2+ has none.
TINY_MISTRAL: dict = {**_TINY_COMMON, "head_dim": 16, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-5, "sliding_window": None}
# Every layer sparse by default; decoder_sparse_step / mlp_only_layers mix in dense layers
# (of intermediate_size) and norm_topk_prob=True is Qwen3-30B-A3B's setting.
TINY_QWEN3_MOE: dict = {**TINY_QWEN3, "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                        "mlp_only_layers": []}

ARCHITECTURES: dict[str, TinyArch] = {
    arch.model_type: arch
    for arch in (
        TinyArch("qwen3", "Qwen3ForCausalLM", "Qwen3Config", TINY_QWEN3),
        TinyArch("llama", "LlamaForCausalLM", "LlamaConfig", TINY_LLAMA),
        TinyArch("qwen2", "Qwen2ForCausalLM", "Qwen2Config", TINY_QWEN2),
        TinyArch("mistral", "MistralForCausalLM", "MistralConfig", TINY_MISTRAL),
        # Qwen3MoeConfig has no head_dim field, but the model reads config.head_dim when set
        # and real Qwen3-MoE configs set it (128, not hidden_size / num_attention_heads).
        TinyArch("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", TINY_QWEN3_MOE, extra_fields=("head_dim",)),
    )
}

# Real architectures that fit a 24 GiB, 2-core CPU machine. Their vocabularies are far bigger
# than the tiny tokenizer: ids it does not know are never produced by it and decode to "".
# Qwen3-0.6B: 596,049,920 parameters (embeddings tied).
QWEN3_0_6B: dict = {
    "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "tie_word_embeddings": True,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}
# Llama-3.2-1B: 1,235,814,400 parameters (embeddings tied), llama3 RoPE scaling.
LLAMA_3_2_1B: dict = {
    "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}
# Qwen2.5-0.5B(-Instruct): 494,032,768 parameters (embeddings tied), biases on q/k/v.
QWEN2_5_0_5B: dict = {
    "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "intermediate_size": 4864, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "max_window_layers": 21, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
# Qwen3-30B-A3B scaled down: 128 experts with top-8 routing, norm_topk_prob, head_dim 128 and
# 4 KV heads are kept; 48 -> 12 layers, hidden 2048 -> 1024, 32 -> 16 query heads, expert
# width 768 -> 256. 1,583,640,576 parameters in all (1,207,959,552 in experts), 451,178,496
# active per token (8 of 128 experts); 3.2 GB in bfloat16.
QWEN3_MOE_1_6B: dict = {
    "vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 3072, "moe_intermediate_size": 256,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}
# Name -> (arch, preset), e.g. for a benchmark's --arch flag.
REAL_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-0.6b": ("qwen3", QWEN3_0_6B),
    "llama-3.2-1b": ("llama", LLAMA_3_2_1B),
    "qwen2.5-0.5b": ("qwen2", QWEN2_5_0_5B),
    "qwen3-moe-1.6b": ("qwen3_moe", QWEN3_MOE_1_6B),
}

# Derived here from the tokenizer and the weights, never overridden.
_RESERVED = {"architectures", "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"}
# transformers 4.x names that the 5.x config classes still accept as keywords.
_LEGACY_FIELDS = {"rope_theta", "rope_scaling"}
# Tensor shapes: they must be positive ints.
_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "decoder_sparse_step",
)


def resolve_arch(arch: str) -> TinyArch:
    """The architecture named by its model_type ("qwen3_moe") or class ("Qwen3MoeForCausalLM")."""
    for spec in ARCHITECTURES.values():
        if arch in (spec.model_type, spec.model_class):
            return spec
    allowed = ", ".join(f"{a.model_type!r} ({a.model_class})" for a in ARCHITECTURES.values())
    raise ValueError(f"arch must be one of {allowed}; got {arch!r}")


def _config_class(spec: TinyArch):
    import transformers  # lazily: slow to import, only needed when building

    return getattr(transformers, spec.config_class)


def _check_field_names(spec: TinyArch, fields: dict) -> None:
    # HF config classes silently keep unknown kwargs, so a typo would go unnoticed.
    allowed = {f.name for f in dataclasses.fields(_config_class(spec))} - _RESERVED
    allowed |= _LEGACY_FIELDS | set(spec.extra_fields)
    for name in fields:
        if name not in allowed:
            raise TypeError(f"unknown or reserved {spec.config_class} field {name!r}")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_fields(spec: TinyArch, fields: dict, tokenizer_size: int) -> None:
    for name in _SHAPE_FIELDS:
        value = fields.get(name)
        if value is None and name == "head_dim":
            continue  # absent: hidden_size / num_attention_heads, checked by the model class
        if name in fields and not _is_positive_int(value):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    # What nanoserve's model would refuse to load (heads, head_dim, experts, RoPE) is not built.
    model_class({"architectures": [spec.model_class]}).check_config(fields, f"{spec.model_type} config")
    if fields["vocab_size"] < tokenizer_size:
        raise ValueError(f"vocab_size={fields['vocab_size']} is smaller than the tokenizer ({tokenizer_size} tokens)")
    if fields.get("sliding_window") is not None and not _is_positive_int(fields["sliding_window"]):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {fields['sliding_window']!r}")
    layers, mlp_only = fields["num_hidden_layers"], fields.get("mlp_only_layers", [])
    if not isinstance(mlp_only, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in mlp_only
    ):
        raise ValueError(f"mlp_only_layers must be a list of layer indices in [0, {layers}), got {mlp_only!r}")


def make_config(arch: str, tokenizer_size: int, bos_token_id: int, eos_token_id: int, dtype: str, overrides: dict):
    """The HF config object: the arch's tiny defaults, then `overrides`, checked first.

    vocab_size defaults to `tokenizer_size`; the token ids are the tokenizer's.
    """
    spec = resolve_arch(arch)
    # Deep-copied: config classes edit nested dicts in place (rope_theta goes into rope_scaling),
    # and the caller's dicts, presets included, must stay as they were.
    fields = copy.deepcopy({**spec.defaults, "vocab_size": tokenizer_size, **overrides})
    _check_field_names(spec, fields)
    _check_fields(spec, fields, tokenizer_size)
    if "mlp_only_layers" in fields:
        fields["mlp_only_layers"] = list(fields["mlp_only_layers"])  # a tuple would not round-trip JSON
    return _config_class(spec)(
        **fields, architectures=[spec.model_class], bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        dtype=dtype,
    )


def add_legacy_keys(config_json: dict) -> dict:
    """config.json as transformers 5 writes it, plus the keys real (4.x-era) checkpoints have.

    transformers 5 writes `dtype`, nests rope_theta and the scaling in `rope_parameters` and
    writes Qwen3-MoE's expert count as `num_local_experts`; published checkpoints (and the
    readers written against them) use `torch_dtype`, top-level `rope_theta`/`rope_scaling` and
    `num_experts`. Both spellings are kept, so either kind of reader finds its keys.
    """
    out = dict(config_json)
    out["torch_dtype"] = out["dtype"]
    rope = dict(out.get("rope_parameters") or {})
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "num_local_experts" in out:
        out["num_experts"] = out["num_local_experts"]
    return dict(sorted(out.items()))  # sorted, as transformers writes it


"""vLLM's engine-argument names for `LLM(...)`, in three explicit groups (the README's table).

1. Supported: every `Config` field, plus vLLM's names for the same knobs (`RENAMED`). For the
   few where vLLM's default is None ("let the engine pick"), None picks nanoserve's default.
2. Accepted with no effect (`NO_EFFECT`): tuning knobs for machinery nanoserve does not have.
   Each is checked for a sensible value and logged once per process.
3. Refused (`REFUSED`): features nanoserve lacks. Passing the "off" value (e.g.
   `quantization=None`) is fine; anything else is a ValueError naming the argument and what
   nanoserve offers instead.

Any other name is a TypeError that suggests the closest valid one.
"""
from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from nanoserve.config import Config
from nanoserve.pooling.config import runner_from_vllm_args

logger = logging.getLogger(__name__)

# ---- 1. supported ----------------------------------------------------------------------------

# vLLM name -> Config field, where the two differ.
RENAMED = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks",
           "override_pooler_config": "pooler_config"}  # vLLM < 0.10's name

# vLLM passes None for "the engine's default" here: None leaves nanoserve's default in place.
NONE_IS_DEFAULT = (
    "seed", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
    *RENAMED,
)

# ---- 2. accepted with no effect --------------------------------------------------------------


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_non_negative_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


# name -> (check, what the check allows, why it changes nothing in nanoserve)
NO_EFFECT: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "trust_remote_code": (
        _is_bool, "a bool", "nanoserve runs only its built-in architectures, so no checkpoint code is ever executed"
    ),
    "disable_log_stats": (_is_bool, "a bool", "nanoserve logs no periodic engine stats"),
    "swap_space": (
        _is_non_negative_number, "a number >= 0",
        "nanoserve never swaps KV blocks to CPU memory: a preempted sequence is recomputed",
    ),
    "tokenizer_mode": (
        lambda v: v == "auto", "'auto'", "nanoserve always loads the tokenizer with transformers' AutoTokenizer"
    ),
    "disable_custom_all_reduce": (
        _is_bool, "a bool", "tensor parallelism always uses torch.distributed's all-reduce"
    ),
    "guided_decoding_backend": (
        lambda v: isinstance(v, str), "a str", "structured outputs always run on llguidance"
    ),
    "structured_outputs_config": (
        lambda v: v is None or isinstance(v, dict), "a dict or None",
        "structured outputs always run on llguidance; whitespace options are set per request",
    ),
}

# ---- 3. refused unless off -------------------------------------------------------------------

_NO_HUB = "nanoserve has no model hub: download the checkpoint (e.g. huggingface-cli download) and pass its directory"
NO_LORA = (
    "nanoserve has no LoRA adapters: merge the adapter into the weights (e.g. PEFT's merge_and_unload) "
    "and load the merged checkpoint"
)
_NO_SPEC = "nanoserve has no speculative decoding; plain decoding with CUDA graphs and batching is what it offers"

# name -> (the values that ask for nothing, what nanoserve offers instead)
REFUSED: dict[str, tuple[tuple, str]] = {
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model dtype: choose it with dtype"),
    "enable_lora": ((False,), NO_LORA),
    "max_loras": ((1,), NO_LORA),
    "max_lora_rank": ((16,), NO_LORA),
    "speculative_config": ((None,), _NO_SPEC),
    "speculative_model": ((None,), _NO_SPEC),
    "num_speculative_tokens": ((None,), _NO_SPEC),
    "pipeline_parallel_size": ((1,), "split a model across devices with tensor_parallel_size"),
    "data_parallel_size": ((1,), "run one LLM per device (or per tensor-parallel group)"),
    "revision": ((None,), _NO_HUB),
    "tokenizer_revision": ((None,), _NO_HUB),
    "code_revision": ((None,), _NO_HUB),
    "download_dir": ((None,), _NO_HUB),
    "hf_token": ((None,), _NO_HUB),
    "load_format": (("auto", "safetensors"), "nanoserve loads *.safetensors checkpoints"),
    "cpu_offload_gb": ((0,), "weights stay on the device: use tensor_parallel_size, or a smaller dtype"),
    "kv_cache_memory_bytes": (
        (None,), "size the KV cache with gpu_memory_utilization, cpu_kvcache_space_gib or num_kvcache_blocks"
    ),
    "skip_tokenizer_init": ((False,), "pass token-id prompts with SamplingParams(detokenize=False) to skip text"),
    "scheduling_policy": (("fcfs",), "nanoserve schedules first come, first served"),
}

# vLLM's older names for the runner (task="embed", convert="embed"): folded into Config.runner.
RUNNER_ALIASES = ("task", "convert")


def is_off(value: Any, off_values: Iterable) -> bool:
    """`value` equals one of `off_values`; a bool never matches an int (enable_lora=0 is not False)."""
    return any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in off_values)


def refuse_unless_off(where: str, name: str, value: Any, off_values: tuple, instead: str) -> None:
    if not is_off(value, off_values):
        allowed = " or ".join(repr(v) for v in off_values)
        raise ValueError(f"{where}: {name}={value!r} is not supported ({instead}); leave it at {allowed}")


# ---- resolution ------------------------------------------------------------------------------


def supported_names() -> set[str]:
    return Config.field_names() | set(RENAMED)


def valid_names() -> set[str]:
    return supported_names() | set(NO_EFFECT) | set(REFUSED) | set(RUNNER_ALIASES)


def resolve_engine_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """vLLM-style `LLM(model, **kwargs)` -> (Config kwargs, the arguments accepted with no effect).

    Raises before anything is loaded: TypeError for an unknown name, ValueError for a refused
    feature, a no-effect argument with a bad value, or a knob given under both of its names.
    """
    _check_names(kwargs)
    kwargs = dict(kwargs)
    runner, pooling_task = runner_from_vllm_args(kwargs.pop("runner", None), kwargs.pop("task", None),
                                                 kwargs.pop("convert", None))
    config_kwargs: dict[str, Any] = {} if runner is None else {"runner": runner}
    if pooling_task is not None:
        config_kwargs["pooling_task"] = pooling_task
    ignored: list[str] = []
    for name, value in kwargs.items():
        if name in REFUSED:
            off_values, instead = REFUSED[name]
            refuse_unless_off("LLM()", name, value, off_values, instead)
        elif name in NO_EFFECT:
            check, allowed, reason = NO_EFFECT[name]
            if not check(value):
                raise ValueError(f"LLM(): {name} must be {allowed}, got {value!r} ({reason})")
            ignored.append(name)
        elif value is None and name in NONE_IS_DEFAULT:
            continue  # vLLM's "engine default"
        else:
            field = RENAMED.get(name, name)
            if field in config_kwargs:
                raise ValueError(f"LLM(): {field} was given twice (as {field} and as {name}); pass one")
            config_kwargs[field] = value
    return config_kwargs, ignored


_already_logged: set[str] = set()


def log_no_effect_once(names: Iterable[str]) -> None:
    """One log line per argument per process: a notebook rebuilding LLM(...) is not flooded."""
    for name in names:
        if name not in _already_logged:
            _already_logged.add(name)
            logger.warning("LLM(): %s is accepted for vLLM compatibility but has no effect: %s", name, NO_EFFECT[name][2])


def _check_names(kwargs: dict[str, Any]) -> None:
    valid = valid_names()
    for name in kwargs:
        if name in valid:
            continue
        close = difflib.get_close_matches(name, sorted(valid), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise TypeError(
            f"LLM() got an unexpected keyword argument {name!r}{hint} "
            f"(supported: {', '.join(sorted(supported_names()))}; the README lists every accepted vLLM argument)"
        )

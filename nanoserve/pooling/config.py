"""Which runner an engine is (generate or pooling) and how a pooling checkpoint pools.

A pooling engine has one task: "embed" (a vector per prompt) or, for a `*ForSequenceClassification`
checkpoint, "classify" (its `score` head's class probabilities from the last token, as vLLM and
HF transformers run such models).

Read as vLLM and sentence-transformers read them: the runner from `runner=` (or vLLM's older
`task=` / `convert=`), "auto" deciding by the architecture name; the pooling from the
checkpoint's sentence-transformers files (`modules.json` -> its Pooling module's
`config.json`, a `Normalize` module), which `LLM(pooler_config=...)` may override; the input
side from `sentence_bert_config.json` (`max_seq_length`, `do_lower_case`) and the output size
from `config_sentence_transformers.json` (`truncate_dim`).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from nanoserve.checkpoint import read_json

RUNNERS = ("auto", "generate", "pooling")
# vLLM's older spellings of a runner: task= and convert= values -> runner.
TASK_TO_RUNNER = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
                  "classify": "pooling"}
CONVERT_TO_RUNNER = {"auto": "auto", "none": "auto", "embed": "pooling", "classify": "pooling"}
POOLING_TASK_NAMES = {"embed": "embed", "embedding": "embed", "classify": "classify"}  # task=/convert= -> task
# vLLM's defaults by architecture-name suffix (first match wins): "*ForCausalLM" generates,
# "*Model" (e.g. Qwen3Model, MistralModel, *EmbeddingModel) is a base model and pools,
# "*ForSequenceClassification" pools and classifies.
CLASSIFIER_SUFFIX = "ForSequenceClassification"
_SUFFIX_TO_RUNNER = (("ForCausalLM", "generate"), ("Model", "pooling"), (CLASSIFIER_SUFFIX, "pooling"))
# HF's problem_type -> the activation that turns a classifier's logits into its outputs (as
# transformers' loss for that problem and vLLM's classify pooler): softmax over >= 2 labels,
# sigmoid for one label or multi-label, none for regression.
_PROBLEM_ACTIVATIONS = {"regression": None, "multi_label_classification": "sigmoid",
                        "single_label_classification": "softmax"}

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes -> ours (the others are refused by name).
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
# A decoder checkpoint with no sentence-transformers files pools like vLLM's embedding
# conversion of it: the last token, normalised.
DEFAULT_POOLING_TYPE = "LAST"
DEFAULT_NORMALIZE = True
# Where sentence-transformers' Transformer module keeps max_seq_length / do_lower_case (vLLM
# reads the same list, first found wins).
ST_INPUT_CONFIGS = (
    "sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
    "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
ST_MODEL_CONFIG = "config_sentence_transformers.json"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's PoolerConfig (the fields nanoserve implements); None = the checkpoint's choice.

    pooling_type: "LAST" (last token), "MEAN" (mean over the prompt) or "CLS" (first token).
    normalize: unit-length vectors unless a request's PoolingParams says otherwise
    (`use_activation` is vLLM's newer name).
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and (
            not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES
        ):
            raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"pooler_config.{name} must be None or a bool, got {value!r}")

    @classmethod
    def coerce(cls, value) -> PoolerConfig | None:
        """LLM(pooler_config=...) takes a PoolerConfig, a dict of its fields, or None."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"pooling_type", "normalize", "use_activation"})
            if unknown:
                raise ValueError(f"pooler_config keys {unknown} are not supported; nanoserve takes "
                                 "pooling_type, normalize (or use_activation)")
            return cls(**value)
        raise TypeError(f"pooler_config must be a PoolerConfig, a dict or None, got {type(value).__name__}")

    @property
    def wants_normalize(self) -> bool | None:
        return self.use_activation if self.use_activation is not None else self.normalize


@dataclass(frozen=True)
class Pooling:
    """The resolved pooling of a pooling engine: what its runner pools and how it post-processes."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None  # None: no Matryoshka; () any size up to hidden_size
    # config_sentence_transformers.json `truncate_dim`: the size a request gets when it asks for none
    # (sentence-transformers cuts every vector to it by default).
    default_dimensions: int | None = None
    lower_case: bool = False  # sentence_bert_config.json `do_lower_case`: texts are lowercased first
    max_seq_length: int | None = None  # sentence_bert_config.json: caps the default max_model_len
    task: str = "embed"  # "embed" or "classify" (a *ForSequenceClassification checkpoint)
    num_labels: int | None = None  # classify: the score head's outputs
    activation: str | None = None  # classify: "softmax", "sigmoid" or None (logits as they are)
    use_activation: bool = True  # classify: apply it unless a request's PoolingParams says otherwise

    @property
    def uses_prefix_cache(self) -> bool:
        """Only last-token pooling can skip cached prompt positions: mean and CLS need the hidden
        states of every position (CLS: the first), which a prefix-cache hit never computes."""
        return self.pooling_type == "LAST"


# ---- the runner ------------------------------------------------------------------------------


def runner_from_vllm_args(runner, task, convert) -> tuple[str | None, str | None]:
    """(one runner name from vLLM's three ways to ask for it, None when none was given; the pooling
    task task= / convert= named, "embed" or "classify", else None)."""
    asked: dict[str, str] = {}
    tasks = set()
    for name, value, table in (("task", task, TASK_TO_RUNNER), ("convert", convert, CONVERT_TO_RUNNER)):
        if value is None:
            continue
        if value not in table:
            raise ValueError(f"LLM(): {name}={value!r} is not supported; nanoserve takes {name} in {tuple(table)}")
        asked[name] = table[value]
        if value in POOLING_TASK_NAMES:
            tasks.add(POOLING_TASK_NAMES[value])
    if runner is not None:
        asked["runner"] = runner
    chosen = {v for v in asked.values() if v != "auto"}
    if len(chosen) > 1 or len(tasks) > 1:
        given = ", ".join(f"{k}={v!r}" for k, v in (("runner", runner), ("task", task), ("convert", convert)) if v)
        raise ValueError(f"LLM(): {given} ask for different runners or tasks; pass one")
    runner = chosen.pop() if chosen else ("auto" if asked else None)
    return runner, (tasks.pop() if tasks else None)


def check_pooling_task(asked: str | None, pooling: Pooling, arch: str, source: str) -> None:
    """task= / convert= name the task the checkpoint's architecture decides: a causal LM or base
    model embeds, a *ForSequenceClassification classifies (nanoserve converts neither into the other)."""
    if asked is not None and asked != pooling.task:
        kind = "a sequence classifier" if pooling.task == "classify" else "an embedding (or causal LM) architecture"
        raise ValueError(f"{source}: task {asked!r} was asked, but {arch!r} is {kind}, which runs "
                         f"task {pooling.task!r} (use llm.{pooling.task}())")


def resolve_runner(runner: str, hf_config: dict, source: str) -> str:
    """"generate" or "pooling" for this checkpoint; refuses what would run wrong."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    arch = hf_config["architectures"][0]
    by_name = next((r for suffix, r in _SUFFIX_TO_RUNNER if arch.endswith(suffix)), "generate")
    if runner == "auto":
        runner = by_name
    if hf_config.get("is_causal") is False:
        raise ValueError(
            f"{source} sets is_causal: false: the model was trained with bidirectional attention (like "
            "gte-Qwen2-instruct), and nanoserve's attention is causal only, so it would embed it wrong"
        )
    if runner == "generate" and by_name == "pooling":
        kind, call = (("a sequence classifier", "llm.classify()") if arch.endswith(CLASSIFIER_SUFFIX)
                      else ("a base model", "llm.embed()"))
        raise ValueError(
            f"{source}: architecture {arch!r} is {kind} without an LM head, so it cannot generate; "
            f"use LLM(model, runner='pooling') and {call}"
        )
    return runner


# ---- the pooling -----------------------------------------------------------------------------


def resolve_pooling(model_dir: str, hf_config: dict, override: PoolerConfig | None) -> Pooling:
    """The checkpoint's pooling (sentence-transformers files, else vLLM's default), then the override."""
    if hf_config["architectures"][0].endswith(CLASSIFIER_SUFFIX):
        return resolve_classifier(hf_config, override, os.path.join(model_dir, "config.json"))
    overridden = override is not None and override.pooling_type is not None
    pooling_type, normalize = read_sentence_transformers_pooling(model_dir, read_pooling_type=not overridden)
    if override is not None:
        pooling_type = override.pooling_type or pooling_type
        if override.wants_normalize is not None:
            normalize = override.wants_normalize
    hidden_size = int(hf_config["hidden_size"])
    st_model = _read_st_model_config(model_dir)
    default_dimensions = _truncate_dim(st_model, hidden_size, model_dir)
    matryoshka = matryoshka_dimensions(hf_config, st_model)
    if matryoshka is None and default_dimensions is not None:
        matryoshka = ()  # the checkpoint says its vectors are meant to be cut: any size may be asked
    max_seq_length, lower_case = read_sentence_transformers_inputs(model_dir)
    return Pooling(
        pooling_type=pooling_type or DEFAULT_POOLING_TYPE,
        normalize=DEFAULT_NORMALIZE if normalize is None else normalize,
        hidden_size=hidden_size,
        matryoshka_dimensions=matryoshka,
        default_dimensions=default_dimensions,
        lower_case=lower_case,
        max_seq_length=max_seq_length,
    )


def classifier_num_labels(hf_config: dict) -> object:
    """The size of config.json's id2label (what transformers saves, and what its PretrainedConfig and
    vLLM count), else its num_labels, else 2 (PretrainedConfig's default). Checked by the caller."""
    id2label = hf_config.get("id2label")
    if id2label:
        return len(id2label)
    num_labels = hf_config.get("num_labels")
    return 2 if num_labels is None else num_labels


def resolve_classifier(hf_config: dict, override: PoolerConfig | None, source: str) -> Pooling:
    """A sequence classifier: the last token's hidden state through the `score` head (HF's and
    vLLM's pooling for a decoder classifier), then the problem type's activation."""
    num_labels = classifier_num_labels(hf_config)
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
        raise ValueError(f"{source}: num_labels must be an int >= 1, got {num_labels!r}")
    problem = hf_config.get("problem_type")
    if problem is not None and problem not in _PROBLEM_ACTIVATIONS:
        raise ValueError(f"{source}: problem_type must be one of {tuple(_PROBLEM_ACTIVATIONS)} or null, "
                         f"got {problem!r}")
    activation = _PROBLEM_ACTIVATIONS[problem] if problem is not None else "softmax"
    if activation == "softmax" and num_labels == 1:
        activation = "sigmoid"  # one logit: its probability, as vLLM's classify pooler
    return Pooling(
        pooling_type=(override.pooling_type if override is not None else None) or "LAST",
        normalize=False, hidden_size=int(hf_config["hidden_size"]), matryoshka_dimensions=None,
        task="classify", num_labels=num_labels, activation=activation,
        use_activation=override is None or override.wants_normalize is not False,
    )


def matryoshka_dimensions(hf_config: dict, st_model_config: dict | None = None) -> tuple[int, ...] | None:
    """vLLM's rule: config.json `matryoshka_dimensions` (the sizes allowed) or `is_matryoshka` (any);
    the same keys in config_sentence_transformers.json where config.json has neither."""
    for cfg in (hf_config, st_model_config or {}):
        dims = cfg.get("matryoshka_dimensions")
        if dims:
            return tuple(int(d) for d in dims)
        if cfg.get("is_matryoshka"):
            return ()
    return None


def _read_st_model_config(model_dir: str) -> dict:
    """config_sentence_transformers.json ({} without one); warns about the prompt that
    sentence-transformers prepends by default and nanoserve, as vLLM, does not."""
    path = os.path.join(model_dir, ST_MODEL_CONFIG)
    if not os.path.isfile(path):
        return {}
    cfg = read_json(path)
    default_prompt = cfg.get("default_prompt_name")
    if default_prompt:
        logger.warning(
            "%s: default_prompt_name=%r: sentence-transformers prepends that prompt to every text; nanoserve "
            "(as vLLM) embeds the text as given, so prepend it yourself", path, default_prompt,
        )
    return cfg


def _truncate_dim(st_model_config: dict, hidden_size: int, model_dir: str) -> int | None:
    value = st_model_config.get("truncate_dim")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hidden_size:
        raise ValueError(
            f"{os.path.join(model_dir, ST_MODEL_CONFIG)}: truncate_dim must be an int in [1, hidden_size="
            f"{hidden_size}], got {value!r}"
        )
    return value


def read_sentence_transformers_inputs(model_dir: str) -> tuple[int | None, bool]:
    """(max_seq_length or None, do_lower_case) from sentence_bert_config.json (or a sibling name)."""
    for name in ST_INPUT_CONFIGS:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        cfg = read_json(path)
        max_len, lower = cfg.get("max_seq_length"), cfg.get("do_lower_case", False)
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
            raise ValueError(f"{path}: max_seq_length must be an int >= 1 or null, got {max_len!r}")
        if not isinstance(lower, bool):
            raise ValueError(f"{path}: do_lower_case must be true or false, got {lower!r}")
        if "message" in (cfg.get("modality_config") or {}):
            logger.warning(
                "%s: modality_config lists 'message': sentence-transformers >= 6 renders every text through "
                "the tokenizer's chat template; nanoserve (as vLLM) embeds the text as given, so render it "
                "yourself (apply_chat_template, then tokenization_kwargs={'add_special_tokens': False})", path,
            )
        return max_len, lower
    return None, False


def read_sentence_transformers_pooling(
    model_dir: str, read_pooling_type: bool = True
) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from modules.json; (None, None) when the checkpoint has none.
    read_pooling_type=False: the user chose it (pooler_config), so the Pooling module is not read."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: must hold a list of modules, found {type(modules).__name__}")
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer" or (kind == "Pooling" and not read_pooling_type):
            continue
        if kind == "Pooling" and read_pooling_type:
            pooling_type = _read_pooling_module(os.path.join(model_dir, str(module.get("path", ""))))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{path}: module {module.get('type')!r} is not supported; nanoserve embeds with "
                "Transformer -> Pooling (-> Normalize) only"
            )
    return pooling_type, normalize


def _read_pooling_module(module_dir: str) -> str:
    path = os.path.join(module_dir, "config.json")
    cfg = read_json(path)
    mode = cfg.get("pooling_mode")
    if mode is None:  # the older format: one boolean per mode
        modes = [m for key, m in _ST_LEGACY_KEYS.items() if cfg.get(key)]
        mode = modes if len(modes) != 1 else modes[0]
        if not modes:
            mode = "mean"  # sentence-transformers' default
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(
            f"{path}: pooling mode {mode!r} is not supported; nanoserve pools with one of "
            f"{tuple(_ST_MODES)}"
        )
    if cfg.get("include_prompt") is False and mode != "lasttoken":
        # sentence-transformers leaves out the prompt it is given separately (encode(prompt=...));
        # a prompt here is part of the text, so every token is pooled (CLS: the first), as in vLLM.
        logger.warning(
            "%s: include_prompt: false: nanoserve (as vLLM) pools the whole text it is given, an "
            "instruction prepended to it included", path,
        )
    return _ST_MODES[mode]

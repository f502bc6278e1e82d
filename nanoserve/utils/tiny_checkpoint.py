"""Build small random-weight checkpoints of HF architectures locally, in seconds, with no network.

The checkpoint is HF transformers' own: the architecture's model class is built from a small
config, given seeded random weights and written with `save_pretrained`, beside a trained
tokenizer (tiny_tokenizer.py). The result is an ordinary Hugging Face directory that
transformers and nanoserve both load offline, so tests and benchmarks never need the hub.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from nanoserve.config import TORCH_DTYPES as DTYPES
from nanoserve.cache import cache_root
from nanoserve.utils.tiny_configs import (
    ARCHITECTURES,
    LLAMA_3_2_1B,
    QWEN2_5_0_5B,
    QWEN3_0_6B,
    QWEN3_MOE_1_6B,
    REAL_SHAPES,
    TINY_QWEN3,
    add_legacy_keys,
    make_config,
    resolve_arch,
)
from nanoserve.utils.tiny_tokenizer import (
    DEFAULT_TOKENIZER_VOCAB_SIZE,
    ENDOFTEXT,
    IM_END,
    MIN_TOKENIZER_VOCAB_SIZE,
    make_hf_tokenizer,
)
from nanoserve.utils.tiny_weights import empty_model, random_model

__all__ = [
    "ARCHITECTURES", "DTYPES", "FINGERPRINT_FILE", "FORMAT_VERSION", "LLAMA_3_2_1B", "QWEN2_5_0_5B", "QWEN3_0_6B",
    "QWEN3_MOE_1_6B", "REAL_SHAPES", "TINY_QWEN3", "build_tiny_checkpoint", "build_tiny_qwen3", "count_parameters",
    "default_model_dir", "ensure_tiny_checkpoint", "ensure_tiny_qwen3",
]

# Bump whenever the bytes written for the same kwargs change, so ensure_* rebuilds.
FORMAT_VERSION = 2
FINGERPRINT_FILE = "nanoserve_fingerprint.json"


def _check_build_args(seed, dtype, shard_size_bytes, generation_config, tokenizer_vocab_size) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if shard_size_bytes is not None and (
        not isinstance(shard_size_bytes, int) or isinstance(shard_size_bytes, bool) or shard_size_bytes < 1
    ):
        raise ValueError(f"shard_size_bytes must be None or an int >= 1, got {shard_size_bytes!r}")
    if generation_config is not None and not isinstance(generation_config, dict):
        raise TypeError(f"generation_config must be a dict or None, got {type(generation_config).__name__}")
    if not isinstance(tokenizer_vocab_size, int) or tokenizer_vocab_size < MIN_TOKENIZER_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer_vocab_size must be an int >= {MIN_TOKENIZER_VOCAB_SIZE}, got {tokenizer_vocab_size!r}"
        )


def _resolve_dtype(dtype: str | None, overrides: dict) -> str:
    # The presets carry torch_dtype like a real config.json, so it may arrive either way.
    from_config = overrides.pop("torch_dtype", None)
    if dtype is not None and from_config is not None and dtype != from_config:
        raise ValueError(f"dtype={dtype!r} conflicts with torch_dtype={from_config!r} in the config overrides")
    return dtype or from_config or "float32"


def _generation_config(tokenizer, extra: dict | None) -> dict:
    endoftext = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    # Like Qwen3 instruct: either <|im_end|> or <|endoftext|> ends a generation.
    return {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext, **(extra or {})}


def _tokenizer_and_config(arch: str, dtype: str | None, config_overrides: dict, tokenizer_vocab_size: int):
    """Every check on the config first, then the tokenizer and the HF config it gets its ids from."""
    spec = resolve_arch(arch)
    overrides = dict(config_overrides)
    dtype = _resolve_dtype(dtype, overrides)
    max_len = overrides.get("max_position_embeddings", spec.defaults["max_position_embeddings"])
    tokenizer = make_hf_tokenizer(tokenizer_vocab_size, max_len)
    config = make_config(
        arch, len(tokenizer), bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END), dtype=dtype, overrides=overrides,
    )
    return tokenizer, config


def build_tiny_checkpoint(
    path: str | os.PathLike,
    arch: str = "qwen3",
    seed: int = 0,
    dtype: str | None = None,
    shard_size_bytes: int | None = None,
    *,
    generation_config: dict | None = None,
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB_SIZE,
    **config_overrides,
) -> str:
    """Write a random-weight checkpoint of `arch` with a trained tokenizer into `path`.

    arch is a model_type or HF class name from ARCHITECTURES ("qwen3", "llama", "qwen2",
    "mistral", "qwen3_moe"). dtype is the weight dtype ("float32", "bfloat16", "float16");
    None means the overrides' torch_dtype, else float32. config_overrides replace the arch's
    tiny defaults (e.g. `**LLAMA_3_2_1B` for a real shape); vocab_size defaults to the
    tokenizer's size. shard_size_bytes splits the weights into shards of at most that size
    (save_pretrained's max_shard_size). generation_config entries (e.g. temperature) are
    merged into generation_config.json. Returns the path as a str.
    """
    dtype = _resolve_dtype(dtype, dict(config_overrides))
    _check_build_args(seed, dtype, shard_size_bytes, generation_config, tokenizer_vocab_size)
    tokenizer, config = _tokenizer_and_config(arch, dtype, config_overrides, tokenizer_vocab_size)
    model = random_model(arch, config, seed, DTYPES[dtype])
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _remove_old_weights(path)
    # Without shard_size_bytes, one file however big (save_pretrained would split at 50GB).
    model.save_pretrained(path, max_shard_size=shard_size_bytes or "1000GB")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config_json = add_legacy_keys(json.load(f))
    _write_json(config_path, config_json)
    _write_json(os.path.join(path, "generation_config.json"), _generation_config(tokenizer, generation_config))
    tokenizer.save_pretrained(path)
    return path


def build_tiny_qwen3(
    path: str | os.PathLike, seed: int = 0, dtype: str | None = None, shard_size_bytes: int | None = None, **kwargs
) -> str:
    """build_tiny_checkpoint for Qwen3ForCausalLM (TINY_QWEN3, or e.g. `**QWEN3_0_6B`)."""
    return build_tiny_checkpoint(path, "qwen3", seed, dtype, shard_size_bytes, **kwargs)


def count_parameters(
    arch: str = "qwen3", *, tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB_SIZE, **config_overrides
) -> int:
    """Parameters of the model build_tiny_checkpoint would write (tied ones once); allocates nothing."""
    _check_build_args(0, _resolve_dtype(None, dict(config_overrides)), None, None, tokenizer_vocab_size)
    _, config = _tokenizer_and_config(arch, None, config_overrides, tokenizer_vocab_size)
    return sum(p.numel() for p in empty_model(arch, config).parameters())


def _remove_old_weights(path: str) -> None:
    # Rebuilding into a used directory must not leave shards of an earlier layout behind,
    # or a loader would see two checkpoints at once.
    for file_name in os.listdir(path):
        if file_name.endswith(".safetensors") or file_name == "model.safetensors.index.json":
            os.remove(os.path.join(path, file_name))


def _write_json(file_path: str, obj: dict) -> None:
    with open(file_path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def default_model_dir(name: str = "tiny-qwen3") -> str:
    """Where ensure_tiny_checkpoint keeps `name`: $NANOSERVE_CACHE/<name>, else ~/.cache/nanoserve/<name>."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"name must be a plain directory name, got {name!r}")
    return os.path.join(cache_root(), name)


def _fingerprint(arch: str, kwargs: dict) -> dict:
    try:
        # Round-trip through JSON so tuples and lists compare equal to what is on disk.
        fingerprint = {"format_version": FORMAT_VERSION, "arch": arch, "kwargs": kwargs}
        return json.loads(json.dumps(fingerprint, sort_keys=True))
    except TypeError as e:
        raise TypeError(f"ensure_tiny_checkpoint kwargs must be JSON-serializable: {e}") from None


def _fingerprint_matches(path: str, fingerprint: dict) -> bool:
    try:
        with open(os.path.join(path, FINGERPRINT_FILE)) as f:
            return json.load(f) == fingerprint
    except (OSError, ValueError):
        return False


def ensure_tiny_checkpoint(name: str, arch: str = "qwen3", **kwargs) -> str:
    """Build `name` once into default_model_dir(name) and reuse it while arch and kwargs match.

    kwargs are build_tiny_checkpoint's (seed, dtype, shard_size_bytes, config overrides...).
    The checkpoint is built in a temporary sibling directory and renamed into place, so a
    crash never leaves a half-written checkpoint where a later run would trust it.
    """
    # The model_type, so "Qwen3ForCausalLM" and "qwen3" share one cached build.
    fingerprint = _fingerprint(resolve_arch(arch).model_type, kwargs)
    return build_cached(name, fingerprint, lambda tmp: build_tiny_checkpoint(tmp, arch, **kwargs))


def build_cached(name: str, fingerprint, build) -> str:
    """default_model_dir(name), built by `build(tmp_dir)` unless a build with this fingerprint is there:
    built in a temporary sibling and renamed into place, so a crash never leaves a half-written one."""
    path = default_model_dir(name)
    if _fingerprint_matches(path, fingerprint):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        build(tmp)
        _write_json(os.path.join(tmp, FINGERPRINT_FILE), fingerprint)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache dir should look normal
        _move_into_place(tmp, path, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_tiny_qwen3(name: str = "tiny-qwen3", **kwargs) -> str:
    """ensure_tiny_checkpoint for Qwen3ForCausalLM."""
    return ensure_tiny_checkpoint(name, "qwen3", **kwargs)


def _move_into_place(tmp: str, path: str, fingerprint: dict) -> None:
    if os.path.exists(path):
        # A stale build (other kwargs or format version): move it aside, then delete it.
        stale = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.stale-", dir=os.path.dirname(path))
        try:
            os.rename(path, os.path.join(stale, "old"))
        except FileNotFoundError:
            pass  # another process removed it first
        finally:
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, path)
    except OSError:
        # Another process finished the same build first; its result is as good as ours.
        if not _fingerprint_matches(path, fingerprint):
            raise

"""Build small random-weight Qwen3 checkpoints locally, in seconds, with no network.

The output is an ordinary Hugging Face directory (config.json, generation_config.json,
safetensors weights, tokenizer files) that transformers and nanoserve both load offline,
so tests and benchmarks never need the model hub.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump whenever the bytes written for the same kwargs change, so ensure_tiny_qwen3 rebuilds.
FORMAT_VERSION = 1
FINGERPRINT_FILE = "nanoserve_fingerprint.json"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Like Qwen3, the think markers are added tokens that are *not* special: they survive
# skip_special_tokens=True.
THINK_TOKENS = ("<think>", "</think>")
DEFAULT_TOKENIZER_VOCAB_SIZE = 1000

# vocab_size is deliberately absent: it defaults to the trained tokenizer's size.
TINY_QWEN3: dict = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}

# Qwen3-0.6B's exact architecture. Its vocab (151936) is far bigger than the tiny tokenizer:
# ids the tokenizer does not know are simply never produced by it, and decode to "".
QWEN3_0_6B: dict = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

# Fields that must be positive ints because they are tensor shapes.
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)

# Qwen3's ChatML template, reduced to what an offline engine needs (no tools). Like Qwen3,
# enable_thinking=False pre-fills an empty think block so the model answers directly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_CORPUS_PARAGRAPHS = (
    "The quick brown fox jumps over the lazy dog. The dog does not mind, because the sun is "
    "warm and the grass is soft. Later the fox returns to the forest, where the trees are tall "
    "and the river runs cold and clear over smooth grey stones.",
    "Once upon a time there was a small village at the edge of a great forest. The people of "
    "the village were farmers and builders, and every morning they walked to the fields while "
    "the children went to school. In the evening they told stories about the old king, the "
    "lost city, and the dragon that slept under the mountain.",
    "A language model reads a sequence of tokens and predicts the next token. During "
    "generation the model repeats this step many times: it samples a token, appends it to the "
    "sequence, and runs again. A key and value cache stores the attention state of earlier "
    "tokens, so each new step only has to process one new token.",
    "The weather today is cloudy with a chance of rain in the afternoon. Tomorrow will be "
    "sunny and warmer, with light winds from the west. On the weekend the temperature will "
    "drop, and there may be snow in the hills. Please remember to bring a coat.",
    "To make a simple bread, mix four cups of flour, one cup of warm water, a spoon of sugar, "
    "a spoon of salt and a little yeast. Knead the dough for ten minutes, let it rise for one "
    "hour, then bake it in a hot oven for thirty minutes until the crust is golden brown.",
    "What is the capital of France? The capital of France is Paris. What is two plus two? "
    "Two plus two is four. Can you help me write a short poem about the sea? Of course! The "
    "sea is wide, the sea is deep, it sings the sailors off to sleep.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, 1))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 42 100 256 1000 2024. Dates like 2024-01-31 "
    "and times like 12:30 are common. Prices such as $3.50 or 7% appear in many texts.",
)


def _corpus() -> list[str]:
    # A few paragraphs are too little text for ~1000 merges; deterministic variants (lower
    # case, title case, sentences rotated) add repetition without adding new words.
    texts = []
    for paragraph in _CORPUS_PARAGRAPHS:
        sentences = paragraph.split(". ")
        rotated = ". ".join(sentences[1:] + sentences[:1])
        texts += [paragraph, paragraph.lower(), paragraph.title(), rotated]
    return texts


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer on the built-in corpus (deterministic; cached)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    num_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # Added after training so, like Qwen, the control tokens get the highest ids.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tokenizer.to_str()


def _make_hf_tokenizer(vocab_size: int, model_max_length: int):
    # transformers is imported lazily: it is slow to import and only needed when building.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        # Declared so skip_special_tokens (convert_ids_to_tokens) skips every control token,
        # like the backend's decode() does.
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, ENDOFTEXT)],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # Qwen's setting; keeps decode() == joined pieces
        model_max_length=model_max_length,
    )


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
    min_vocab = 256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS)  # the byte alphabet must fit
    if not isinstance(tokenizer_vocab_size, int) or tokenizer_vocab_size < min_vocab:
        raise ValueError(f"tokenizer_vocab_size must be an int >= {min_vocab}, got {tokenizer_vocab_size!r}")


def _resolve_dtype(dtype: str | None, overrides: dict) -> str:
    # QWEN3_0_6B carries torch_dtype like a real config.json, so it may arrive either way.
    from_config = overrides.pop("torch_dtype", None)
    if dtype is not None and from_config is not None and dtype != from_config:
        raise ValueError(f"dtype={dtype!r} conflicts with torch_dtype={from_config!r} in the config overrides")
    return dtype or from_config or "float32"


def _check_override_names(overrides: dict) -> None:
    import dataclasses

    from transformers import Qwen3Config

    # Qwen3Config silently keeps unknown kwargs, so a typo would go unnoticed. The token ids
    # and architecture are derived here and cannot be overridden.
    reserved = {"architectures", "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"}
    allowed = {f.name for f in dataclasses.fields(Qwen3Config)} - reserved | {"rope_theta"}
    for name in overrides:
        if name not in allowed:
            raise TypeError(f"unknown or reserved Qwen3 config field {name!r}")
    if overrides.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported: Qwen3 has no attention biases")


def _config_fields(tokenizer, overrides: dict) -> dict:
    _check_override_names(overrides)
    fields = {**TINY_QWEN3, "vocab_size": len(tokenizer), **overrides}
    for name in _SHAPE_FIELDS:
        value = fields[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads={fields['num_attention_heads']} must be a multiple of "
            f"num_key_value_heads={fields['num_key_value_heads']}"
        )
    if fields["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size={fields['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    return fields


def _make_config(tokenizer, dtype: str, overrides: dict) -> dict:
    from transformers import Qwen3Config

    fields = _config_fields(tokenizer, overrides)
    config = Qwen3Config(
        **fields,
        architectures=["Qwen3ForCausalLM"],
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        dtype=dtype,
    )
    config_dict = json.loads(config.to_json_string())
    # transformers 5 writes `dtype` and nests rope_theta in `rope_parameters`; real Qwen3
    # checkpoints (and readers written against them) use the 4.x keys, so write both.
    config_dict["torch_dtype"] = dtype
    config_dict["rope_theta"] = fields["rope_theta"]
    config_dict.setdefault("rope_scaling", None)
    return config_dict


def _generation_config(tokenizer, extra: dict | None) -> dict:
    endoftext = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    # Like Qwen3 instruct: either <|im_end|> or <|endoftext|> ends a generation.
    return {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext, **(extra or {})}


def _weight_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen3ForCausalLM in HF naming, in a fixed order (the RNG order)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q_size, hidden)),
            (p + "self_attn.k_proj.weight", (kv_size, hidden)),
            (p + "self_attn.v_proj.weight", (kv_size, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_size)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    # Scales were tuned by checking greedy continuations (see tests/test_tiny_checkpoint.py).
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if len(shape) == 1:
        # Norm weights near 1 with visible noise, so a bug that skips a norm changes outputs.
        return 1.0 + 0.1 * noise
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        # With the final norm's output at unit RMS, logits get a std of about
        # 0.5 * sqrt(hidden_size): decisive for greedy, still soft enough to sample from.
        return 0.5 * noise
    # Linear layers get twice the variance-preserving scale so every block writes more into
    # the residual stream than the token embedding holds. With weaker blocks the tied
    # embedding dominates the final hidden state and the model just echoes its input token.
    return noise * (2.0 / math.sqrt(shape[1]))


def _random_tensors(shapes, seed: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    # One generator over all tensors in a fixed order: the same seed gives the same weights
    # whatever the dtype or sharding; tensors are made one at a time to bound memory.
    generator = torch.Generator().manual_seed(seed)
    for name, shape in shapes:
        yield _random_tensor(name, shape, generator).to(dtype)


def _plan_shards(shapes, itemsize: int, shard_size_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Group tensors, in order, into shards of at most shard_size_bytes (a bigger tensor gets its own)."""
    shards: list[list] = [[]]
    used = 0
    for name, shape in shapes:
        size = math.prod(shape) * itemsize
        if shards[-1] and used + size > shard_size_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += size
    return shards


def _write_safetensors(file_path: str, shapes, tensors: Iterator[torch.Tensor], dtype: torch.dtype) -> int:
    """Stream tensors into a .safetensors file without holding them all; returns the data size.

    The format is an 8-byte little-endian header length, a JSON header of names, dtypes,
    shapes and byte offsets, then the raw tensor bytes back to back.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        size = math.prod(shape) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data must start 8-byte aligned
    with open(file_path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for _, tensor in zip(shapes, tensors):
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return offset


def _write_weights(path: str, config: dict, seed: int, dtype_name: str, shard_size_bytes: int | None) -> None:
    dtype = DTYPES[dtype_name]
    shapes = _weight_shapes(config)
    tensors = _random_tensors(shapes, seed, dtype)
    if shard_size_bytes is None:
        _write_safetensors(os.path.join(path, "model.safetensors"), shapes, tensors, dtype)
        return
    shards = _plan_shards(shapes, torch.empty((), dtype=dtype).element_size(), shard_size_bytes)
    weight_map = {}
    total_size = 0
    for k, shard in enumerate(shards, start=1):
        file_name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        total_size += _write_safetensors(os.path.join(path, file_name), shard, tensors, dtype)
        weight_map.update({name: file_name for name, _ in shard})
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(path, "model.safetensors.index.json"), index)


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


def build_tiny_qwen3(
    path: str | os.PathLike,
    seed: int = 0,
    dtype: str | None = None,
    shard_size_bytes: int | None = None,
    *,
    generation_config: dict | None = None,
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB_SIZE,
    **config_overrides,
) -> str:
    """Write a random-weight Qwen3ForCausalLM checkpoint with a trained tokenizer into `path`.

    dtype is the weight dtype ("float32", "bfloat16", "float16"); None means the overrides'
    torch_dtype, else float32. config_overrides replace TINY_QWEN3 fields (e.g.
    `**QWEN3_0_6B` for the real architecture); vocab_size defaults to the tokenizer's size.
    generation_config entries (e.g. temperature) are merged into generation_config.json.
    Returns the path as a str.
    """
    overrides = dict(config_overrides)
    dtype = _resolve_dtype(dtype, overrides)
    _check_build_args(seed, dtype, shard_size_bytes, generation_config, tokenizer_vocab_size)
    max_len = overrides.get("max_position_embeddings", TINY_QWEN3["max_position_embeddings"])
    tokenizer = _make_hf_tokenizer(tokenizer_vocab_size, max_len)
    config = _make_config(tokenizer, dtype, overrides)

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _remove_old_weights(path)
    _write_json(os.path.join(path, "config.json"), config)
    _write_json(os.path.join(path, "generation_config.json"), _generation_config(tokenizer, generation_config))
    tokenizer.save_pretrained(path)
    _write_weights(path, config, seed, dtype, shard_size_bytes)
    return path


def default_model_dir(name: str = "tiny-qwen3") -> str:
    """Where ensure_tiny_qwen3 keeps `name`: $NANOSERVE_CACHE/<name>, else ~/.cache/nanoserve/<name>."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"name must be a plain directory name, got {name!r}")
    root = os.environ.get("NANOSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanoserve")
    return os.path.join(root, name)


def _fingerprint(kwargs: dict) -> dict:
    try:
        # Round-trip through JSON so tuples and lists compare equal to what is on disk.
        return json.loads(json.dumps({"format_version": FORMAT_VERSION, "kwargs": kwargs}, sort_keys=True))
    except TypeError as e:
        raise TypeError(f"ensure_tiny_qwen3 kwargs must be JSON-serializable: {e}") from None


def _fingerprint_matches(path: str, fingerprint: dict) -> bool:
    try:
        with open(os.path.join(path, FINGERPRINT_FILE)) as f:
            return json.load(f) == fingerprint
    except (OSError, ValueError):
        return False


def ensure_tiny_qwen3(name: str = "tiny-qwen3", **kwargs) -> str:
    """Build `name` once into default_model_dir(name) and reuse it while kwargs match.

    The checkpoint is built in a temporary sibling directory and renamed into place, so a
    crash never leaves a half-written checkpoint where a later run would trust it.
    """
    path = default_model_dir(name)
    fingerprint = _fingerprint(kwargs)
    if _fingerprint_matches(path, fingerprint):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        build_tiny_qwen3(tmp, **kwargs)
        _write_json(os.path.join(tmp, FINGERPRINT_FILE), fingerprint)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache dir should look normal
        _move_into_place(tmp, path, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


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

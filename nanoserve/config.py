"""Engine configuration: one dataclass, validated once, read everywhere else."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields

import torch

from nanoserve.backends import BACKEND_NAMES as ATTENTION_BACKENDS
from nanoserve.checkpoint import read_json
from nanoserve.models import model_class, sliding_window
from nanoserve.pooling.config import PoolerConfig, Pooling, check_pooling_task, resolve_pooling, resolve_runner
from nanoserve.quantization.checkpoint import resolve_quantization

logger = logging.getLogger(__name__)

# The dtypes the engine runs in, by name: the one table ("auto" is resolved at startup, resolve_dtype).
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPES = ("auto", *TORCH_DTYPES)
# vLLM's spellings of the same dtypes (torch.dtype values are accepted too).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DEVICES = ("auto", "cpu", "cuda")
WEIGHT_SUFFIXES = (".safetensors",)
# A step's default token budget (Config.max_num_batched_tokens=None).
STEP_TOKENS = {"default": 8192, "pooling_cpu": 512}

# Weights in pickle files: unpickling runs arbitrary code, so they are never read.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class Config:
    """Every knob of the engine. `LLM(model, **kwargs)` takes these fields, and vLLM's names for
    them (see nanoserve/engine_args.py), as kwargs."""

    model: str
    tokenizer: str | None = None  # None = the model directory; or another local tokenizer directory
    device: str = "auto"
    dtype: str = "auto"  # also vLLM's "half" / "float" and torch dtypes, stored as one of DTYPES
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = STEP_TOKENS[runner on device] (see _resolve_step_budget)
    max_model_len: int | None = None  # None = min(4096, max_position_embeddings, ST max_seq_length)
    kvcache_block_size: int | None = None  # None = the backend's: 256 where flash-attn runs (its paged-KV minimum), else 16
    num_kvcache_blocks: int | None = None  # None = derived from the memory budget below
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: float = 4.0  # the CPU KV budget, like vLLM's VLLM_CPU_KVCACHE_SPACE
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    attention_backend: str | type = "auto"  # a name (nanoserve.backends) or a Backend subclass
    seed: int = 0
    max_logprobs: int = 20  # vLLM's cap on SamplingParams.logprobs; -1 = none (the warm-up sizes memory for it)
    # Structured outputs: append the tokens a grammar forces (key names, `":`, closing braces)
    # without sampling them (nanoserve/structured/matcher.py). False: every token is sampled, as in vLLM.
    structured_outputs_jump_forward: bool = True
    # A request's tokens and logprobs bit-identical whatever else shares its steps (README "Scoring"), CPU only;
    # also turned on by vLLM's env VLLM_BATCH_INVARIANT=1.
    batch_invariant: bool = False
    # "int8": per-channel int8 weights quantized at load (CPU only); a pre-quantized checkpoint's
    # format ("gptq", "awq", "compressed-tensors", "fp8") is read from its config.json (None or the
    # same name may be passed, as in vLLM), and set here after validation. "int8" with such a
    # checkpoint: its integers as they are, its float layers (the LM head) quantized at load.
    quantization: str | None = None
    # "generate", "pooling" (embeddings: nanoserve/pooling) or "auto" (by architecture name, as vLLM).
    runner: str = "auto"
    # the pooling task vLLM's task= / convert= asked for ("embed", "classify"), checked against the
    # architecture; None: the architecture's (nanoserve/pooling/config.py)
    pooling_task: str | None = None
    pooler_config: PoolerConfig | dict | None = None  # overrides the checkpoint's pooling (runner="pooling")
    # vLLM's hf_overrides (a dict): config.json fields replaced before anything reads them, e.g.
    # {"is_matryoshka": True} for Qwen3-Embedding's Matryoshka sizes, as vLLM's docs show.
    hf_overrides: dict | None = None
    # Read from the checkpoint in __post_init__; not meant to be passed by users.
    hf_config: dict = field(default_factory=dict, repr=False)
    pooling: Pooling | None = field(default=None, repr=False)  # runner="pooling" only

    def __post_init__(self) -> None:
        self._check_model_dir()
        self._check_tokenizer_dir()
        self.dtype = canonical_dtype(self.dtype)
        self._check_choices()
        self._check_ints()
        source = os.path.join(self.model, "config.json")
        self.hf_config = read_json(source)
        if self.hf_overrides is not None:
            if not isinstance(self.hf_overrides, dict) or not all(isinstance(k, str) for k in self.hf_overrides):
                raise TypeError(f"hf_overrides must be a dict of config.json fields, got {self.hf_overrides!r:.80}")
            self.hf_config = {**self.hf_config, **self.hf_overrides}
        self.quantization = resolve_quantization(self.quantization, self.hf_config, source)
        # The architecture's own checks of the fields it reads, and that they shard over the ranks.
        model_class(self.hf_config, source).check_config(self.hf_config, source, self.tensor_parallel_size)
        max_pos = int(self.hf_config.get("max_position_embeddings", 4096))
        window = sliding_window(self.hf_config)
        max_model_len_given = self.max_model_len is not None
        if self.max_model_len is None:
            self.max_model_len = min(4096, max_pos, window or max_pos)
        elif self.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the checkpoint's "
                f"max_position_embeddings={max_pos}"
            )
        self._resolve_pooling(source, max_model_len_given)
        self._resolve_step_budget()
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when enable_chunked_prefill=False, "
                "otherwise a long prompt could never be scheduled"
            )
        if window is not None and window < self.max_model_len:
            raise ValueError(
                f"{source} uses sliding-window attention (sliding_window={window}), which nanoserve does not "
                f"implement; pass max_model_len <= {window} (got {self.max_model_len}), "
                "where full attention is the same"
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.name not in ("model", "hf_config", "pooling")}

    def _resolve_pooling(self, source: str, max_model_len_given: bool) -> None:
        """The runner, and for a pooling one how it pools (nanoserve/pooling/config.py); a
        sentence-transformers checkpoint's max_seq_length is its default max_model_len (as vLLM's)."""
        self.runner = resolve_runner(self.runner, self.hf_config, source)
        self.pooler_config = PoolerConfig.coerce(self.pooler_config)
        if self.pooling_task not in (None, "embed", "classify"):
            raise ValueError(f"pooling_task must be None, 'embed' or 'classify', got {self.pooling_task!r}")
        if self.pooling_task is not None and self.runner != "pooling":
            raise ValueError(f"pooling_task={self.pooling_task!r} needs runner='pooling', got runner={self.runner!r}")
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config is only used with runner='pooling'")
            return
        if self.tensor_parallel_size > 1:
            raise ValueError("runner='pooling' runs with tensor_parallel_size=1 only")
        self.pooling = resolve_pooling(self.model, self.hf_config, self.pooler_config)
        check_pooling_task(self.pooling_task, self.pooling, self.hf_config["architectures"][0], source)
        if not max_model_len_given and self.pooling.max_seq_length is not None:
            self.max_model_len = min(self.max_model_len, self.pooling.max_seq_length)

    def _resolve_step_budget(self) -> None:
        """The default token budget of a step, when none was given. Embedding on the CPU runs
        compute-bound prefills only, where 512-token steps keep each layer's activations in cache:
        0.253 docs/s against 0.226 at 8192 (Qwen3-0.6B shape, 138-497-token documents, 2 AVX2 cores).
        Without chunked prefill a step must hold the longest prompt."""
        if self.max_num_batched_tokens is not None:
            return
        # "auto" as engine.model_runner.resolve_device decides it (not imported: it imports this module)
        on_cpu = self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())
        budget = STEP_TOKENS["pooling_cpu" if self.runner == "pooling" and on_cpu else "default"]
        self.max_num_batched_tokens = budget if self.enable_chunked_prefill else max(budget, self.max_model_len)

    def _check_model_dir(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path to a checkpoint directory, got {type(self.model).__name__}")
        self.model = os.fspath(self.model)
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory {self.model!r} does not exist (no model hub: pass a local path)")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model directory {self.model!r} has no config.json")
        files = os.listdir(self.model)
        if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
            pickled = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
            hint = (f"; it holds pickle weights ({', '.join(pickled)}), which nanoserve never loads because "
                    "unpickling can run arbitrary code: convert them to safetensors (e.g. transformers' "
                    "save_pretrained(dir, safe_serialization=True))") if pickled else ""
            raise ValueError(f"model directory {self.model!r} has no *.safetensors weights{hint}")

    def _check_tokenizer_dir(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = self.model
            return
        if not isinstance(self.tokenizer, (str, os.PathLike)):
            raise TypeError(f"tokenizer must be a path to a tokenizer directory, got {type(self.tokenizer).__name__}")
        self.tokenizer = os.fspath(self.tokenizer)
        if not os.path.isdir(self.tokenizer):
            raise ValueError(
                f"tokenizer directory {self.tokenizer!r} does not exist (no model hub: pass a local path)"
            )

    def _check_choices(self) -> None:
        for name, allowed in (("device", DEVICES), ("attention_backend", ATTENTION_BACKENDS)):
            value = getattr(self, name)
            if name == "attention_backend" and isinstance(value, type):
                continue  # a Backend subclass, checked when it is built (nanoserve.backends.select_backend)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                     "structured_outputs_jump_forward", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.cpu_kvcache_space_gib > 0:
            raise ValueError(f"cpu_kvcache_space_gib must be > 0, got {self.cpu_kvcache_space_gib}")

    def _check_ints(self) -> None:
        minimums = {
            "max_num_seqs": 1,
            "max_num_batched_tokens": 1,
            "max_model_len": 1,
            "kvcache_block_size": 1,
            "num_kvcache_blocks": 1,
            "tensor_parallel_size": 1,
            "seed": 0,
            "max_logprobs": -1,  # -1: no cap (the whole vocabulary), as vLLM
        }
        for name, lo in minimums.items():
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "num_kvcache_blocks", "kvcache_block_size",
                                          "max_num_batched_tokens"):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < lo:
                allowed = ">= 0 or -1 (no cap: the whole vocabulary)" if name == "max_logprobs" else f">= {lo}"
                raise ValueError(f"{name} must be {allowed}, got {value}")


def canonical_dtype(dtype) -> str:
    """One of DTYPES from any spelling vLLM accepts: "half", "float", "bfloat16", torch.float16, ..."""
    if isinstance(dtype, torch.dtype):
        names = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype must be one of {DTYPES} (or torch.bfloat16/float16/float32), got {dtype}")
        return names[dtype]
    if isinstance(dtype, str) and dtype.lower() in DTYPES + tuple(DTYPE_ALIASES):
        return DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    raise ValueError(
        f"dtype must be one of {DTYPES}, vLLM's aliases {tuple(DTYPE_ALIASES)} or a torch dtype, got {dtype!r}"
    )


def resolve_dtype(dtype: str, hf_config: dict, device: torch.device) -> torch.dtype:
    """The torch dtype to run in: the one asked for, else bfloat16 on CPU, else the checkpoint's
    (float32 checkpoints in bf16 on CUDA, fp16 before sm80)."""
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if device.type == "cpu":
        return torch.bfloat16
    checkpoint = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    if TORCH_DTYPES.get(checkpoint, torch.bfloat16) != torch.float32:
        return TORCH_DTYPES.get(checkpoint, torch.bfloat16)
    # As vLLM does: float32 would refuse flash-attn and run Triton's dots without tensor cores.
    lowp = torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    logger.info("the checkpoint is float32: running it in %s on CUDA (dtype='float32' keeps float32)", lowp)
    return lowp

"""vLLM's `EngineArgs`, for what vLLM's example scripts use it for: putting the engine options on
an argparse parser, then `LLM(**vars(parser.parse_args()))` (or `LLMEngine.from_engine_args`).

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.set_defaults(model="/path/to/Qwen3-0.6B", runner="pooling")
    llm = LLM(**vars(parser.parse_args()))

Unlike vLLM's, a flag left unset is left out of the namespace (argparse.SUPPRESS), so `LLM` sees
only what the command line or `set_defaults` gave and keeps its own defaults for the rest.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from nanoserve.cli import add_engine_args
from nanoserve.engine_args import resolve_engine_args, valid_names

# vLLM's names that are not Config fields (engine_args.py: RENAMED, the runner's older names and
# the accepted-with-no-effect group), with their value parser; None is an on/off flag.
_VLLM_ONLY_FLAGS: dict[str, Callable[[str], object] | None] = {
    "block_size": int,
    "num_gpu_blocks_override": int,
    "override_pooler_config": json.loads,
    "task": str,
    "convert": str,
    "trust_remote_code": None,
    "disable_log_stats": None,
    "disable_custom_all_reduce": None,
    "swap_space": float,
    "tokenizer_mode": str,
}


class EngineArgs:
    """vLLM's EngineArgs: `LLM(...)`'s keywords held for `LLMEngine.from_engine_args`, and
    `add_cli_args` (every keyword as a `--flag`).

    >>> engine = LLMEngine.from_engine_args(EngineArgs(model="/path/to/Qwen3-0.6B", dtype="float32"))
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        resolve_engine_args(kwargs)  # an unknown or refused keyword fails here, as vLLM's dataclass does
        self.model = model
        self.kwargs = kwargs

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine keywords among `args` (a script's own flags, e.g. --max-tokens, are left out)."""
        engine_names = valid_names() | {"model"}
        return cls(**{name: value for name, value in vars(args).items() if name in engine_names})

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"EngineArgs(model={self.model!r}{options})"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> argparse.ArgumentParser:
        """Add `--model` and the engine flags to `parser` (a parser, or one of its argument groups,
        as vLLM's older examples pass); returns it, since vLLM's examples use both forms."""
        parser.add_argument("--model", default=argparse.SUPPRESS, help="checkpoint directory (no model hub)")
        add_engine_args(parser)
        group = parser if isinstance(parser, argparse._ArgumentGroup) else parser.add_argument_group(
            "vLLM's names for the same options (see the README's engine options)")
        for name, parse in _VLLM_ONLY_FLAGS.items():
            flag = "--" + name.replace("_", "-")
            if parse is None:
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
            else:
                group.add_argument(flag, dest=name, type=parse, default=argparse.SUPPRESS)
        return parser

"""vLLM's `EngineArgs`, for what vLLM's example scripts use it for: putting the engine options on
an argparse parser, then `LLM(**vars(parser.parse_args()))`.

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

from nanoserve.cli import add_engine_args

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
    """The command-line half of vLLM's EngineArgs: `add_cli_args` (every `LLM(...)` keyword as a
    `--flag`); the keywords themselves go to `LLM` directly."""

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

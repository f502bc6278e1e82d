"""vLLM's FlexibleArgumentParser: `--max_model_len` and `--max-model-len` name the same flag."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _dashed(arg: str) -> str:
    """`--max_model_len=5` -> `--max-model-len=5`; values and positionals are left alone."""
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    return key.replace("_", "-") + eq + value


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes underscores or dashes in option names, as vLLM's does."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(a) for a in args], namespace)

"""The `nanoserve` command line. Engine flags are made from `Config`'s fields, so they never drift
from what `LLM(model, **kwargs)` accepts: `max_model_len` is `--max-model-len`, a bool field
`enable_prefix_caching` is `--enable-prefix-caching` / `--no-enable-prefix-caching`.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import MISSING, fields

from nanoserve.config import Config

_SCALARS: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str}


def _value_parser(annotation: str) -> Callable[[str], object] | None:
    """The argparse type for a field's annotation string; None for a bool (an on/off flag)."""
    # `type` in a union is a Python-only alternative (e.g. attention_backend: a name or a Backend class).
    parts = [p.strip() for p in annotation.split("|") if p.strip() not in ("None", "type")]
    if parts == ["bool"]:
        return None
    if len(parts) == 1 and parts[0] in _SCALARS:
        return _SCALARS[parts[0]]
    return json.loads  # lists, dicts, unions: written as JSON on the command line


def add_engine_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the engine flags to `parser`, in a group of their own; handed a group (as vLLM's
    EngineArgs.add_cli_args can be), into that group."""
    group = parser if isinstance(parser, argparse._ArgumentGroup) else parser.add_argument_group(
        "engine options (the keyword arguments of LLM; unset ones keep its defaults)")
    names = Config.field_names()
    for f in fields(Config):
        if f.name not in names:
            continue
        default = f.default if f.default not in (MISSING, None) else "derived (see README)"
        help_text = f"LLM({f.name}=...); default: {default}"
        flag = "--" + f.name.replace("_", "-")
        parse = _value_parser(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type)))
        if parse is None:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=parse, default=argparse.SUPPRESS, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in Config.field_names() if hasattr(args, name)}


def _add_run_batch(subparsers) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="run an OpenAI Batch JSONL file (/v1/chat/completions, /v1/completions; /v1/embeddings with "
        "--runner pooling) through one model",
        description="Run an OpenAI Batch JSONL file through one model. Results are appended as they finish; "
        "exit status 0: every line succeeded, 1: some lines have error records, 2: usage error, "
        "128+N: stopped by signal N (rerun with --resume).",
    )
    p.add_argument("-i", "--input-file", required=True, help="OpenAI Batch input (JSONL)")
    p.add_argument("-o", "--output-file", required=True, help="results (JSONL), appended; never overwritten")
    p.add_argument("--model", required=True, help="checkpoint directory; bodies may name it or its directory name")
    p.add_argument("--resume", action="store_true", help="skip the custom_ids already in the output file")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="requests in the engine at once (default 2 * max_num_seqs); bounds memory")
    p.add_argument("--no-progress-bar", action="store_true", help="do not draw the progress bar")
    add_engine_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="nanoserve: offline batch LLM inference")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_run_batch(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from nanoserve.entrypoints.run_batch import run_batch  # imports torch: not needed for --help

    try:
        return run_batch(
            args.input_file, args.output_file, args.model, engine_kwargs(args), resume=args.resume,
            max_inflight=args.max_inflight, progress=not args.no_progress_bar,
        )
    except (ValueError, TypeError) as e:  # a bad engine option, found when the LLM is built
        parser.exit(2, f"nanoserve run-batch: error: {e}\n")

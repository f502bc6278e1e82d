"""`nanoserve run-batch`: an OpenAI Batch JSONL file through one LLM, resumable, in bounded memory.

Input lines are read one at a time and only as the engine has room (`max_inflight`); each
result is appended to the output as its request finishes (completion order, not input order).
What is remembered per line is its custom_id, to spot duplicates and to skip finished work on
`--resume`. A first SIGINT/SIGTERM stops reading input and lets the requests in flight finish;
a second one exits at once (unfinished requests are redone on resume).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import NamedTuple

from tqdm.auto import tqdm

from nanoserve.entrypoints.batch_output import FinishedWork, OutputWriter, scan_output
from nanoserve.entrypoints.openai_embeddings import EmbeddingLine, LineParts
from nanoserve.entrypoints.openai_request import (
    BatchLineError, CompletionLine, ModelNotFoundError, RequestBuilder, parse_line,
)
from nanoserve.entrypoints.openai_response import embeddings_record, error_record, result_record
from nanoserve.llm import LLM
from nanoserve.engine.input_processor import EngineRequest, RequestError
from nanoserve.engine.request_stream import default_max_inflight, stream_requests

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE = 0, 1, 2


class LineKey(NamedTuple):
    """What a result must be written with: the input line and the custom_id it answers for."""

    line: int
    custom_id: str | None  # None: the line is answered by its number (no custom_id of its own)
    url: str | None
    echo: bool = False  # completions: the prompt comes back before the completion (text and logprobs)
    prompt_only: bool = False  # completions echo with max_tokens 0: the prompt comes back alone
    num_logprobs: int | None = None  # the request's k: the top_logprobs lists of the body hold k entries
    # An embeddings line with several inputs (a completions line with several prompts) runs as
    # several requests, answered in one record.
    part: int = 0
    num_parts: int = 1
    encoding_format: str | None = None


class StopOnSignal:
    """First SIGINT/SIGTERM: ask to stop reading input. Second: KeyboardInterrupt, exit now."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\nnanoserve run-batch: {signal.Signals(signum).name}: finishing the requests in flight, then exiting "
            "(signal again to exit now; --resume redoes what is unfinished)",
            file=sys.stderr,
        )


def run_batch(
    input_file: str, output_file: str, model: str, engine_kwargs: dict, resume: bool = False,
    max_inflight: int | None = None, progress: bool = True,
) -> int:
    """Run the batch; returns the exit status (0 all succeeded, 1 some lines failed, 2 usage, 128+N signal N)."""
    if not os.path.isfile(input_file):
        return _usage_error(f"input file {input_file!r} does not exist")
    out_dir = os.path.dirname(os.path.abspath(output_file))
    if os.path.isdir(output_file) or not os.path.isdir(out_dir):
        # checked before the model loads: a large one takes minutes, then the first write would fail
        return _usage_error(f"output file {output_file!r} is a directory or its directory does not exist")
    if max_inflight is not None and max_inflight < 1:
        return _usage_error(f"--max-inflight must be >= 1, got {max_inflight}")
    done = FinishedWork()
    if os.path.exists(output_file) and os.path.getsize(output_file) > 0:
        if not resume:
            return _usage_error(
                f"output file {output_file!r} exists and is not empty; pass --resume to continue it "
                "(it is never overwritten)"
            )
        try:
            done = scan_output(output_file)
        except ValueError as e:
            return _usage_error(str(e))
    total = _count_lines(input_file)
    llm = LLM(model, **engine_kwargs)
    try:
        return _run(llm, input_file, output_file, model, done, total, max_inflight, progress)
    finally:
        llm.close()


def _run(llm, input_file, output_file, model, done, total, max_inflight, progress) -> int:
    builder = RequestBuilder(llm, model)
    writer = OutputWriter(output_file)
    bar = tqdm(
        total=total, initial=done.num_records, unit="req", desc="run-batch", dynamic_ncols=True,
        disable=not progress, mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr,
    )
    num_failed = done.num_failed
    tokens, start = 0, time.perf_counter()

    def on_step(stats) -> None:
        nonlocal tokens
        tokens += sum(entry.sampled for entry in stats.entries)
        writer.maybe_sync()  # results finished a while ago reach the disk even if nothing else finishes

    with StopOnSignal() as stop:
        try:
            items = _requests(input_file, done, builder, stop)
            window = max_inflight or default_max_inflight(llm.config.max_num_seqs)
            parts = LineParts()
            for key, result in stream_requests(llm.engine, items, window, on_step):
                if isinstance(result, RequestError):
                    writer.write(error_record(key.custom_id, key.line, result))
                    num_failed += 1
                else:  # a line of several requests is written once all of them are done
                    outs = parts.add(key.line, key.part, key.num_parts, result)
                    if outs is None:
                        continue
                    writer.write(
                        embeddings_record(key.custom_id, outs, model, key.encoding_format)
                        if key.encoding_format is not None
                        else result_record(key.custom_id, key.url, outs, model, llm.tokenizer, key.echo,
                                           key.prompt_only, num_logprobs=key.num_logprobs)
                    )
                bar.update(1)
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.0f} gen tok/s", refresh=False)
        except KeyboardInterrupt:
            stop.signum = stop.signum or signal.SIGINT
        finally:
            writer.close()
            bar.close()
    if stop.signum is not None:
        return 128 + stop.signum
    return EXIT_SOME_FAILED if num_failed else EXIT_OK


def _requests(
    input_file: str, done: FinishedWork, builder: RequestBuilder, stop: StopOnSignal
) -> Iterator[tuple[LineKey, EngineRequest | RequestError]]:
    """Each unfinished input line as an engine request or the error that rejects it."""
    seen: dict[str, int] = {}  # custom_id -> the line it was first seen on
    for line, raw in _lines(input_file):
        if stop.signum is not None:
            return
        try:
            custom_id, record = parse_line(_decode(raw))
        except BatchLineError as e:
            if line not in done.lines:
                yield LineKey(line, None, None), RequestError(f"line {line}: {e}", ValueError)
            continue
        if custom_id in seen:
            if line not in done.lines:
                message = f"line {line}: duplicate custom_id {custom_id!r} (first on line {seen[custom_id]})"
                yield LineKey(line, None, None), RequestError(message, ValueError)
            continue
        seen[custom_id] = line
        if custom_id in done.custom_ids:
            continue
        try:
            request = builder.build(record)
        except (ValueError, TypeError, ModelNotFoundError) as e:
            request = RequestError(str(e), type(e))
        body = record.get("body")
        echo = isinstance(body, dict) and body.get("echo") is True
        prompt_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
        first = request.requests[0] if isinstance(request, (EmbeddingLine, CompletionLine)) else request
        num_logprobs = getattr(first.params, "logprobs", None) if isinstance(first, EngineRequest) else None
        key = LineKey(line, custom_id, record.get("url"), echo, prompt_only, num_logprobs)
        if isinstance(request, (EmbeddingLine, CompletionLine)):
            n = len(request.requests)
            fmt = request.encoding_format if isinstance(request, EmbeddingLine) else None
            for i, part in enumerate(request.requests):
                yield key._replace(part=i, num_parts=n, encoding_format=fmt), part
        else:
            yield key, request


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each non-blank line, read lazily."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield number, raw


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BatchLineError(f"not valid UTF-8: {e}") from None


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def _usage_error(message: str) -> int:
    print(f"nanoserve run-batch: error: {message}", file=sys.stderr)
    return EXIT_USAGE

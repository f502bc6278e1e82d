"""The run-batch output file: what an earlier run finished, and appending that survives a crash.

Every record is one line written with a single system call while SIGINT/SIGTERM are held back,
so a line is torn only when the process dies mid-write (SIGKILL, power loss). Then only the
last line can be torn: `scan_output` drops it, and its request is redone. Lines are fsynced at
least every `sync_interval` seconds and when the file is closed.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass
class FinishedWork:
    """What the output file already answers for."""

    custom_ids: set[str] = field(default_factory=set)  # results and errors of lines with a custom_id
    lines: set[int] = field(default_factory=set)  # errors of lines without one (error.line)
    num_records: int = 0
    num_failed: int = 0


def scan_output(path: str) -> FinishedWork:
    """Read an earlier run's output; truncate a torn last line so appending continues cleanly."""
    done = FinishedWork()
    good_end = 0  # byte offset just past the last complete line
    torn = b""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                torn = raw  # only the very last line can lack its newline
                break
            good_end += len(raw)
            if raw.strip():
                _record_done(done, raw, path, number)
    if torn:
        os.truncate(path, good_end)
        print(
            f"nanoserve run-batch: dropped a torn last line ({len(torn)} bytes) from {path}; its request is redone",
            file=sys.stderr,
        )
    return done


def _record_done(done: FinishedWork, raw: bytes, path: str, number: int) -> None:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"{path} line {number} is not JSON: not a run-batch output file, refusing to resume") from None
    error = record.get("error") if isinstance(record, dict) else None
    if isinstance(record, dict) and isinstance(record.get("custom_id"), str):
        done.custom_ids.add(record["custom_id"])
    elif isinstance(error, dict) and isinstance(error.get("line"), int):
        done.lines.add(error["line"])
    else:
        raise ValueError(f"{path} line {number} has neither a custom_id nor an error line number: not a run-batch output")
    done.num_records += 1
    done.num_failed += error is not None


@contextlib.contextmanager
def _signals_held():
    """Defer SIGINT/SIGTERM so a handler that raises cannot cut a line in half."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class OutputWriter:
    """Appends JSON lines; never truncates what is there."""

    def __init__(self, path: str, sync_interval: float = 2.0) -> None:
        created = not os.path.exists(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if created:
            _fsync_dir(os.path.dirname(os.path.abspath(path)))  # so the new file's name survives a crash
        self.sync_interval = sync_interval
        self._last_sync = time.monotonic()
        self._dirty = False

    def write(self, record: dict) -> None:
        data = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode())
        with _signals_held():
            while data:
                data = data[os.write(self._fd, data):]
        self._dirty = True
        self.maybe_sync()

    def maybe_sync(self) -> None:
        if self._dirty and time.monotonic() - self._last_sync >= self.sync_interval:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._fd)
        self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""llama.cpp as a peer: `llama-batched-bench` on GGUF conversions of the bench checkpoint
(bf16, Q8_0, Q4_K_M), the quantized models CPU users actually run.

batched-bench runs N sequences of fixed lengths: P prompt tokens each, prefilled together, then G
decode steps of all N. It is given the workload's request count and its mean prompt and output
lengths (fixed lengths favour it against nanoserve's varied ones). Its figures are put on
nanoserve's basis: output tok/s = N x G / T, T = its prefill + decode seconds; prefill tok/s =
N x P / prefill seconds; decode tok/s = N x G / decode seconds. Model load is not timed, as for
every peer. Finding, building and converting: llamacpp_setup.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from nanoserve.bench.peers import PeerSettings, PeerUnavailable
from nanoserve.bench.peers.llamacpp_setup import (build, check_quantization, ensure_gguf, find_binaries,
                                                  find_source, tail)
from nanoserve.bench.results import RunResult
from nanoserve.bench.roofline import Roofline
from nanoserve.bench.workloads import Request

# PEERS.md's settings: an 8192-token context (raised when the workload needs more), logical and
# physical batch 2048 / 512, flash attention on (its fastest on CPU).
MIN_CONTEXT = 8192
BATCH, UBATCH = 2048, 512
# batched-bench prints its table through llama.cpp's log thread, which the process does not wait for
# at exit (llama.cpp issue 22142): a row printed just before exit is often lost (5 times in 6 on a
# tiny model here, where its spinning compute threads starve the log thread). So cheap
# single-sequence rows (P, G, 1) run after the measured one while the log thread writes it: one on
# the first attempt (a real model's row takes seconds), TRAILING_GROWTH times more on each retry.
ATTEMPTS = 4
TRAILING_GROWTH = 8
ROW = re.compile(r"^\|\s*" + r"\s*\|\s*".join([r"(\d+)"] * 4 + [r"([\d.]+)"] * 6) + r"\s*\|\s*$")


@dataclass(frozen=True)
class BatchedBenchRow:
    """One row of llama-batched-bench's table."""

    pp: int  # prompt tokens per sequence
    tg: int  # generated tokens per sequence
    pl: int  # sequences
    n_kv: int
    t_pp: float  # prefill seconds (all sequences)
    s_pp: float  # prefill tok/s
    t_tg: float  # decode seconds
    s_tg: float  # decode tok/s
    t: float  # t_pp + t_tg
    s: float  # (prompt + generated tokens) / t


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    """Every row of the result table in batched-bench's output (its log lines are ignored)."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            g = m.groups()
            rows.append(BatchedBenchRow(*map(int, g[:4]), *map(float, g[4:])))
    return rows


def workload_lengths(requests: list[Request]) -> tuple[int, int, int]:
    """(N, P, G): the request count and the mean prompt and output lengths, rounded, at least 1."""
    if not requests:
        raise ValueError("the llama.cpp peer needs at least one request")
    n = len(requests)
    return (n, max(1, round(sum(len(r.prompt) for r in requests) / n)),
            max(1, round(sum(r.max_tokens for r in requests) / n)))


def batched_bench_command(binary: str, gguf: str, n: int, p: int, g: int, threads: int,
                          trailing: int = 1) -> list[str]:
    # Without unified KV, each of the n sequences gets context / n cells: every one must hold P + G,
    # else batched-bench silently skips the row.
    # The trailing 1s in -npl: see ATTEMPTS. Rows run in -npl's order, so the measured row comes first.
    if trailing < 1:
        raise ValueError(f"trailing must be >= 1, got {trailing}")
    context = max(MIN_CONTEXT, n * (p + g))
    return [binary, "-m", gguf, "-c", str(context), "-b", str(BATCH), "-ub", str(UBATCH), "-npp", str(p),
            "-ntg", str(g), "-npl", ",".join([str(n)] + ["1"] * trailing), "-t", str(threads), "-fa", "on"]


def row_result(name: str, row: BatchedBenchRow, roof: Roofline | None = None) -> RunResult:
    """A batched-bench row on nanoserve's basis (see the module docstring). The seconds come from its
    speed columns (computed from unrounded times; its time columns are rounded to milliseconds)."""
    if row.s_pp <= 0 or row.s_tg <= 0:
        raise PeerUnavailable(f"llama-batched-bench reported a zero speed: {row}")
    prefill_s, decode_s = row.pl * row.pp / row.s_pp, row.pl * row.tg / row.s_tg
    res = RunResult(name=name, num_requests=row.pl, prompt_tokens=row.pl * row.pp, output_tokens=row.pl * row.tg,
                    wall_s=prefill_s + decode_s, counts_ok=True, prefill_tok_s=row.s_pp, decode_tok_s=row.s_tg,
                    decode_s=decode_s)
    if roof is not None:
        res.model_flops = row.pl * roof.shape.request_cost(row.pp, row.tg, roof.itemsize).flops
    return res


class LlamaCppPeer:
    """llama-batched-bench on one GGUF quantization of the checkpoint."""

    def __init__(self, quant: str, settings: PeerSettings, requests: list[Request], binaries: dict[str, str],
                 source: str, roof: Roofline | None = None, timeout_s: float = 3600.0) -> None:
        check_quantization(quant)
        self.quant, self.settings, self.binaries, self.source = quant, settings, binaries, source
        self.roof, self.timeout_s = roof, timeout_s
        self.lengths = workload_lengths(requests)
        self.name = f"llama.cpp {quant}"
        self.gguf: str | None = None
        self._tail = ""  # the last lines of the latest batched-bench output, for error messages

    def start(self) -> list[str]:
        self.gguf = ensure_gguf(self.settings.model, self.quant, self.source, self.binaries["llama-quantize"])
        n, p, g = self.lengths
        return [f"{self.gguf}: {n} sequences x {p} prompt + {g} output tokens (the workload's count and mean "
                f"lengths, fixed), {self.settings.threads} threads"]

    def command(self, trailing: int = 1) -> list[str]:
        assert self.gguf is not None, "start() first"
        return batched_bench_command(self.binaries["llama-batched-bench"], self.gguf, *self.lengths,
                                     self.settings.threads, trailing)

    def run(self) -> list[RunResult]:
        for attempt in range(1, ATTEMPTS + 1):
            row = self._run_once(trailing=TRAILING_GROWTH ** (attempt - 1))
            if row is not None:
                return [row_result(self.name, row, self.roof)]
            print(f"[{self.name}] batched-bench printed no result row (attempt {attempt} of {ATTEMPTS})", flush=True)
        raise PeerUnavailable(f"llama-batched-bench printed no row for {self.lengths[0]} x ({self.lengths[1]} + "
                              f"{self.lengths[2]}) tokens in {ATTEMPTS} runs; last lines of its output:\n{self._tail}")

    def _run_once(self, trailing: int) -> BatchedBenchRow | None:
        """The measured row of one batched-bench run; None when it exited cleanly without printing it."""
        n, p, g = self.lengths
        with tempfile.TemporaryDirectory(prefix="nanoserve-llamacpp-") as d:
            log_path = os.path.join(d, "batched-bench.log")
            with open(log_path, "w") as log:
                try:
                    rc = subprocess.run(self.command(trailing), stdout=log, stderr=subprocess.STDOUT,
                                        timeout=self.timeout_s).returncode
                except subprocess.TimeoutExpired:
                    raise PeerUnavailable(f"llama-batched-bench took over {self.timeout_s:.0f} s") from None
            with open(log_path, errors="replace") as f:
                rows = [r for r in parse_batched_bench(f.read()) if (r.pl, r.pp, r.tg) == (n, p, g)]
            self._tail = tail(log_path)
        if rc != 0:
            raise PeerUnavailable(f"llama-batched-bench exited with status {rc}; last lines of its output:\n"
                                  f"{self._tail}")
        return rows[0] if rows else None

    def close(self) -> None:
        pass  # each run is its own process; the GGUF files stay cached for the next bench


def llamacpp_peers(settings: PeerSettings, requests: list[Request], quants: list[str], build_dir: str | None,
                   source: str | None, roof: Roofline | None = None) -> list[LlamaCppPeer]:
    """One peer per quantization, sharing one llama.cpp build (found, else built) and its source."""
    for quant in quants:  # before finding or building anything
        check_quantization(quant)
    if settings.device != "cpu":
        raise PeerUnavailable(f"the llama.cpp peer runs llama.cpp's CPU build; this run is on {settings.device}")
    binaries, directory = find_binaries(build_dir)  # the dir they were found in, else the one to build into
    src = find_source(source, directory)
    if binaries is None:
        binaries = build(src, directory, jobs=max(1, settings.threads))
    return [LlamaCppPeer(q, settings, requests, binaries, src, roof) for q in quants]

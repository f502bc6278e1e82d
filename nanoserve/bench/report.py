"""Printing a run's figures and the comparisons; every figure also goes into the JSON report."""
from __future__ import annotations

import json
import os
import statistics

from nanoserve.bench.results import RunResult


def fmt_ms(d: dict | None) -> str:
    if not d:
        return "n/a"
    return " / ".join(f"{k} {v * 1e3:.0f} ms" if v is not None else f"{k} n/a" for k, v in d.items())


def print_run(res: RunResult) -> None:
    print(f"\n== {res.name} ==")
    print(f"requests            {res.num_requests}")
    print(f"prompt tokens       {res.prompt_tokens}")
    print(f"output tokens       {res.output_tokens}   (requested counts met: {res.counts_ok})")
    print(f"wall time           {res.wall_s:.2f} s")
    print(f"output throughput   {res.output_tok_s:.1f} tok/s")
    print(f"total throughput    {res.total_tok_s:.1f} tok/s")
    if res.ttft_s:
        print(f"TTFT                {fmt_ms(res.ttft_s)}")
        print(f"TPOT                {fmt_ms(res.tpot_s)}")
        print(f"inter-token latency {fmt_ms(res.itl_s)}")
    if res.short_tpot_s is not None:
        print(f"TPOT (short reqs)   {fmt_ms(res.short_tpot_s)}")
        print(f"ITL (short reqs)    {fmt_ms(res.short_itl_s)}")
    if res.peak_kv_blocks is not None:
        print(f"peak KV blocks used {res.peak_kv_blocks} of {res.num_kv_blocks}")
    if res.prefix_cache_hit_rate is not None:
        print(f"prefix-cache hits   {res.prefix_cache_hit_rate:.1%} of prompt tokens")
    if res.num_steps is not None:
        print(f"steps               {res.num_steps} ({res.num_preemptions} preemptions)")
    if res.decode_step_ms is not None:
        print(f"decode step         {res.decode_step_ms:.1f} ms median")
    if res.prefill_tok_s is not None:
        print(f"prefill-only steps  {res.prefill_tok_s:.0f} tok/s")
    if res.decode_tok_s is not None:
        print(f"decode-only steps   {res.decode_tok_s:.1f} tok/s")
    if res.model_flops:
        print(f"model FLOP/s        {res.achieved_flops / 1e9:.1f} GFLOP/s")
    if res.floor_s is not None:
        print(f"roofline            whole run: floor {res.floor_s:.2f} s, achieved {res.wall_s:.2f} s -> "
              f"achieved/floor {res.wall_s / res.floor_s:.2f}x ({res.floor_s / res.wall_s:.0%} of the floor's "
              f"speed; {res.memory_bound_steps} of {res.num_steps} steps bandwidth-bound)")
        if res.decode_floor_s is not None:
            print(f"                    decode steps: floor {res.decode_floor_s:.2f} s, achieved {res.decode_s:.2f} s"
                  f" -> achieved/floor {res.decode_s / res.decode_floor_s:.2f}x "
                  f"({res.decode_floor_s / res.decode_s:.0%})")


def print_roofline(figures: dict) -> None:
    peak, bw = figures["gemm_peak"], figures["weight_bandwidth"]
    print(f"GEMM at the model's shapes, {peak['rows']} rows: " + ", ".join(
        f"{k} {v / 1e9:.1f}" for k, v in peak["per_path_flops"].items())
        + f" GFLOP/s -> peak {peak['peak_flops'] / 1e9:.1f} ({peak['best_path']})")
    print(f"weight streaming, 1 row over {bw['buffer_bytes'] / 2**20:.1f} MiB: " + ", ".join(
        f"{k} {v / 1e9:.1f}" for k, v in bw["per_path_bytes_s"].items())
        + f" GB/s -> {bw['bandwidth'] / 1e9:.1f} GB/s ({bw['best_path']})")
    print_instruction_peaks(figures)


def print_instruction_peaks(figures: dict) -> None:
    from nanoserve.bench.roofline import INSTRUCTIONS

    peaks = figures.get("instruction_peaks") or {}
    if peaks:
        fma = peaks["peak_loop_fma_f32"]
        print("instruction peaks (register-only loops): " + ", ".join(
            f"{INSTRUCTIONS[k]} {v / 1e9:.1f} GFLOP/s ({v / fma:.2f}x FMA)" for k, v in peaks.items()))
    for rows, per_path in (figures.get("gemm_efficiency") or {}).items():
        print(f"  C GEMMs at {rows} rows: " + ", ".join(
            f"{name} {v['flops'] / 1e9:.1f} GFLOP/s = {v['of_peak']:.0%} of {INSTRUCTIONS[v['instruction']]}"
            for name, v in per_path.items()))


def print_table(runs: dict[str, list[RunResult]]) -> list[dict]:
    """One row per engine (nanoserve and each peer): the median over repeats of output tok/s
    (generated tokens / whole-run time), prefill tok/s and decode tok/s (pure prefill / decode steps)."""
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    def cell(v: float | None) -> str:
        return f"{v:.1f}" if v is not None else ""

    rows = [{"engine": name, "output_tok_s": median([r.output_tok_s for r in rs]),
             "prefill_tok_s": median([r.prefill_tok_s for r in rs]),
             "decode_tok_s": median([r.decode_tok_s for r in rs]), "repeats": len(rs)}
            for name, rs in runs.items() if rs]
    print("\n| engine | output tok/s | prefill tok/s | decode tok/s |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['engine']} | {cell(row['output_tok_s'])} | {cell(row['prefill_tok_s'])} | "
              f"{cell(row['decode_tok_s'])} |")
    print(f"(median of {max(r['repeats'] for r in rows)} runs each)" if rows else "")
    return rows


def compare(ours: list[RunResult], peer_runs: dict[str, list[RunResult]]) -> dict[str, dict]:
    """Per peer: the median over repeats of nanoserve's output tok/s over the peer's (repeat i
    against repeat i: they ran back to back)."""
    summary = {}
    for name, runs in peer_runs.items():
        ratios = [a.output_tok_s / b.output_tok_s for a, b in zip(ours, runs)]
        if not ratios:
            continue
        counts_ok = all(r.counts_ok for r in runs) and all(r.counts_ok for r in ours)
        summary[name] = {"ratios": ratios, "median_ratio": statistics.median(ratios), "counts_ok": counts_ok,
                         "nanoserve_output_tok_s": [r.output_tok_s for r in ours],
                         "peer_output_tok_s": [r.output_tok_s for r in runs]}
        print(f"\nnanoserve / {name}: {summary[name]['median_ratio']:.2f}x output tok/s (median of "
              f"{len(ratios)}: " + ", ".join(f"{x:.2f}" for x in ratios) + "; "
              f"{statistics.median(r.output_tok_s for r in ours):.1f} vs "
              f"{statistics.median(r.output_tok_s for r in runs):.1f} tok/s)")
        if not counts_ok:
            print(f"WARNING: nanoserve or {name} did not produce every request's exact token count")
    return summary


def finish_report(args, report: dict) -> dict:
    """The load average at the end (it includes this run itself), and the JSON report if asked for."""
    if hasattr(os, "getloadavg"):
        report["machine"]["load_average_end"] = os.getloadavg()
        print("load average (1/5/15 min) at the end: " + " / ".join(f"{v:.2f}" for v in os.getloadavg()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return report

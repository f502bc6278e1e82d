"""Figures of one run: throughput, latencies, cache use, and achieved time against the floor."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from nanoserve.bench.driver import EngineRun
from nanoserve.bench.roofline import Roofline
from nanoserve.bench.workloads import Request


def percentiles(values: list[float], ps=(50, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in ps}
    vs = sorted(values)
    out = {}
    for p in ps:  # linear interpolation, like numpy's default
        k = (len(vs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = vs[lo] + (vs[hi] - vs[lo]) * (k - lo)
    return out


@dataclass
class RunResult:
    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    counts_ok: bool  # every request produced exactly its requested token count
    ttft_s: dict = field(default_factory=dict)
    tpot_s: dict = field(default_factory=dict)
    itl_s: dict = field(default_factory=dict)
    peak_kv_blocks: int | None = None
    num_kv_blocks: int | None = None
    prefix_cache_hit_rate: float | None = None
    num_steps: int | None = None
    num_preemptions: int | None = None
    model_flops: float = 0.0
    decode_step_ms: float | None = None
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None  # tokens sampled in pure-decode steps / their time
    # The roofline model of the run (see roofline.py): the sum of per-step floors.
    floor_s: float | None = None
    decode_s: float | None = None  # time spent in pure-decode steps
    decode_floor_s: float | None = None
    memory_bound_steps: int | None = None
    short_tpot_s: dict | None = None  # mixed workload: the requests present from the start
    short_itl_s: dict | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def achieved_flops(self) -> float:
        return self.model_flops / self.wall_s

    def row(self) -> str:
        return f"{self.name}: {self.output_tok_s:.1f} output tok/s, {self.total_tok_s:.1f} total tok/s"

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d.update(output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s, achieved_flops=self.achieved_flops)
        return d


def summarize(name: str, requests: list[Request], run: EngineRun, roof: Roofline | None = None,
              short_only: bool = False) -> RunResult:
    """short_only: also report TPOT / inter-token gaps of the requests present from the start."""
    outs = run.outputs
    counts = [len(o.outputs[0].token_ids) for o in outs]
    gaps = {i: [b - a for a, b in zip(ts, ts[1:])] for i, ts in run.token_times.items()}
    decode = [s for s in run.steps if s.is_decode]
    prefill = [s for s in run.steps if s.num_decode_tokens == 0 and s.num_prefill_tokens > 0]
    prompt_tokens = sum(len(r.prompt) for r in requests)
    res = RunResult(
        name=name, num_requests=len(requests), prompt_tokens=prompt_tokens, output_tokens=sum(counts),
        wall_s=run.wall_s, counts_ok=all(c == r.max_tokens for c, r in zip(counts, requests)),
        ttft_s=percentiles([o.metrics.time_to_first_token for o in outs]),
        tpot_s=percentiles([o.metrics.time_per_output_token for o in outs
                            if o.metrics.time_per_output_token is not None]),
        itl_s=percentiles([g for gs in gaps.values() for g in gs], (50, 99, 100)),
        peak_kv_blocks=run.peak_kv_blocks, num_kv_blocks=run.num_kv_blocks,
        prefix_cache_hit_rate=sum(o.num_cached_tokens for o in outs) / prompt_tokens,
        num_steps=len(run.steps), num_preemptions=run.num_preemptions,
        decode_step_ms=1e3 * statistics.median(s.elapsed for s in decode) if decode else None,
        prefill_tok_s=(sum(s.num_prefill_tokens for s in prefill) / sum(s.elapsed for s in prefill)
                       if prefill else None),
        decode_s=sum(s.elapsed for s in decode) if decode else None,
        decode_tok_s=(sum(s.num_decode_tokens for s in decode) / sum(s.elapsed for s in decode)
                      if decode else None),
    )
    if roof is not None:
        res.model_flops = sum(roof.shape.step_cost(s.entries, roof.itemsize).flops for s in run.steps)
        res.floor_s = sum(roof.step_floor(s.entries) for s in run.steps)
        res.decode_floor_s = sum(roof.step_floor(s.entries) for s in decode) if decode else None
        res.memory_bound_steps = sum(roof.step_bound(s.entries) == "memory" for s in run.steps)
    if short_only:
        first = [i for i, r in enumerate(requests) if r.arrival == 0]
        res.short_tpot_s = percentiles([outs[i].metrics.time_per_output_token for i in first
                                        if outs[i].metrics.time_per_output_token is not None])
        res.short_itl_s = percentiles([g for i in first for g in gaps[i]], (50, 99, 100))
    return res


def peer_result(name: str, requests: list[Request], counts: list[int], wall_s: float,
                roof: Roofline | None = None) -> RunResult:
    """A peer engine's run, where only the wall time and each request's token count are known."""
    res = RunResult(name=name, num_requests=len(requests), prompt_tokens=sum(len(r.prompt) for r in requests),
                    output_tokens=sum(min(c, r.max_tokens) for c, r in zip(counts, requests)), wall_s=wall_s,
                    counts_ok=all(c == r.max_tokens for c, r in zip(counts, requests)))
    if roof is not None:
        res.model_flops = sum(roof.shape.request_cost(len(r.prompt), r.max_tokens, roof.itemsize).flops
                              for r in requests)
    return res

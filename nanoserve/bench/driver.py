"""One driver for every workload: steps an LLM's engine and records what each step did.

It runs the engine's one step loop (`RequestStream`) with requests prepared by the engine's
`InputProcessor`, and reads each step's `StepStats` through the loop's `on_step` hook
(`entries`: each scheduled sequence's cached and new tokens and whether it sampled).
Requests with arrival k > 0 are added once every request present from the start has made k
output tokens (or finished): the mixed and shared-prefix workloads use it.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve import LLM, SamplingParams
from nanoserve.bench.workloads import Request, random_tokens
from nanoserve.engine.request_stream import RequestStream
from nanoserve.outputs import RequestOutput


@dataclass
class StepRecord:
    elapsed: float
    num_prefill_tokens: int
    num_decode_tokens: int
    entries: list[tuple[int, int, bool]]  # (num_computed_tokens, num_new_tokens, sampled) per sequence

    @property
    def is_decode(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_decode_tokens > 0


@dataclass
class EngineRun:
    outputs: list[RequestOutput]  # in request order
    steps: list[StepRecord]
    wall_s: float
    token_times: dict[int, list[float]] = field(default_factory=dict)  # request index -> each token's time
    peak_kv_blocks: int | None = None
    num_kv_blocks: int | None = None
    num_preemptions: int | None = None


def sampling_params(max_tokens: int, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=max_tokens, detokenize=False,
                          seed=seed if temperature > 0 else None)


def _blocks_in_use(engine) -> tuple[int, int] | None:
    """(used, total) KV blocks, read from the block manager where this engine has one."""
    bm = getattr(engine, "block_manager", None)
    if bm is None:
        return None
    return bm.pool.num_blocks - bm.num_free_blocks, bm.pool.num_blocks


def drive(llm: LLM, requests: list[Request], params: Callable[[Request], SamplingParams]) -> EngineRun:
    """Run `requests` to completion, one engine step at a time."""
    engine = llm.engine
    if not engine.is_finished():
        raise RuntimeError("drive() needs an idle engine")
    preempt0 = getattr(engine.scheduler, "num_preemptions", None)
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    prepared = {i: engine.input_processor.prepare(r.prompt, params(r), i) for i, r in enumerate(requests)}
    produced = [0] * len(requests)
    outputs: dict[int, RequestOutput] = {}
    token_times: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    steps: list[StepRecord] = []
    peak = total = None
    index_of: dict[str, int] = {}  # engine request id -> request index, for the step entries
    t0 = time.perf_counter()

    def on_step(stats) -> None:
        nonlocal peak, total
        now = time.perf_counter()
        entries = [(e.num_computed_tokens, e.num_new_tokens, e.sampled) for e in stats.entries]
        steps.append(StepRecord(now - t0, stats.num_prefill_tokens, stats.num_decode_tokens, entries))
        for e in stats.entries:
            if e.sampled:
                i = index_of[e.request_id]
                produced[i] += 1
                token_times[i].append(now)
        usage = _blocks_in_use(engine)
        if usage is not None:
            peak, total = max(peak or 0, usage[0]), usage[1]

    def admit(stream: RequestStream, progress: int) -> None:
        while pending and requests[pending[0]].arrival <= progress:
            i = pending.pop(0)
            index_of[stream.add(i, prepared[i])] = i

    def progress_of_first_wave() -> int:
        return min((produced[i] if i not in outputs else 1 << 30 for i in range(len(requests))
                    if requests[i].arrival == 0), default=1 << 30)

    start = time.perf_counter()
    with RequestStream(engine, on_step, "the benchmark driver") as stream:
        admit(stream, 0)
        while pending or stream.inflight:
            if not stream.inflight:  # nothing running: let the next arrival in
                admit(stream, requests[pending[0]].arrival)
            t0 = time.perf_counter()
            outputs.update(stream.step())
            if pending:
                admit(stream, progress_of_first_wave())
    wall = time.perf_counter() - start
    preempts = engine.scheduler.num_preemptions - preempt0 if preempt0 is not None else None
    return EngineRun([outputs[i] for i in range(len(requests))], steps, wall, token_times, peak, total, preempts)


def warm_up(llm: LLM, seed: int = 0) -> None:
    """Two short requests through every step kind (prefill, decode), then an empty prefix cache."""
    rng = random.Random(seed + 1)
    max_len = llm.config.max_model_len
    prompt_len = max(1, min(32, max_len // 2))
    prompts = [random_tokens(rng, prompt_len, llm.engine.vocab_size) for _ in range(2)]
    llm.generate(prompts, sampling_params(max(1, min(8, max_len - prompt_len))), use_tqdm=False)
    llm.reset_prefix_cache()

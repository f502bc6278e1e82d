"""Offline throughput benchmark for nanoserve, optionally side by side with HF transformers.

    python bench.py                                   # default CPU workload on a random Qwen3-0.6B
    python bench.py --compare hf                      # ... and HF transformers on the same prompts
    python bench.py --num-seqs 256 --input-len 100 1024 --output-len 100 1024   # nano-vllm's workload
    python bench.py --workload shared-prefix          # prefix caching on vs off
    python bench.py --workload mixed                  # TPOT / inter-token p99, chunked prefill on vs off
    python bench.py --model ~/Qwen3-0.6B --json out.json

Workloads follow nano-vllm's bench.py: random token-id prompts, input and output lengths drawn
uniformly from ranges, ignore_eos=True, a fixed seed, one warm-up. With no --model the bench
uses a random-weight checkpoint with Qwen3-0.6B's exact architecture, built once and cached
(~/.cache/nanoserve/qwen3-0.6b-random, or $NANOSERVE_CACHE).

Figures: throughput (output and total tok/s), TTFT / TPOT percentiles, peak KV blocks used,
prefix-cache hit rate, and a roofline: achieved model FLOP/s over the best matmul FLOP/s this
machine reaches at the model's shapes, measured in the same run.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from nanoserve import LLM, SamplingParams
from nanoserve.utils.tiny_checkpoint import QWEN3_0_6B, ensure_tiny_qwen3

DEFAULT_MODEL_NAME = "qwen3-0.6b-random"

# Per-workload defaults; every value can be overridden from the command line.
PRESETS = {
    # Sized so `--compare hf` finishes in about five minutes on 2 AVX2 cores, where HF's bf16 GEMMs
    # run at ~20 GFLOP/s. A longer CPU workload: --input-len 64 256 --output-len 64 256.
    "random": dict(num_seqs=16, input_len=(32, 64), output_len=(32, 64)),
    # Many requests share one long system prompt; their own tails and outputs are short.
    "shared-prefix": dict(num_seqs=16, input_len=(16, 64), output_len=(16, 32), prefix_len=512),
    # Short prompts decode while long prompts arrive one by one.
    "mixed": dict(num_seqs=8, input_len=(32, 64), output_len=(96, 96), long_len=(768, 768), num_long=3,
                  long_every=24, max_num_batched_tokens=256),
}


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=list(PRESETS), default="random",
                   help="random: nano-vllm's shape; shared-prefix: caching on vs off; mixed: chunked prefill on vs off")
    w.add_argument("--num-seqs", type=int, help="number of requests")
    w.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="prompt length range (shared-prefix: the distinct tail after the shared prefix)")
    w.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="output length range")
    w.add_argument("--prefix-len", type=int, help="shared-prefix: length of the shared system prompt")
    w.add_argument("--long-len", type=int, nargs=2, metavar=("MIN", "MAX"), help="mixed: long prompt length range")
    w.add_argument("--num-long", type=int, help="mixed: number of long prompts")
    w.add_argument("--long-every", type=int,
                   help="mixed: a long prompt arrives each time the short requests have made this many tokens")
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else sampling")
    w.add_argument("--seed", type=int, default=0)

    m = p.add_argument_group("model and machine")
    m.add_argument("--model", help="HF-format Qwen3 checkpoint dir (default: random-weight Qwen3-0.6B, cached)")
    m.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    m.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    m.add_argument("--threads", type=int, help="torch.set_num_threads for both engines (default: torch's)")

    e = p.add_argument_group("engine knobs (nanoserve LLM kwargs)")
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--max-model-len", type=int, help="default: longest prompt + longest output")
    e.add_argument("--block-size", type=int, help="kvcache_block_size (default: the engine's)")
    e.add_argument("--num-kvcache-blocks", type=int)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--enforce-eager", action="store_true")

    o = p.add_argument_group("comparison and output")
    o.add_argument("--compare", choices=["hf"], help="also run HF transformers on the same prompts")
    o.add_argument("--hf-paths", default="generate,cb",
                   help="HF paths to try, comma separated: generate (padded batch), cb (continuous batching)")
    o.add_argument("--hf-batch-size", type=int, help="padded generate: requests per batch (default: all)")
    o.add_argument("--no-warmup", action="store_true")
    o.add_argument("--profile", action="store_true",
                   help="also profile one prefill step and one decode step (torch.profiler top ops)")
    o.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    args = p.parse_args(argv)

    for key, value in PRESETS[args.workload].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for name in ("input_len", "output_len", "long_len"):
        rng = getattr(args, name, None)
        if rng is not None and not 1 <= rng[0] <= rng[1]:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {rng}")
    if args.num_seqs < 1:
        p.error("--num-seqs must be >= 1")
    if args.compare and args.workload != "random":
        p.error("--compare hf runs with --workload random (the other workloads compare nanoserve settings)")
    return args


# ---------------------------------------------------------------------------------------------
# Workloads


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    # 0: present from the start. k > 0: added once every request present from the start has made
    # k output tokens (or finished); the mixed and shared-prefix workloads use it.
    arrival: int = 0


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # nano-vllm draws ids below 10000; any id works since EOS is ignored.
    return [rng.randrange(0, min(vocab, 10000)) for _ in range(n)]


def make_requests(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    lens = lambda r: rng.randint(*r)  # noqa: E731
    if args.workload == "random":
        return [Request(random_tokens(rng, lens(args.input_len), vocab), lens(args.output_len))
                for _ in range(args.num_seqs)]
    if args.workload == "shared-prefix":
        # The first request arrives alone (a system prompt the server has seen before); the rest
        # arrive once it has its first token, so caching can serve their prefix. Requests that all
        # arrive in the same step would each compute the prefix: nothing is cached yet.
        prefix = random_tokens(rng, args.prefix_len, vocab)
        return [Request(prefix + random_tokens(rng, lens(args.input_len), vocab), lens(args.output_len),
                        arrival=0 if i == 0 else 1) for i in range(args.num_seqs)]
    # mixed: short requests from the start, then long prompts every `long_every` tokens of progress.
    short = [Request(random_tokens(rng, lens(args.input_len), vocab), lens(args.output_len))
             for _ in range(args.num_seqs)]
    long = [Request(random_tokens(rng, lens(args.long_len), vocab), 16, arrival=(i + 1) * args.long_every)
            for i in range(args.num_long)]
    return short + long


# ---------------------------------------------------------------------------------------------
# Model FLOPs and the matmul roofline


@dataclass
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads") or heads,
                   cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["intermediate_size"], cfg["vocab_size"])

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every per-layer projection: qkv, o, gate_up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.hidden, q + 2 * kv), (q, self.hidden), (self.hidden, 2 * self.inter), (self.inter, self.hidden)]

    @property
    def linear_flops_per_token(self) -> int:
        return 2 * self.layers * sum(i * o for i, o in self.linear_shapes())

    @property
    def lm_head_flops(self) -> int:  # per sampled row
        return 2 * self.vocab * self.hidden

    def attention_flops(self, num_keys: int) -> int:
        """QK^T and PV for one query token that attends num_keys keys, all layers."""
        return 4 * self.layers * self.heads * self.head_dim * num_keys

    def step_flops(self, entries: list[tuple[int, int, bool]]) -> int:
        """entries: (tokens already in cache, new tokens, samples) per sequence of a step."""
        flops = 0
        for start, n, samples in entries:
            keys = n * start + n * (n + 1) // 2  # query i (0-based) sees start + i + 1 keys
            flops += n * self.linear_flops_per_token + self.attention_flops(keys) + samples * self.lm_head_flops
        return flops


def _time_call(fn, min_time: float = 0.2) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed > min_time and n >= 3:
            return elapsed / n


@torch.inference_mode()
def measure_matmul_peak(shape: ModelShape, dtype: torch.dtype, device: torch.device, rows: int = 256) -> dict:
    """FLOP/s of a GEMM at the model's projection shapes with `rows` tokens, per path.

    Paths: torch.mm in the model dtype; on CPU also torch.mm in float32 on the dtype's values (a
    CPU without bf16/fp16 dot products runs those much faster in float32), the oneDNN prepacked
    float32 GEMM nanoserve's CPU linears use, and for decode-sized batches its skinny bf16-weight
    GEMM. The peak is the best path: the roofline is what this machine reaches for this model,
    not what one library reaches.
    """
    try:
        from nanoserve.kernels.cpu import CPUWeight
    except ImportError:  # an older nanoserve
        CPUWeight = None

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    weights = [torch.randn(n, k, device=device).to(dtype) for k, n in shape.linear_shapes()]
    inputs = [torch.randn(rows, k, device=device).to(dtype) for k, _ in shape.linear_shapes()]
    paths = {f"torch.mm {str(dtype).removeprefix('torch.')}": [(lambda x=x, w=w: F.linear(x, w))
                                                               for x, w in zip(inputs, weights)]}
    if device.type == "cpu":
        if dtype != torch.float32:
            paths["torch.mm float32"] = [(lambda x=x.float(), w=w.float(): F.linear(x, w))
                                         for x, w in zip(inputs, weights)]
        if CPUWeight is not None and torch.backends.mkldnn.is_available():
            paths["oneDNN packed float32"] = [(lambda x=x, cw=CPUWeight(w.float()): cw(x.float()))
                                              for x, w in zip(inputs, weights)]
        if CPUWeight is not None and dtype == torch.bfloat16 and rows <= 16:
            from nanoserve.kernels import cpu_kernels

            if cpu_kernels.skinny_gemm(inputs[0].float(), weights[0]) is not None:
                paths["skinny bf16-weight (C)"] = [(lambda x=x.float(), w=w: cpu_kernels.skinny_gemm(x, w))
                                                   for x, w in zip(inputs, weights)]
    flops = sum(2 * rows * k * n for k, n in shape.linear_shapes())
    out = {}
    for name, calls in paths.items():
        sync()
        # Best of two passes: a peak, so a pass slowed by anything else running must not set it.
        out[name] = max(flops / sum(_time_call(lambda: (call(), sync())) for call in calls) for _ in range(2))
    best = max(out, key=out.get)
    return {"rows": rows, "per_path_flops": out, "best_path": best, "peak_flops": out[best]}


# ---------------------------------------------------------------------------------------------
# nanoserve


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
class StepRecord:
    elapsed: float
    prefill_tokens: int
    decode_tokens: int
    flops: int


@dataclass
class RunResult:
    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_s: dict = field(default_factory=dict)
    tpot_s: dict = field(default_factory=dict)
    itl_s: dict = field(default_factory=dict)
    peak_kv_blocks: int | None = None
    num_kv_blocks: int | None = None
    prefix_cache_hit_rate: float | None = None
    num_steps: int = 0
    num_preemptions: int = 0
    model_flops: float = 0.0
    achieved_flops: float = 0.0
    decode_flops: float | None = None  # FLOP/s over pure-decode steps only
    decode_step_ms: float | None = None
    prefill_tok_s: float | None = None
    counts_ok: bool = True
    short_tpot_s: dict | None = None  # mixed workload: the short requests only
    short_itl_s: dict | None = None

    def row(self) -> str:
        return f"{self.name}: {self.output_tok_s:.1f} output tok/s, {self.total_tok_s:.1f} total tok/s"


class _BatchSpy:
    """Wraps model_runner.run to note each step's (cached tokens, new tokens, samples) per sequence."""

    def __init__(self, runner) -> None:
        self.runner, self.inner = runner, runner.run
        self.entries: list[tuple[int, int, bool]] = []
        runner.run = self

    def __call__(self, batch):
        self.entries = [(s.num_computed_tokens, n, smp) for s, n, smp in zip(batch.seqs, batch.num_new_tokens,
                                                                             batch.samples)]
        return self.inner(batch)

    def remove(self) -> None:
        del self.runner.run  # back to the class method


def make_llm(args: argparse.Namespace, requests: list[Request], **overrides) -> LLM:
    max_model_len = args.max_model_len or max(len(r.prompt) + r.max_tokens for r in requests)
    kwargs = dict(
        device=args.device,
        dtype=args.dtype,
        max_model_len=max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    for key, arg in (("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                     ("num_kvcache_blocks", "num_kvcache_blocks"), ("kvcache_block_size", "block_size")):
        if getattr(args, arg) is not None:
            kwargs[key] = getattr(args, arg)
    if not kwargs["enable_chunked_prefill"]:
        kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens", 0), max_model_len)
    kwargs.update(overrides)
    return LLM(args.model, **kwargs)


def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=max_tokens, detokenize=False,
                          seed=args.seed if args.temperature > 0 else None)


def warm_up_nanoserve(llm: LLM, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed + 1)
    max_len = llm.config.max_model_len
    prompt_len = max(1, min(32, max_len // 2))
    prompts = [random_tokens(rng, prompt_len, llm.engine.vocab_size) for _ in range(2)]
    llm.generate(prompts, sampling_params(args, max(1, min(8, max_len - prompt_len))), use_tqdm=False)
    llm.reset_prefix_cache()


def run_nanoserve(llm: LLM, requests: list[Request], args: argparse.Namespace, name: str = "nanoserve",
                  short_ids: set[int] | None = None) -> RunResult:
    """Drive llm.engine step by step: per-step timing and FLOPs, peak KV blocks, per-token gaps.

    Requests with arrival > 0 (mixed workload) are added once every short request has made that
    many output tokens (or finished).
    """
    engine = llm.engine
    shape = ModelShape.from_hf(engine.config.hf_config)
    bm = engine.block_manager
    queried0, hits0 = bm.num_queried_tokens, bm.num_hit_tokens
    preempt0 = engine.scheduler.num_preemptions
    spy = _BatchSpy(engine.model_runner)

    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    seqs: dict[int, object] = {}  # request index -> its Sequence
    last_token_at: dict[int, float] = {}
    seen: dict[int, int] = {}
    gaps: dict[int, list[float]] = {}
    outputs: dict[int, object] = {}
    rid_to_idx: dict[str, int] = {}
    steps: list[StepRecord] = []
    peak_blocks = 0

    def admit(progress: int) -> None:
        while pending and requests[pending[0]].arrival <= progress:
            i = pending.pop(0)
            rid = engine.add_request(requests[i].prompt, sampling_params(args, requests[i].max_tokens))
            rid_to_idx[rid] = i
            seqs[i] = engine.requests[rid].seqs[0]

    start = time.perf_counter()
    try:
        admit(0)
        while not engine.is_finished() or pending:
            if engine.is_finished():  # nothing running: let the next arrival in
                admit(requests[pending[0]].arrival)
            t0 = time.perf_counter()
            stats = engine.step()
            now = time.perf_counter()
            steps.append(StepRecord(now - t0, stats.num_prefill_tokens, stats.num_decode_tokens,
                                    shape.step_flops(spy.entries)))
            peak_blocks = max(peak_blocks, bm.pool.num_blocks - bm.num_free_blocks)
            for i, seq in seqs.items():  # per-token gaps: did this sequence get a token this step?
                n = seq.num_output_tokens
                if n > seen.get(i, 0):
                    if i in last_token_at:
                        gaps.setdefault(i, []).append(now - last_token_at[i])
                    last_token_at[i], seen[i] = now, n
            for out in stats.finished:
                outputs[rid_to_idx[out.request_id]] = out
            if pending:
                short = [s for i, s in seqs.items() if requests[i].arrival == 0]
                admit(min(s.num_output_tokens if s.finish_reason is None else 1 << 30 for s in short))
    finally:
        spy.remove()
    wall = time.perf_counter() - start

    outs = [outputs[i] for i in range(len(requests))]
    counts_ok = all(len(o.outputs[0].token_ids) == r.max_tokens for o, r in zip(outs, requests))
    prompt_tokens = sum(len(r.prompt) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    tpot = [o.metrics.time_per_output_token for o in outs if o.metrics.time_per_output_token is not None]
    all_gaps = [g for gs in gaps.values() for g in gs]

    decode_steps = [s for s in steps if s.prefill_tokens == 0]
    prefill_steps = [s for s in steps if s.decode_tokens == 0]
    total_flops = sum(s.flops for s in steps)
    queried = bm.num_queried_tokens - queried0
    res = RunResult(
        name=name,
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        wall_s=wall,
        output_tok_s=output_tokens / wall,
        total_tok_s=(prompt_tokens + output_tokens) / wall,
        ttft_s=percentiles(ttft),
        tpot_s=percentiles(tpot),
        itl_s=percentiles(all_gaps, (50, 99, 100)),
        peak_kv_blocks=peak_blocks,
        num_kv_blocks=bm.pool.num_blocks,
        prefix_cache_hit_rate=(bm.num_hit_tokens - hits0) / queried if queried else 0.0,
        num_steps=len(steps),
        num_preemptions=engine.scheduler.num_preemptions - preempt0,
        model_flops=total_flops,
        achieved_flops=total_flops / wall,
        decode_flops=(sum(s.flops for s in decode_steps) / sum(s.elapsed for s in decode_steps)
                      if decode_steps else None),
        decode_step_ms=1e3 * statistics.median(s.elapsed for s in decode_steps) if decode_steps else None,
        prefill_tok_s=(sum(s.prefill_tokens for s in prefill_steps) / sum(s.elapsed for s in prefill_steps)
                       if prefill_steps else None),
        counts_ok=counts_ok,
    )
    if short_ids is not None:
        res.short_tpot_s = percentiles([tpot_of(outs[i]) for i in short_ids if tpot_of(outs[i]) is not None])
        res.short_itl_s = percentiles([g for i in short_ids for g in gaps.get(i, [])], (50, 99, 100))
    return res


def tpot_of(out) -> float | None:
    return out.metrics.time_per_output_token


# ---------------------------------------------------------------------------------------------
# Profiling one prefill step and one decode step


def profile_steps(llm: LLM, requests: list[Request], args: argparse.Namespace, top: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    sort_key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    for r in requests:
        engine.add_request(r.prompt, sampling_params(args, r.max_tokens))
    tables = {}
    try:
        with profile(activities=activities) as prof:
            engine.step()  # the first step is all prefill
        tables["prefill"] = prof.key_averages().table(sort_by=sort_key, row_limit=top)
        for _ in range(10_000):
            if not engine.scheduler.waiting and all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running):
                break
            engine.step()
        with profile(activities=activities) as prof:
            stats = engine.step()
        tables[f"decode ({stats.num_decode_tokens} seqs)"] = prof.key_averages().table(sort_by=sort_key,
                                                                                        row_limit=top)
    finally:
        engine.abort_all()
        llm.reset_prefix_cache()
    for name, table in tables.items():
        print(f"\n--- profile: one {name} step ---\n{table}")
    return tables


# ---------------------------------------------------------------------------------------------
# HF transformers


def load_hf(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    return model


def _hf_sampling_kwargs(args: argparse.Namespace) -> dict:
    if args.temperature > 0:
        return dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False, temperature=None, top_k=None, top_p=None)


@torch.inference_mode()
def run_hf_generate(model, requests: list[Request], args: argparse.Namespace, batch_size: int | None) -> RunResult:
    """HF's padded batched generate: left-pad each batch, generate the batch's longest output,
    and count only each request's own requested tokens as useful."""
    device = model.device
    batch_size = batch_size or len(requests)
    pad = model.generation_config.pad_token_id
    useful, counts_ok = 0, True
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
        new = max(r.max_tokens for r in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             eos_token_id=None, pad_token_id=pad, **_hf_sampling_kwargs(args))
        generated = out.shape[1] - width
        counts_ok &= generated >= max(r.max_tokens for r in batch)
        useful += sum(min(r.max_tokens, generated) for r in batch)
    wall = time.perf_counter() - start
    return _hf_result("hf generate (padded)", requests, useful, wall, counts_ok)


class _DropPsutilNotices(logging.Filter):
    """HF's CB manager logs an ERROR when psutil is missing on CPU; it only sizes its cache from
    free memory, which we size explicitly, so the notice is noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


def run_hf_continuous_batching(model, requests: list[Request], args: argparse.Namespace) -> RunResult:
    """HF's continuous batching manager (paged KV cache), one request per prompt with its own length."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    if not any(isinstance(f, _DropPsutilNotices) for f in cb_logger.filters):
        cb_logger.addFilter(_DropPsutilNotices())

    page = args.block_size or ContinuousBatchingConfig().page_size
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        # Sized to the workload: left alone, HF sizes its cache from free memory (slow on CPU).
        num_blocks=-(-longest // page) * len(requests) + 1,
        # 512 was HF's fastest token budget on 2 CPU cores (256: same, 2048: 14% slower).
        max_batch_tokens=args.max_num_batched_tokens or 512,
        max_requests_per_batch=min(args.max_num_seqs or len(requests), len(requests)),
        seed=args.seed,
    )
    gen_config = GenerationConfig(eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id,
                                  max_new_tokens=max(r.max_tokens for r in requests), **_hf_sampling_kwargs(args))
    results = {}
    with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=10,
                                                   continuous_batching_config=cb_config) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens, eos_token_id=-1) for r in requests]
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.error is not None:
                raise RuntimeError(f"HF continuous batching failed: {result.error}")
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing every request")
        wall = time.perf_counter() - start
    counts = [len(results[i].generated_tokens) for i in ids]
    counts_ok = all(c == r.max_tokens for c, r in zip(counts, requests))
    return _hf_result("hf continuous batching", requests, sum(counts), wall, counts_ok)


def _hf_result(name: str, requests: list[Request], useful: int, wall: float, counts_ok: bool) -> RunResult:
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return RunResult(name=name, num_requests=len(requests), prompt_tokens=prompt_tokens, output_tokens=useful,
                     wall_s=wall, output_tok_s=useful / wall, total_tok_s=(prompt_tokens + useful) / wall,
                     counts_ok=counts_ok)


def run_hf(args: argparse.Namespace, requests: list[Request], dtype: torch.dtype, device: torch.device,
           shape: ModelShape) -> list[RunResult]:
    model = load_hf(args.model, dtype, device)
    paths = [p.strip() for p in args.hf_paths.split(",") if p.strip()]
    results = []
    warm = [Request(requests[0].prompt[:32], 4), Request(requests[-1].prompt[:24], 4)]
    for path in paths:
        runner = {"generate": lambda reqs: run_hf_generate(model, reqs, args, args.hf_batch_size),
                  "cb": lambda reqs: run_hf_continuous_batching(model, reqs, args)}.get(path)
        if runner is None:
            raise SystemExit(f"unknown HF path {path!r}; choose from generate, cb")
        try:
            if not args.no_warmup:
                runner(warm)
            print(f"[hf] running {path} ...", flush=True)
            res = runner(requests)
        except Exception as e:  # one HF path failing must not hide the others
            print(f"[hf] {path} failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        res.model_flops = sum(shape.step_flops([(0, len(r.prompt) + r.max_tokens - 1, False)]) +
                              r.max_tokens * shape.lm_head_flops for r in requests)
        res.achieved_flops = res.model_flops / res.wall_s
        results.append(res)
        print(f"[hf] {res.row()}", flush=True)
    del model
    gc.collect()
    return results


# ---------------------------------------------------------------------------------------------
# Reporting


def fmt_ms(d: dict | None) -> str:
    if not d:
        return "n/a"
    return " / ".join(f"{k} {v * 1e3:.0f} ms" if v is not None else f"{k} n/a" for k, v in d.items())


def print_run(res: RunResult, peak: float | None = None) -> None:
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
        print(f"prefix-cache hits   {res.prefix_cache_hit_rate:.1%}")
        print(f"steps               {res.num_steps} ({res.num_preemptions} preemptions)")
        if res.decode_step_ms is not None:
            print(f"decode step         {res.decode_step_ms:.1f} ms median")
        if res.prefill_tok_s is not None:
            print(f"prefill-only steps  {res.prefill_tok_s:.0f} tok/s")
    if peak:
        line = f"roofline            {res.achieved_flops / 1e9:.1f} GFLOP/s = {res.achieved_flops / peak:.1%} of peak"
        if res.decode_flops is not None:
            line += f"; decode steps {res.decode_flops / 1e9:.1f} GFLOP/s = {res.decode_flops / peak:.1%}"
        print(line)


def cpu_idle_fraction(seconds: float = 1.0) -> float | None:
    """Share of all CPUs' time spent idle over `seconds` (Linux /proc/stat), or None elsewhere."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (idle1 - idle0) / max(total1 - total0, 1)


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "device": str(device),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    info["cpu_count"] = os.cpu_count()
    idle = cpu_idle_fraction()
    if idle is not None:  # other work on the machine skews CPU timings: keep it on record
        info["cpu_idle_before_run"] = idle
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


# ---------------------------------------------------------------------------------------------
# Workload drivers


def bench_random(args, requests, report: dict) -> None:
    llm = make_llm(args, requests)
    device, dtype = llm.engine.device, llm.engine.model_runner.dtype
    shape = ModelShape.from_hf(llm.engine.config.hf_config)
    roof = measure_matmul_peak(shape, dtype, device)
    report["matmul_peak"] = roof
    peak = roof["peak_flops"]
    print(f"matmul peak at the model's shapes, {roof['rows']} rows: " + ", ".join(
        f"{k} {v / 1e9:.1f}" for k, v in roof["per_path_flops"].items()) + f" GFLOP/s -> peak {peak / 1e9:.1f}")
    decode_rows = min(args.num_seqs, args.max_num_seqs or args.num_seqs)
    roof_decode = measure_matmul_peak(shape, dtype, device, rows=decode_rows)
    report["matmul_at_decode_rows"] = roof_decode
    print(f"  at {decode_rows} rows (a full decode batch): " + ", ".join(
        f"{k} {v / 1e9:.1f}" for k, v in roof_decode["per_path_flops"].items()) + " GFLOP/s")
    flops_per_out = shape.linear_flops_per_token + shape.lm_head_flops
    print(f"compute limit ~{peak / flops_per_out:.0f} tok/s (decode tokens, {flops_per_out / 1e9:.2f} GFLOP each)")

    if args.profile:
        report["profile"] = profile_steps(llm, requests, args)
    if not args.no_warmup:
        warm_up_nanoserve(llm, args)
    print("[nanoserve] running ...", flush=True)
    ns = run_nanoserve(llm, requests, args)
    print_run(ns, peak)
    report["nanoserve"] = asdict(ns)
    del llm
    gc.collect()

    if args.compare == "hf":
        hf_results = run_hf(args, requests, dtype, device, shape)
        for res in hf_results:
            print_run(res, peak)
        report["hf"] = [asdict(r) for r in hf_results]
        if hf_results:
            best = max(hf_results, key=lambda r: r.output_tok_s)
            ratio = ns.output_tok_s / best.output_tok_s
            report["ratio_vs_best_hf"] = ratio
            report["best_hf_path"] = best.name
            print(f"\nnanoserve / best HF ({best.name}): {ratio:.2f}x output tok/s "
                  f"({ns.output_tok_s:.1f} vs {best.output_tok_s:.1f})")
            if not (ns.counts_ok and all(r.counts_ok for r in hf_results)):
                print("WARNING: some engine did not produce the requested token counts", file=sys.stderr)


def bench_shared_prefix(args, requests, report: dict) -> None:
    results = []
    for caching in (True, False):
        llm = make_llm(args, requests, enable_prefix_caching=caching)
        if not args.no_warmup:
            warm_up_nanoserve(llm, args)
        name = f"nanoserve, prefix caching {'on' if caching else 'off'}"
        print(f"[{name}] running ...", flush=True)
        res = run_nanoserve(llm, requests, args, name=name)
        print_run(res)
        results.append(res)
        del llm
        gc.collect()
    on, off = results
    report["caching_on"], report["caching_off"] = asdict(on), asdict(off)
    report["speedup_caching"] = on.output_tok_s / off.output_tok_s
    print(f"\nprefix caching: hit rate {on.prefix_cache_hit_rate:.1%}, {on.total_tok_s:.1f} vs "
          f"{off.total_tok_s:.1f} total tok/s ({report['speedup_caching']:.2f}x), TTFT p50 "
          f"{on.ttft_s['p50'] * 1e3:.0f} vs {off.ttft_s['p50'] * 1e3:.0f} ms")


def bench_mixed(args, requests, report: dict) -> None:
    short_ids = {i for i, r in enumerate(requests) if r.arrival == 0}
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    results = []
    for chunked in (True, False):
        budget = args.max_num_batched_tokens if chunked else max(longest, args.max_model_len or 0)
        llm = make_llm(args, requests, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
        if not args.no_warmup:
            warm_up_nanoserve(llm, args)
        name = f"nanoserve, chunked prefill {'on' if chunked else 'off'} (budget {budget})"
        print(f"[{name}] running ...", flush=True)
        res = run_nanoserve(llm, requests, args, name=name, short_ids=short_ids)
        print_run(res)
        results.append(res)
        del llm
        gc.collect()
    on, off = results
    report["chunked_on"], report["chunked_off"] = asdict(on), asdict(off)
    print(f"\nshort requests' TPOT p99: chunked on {on.short_tpot_s['p99'] * 1e3:.0f} ms vs off "
          f"{off.short_tpot_s['p99'] * 1e3:.0f} ms; inter-token p99 {on.short_itl_s['p99'] * 1e3:.0f} vs "
          f"{off.short_itl_s['p99'] * 1e3:.0f} ms; throughput {on.output_tok_s:.1f} vs {off.output_tok_s:.1f} "
          "output tok/s")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        print(f"building/using the random-weight Qwen3-0.6B checkpoint ({DEFAULT_MODEL_NAME}) ...", flush=True)
        args.model = ensure_tiny_qwen3(DEFAULT_MODEL_NAME, **QWEN3_0_6B)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    requests = make_requests(args, vocab)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    report = {"args": {k: v for k, v in vars(args).items()}, "machine": machine_info(device)}
    print(f"workload {args.workload}: {len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt "
          f"tokens, {sum(r.max_tokens for r in requests)} output tokens; model {args.model}; {args.dtype} on "
          f"{device}, {torch.get_num_threads()} threads", flush=True)
    machine = report["machine"]
    print(f"machine: {machine['cpu']} ({machine['cpu_count']} CPUs, {machine['cpu_capability']})"
          + (f", {machine['gpu']}" if "gpu" in machine else "")
          + (f"; CPUs {machine['cpu_idle_before_run']:.0%} idle before the run" if "cpu_idle_before_run" in machine
             else ""), flush=True)

    {"random": bench_random, "shared-prefix": bench_shared_prefix, "mixed": bench_mixed}[args.workload](
        args, requests, report)

    if hasattr(os, "getloadavg"):  # includes this run itself: ~threads when nothing else ran
        report["machine"]["load_average_end"] = os.getloadavg()
        print(f"load average (1/5/15 min) at the end: " + " / ".join(f"{v:.2f}" for v in os.getloadavg()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()

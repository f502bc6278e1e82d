"""What each workload measures, built from the one driver.

--accuracy: instead of timing, the int8 paths' accuracy against bf16 (bench/accuracy.py).

random / long-prompt: nanoserve's throughput, optionally against peers (HF, vLLM) on the same
requests, repeats alternating back to back; long-prompt also probes a one-block prefix-cache hit.
shared-prefix: prefix caching on vs off. mixed: chunked prefill on vs off. json: structured
outputs against their unconstrained twins (bench/structured.py).
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from typing import NamedTuple

from nanoserve import LLM, SamplingParams
from nanoserve.bench.accuracy import int8_paths, measure_accuracy, realistic_checkpoint
from nanoserve.bench.driver import drive, sampling_params, warm_up
from nanoserve.bench.machine import engine_description
from nanoserve.bench.model_shape import ModelShape
from nanoserve.bench.peers import PeerUnavailable
from nanoserve.bench.peers.start import close_peers, make_vllm_peer, peer_settings, start_peers, start_vllm
from nanoserve.bench.profiler import profile_steps
from nanoserve.bench.report import compare, fmt_ms, print_roofline, print_run, print_table
from nanoserve.bench.results import RunResult, summarize
from nanoserve.bench.roofline import Roofline, measure_roofline
from nanoserve.bench.structured import bench_json
from nanoserve.bench.trained_checkpoint import ensure_trained_checkpoint, heldout_windows
from nanoserve.bench.workloads import Request, one_block_hit_pair


def make_llm(args: argparse.Namespace, requests: list[Request], **overrides) -> LLM:
    max_model_len = args.max_model_len or max(len(r.prompt) + r.max_tokens for r in requests)
    kwargs = dict(device=args.device, dtype=args.dtype, max_model_len=max_model_len,
                  enable_prefix_caching=not args.no_prefix_caching, enable_chunked_prefill=not args.no_chunked_prefill,
                  enforce_eager=args.enforce_eager, seed=args.seed, quantization=getattr(args, "quantization", None))
    for key, arg in (("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                     ("num_kvcache_blocks", "num_kvcache_blocks"), ("kvcache_block_size", "block_size")):
        if getattr(args, arg) is not None:
            kwargs[key] = getattr(args, arg)
    if not kwargs["enable_chunked_prefill"]:
        kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens", 0), max_model_len)
    kwargs.update(overrides)
    return LLM(args.model, **kwargs)


def _params(args: argparse.Namespace):
    return lambda r: sampling_params(r.max_tokens, args.temperature, args.seed)


def _roofline(args: argparse.Namespace, llm: LLM, report: dict) -> Roofline | None:
    if args.no_roofline:
        return None
    shape = ModelShape.from_hf(llm.config.hf_config)
    roof, figures = measure_roofline(shape, llm.engine.model_runner.dtype, llm.engine.device,
                                     int8=llm.config.quantization == "int8")
    report["roofline"] = figures
    print_roofline(figures)
    return roof


def _start(args: argparse.Namespace, requests: list[Request], report: dict, **overrides) -> LLM:
    llm = make_llm(args, requests, **overrides)
    if "engine" not in report:
        report["engine"] = engine_description(llm)
        print("engine: " + ", ".join(f"{k} {v}" for k, v in report["engine"].items()), flush=True)
    return llm


def _median_run(runs: list[RunResult]) -> RunResult:
    order = sorted(runs, key=lambda r: r.output_tok_s)
    return order[(len(order) - 1) // 2]


def bench_throughput(args: argparse.Namespace, requests: list[Request], report: dict) -> None:
    llm = _start(args, requests, report)
    roof = _roofline(args, llm, report)
    if args.profile:
        report["profile"] = profile_steps(llm, requests, _params(args))
    if not args.no_warmup:
        warm_up(llm, args.seed)
    peers = start_peers(args, llm, requests, roof, report)
    ours: list[RunResult] = []
    theirs: dict[str, list[RunResult]] = {}
    try:
        for i in range(args.repeat):
            llm.reset_prefix_cache()  # every repeat starts cold, as the peers' do
            print(f"[nanoserve] run {i + 1}/{args.repeat} ...", flush=True)
            ours.append(summarize("nanoserve", requests, drive(llm, requests, _params(args)), roof))
            print(f"  {ours[-1].row()}", flush=True)
            for peer in list(peers):
                try:
                    for res in peer.run():
                        theirs.setdefault(res.name, []).append(res)
                        print(f"  {res.row()}", flush=True)
                except Exception as e:  # one peer failing must not stop the others: say why, drop it
                    print(f"[{peer.name}] failed: {type(e).__name__}: {e}", flush=True)
                    report.setdefault("peer_errors", {})[peer.name] = f"{type(e).__name__}: {e}"
                    close_peers([peer])
                    peers.remove(peer)
    finally:
        close_peers(peers)
    print_run(_median_run(ours))
    for runs in theirs.values():
        print_run(_median_run(runs))
    report["nanoserve"] = [r.as_dict() for r in ours]
    report["peers"] = {name: [r.as_dict() for r in runs] for name, runs in theirs.items()}
    report["comparison"] = compare(ours, theirs)
    report["table"] = print_table({"nanoserve": ours, **theirs})
    if args.workload == "long-prompt":
        report["prefix_hit_probe"] = prefix_hit_probe(llm, requests, args, roof)


def prefix_hit_probe(llm: LLM, requests: list[Request], args: argparse.Namespace, roof: Roofline | None) -> dict:
    """A long prompt, then one of the same length sharing only its first block: computing on top
    of a one-block cache hit must cost no more than computing those tokens cold."""
    if not llm.config.enable_prefix_caching:
        print("\nprefix-hit probe skipped: prefix caching is off")
        return {"skipped": "prefix caching is off"}
    block = llm.engine.block_size  # the config's, or the backend's preferred size
    cold, hit = one_block_hit_pair(requests[0].prompt, block, llm.engine.vocab_size, args.seed + 2)
    llm.reset_prefix_cache()
    out = {}
    for name, prompt in (("cold", cold), ("one_block_hit", hit)):
        probe = [Request(prompt, 1)]
        run = drive(llm, probe, _params(args))
        res = summarize(name, probe, run, roof)
        out[name] = {"wall_s": res.wall_s, "cached_tokens": run.outputs[0].num_cached_tokens, "floor_s": res.floor_s}
    ratio = out["one_block_hit"]["wall_s"] / out["cold"]["wall_s"]
    out["ratio"] = ratio
    out["hit_as_expected"] = out["one_block_hit"]["cached_tokens"] == block and out["cold"]["cached_tokens"] == 0
    n = len(cold)
    print(f"\nprefix-hit probe: a {n}-token prompt cold {out['cold']['wall_s']:.2f} s; one of the same length "
          f"sharing only its first block ({out['one_block_hit']['cached_tokens']} cached tokens) "
          f"{out['one_block_hit']['wall_s']:.2f} s: ratio {ratio:.2f} (it computes {n - block} of {n} tokens, "
          f"so <= {(n - block) / n:.2f} is no worse than cold)")
    if not out["hit_as_expected"]:
        print(f"WARNING: expected exactly {block} cached tokens on the second prompt and none on the first")
    return out


def bench_variants(args: argparse.Namespace, requests: list[Request], report: dict,
                   variants: list[tuple[str, str, dict]], short_only: bool = False) -> list[RunResult]:
    """The same requests under several engine settings: (name, report key, LLM overrides) each."""
    results, roof = [], None
    for i, (name, key, overrides) in enumerate(variants):
        llm = _start(args, requests, report, **overrides)
        if i == 0:  # one measurement serves every variant: same model, dtype and machine
            roof = _roofline(args, llm, report)
        if not args.no_warmup:
            warm_up(llm, args.seed)
        print(f"[{name}] running ...", flush=True)
        res = summarize(name, requests, drive(llm, requests, _params(args)), roof, short_only=short_only)
        print_run(res)
        report[key] = res.as_dict()
        results.append(res)
        del llm
        gc.collect()
    return results


def bench_shared_prefix(args: argparse.Namespace, requests: list[Request], report: dict) -> None:
    on, off = bench_variants(args, requests, report, [
        ("nanoserve, prefix caching on", "caching_on", dict(enable_prefix_caching=True)),
        ("nanoserve, prefix caching off", "caching_off", dict(enable_prefix_caching=False))])
    report["speedup_caching"] = on.output_tok_s / off.output_tok_s
    print(f"\nprefix caching: hit rate {on.prefix_cache_hit_rate:.1%}, {on.total_tok_s:.1f} vs "
          f"{off.total_tok_s:.1f} total tok/s ({report['speedup_caching']:.2f}x), TTFT p50 "
          f"{on.ttft_s['p50'] * 1e3:.0f} vs {off.ttft_s['p50'] * 1e3:.0f} ms")


def bench_mixed(args: argparse.Namespace, requests: list[Request], report: dict) -> None:
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    unchunked = max(longest, args.max_model_len or 0)
    on, off = bench_variants(args, requests, report, [
        (f"nanoserve, chunked prefill on (budget {args.max_num_batched_tokens})", "chunked_on",
         dict(enable_chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens)),
        (f"nanoserve, chunked prefill off (budget {unchunked})", "chunked_off",
         dict(enable_chunked_prefill=False, max_num_batched_tokens=unchunked))], short_only=True)
    print(f"\nshort requests' TPOT p99: chunked on {fmt_ms({'p99': on.short_tpot_s['p99']})} vs off "
          f"{fmt_ms({'p99': off.short_tpot_s['p99']})}; inter-token {fmt_ms({'p99': on.short_itl_s['p99']})} vs "
          f"{fmt_ms({'p99': off.short_itl_s['p99']})}; throughput {on.output_tok_s:.1f} vs {off.output_tok_s:.1f} "
          "output tok/s")


def bench_mcq(args: argparse.Namespace, requests: list[Request], report: dict) -> None:
    """Scoring, as lm-eval's loglikelihood asks it: every choice's continuation scored through prompt
    logprobs, all requests at once; prefix caching on (the shared contexts are hits) vs off."""
    params = [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=1,
                             prompt_logprobs_start=r.score_from) for r in requests]
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    times, settings = {}, None
    for name, key, caching in (("prefix caching on", "mcq_caching_on", True),
                               ("prefix caching off", "mcq_caching_off", False)):
        llm = _start(args, requests, report, enable_prefix_caching=caching)
        settings = settings or peer_settings(args, llm)
        if not args.no_warmup:
            warm_up(llm, args.seed)
        runs = []
        for _ in range(args.repeat):
            llm.reset_prefix_cache()  # every run starts cold: only hits within the run count
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            runs.append(time.perf_counter() - start)
        times[key] = sorted(runs)[(len(runs) - 1) // 2]
        report[key] = {"seconds_median": times[key], "seconds": runs, "requests_per_s": len(requests) / times[key],
                       "prefix_cache_hit_rate": llm.prefix_cache_hit_rate}
        print(f"[{name}] {len(requests)} scoring requests in {times[key]:.2f} s (median of {len(runs)}), "
              f"{len(requests) / times[key]:.1f} req/s, hit rate {llm.prefix_cache_hit_rate:.1%}", flush=True)
        del llm
        gc.collect()
    report["speedup_caching"] = times["mcq_caching_off"] / times["mcq_caching_on"]
    print(f"\nmcq scoring: prefix caching {report['speedup_caching']:.2f}x faster than without")
    if "vllm" in args.compare:
        mcq_vs_vllm(args, requests, settings, times["mcq_caching_on"], report)


def mcq_vs_vllm(args: argparse.Namespace, requests: list[Request], settings, ours_s: float, report: dict) -> None:
    """The same scoring requests through vLLM (prompt_logprobs=1, as lm-eval's vllm model asks;
    vLLM skips its prefix cache for prompt-logprob requests), median of --repeat."""
    peer = make_vllm_peer(args, settings, requests, task="mcq", payloads=[{"prompt": r.prompt} for r in requests])
    try:
        start_vllm(peer)
        runs = []
        for i in range(args.repeat):
            result = peer.run_raw()
            if result["counts"] != [len(r.prompt) - 1 for r in requests]:
                raise PeerUnavailable("vLLM returned prompt logprobs for other positions than asked")
            runs.append(result["wall_s"])
            print(f"[vllm cpu] run {i + 1}/{args.repeat}: {len(requests)} scoring requests in {runs[-1]:.2f} s",
                  flush=True)
    except PeerUnavailable as e:
        print(f"[vllm] skipped: {e}", flush=True)
        report.setdefault("peers_skipped", {})["vllm"] = str(e)
        return
    finally:
        peer.close()
    theirs = sorted(runs)[(len(runs) - 1) // 2]
    report["mcq_vllm"] = {"seconds_median": theirs, "seconds": runs, "dtype": peer.settings.dtype,
                          "version": peer.version}
    report["speedup_vs_vllm"] = theirs / ours_s
    print(f"mcq scoring vs vLLM {peer.version} ({peer.settings.dtype}): {ours_s:.2f} vs {theirs:.2f} s, "
          f"nanoserve {report['speedup_vs_vllm']:.2f}x faster (median of {len(runs)})")


ACCURACY_PROMPT_TOKENS = 64  # each gate prompt's length (a workload prompt's first tokens, a held-out window's)


class AccuracyGate(NamedTuple):
    name: str
    model: str
    prompts: list[list[int]]
    teachers: list[list[int]] | None  # None: the bf16 model's greedy tokens


def bench_accuracy(args: argparse.Namespace, requests: list[Request], report: dict) -> None:
    """The int8 accuracy gate (bench/accuracy.py) on the workload's first prompts, on the checkpoint
    and on a copy of it with outlier activation channels (teachers: the bf16 model's greedy tokens),
    then on the trained checkpoint (bench/trained_checkpoint.py; teachers: held-out text; trained
    once with its own fixed seed, so every run scores the same model)."""
    prompts = [r.prompt[:ACCURACY_PROMPT_TOKENS] for r in requests[: args.accuracy_prompts]]
    with tempfile.TemporaryDirectory(prefix="nanoserve-outliers-") as outliers:
        realistic_checkpoint(args.model, outliers, args.seed)
        gates = [AccuracyGate("checkpoint", args.model, prompts, None),
                 AccuracyGate("with outlier channels", outliers, prompts, None)]
        if args.accuracy_trained_steps:
            print(f"building/using the trained checkpoint ({args.accuracy_trained_steps} steps; "
                  "minutes on a CPU, once) ...", flush=True)
            trained = ensure_trained_checkpoint(args.accuracy_trained_steps)
            windows = heldout_windows(trained, args.accuracy_prompts, ACCURACY_PROMPT_TOKENS, args.accuracy_tokens)
            gates.append(AccuracyGate("trained, with outlier channels, held-out text", trained, *windows))
        _accuracy_gate(args, gates, report)


def _accuracy_gate(args: argparse.Namespace, gates: list[AccuracyGate], report: dict) -> None:
    paths = {**int8_paths(), "float32 (floor)": {"llm": {"dtype": "float32"}}}
    report["accuracy"] = {}
    for gate in gates:
        print(f"\naccuracy against bf16, {gate.name} ({gate.model}), {len(gate.prompts)} prompts x "
              f"{args.accuracy_tokens} teacher-forced positions:", flush=True)
        max_model_len = max(len(p) for p in gate.prompts) + args.accuracy_tokens
        results, _ = measure_accuracy(gate.model, gate.prompts, args.accuracy_tokens, paths, gate.teachers,
                                      device="cpu", dtype="bfloat16", max_model_len=max_model_len)
        for r in results:
            print("  " + r.line(), flush=True)
        report["accuracy"][gate.name] = [vars(r) for r in results]


WORKLOADS = {"random": bench_throughput, "long-prompt": bench_throughput, "shared-prefix": bench_shared_prefix,
             "mixed": bench_mixed, "json": lambda args, requests, report: bench_json(args, requests, report, make_llm),
             "mcq": bench_mcq}

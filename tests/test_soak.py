"""Long runs: resident memory stays flat over thousands of requests, and over LLMs created and
dropped again and again (what a notebook does when a cell is re-run). No timing assertions.

Resident memory is VmRSS from /proc/self/status.
"""
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_no_leak, make_llm, rss_mb

from nanoserve import SamplingParams
from nanoserve.backends.cpu import gemm_unavailable
from nanoserve.kernels import cpu_kernels

NUM_CALLS = 25
REQUESTS_PER_CALL = 80  # 2,000 requests in all
WARM_UP_CALLS = 5
MAX_GROWTH_MB = 40  # after warm-up; the failure this guards against grew ~10 MB per call

# Every CPU GEMM path (NANOSERVE_CPU_GEMM) for the dtypes that take it. oneDNN keeps memory for every
# row count it meets; its paths (and F.linear's) pad the rows to a bounded set of sizes, the panel
# kernel keeps no state at all. A path this CPU lacks is skipped with the reason.
GEMM_PATHS = [
    ("bfloat16", "panel"), ("bfloat16", "dpbf16"), ("bfloat16", "onednn-bf16"), ("bfloat16", "onednn-fp32"),
    ("bfloat16", "native"),
    ("float32", "onednn-fp32"), ("float32", "native"),
]


def random_requests(rng: random.Random, num: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for _ in range(num):
        prompts.append([rng.randrange(3, 990) for _ in range(rng.randint(1, 48))])
        params.append(SamplingParams(
            n=rng.choice([1, 1, 1, 2]), temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 20]), repetition_penalty=rng.choice([1.0, 1.1]),
            seed=rng.choice([None, rng.randrange(1000)]), logprobs=rng.choice([None, None, 2]),
            stop=rng.choice([None, ["e"]]), max_tokens=rng.randint(1, 6), ignore_eos=rng.random() < 0.5,
        ))
    return prompts, params


@pytest.mark.parametrize("dtype, gemm", GEMM_PATHS, ids=[f"{d}-{g}" for d, g in GEMM_PATHS])
def test_soak_memory_stays_flat(tiny_model, monkeypatch, dtype, gemm):
    lib = cpu_kernels.load()
    reason = gemm_unavailable(gemm, getattr(torch, dtype), cpu_kernels.CPUKernels(lib) if lib is not None else None)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", gemm)
    llm = make_llm(tiny_model, dtype=dtype, kvcache_block_size=16, num_kvcache_blocks=48, max_model_len=128,
                   max_num_seqs=32, max_num_batched_tokens=256)
    rng = random.Random(0)
    rss = []
    for _ in range(NUM_CALLS):
        prompts, params = random_requests(rng, REQUESTS_PER_CALL)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert len(outputs) == len(prompts) and all(o.finished for o in outputs)
        rss.append(rss_mb())
    assert_no_leak(llm)
    growth = max(rss[WARM_UP_CALLS:]) - rss[WARM_UP_CALLS - 1]
    assert growth < MAX_GROWTH_MB, f"RSS grew {growth:.0f} MB after warm-up: {[round(r) for r in rss]}"


# Runs in a fresh interpreter, as a notebook kernel does: imports happen the way a user's do, and
# nothing the test session already loaded hides a module that keeps an engine alive.
RECREATE_SCRIPT = textwrap.dedent("""
    import gc, json, sys, threading, weakref
    sys.path.insert(0, sys.argv[2])
    # A dropped engine must be freed at once by reference counting, not whenever the cycle
    # collector next runs: until then its weights and KV cache stay resident.
    gc.disable()
    from helpers import child_pids, make_llm, rss_mb
    from nanoserve import SamplingParams

    report = {"rss": [], "alive": [], "threads": [], "children": []}
    previous = None
    for i in range(20):
        # Rebinding the name drops the last engine, as re-running a notebook cell does; no gc.collect().
        llm = make_llm(sys.argv[1], dtype="bfloat16", max_model_len=256, num_kvcache_blocks=64)
        report["alive"].append(previous is not None and previous() is not None)
        llm.generate(["The quick brown fox"] * 4, SamplingParams(max_tokens=8), use_tqdm=i % 2 == 0)
        llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=4), use_tqdm=False)
        previous = weakref.ref(llm)
        report["rss"].append(rss_mb())
        report["threads"].append(sorted(t.name for t in threading.enumerate()))
        report["children"].append(sorted(child_pids()))
    del llm
    report["alive"].append(previous() is not None)
    report["threads"].append(sorted(t.name for t in threading.enumerate()))
    report["children"].append(sorted(child_pids()))
    print(json.dumps(report))
""")


def test_creating_and_dropping_an_llm_twenty_times(tiny_model):
    tests_dir = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests_dir), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", RECREATE_SCRIPT, tiny_model, tests_dir], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not any(report["alive"]), f"a dropped LLM stayed alive: {report['alive']}"
    assert all(threads == report["threads"][0] for threads in report["threads"]), report["threads"]
    assert not any(report["children"]), report["children"]
    rss = report["rss"]
    assert max(rss) - rss[0] < 60, f"RSS grew from {rss[0]:.0f} MB after the first LLM to {max(rss):.0f} MB: {rss}"

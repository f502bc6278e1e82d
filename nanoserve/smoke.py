"""A few minutes on a CUDA machine that say whether the GPU path works: `python -m nanoserve.smoke`.

Every installed backend (torch, Triton, flash-attn) x CUDA graphs on/off x tensor parallelism 1/2
(2 where two GPUs exist) generates from the same prompts as the torch backend run eagerly, greedy
and bf16; a row reports how many sample streams agree (a divergence counts as agreeing only where
the reference's top-2 logits nearly tie), or the error. Then a short throughput run on a random
Qwen3-0.6B. On a machine without a GPU it says so and exits 0: the CPU path is the test suite's.
"""
from __future__ import annotations

import argparse
import importlib.util
import time
import traceback

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.utils.tiny_checkpoint import QWEN3_0_6B, ensure_tiny_qwen3

SMOKE_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=32, intermediate_size=512, max_position_embeddings=2048)
NEAR_TIE = 5e-2  # bf16 logits of two correct kernels differ by a few hundredths


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (300,), generator=g).tolist()  # longer than one 256-token block
    tails = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 700)]
    return [shared + t for t in tails] + tails


def agreement(outputs, reference) -> tuple[int, int]:
    """(streams that agree, streams) under the near-tie rule."""
    ok = total = 0
    for out, ref in zip(outputs, reference):
        for o, r in zip(out.outputs, ref.outputs):
            total += 1
            first = next((i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b), None)
            if first is None:
                ok += 1
                continue
            top = sorted((lp.logprob for lp in r.logprobs[first].values() if lp.rank in (1, 2)), reverse=True)
            ok += len(top) == 2 and top[0] - top[1] < NEAR_TIE
    return ok, total


def run_case(model: str, backend: str, eager: bool, tp: int, reqs, params, reference) -> str:
    block = 256 if backend == "flash_attn" else 16
    try:
        with LLM(model, dtype="bfloat16", attention_backend=backend, enforce_eager=eager, tensor_parallel_size=tp,
                 kvcache_block_size=block, max_model_len=1536, max_num_batched_tokens=512) as llm:
            start = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
    except Exception as e:  # a row per failure: the table is the point
        return f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:80]}  ({traceback.extract_tb(e.__traceback__)[-1].name})"
    ok, total = agreement(outs, reference)
    return f"{'ok' if ok == total else 'MISMATCH'}: {ok}/{total} streams agree ({elapsed:.1f} s)"


def throughput(num_requests: int) -> str:
    model = ensure_tiny_qwen3("qwen3-0.6b-random", **QWEN3_0_6B)
    g = torch.Generator().manual_seed(1)
    reqs = [torch.randint(3, 10000, (128,), generator=g).tolist() for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False)
    with LLM(model, dtype="bfloat16", max_model_len=512) as llm:
        llm.generate(reqs[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up, graphs
        start = time.perf_counter()
        llm.generate(reqs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        backend = llm.engine.model_runner.backend.describe()
    return f"{num_requests * 128 / elapsed:.0f} output tok/s ({num_requests} x 128 in / 128 out, {backend})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="requests of the throughput run (0: skip it)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to smoke-test (the CPU path is covered by the test suite)")
        return 0
    print(f"GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}")
    model = ensure_tiny_qwen3("smoke-qwen3", **SMOKE_MODEL)
    reqs = prompts(900)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2, logprobs=2)
    with LLM(model, dtype="bfloat16", attention_backend="torch", enforce_eager=True, max_model_len=1536) as ref_llm:
        reference = ref_llm.generate(reqs, params, use_tqdm=False)
    rows = []
    for backend in ("torch", "triton", "flash_attn"):
        for tp in [1, 2] if torch.cuda.device_count() >= 2 else [1]:
            for eager in (True, False):
                if backend == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
                    status = "not installed (pip install nanoserve[cuda])"
                else:
                    status = run_case(model, backend, eager, tp, reqs, params, reference)
                rows.append((backend, "off" if eager else "on", tp, status))
                print(f"{backend:<11} graphs {rows[-1][1]:<3} tp {tp}  {status}", flush=True)
    print("\n| backend | CUDA graphs | TP | result |\n|---|---|---|---|")
    for backend, graphs, tp, status in rows:
        print(f"| {backend} | {graphs} | {tp} | {status} |")
    if args.requests:
        print(f"\nthroughput: {throughput(args.requests)}")
    return 1 if any(s.startswith(("ERROR", "MISMATCH")) for *_, s in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

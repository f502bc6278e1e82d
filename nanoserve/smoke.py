"""The first command on a CUDA machine: `python -m nanoserve.smoke` says whether every GPU path works.

Each row builds an engine and generates greedily (n=2, logprobs) from the prompts its model's
reference (the torch backend, eager, same dtype) answered; it reports how many sample streams
agree, or the error. In bf16 two correct engines differ by a bf16 rounding of the logits (0.125
at a logit of 16-32), so a divergence is forgiven the way vLLM's check_logprobs_close forgives it:
each engine's token is in the other's top LOGPROBS. In float32 they agree to ~1e-5, so only a
near-exact tie of the reference's top 2 forgives one. The rows cover what the README claims (`plan`):
  * dense and MoE models: every backend (torch, triton, flash_attn) x CUDA graphs on/off x TP 1/2;
  * the Triton backend in float32 (dense and MoE, graphs on/off; every head_dim): exact tokens;
  * head_dim 64, 80, 96, 128 and 256 on the Triton and flash-attn backends;
  * the old paths of the CUDA speed work (NANOSERVE_TRITON_FUSED_OPS=0, _PREFILL=key, _MOE_TILES=fixed);
  * a decode past 8k context (a multi-split decode) over a KV cache whose per-layer views pass 2^31
    elements, with the sequences placed in its last blocks;
  * every architecture (Qwen3, Llama, Qwen2, Mistral, Qwen3-MoE) in float32 on the torch and Triton
    backends against HF transformers' own model on the GPU, token for token (`hf_parity`);
  * every pre-quantized checkpoint format (GPTQ with and without act-order, AWQ, compressed-tensors
    W4A16 and W8A8, FP8), dequantized at load, against HF on its float twin (`quantized_parity`).
Rows that cannot run here (one GPU, no usable flash-attn) are listed with the reason. Then a short
throughput run on a random Qwen3-0.6B. Without a GPU it says so and exits 0 (`--plan` lists the rows).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from unittest import mock

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.utils.tiny_checkpoint import QWEN3_0_6B, ensure_tiny_checkpoint, ensure_tiny_qwen3

_DENSE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=512, max_position_embeddings=2048)
MODELS = {  # name -> (arch, config): random weights, built once into the cache
    **{f"dense-d{d}": ("qwen3", {**_DENSE, "head_dim": d}) for d in (64, 80, 96, 128, 256)},
    "moe-d128": ("qwen3_moe", {**_DENSE, "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 4,
                               "moe_intermediate_size": 128}),
    # Its per-layer K (or V) view of BIG_CACHE_BLOCKS x 256 x 8 heads x 128 passes 2^31 elements (4.3 GB each).
    "long-d128": ("qwen3", {**_DENSE, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 16384}),
}
BACKENDS = ("torch", "triton", "flash_attn")
OLD_PATHS = ({"NANOSERVE_TRITON_FUSED_OPS": "0"}, {"NANOSERVE_TRITON_PREFILL": "key"},
             {"NANOSERVE_TRITON_MOE_TILES": "fixed"})
LONG_PROMPT = 8500
LAST_BLOCKS = 64  # the long rows' sequences live in these, all past element 2^31 of a layer's view
BIG_CACHE_BLOCKS = 2**31 // (256 * 8 * 128) + LAST_BLOCKS
LOGPROBS = 5  # bf16 rows: a divergence is forgiven where each token is in the other's top LOGPROBS
FP32_NEAR_TIE = 1e-3  # float32 rows: only a tie this close forgives one


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (300,), generator=g).tolist()  # longer than one 256-token block
    tails = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 700)]
    return [shared + t for t in tails] + tails


def first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)


def _rank(logprobs: dict, token: int) -> int | None:
    return logprobs[token].rank if token in logprobs else None


def forgiven(o, r, t: int, dtype: str) -> tuple[bool, str]:
    """Whether sample o may leave reference sample r at token t, and what the two saw there."""
    ours, theirs = o.token_ids[t], r.token_ids[t]
    if dtype == "float32":
        top = sorted((lp.logprob for lp in r.logprobs[t].values() if lp.rank in (1, 2)), reverse=True)
        gap = top[0] - top[1] if len(top) == 2 else float("inf")
        return gap < FP32_NEAR_TIE, f"reference top-2 gap {gap:.2e}"
    rank_in_ref, rank_in_ours = _rank(r.logprobs[t], ours), _rank(o.logprobs[t], theirs)
    ok = all(rank is not None and rank <= LOGPROBS for rank in (rank_in_ref, rank_in_ours))
    return ok, f"ours ranked {rank_in_ref} by the reference, its token ranked {rank_in_ours} by ours"


def agreement(outputs, reference, dtype: str) -> tuple[int, int, list[str]]:
    """(streams that agree, streams, where the others diverge)."""
    ok = total = 0
    diverged = []
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        for o, r in zip(out.outputs, ref.outputs):
            total += 1
            first = first_divergence(o.token_ids, r.token_ids)
            if first is None:
                ok += 1
                continue
            fine, seen = forgiven(o, r, first, dtype)
            ok += fine
            if not fine:
                diverged.append(f"prompt {i} token {first} ({seen})")
    return ok, total, diverged


@dataclass(frozen=True)
class Case:
    model: str
    backend: str
    graphs: bool
    tp: int = 1
    env: dict = field(default_factory=dict)  # old paths
    dtype: str = "bfloat16"

    def __str__(self) -> str:
        env = " ".join(f"{k.removeprefix('NANOSERVE_TRITON_')}={v}" for k, v in self.env.items())
        graphs = "on " if self.graphs else "off"
        dtype = "fp32" if self.dtype == "float32" else "bf16"
        return f"{self.model:<10} {self.backend:<10} {dtype} graphs {graphs} tp {self.tp} {env}".rstrip()


def plan(num_gpus: int, flash_attn_reason: str | None) -> tuple[list[Case], list[tuple[Case, str]]]:
    """The rows to run here, and the rows skipped with the reason."""
    wanted = [Case(m, b, g, tp) for m in ("dense-d128", "moe-d128") for b in BACKENDS
              for g in (False, True) for tp in (1, 2)]
    wanted += [Case(f"dense-d{d}", b, True) for d in (64, 80, 96, 256) for b in ("triton", "flash_attn")]
    wanted += [Case(m, "triton", g, dtype="float32") for m in ("dense-d128", "moe-d128") for g in (False, True)]
    wanted += [Case(f"dense-d{d}", "triton", True, dtype="float32") for d in (64, 80, 96, 256)]
    wanted += [Case("moe-d128" if "MOE" in next(iter(env)) else "dense-d128", "triton", True, 1, env)
               for env in OLD_PATHS]
    wanted += [Case("long-d128", b, True, 1, env) for b, env in
               (("triton", {}), ("flash_attn", {}), ("triton", OLD_PATHS[1]))]
    run, skipped = [], []
    for case in wanted:
        if case.tp > num_gpus:
            skipped.append((case, f"needs {case.tp} GPUs, {num_gpus} here"))
        elif case.backend == "flash_attn" and flash_attn_reason:
            skipped.append((case, flash_attn_reason))
        elif case.backend == "torch" and case.graphs:
            skipped.append((case, "the torch backend on CUDA runs eagerly: same as graphs off"))
        else:
            run.append(case)
    return run, skipped


def workload(model: str, vocab: int) -> tuple[list[list[int]], dict]:
    """Prompts and engine settings: prefix sharing, chunked prefill and a long prompt for the usual
    models; a prompt past 8k tokens on a cache of BIG_CACHE_BLOCKS for long-d128."""
    if model == "long-d128":
        g = torch.Generator().manual_seed(1)
        reqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (LONG_PROMPT, 50)]
        return reqs, dict(max_model_len=16384, max_num_batched_tokens=2048, kvcache_block_size=256)
    return prompts(vocab), dict(max_model_len=1536, max_num_batched_tokens=512)


def use_the_last_blocks(llm: LLM, keep: int) -> None:
    """Let the next allocations take the cache's last `keep` blocks (offsets past 2^31 elements)."""
    queue = llm.engine.block_manager.pool.free_queue
    for block_id in list(queue)[:-keep]:
        queue.move_to_end(block_id)


def run_case(case: Case, path: str, reqs, params, settings: dict, reference) -> str:
    kw = {"max_num_seqs": 32, **settings}
    if case.model == "long-d128":  # max_num_seqs x blocks per sequence must not cap the cache
        kw.update(num_kvcache_blocks=BIG_CACHE_BLOCKS, max_num_seqs=256)
    elif case.backend == "flash_attn":
        kw.update(kvcache_block_size=256)
    try:
        # The switches are read at engine start; TP workers inherit them.
        with mock.patch.dict(os.environ, case.env), LLM(path, dtype=case.dtype, attention_backend=case.backend,
                                        enforce_eager=not case.graphs, tensor_parallel_size=case.tp, **kw) as llm:
            if case.model == "long-d128":
                assert llm.engine.model_runner.kv_cache[0, 0].numel() > 2**31, "the cache is not past 2^31 elements"
                use_the_last_blocks(llm, LAST_BLOCKS)
            start = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
    except Exception as e:  # a row per failure: the table is the point
        return f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:80]}  ({traceback.extract_tb(e.__traceback__)[-1].name})"
    ok, total, diverged = agreement(outs, reference, case.dtype)
    where = f"; {', '.join(diverged[:3])}" if diverged else ""
    return f"{'ok' if ok == total else 'MISMATCH'}: {ok}/{total} streams agree ({elapsed:.1f} s){where}"


HF_ARCHS = ("qwen3", "llama", "qwen2", "mistral", "qwen3_moe")  # their tiny random configs (tiny_configs.py)


@torch.inference_mode()
def hf_greedy(path: str, reqs: list[list[int]], max_tokens: int, device: str) -> list[tuple[list[int], list[float]]]:
    """HF transformers' own model, float32 on `device`: each prompt's greedy tokens and the gap
    between its top-2 logits at every step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    answers = []
    for prompt in reqs:
        out = model.generate(torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        gaps = [float(top[0] - top[1]) for top in (step[0].float().topk(2).values for step in out.logits)]
        answers.append((out.sequences[0, len(prompt):].tolist(), gaps))
    return answers


def hf_parity(device: str = "cuda", backends=("torch", "triton"), graphs=(False, True), archs=HF_ARCHS,
              max_tokens: int = 16) -> list[tuple[str, str]]:
    """float32 greedy tokens of every architecture against HF's model on the same device (TF32 off),
    token for token (a reference top-2 gap under FP32_NEAR_TIE forgives a divergence), each batch
    twice so the second run hits the prefix cache, every KV block free afterwards: (row, result)."""
    with tf32_off():
        return _hf_parity_rows(device, backends, graphs, archs, max_tokens)


@contextlib.contextmanager
def tf32_off():
    """float32 matmuls in float32 (HF and the engine alike), the caller's settings back after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _hf_parity_rows(device: str, backends, graphs, archs, max_tokens: int) -> list[tuple[str, str]]:
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 900, (40,), generator=g).tolist()
    reqs = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (1, 7, 64, 200)]
    reqs += [shared + torch.randint(3, 900, (n,), generator=g).tolist() for n in (3, 30)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    rows = []
    for arch in archs:
        path = ensure_tiny_checkpoint(f"smoke-hf-{arch}", arch)
        reference = hf_greedy(path, reqs, max_tokens, device)
        for backend, graph in ((b, g) for b in backends for g in graphs if not (b == "torch" and g)):
            name = getattr(backend, "__name__", backend)  # a name or a Backend subclass
            label = f"{arch:<10} {name:<10} fp32 graphs {'on ' if graph else 'off'} vs HF"
            try:
                with LLM(path, device=device, dtype="float32", attention_backend=backend, enforce_eager=not graph,
                         kvcache_block_size=16, max_model_len=512, max_num_batched_tokens=128) as llm:
                    runs = [llm.generate(reqs, params, use_tqdm=False) for _ in range(2)]
                    held = sum(block.ref_count > 0 for block in llm.engine.block_manager.pool.blocks)
            except Exception as e:  # a row per failure
                rows.append((label, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                continue
            rows.append((label, verdict(runs, reference, held)))
    return rows


def verdict(runs, reference, held: int) -> str:
    """Each run's greedy tokens against HF's (a top-2 gap under FP32_NEAR_TIE forgives a divergence)
    and no KV block held once the engine is idle."""
    diverged = []
    for outs in runs:
        for i, (out, (tokens, gaps)) in enumerate(zip(outs, reference)):
            t = first_divergence(out.outputs[0].token_ids, tokens)
            if t is not None and gaps[t] >= FP32_NEAR_TIE:
                diverged.append(f"prompt {i} token {t} (HF top-2 gap {gaps[t]:.2e})")
    ok = not diverged and not held
    detail = f"; {', '.join(diverged[:3])}" if diverged else f"; {held} KV blocks still held" if held else ""
    return f"{'ok' if ok else 'MISMATCH'}: {len(reference)} prompts x {len(runs)} runs{detail}"


QUANTIZED_FORMATS = {  # row name -> (nanoserve.quantization.pack kind, options): the layouts its tools write
    "gptq": ("gptq", {}),
    "gptq-act-order": ("gptq", dict(sym=False, act_order=True)),
    "awq": ("awq", {}),
    "ct-w4a16": ("ct-pack", {}),
    "ct-w8a8": ("ct-int8", dict(w8a8=True)),
    "fp8": ("fp8", dict(block=(16, 32))),
}


def quantized_parity(device: str = "cuda", backends=("triton",), formats=tuple(QUANTIZED_FORMATS),
                     max_tokens: int = 16) -> list[tuple[str, str]]:
    """Each pre-quantized checkpoint format loaded on `device` (where a non-CPU backend dequantizes
    it once at load): float32 greedy tokens against HF's model on the float twin the packer wrote,
    the very weights its integers stand for, token for token: (row, result)."""
    g = torch.Generator().manual_seed(3)
    reqs = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (1, 9, 70)]
    source = ensure_tiny_checkpoint("smoke-hf-qwen3", "qwen3")
    rows = []
    with tf32_off():
        for name in formats:
            for backend in backends:
                label = f"{name:<14} {getattr(backend, '__name__', backend):<10} fp32 vs HF on its float weights"
                try:
                    result = _quantized_row(name, source, reqs, backend, device, max_tokens)
                except Exception as e:  # a row per failure
                    result = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                rows.append((label, result))
    return rows


def _quantized_row(name: str, source: str, reqs, backend, device: str, max_tokens: int) -> str:
    from nanoserve.quantization.pack import write_quantized_checkpoint

    kind, options = QUANTIZED_FORMATS[name]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    with tempfile.TemporaryDirectory() as tmp:
        path, twin = os.path.join(tmp, name), os.path.join(tmp, "float")
        write_quantized_checkpoint(source, path, kind, twin, **options)
        reference = hf_greedy(twin, reqs, max_tokens, device)
        with LLM(path, device=device, dtype="float32", attention_backend=backend, kvcache_block_size=16,
                 max_model_len=256) as llm:
            runs = [llm.generate(reqs, params, use_tqdm=False)]
            held = sum(block.ref_count > 0 for block in llm.engine.block_manager.pool.blocks)
    return verdict(runs, reference, held)


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
    parser.add_argument("--plan", action="store_true", help="list the rows for 2 GPUs with flash-attn, run nothing")
    args = parser.parse_args(argv)
    if args.plan:
        for case in plan(2, None)[0]:
            print(case)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to smoke-test (the CPU path is covered by the test suite)")
        return 0
    from nanoserve.kernels.flash_attn import flash_attn_unusable_reason

    print(f"GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}")
    cases, skipped = plan(torch.cuda.device_count(), flash_attn_unusable_reason())
    rows = []
    for model in dict.fromkeys(case.model for case in cases):
        arch, config = MODELS[model]
        path = ensure_tiny_checkpoint(f"smoke-{model}", arch, **config)
        reqs, settings = workload(model, 900)
        params = SamplingParams(temperature=0, max_tokens=24 if model != "long-d128" else 16, ignore_eos=True,
                                n=2, logprobs=LOGPROBS)
        ref_kw = {**settings, "num_kvcache_blocks": 200} if model == "long-d128" else settings
        for dtype in dict.fromkeys(case.dtype for case in cases if case.model == model):
            with LLM(path, dtype=dtype, attention_backend="torch", enforce_eager=True, **ref_kw) as ref_llm:
                reference = ref_llm.generate(reqs, params, use_tqdm=False)
            for case in (c for c in cases if c.model == model and c.dtype == dtype):
                rows.append((case, run_case(case, path, reqs, params, settings, reference)))
                print(f"{case}  {rows[-1][1]}", flush=True)
    for parity in (hf_parity, quantized_parity):  # hf_parity's rows printed before the next one runs
        for label, status in parity():
            rows.append((label, status))
            print(f"{label}  {status}", flush=True)
    print("\n| row | result |\n|---|---|")
    for case, status in rows:
        print(f"| {case} | {status} |")
    for case, reason in skipped:
        print(f"| {case} | skipped: {reason} |")
    if args.requests:
        print(f"\nthroughput: {throughput(args.requests)}")
    return 1 if any(s.startswith(("ERROR", "MISMATCH")) for _, s in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

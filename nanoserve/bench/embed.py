"""`bench.py --workload embed`: documents per second, nanoserve's LLM.embed vs sentence-transformers.

Two sets of texts, both sides given the same strings and tokenizing them the same way:
- a corpus of `--num-seqs` documents of `--input-len MIN MAX` tokens (decoded random token ids);
- as many queries, each Qwen3-Embedding's instruction ("Instruct: ...\\nQuery: ") before a short
  query, run with nanoserve's prefix cache on and off (its hit rate and the speed ratio).
sentence-transformers runs at each batch size of `--st-batch-sizes` and its best is compared.
Each side runs in its fastest dtype here (nanoserve: --dtype, bf16 by default, whose weights run
the panel GEMM with float32 math on AVX2; sentence-transformers and vLLM: float32 on AVX2-only
CPUs, where their bf16 `F.linear` crawls, else bf16), `--repeat` times, median. Each side's
vectors are checked against the other's (min cosine). With no --model the bench builds (once) a random-weight
checkpoint of Qwen3-Embedding-0.6B's exact shape with sentence-transformers files. With
--compare vllm, vLLM's `runner="pooling"` embeds the same texts, median of --repeat.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import numpy as np
import torch

from nanoserve import LLM
from nanoserve.bench.machine import _cpuinfo, describe_machine, engine_description, machine_info
from nanoserve.bench.peers import PeerUnavailable
from nanoserve.bench.peers.start import make_vllm_peer, peer_settings, start_vllm
from nanoserve.bench.report import finish_report
from nanoserve.utils.tiny_configs import QWEN3_0_6B
from nanoserve.utils.tiny_embedding import ensure_tiny_embedding_checkpoint

INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
DEFAULT_ST_BATCH_SIZES = (4, 16, 32)
QUERY_LEN = (4, 24)  # tokens of each query after the instruction


def resolve_embedding_model(model: str | None, arch: str | None) -> str:
    if model is not None:
        return model
    if arch not in (None, "qwen3-0.6b"):
        raise ValueError("--workload embed builds Qwen3-Embedding-0.6B's shape only; pass --model for another")
    print("building/using the random-weight Qwen3-Embedding-0.6B checkpoint ...", flush=True)
    shape = {k: v for k, v in QWEN3_0_6B.items() if k != "torch_dtype"}
    return ensure_tiny_embedding_checkpoint("qwen3-embedding-0.6b-random", dtype="bfloat16", **shape)


def make_texts(tokenizer, num: int, length: tuple[int, int], seed: int, prefix: str = "") -> list[str]:
    """Texts whose token counts fall about uniformly in `length` (decoded random ordinary tokens,
    re-tokenized and cut back to the drawn length, since decoded ids re-tokenize differently)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(min(len(tokenizer), 10000)) if i not in special]
    texts = []
    for _ in range(num):
        n = rng.randint(*length)
        text = tokenizer.decode([rng.choice(ordinary) for _ in range(n)])
        texts.append(prefix + tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:n]))
    return texts


def _peer_dtype(device: torch.device) -> str:
    """sentence-transformers' (and vLLM's) fastest dtype: bf16 only where the CPU has bf16 dot
    products (or on CUDA); on AVX2-only CPUs their bf16 `F.linear` crawls, so float32."""
    if device.type == "cuda" or "avx512_bf16" in _cpuinfo()[1]:
        return "bfloat16"
    return "float32"


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _nanoserve(args, model: str, dtype: str, prefix_caching: bool) -> LLM:
    kwargs = dict(device=args.device, dtype=dtype, runner="pooling", enable_prefix_caching=prefix_caching,
                  max_model_len=args.max_model_len or 1024, seed=args.seed)
    for key, arg in (("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                     ("num_kvcache_blocks", "num_kvcache_blocks"), ("kvcache_block_size", "block_size")):
        if getattr(args, arg) is not None:
            kwargs[key] = getattr(args, arg)
    return LLM(model, **kwargs)


def _embed(llm: LLM, texts: list[str]) -> tuple[np.ndarray, float, float]:
    """(vectors, wall seconds, this run's prefix-cache hit rate); each run starts with an empty cache."""
    llm.reset_prefix_cache()
    before = llm.prefix_cache_stats
    outs, wall = _timed(lambda: llm.embed(texts, use_tqdm=False))
    after = llm.prefix_cache_stats
    queried = after["queries"] - before["queries"]
    hit_rate = (after["hits"] - before["hits"]) / queried if queried else 0.0
    return np.array([o.outputs.embedding for o in outs], dtype=np.float32), wall, hit_rate


def _st_best(st, texts: list[str], batch_sizes, repeat: int) -> tuple[np.ndarray, int, float, dict]:
    """(vectors, best batch size, its median wall, every size's median)."""
    walls: dict[int, float] = {}
    vectors = None
    for bs in batch_sizes:
        runs = []
        for _ in range(repeat):
            vectors, wall = _timed(lambda: st.encode(texts, batch_size=bs, convert_to_numpy=True))
            runs.append(wall)
        walls[bs] = statistics.median(runs)
    best = min(walls, key=walls.get)
    return vectors, best, walls[best], walls


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def _vs_vllm(args: argparse.Namespace, settings, docs: list[str], queries: list[str], report: dict) -> dict:
    """vLLM's pooling runner on the same texts: docs/s and queries/s, median of --repeat each."""
    peer = make_vllm_peer(args, settings, [], task="embed", payloads=[{"text": d} for d in docs],
                          request_sets={"queries": [{"text": q} for q in queries]})
    try:
        start_vllm(peer)
        walls: dict[str, list[float]] = {"docs": [], "queries": []}
        for _ in range(args.repeat):
            for name in walls:
                result = peer.run_raw(None if name == "docs" else name)
                walls[name].append(result["wall_s"])
    except PeerUnavailable as e:
        print(f"[vllm] skipped: {e}", flush=True)
        return {"skipped": str(e)}
    finally:
        peer.close()
    out = {"version": peer.version, "dtype": peer.settings.dtype,
           "docs_per_s": len(docs) / statistics.median(walls["docs"]),
           "queries_per_s": len(queries) / statistics.median(walls["queries"])}
    out["nanoserve_speedup_docs"] = report["nanoserve_docs_per_s"] / out["docs_per_s"]
    out["nanoserve_speedup_queries"] = report["nanoserve_queries_per_s_cache_on"] / out["queries_per_s"]
    print(f"| vLLM {peer.version} pooling ({peer.settings.dtype}) | docs/s {out['docs_per_s']:.2f} (nanoserve "
          f"{out['nanoserve_speedup_docs']:.2f}x) | queries/s {out['queries_per_s']:.2f} (nanoserve "
          f"{out['nanoserve_speedup_queries']:.2f}x) |", flush=True)
    return out


def run_embed_bench(args: argparse.Namespace) -> dict:
    model = resolve_embedding_model(args.model, args.arch)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    # Each side in its fastest dtype on this machine: nanoserve's --dtype (bf16 weights run its panel
    # GEMM with float32 math on AVX2), the peers' _peer_dtype.
    dtype = _peer_dtype(device) if args.dtype == "auto" else args.dtype
    st_dtype = _peer_dtype(device)
    report: dict = {"args": dict(vars(args)), "machine": machine_info(device), "dtype": dtype, "st_dtype": st_dtype,
                    "model": model}
    print(describe_machine(report["machine"]), flush=True)
    llm = _nanoserve(args, model, dtype, prefix_caching=not args.no_prefix_caching)
    report["engine"] = engine_description(llm)
    settings = peer_settings(args, llm) if "vllm" in args.compare else None
    tok = llm.get_tokenizer()
    docs = make_texts(tok, args.num_seqs, tuple(args.input_len), args.seed)
    queries = make_texts(tok, args.num_seqs, QUERY_LEN, args.seed + 1, prefix=INSTRUCTION)
    doc_tokens = [len(tok.encode(d)) for d in docs]
    print(f"workload embed: {len(docs)} documents ({min(doc_tokens)}-{max(doc_tokens)} tokens, "
          f"{sum(doc_tokens)} in all) and {len(queries)} queries sharing a "
          f"{len(tok.encode(INSTRUCTION)) - 1}-token instruction; {dtype} on {device}, {torch.get_num_threads()} "
          f"threads; model {model}", flush=True)
    if not args.no_warmup:
        llm.embed(docs[:2], use_tqdm=False)

    ours_docs, ours_q_on = [], []
    for i in range(args.repeat):
        vecs, wall, _ = _embed(llm, docs)
        ours_docs.append(wall)
        q_vecs, q_wall, hit_rate = _embed(llm, queries)
        ours_q_on.append(q_wall)
        print(f"[nanoserve] run {i + 1}/{args.repeat}: corpus {len(docs) / wall:.2f} docs/s, queries "
              f"{len(queries) / q_wall:.2f} q/s (prefix cache hit rate {hit_rate:.1%})", flush=True)
    del llm
    gc.collect()
    off = _nanoserve(args, model, dtype, prefix_caching=False)
    ours_q_off = []
    for _ in range(args.repeat):
        q_off_vecs, q_wall, _ = _embed(off, queries)
        ours_q_off.append(q_wall)
    del off
    gc.collect()

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device=str(device), model_kwargs={"dtype": getattr(torch, st_dtype)})
    sizes = tuple(args.st_batch_sizes or DEFAULT_ST_BATCH_SIZES)
    st_docs, bs_docs, st_docs_wall, st_doc_walls = _st_best(st, docs, sizes, args.repeat)
    st_q, bs_q, st_q_wall, _ = _st_best(st, queries, sizes, args.repeat)

    ours_doc_s = len(docs) / statistics.median(ours_docs)
    report.update({
        "nanoserve_docs_per_s": ours_doc_s,
        "nanoserve_queries_per_s_cache_on": len(queries) / statistics.median(ours_q_on),
        "nanoserve_queries_per_s_cache_off": len(queries) / statistics.median(ours_q_off),
        "query_prefix_cache_hit_rate": hit_rate,
        "st_docs_per_s": len(docs) / st_docs_wall, "st_best_batch_size_docs": bs_docs,
        "st_docs_walls_by_batch_size": st_doc_walls,
        "st_queries_per_s": len(queries) / st_q_wall, "st_best_batch_size_queries": bs_q,
        "min_cosine_docs": _min_cosine(vecs, st_docs), "min_cosine_queries": _min_cosine(q_vecs, st_q),
        "min_cosine_cache_on_vs_off": _min_cosine(q_vecs, q_off_vecs),
    })
    r = report
    print(f"\n| median of {args.repeat} | nanoserve ({dtype}) | sentence-transformers ({st_dtype}, best batch) | "
          f"ratio |\n"
          f"|---|---|---|---|\n"
          f"| corpus docs/s | {r['nanoserve_docs_per_s']:.2f} | {r['st_docs_per_s']:.2f} (batch {bs_docs}) | "
          f"{r['nanoserve_docs_per_s'] / r['st_docs_per_s']:.2f}x |\n"
          f"| queries/s, prefix cache on | {r['nanoserve_queries_per_s_cache_on']:.2f} | "
          f"{r['st_queries_per_s']:.2f} (batch {bs_q}) | "
          f"{r['nanoserve_queries_per_s_cache_on'] / r['st_queries_per_s']:.2f}x |\n"
          f"| queries/s, prefix cache off | {r['nanoserve_queries_per_s_cache_off']:.2f} | | |")
    if settings is not None:
        report["vllm"] = _vs_vllm(args, settings, docs, queries, report)
    cache_ratio = r["nanoserve_queries_per_s_cache_on"] / r["nanoserve_queries_per_s_cache_off"]
    print(f"prefix cache on vs off (queries): {cache_ratio:.2f}x "
          f"at hit rate {hit_rate:.1%}; min cosine vs sentence-transformers: docs {r['min_cosine_docs']:.6f}, "
          f"queries {r['min_cosine_queries']:.6f}")
    return finish_report(args, report)

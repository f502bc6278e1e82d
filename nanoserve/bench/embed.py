"""`bench.py --workload embed`: documents per second, nanoserve's LLM.embed vs sentence-transformers.

Two sets of texts, both sides given the same strings and tokenizing them the same way:
- a corpus of `--num-seqs` documents of `--input-len MIN MAX` tokens (decoded random token ids);
- as many queries, each Qwen3-Embedding's instruction ("Instruct: ...\\nQuery: ") before a short
  query, run with nanoserve's prefix cache on and off (its hit rate and the speed ratio).
sentence-transformers runs at each batch size of `--st-batch-sizes` and its best is compared.
Each side runs in its fastest dtype here (nanoserve: --dtype, bf16 by default, whose weights run
the panel GEMM with float32 math on AVX2; sentence-transformers and vLLM: float32 on AVX2-only
CPUs, where their bf16 `F.linear` crawls, else bf16). The sides run in `--repeat` interleaved
rounds (each side's corpus and queries, one side after the other, every round), each side's
median is reported: the machine's speed drifts, and every side sees the same drift. Each side's
vectors are checked against the other's (min cosine). With no --model the bench builds (once) a random-weight
checkpoint of Qwen3-Embedding-0.6B's exact shape with sentence-transformers files. With
--compare vllm, vLLM's `runner="pooling"` (started first: it compiles for minutes) is one more side.
"""
from __future__ import annotations

import argparse
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
    # 1 GiB of KV holds the whole default corpus: the bench keeps two engines, sentence-transformers
    # and vLLM in memory at once, and the CPU default (4 GiB each) left vLLM's process to the OOM killer.
    kwargs = dict(device=args.device, dtype=dtype, runner="pooling", enable_prefix_caching=prefix_caching,
                  max_model_len=args.max_model_len or 1024, seed=args.seed, cpu_kvcache_space_gib=1.0)
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


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def _start_vllm(args: argparse.Namespace, settings, docs: list[str], queries: list[str]):
    """vLLM's pooling runner on the same texts, started before the rounds (it compiles for minutes);
    None with the reason printed if it cannot run."""
    peer = make_vllm_peer(args, settings, [], task="embed", payloads=[{"text": d} for d in docs],
                          request_sets={"queries": [{"text": q} for q in queries]})
    try:
        start_vllm(peer)
    except PeerUnavailable as e:
        print(f"[vllm] skipped: {e}", flush=True)
        return None, str(e)
    return peer, None


def _rounds(args, sides: dict, docs: list[str], queries: list[str]) -> tuple[dict, dict]:
    """--repeat rounds; in each, every side embeds the corpus and then the queries, one after the
    other, so a change in the machine's speed (it moves by up to 20% here) reaches every side alike.
    Returns ({(side, set): [walls]}, each side's last vectors and hit rates)."""
    walls: dict[tuple[str, str], list[float]] = {}
    last: dict = {}
    for r in range(args.repeat):
        line = []
        for name, run in sides.items():
            for set_name, texts in (("docs", docs), ("queries", queries)):
                if (name, set_name) not in run:
                    continue
                result = run[name, set_name](texts)
                walls.setdefault((name, set_name), []).append(result["wall"])
                last[name, set_name] = result
                line.append(f"{name} {set_name} {len(texts) / result['wall']:.2f}/s")
        print(f"[round {r + 1}/{args.repeat}] " + ", ".join(line), flush=True)
    return walls, last


def _side_runs(llm: LLM, off: LLM, st, sizes, peer) -> dict:
    """Each side's run functions: texts -> {"wall", and where known "vectors", "hit_rate"}."""
    def ours(engine):
        def run(texts):
            vectors, wall, hit_rate = _embed(engine, texts)
            return {"wall": wall, "vectors": vectors, "hit_rate": hit_rate}
        return run

    def st_run(batch_size):
        def run(texts):
            vectors, wall = _timed(lambda: st.encode(texts, batch_size=batch_size, convert_to_numpy=True))
            return {"wall": wall, "vectors": vectors}
        return run

    def vllm_run(request_set):
        return lambda texts: {"wall": peer.run_raw(request_set)["wall_s"]}

    sides = {"nanoserve": {("nanoserve", "docs"): ours(llm), ("nanoserve", "queries"): ours(llm)},
             "nanoserve-cache-off": {("nanoserve-cache-off", "queries"): ours(off)}}
    for bs in sizes:
        sides[f"st-batch{bs}"] = {(f"st-batch{bs}", "docs"): st_run(bs), (f"st-batch{bs}", "queries"): st_run(bs)}
    if peer is not None:
        sides["vllm"] = {("vllm", "docs"): vllm_run(None), ("vllm", "queries"): vllm_run("queries")}
    return sides


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
    off = _nanoserve(args, model, dtype, prefix_caching=False)
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

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device=str(device), model_kwargs={"dtype": getattr(torch, st_dtype)})
    sizes = tuple(args.st_batch_sizes or DEFAULT_ST_BATCH_SIZES)
    peer, peer_skipped = _start_vllm(args, settings, docs, queries) if settings is not None else (None, None)
    try:
        if not args.no_warmup:
            for engine in (llm, off):
                engine.embed(docs[:2], use_tqdm=False)
            st.encode(docs[:2], batch_size=2)
        walls, last = _rounds(args, _side_runs(llm, off, st, sizes, peer), docs, queries)
    finally:
        if peer is not None:
            peer.close()
    per_s = {key: len(docs if key[1] == "docs" else queries) / statistics.median(w) for key, w in walls.items()}
    bs_docs = max(sizes, key=lambda bs: per_s[f"st-batch{bs}", "docs"])
    bs_q = max(sizes, key=lambda bs: per_s[f"st-batch{bs}", "queries"])
    hit_rate = last["nanoserve", "queries"]["hit_rate"]
    report.update({
        "nanoserve_docs_per_s": per_s["nanoserve", "docs"],
        "nanoserve_queries_per_s_cache_on": per_s["nanoserve", "queries"],
        "nanoserve_queries_per_s_cache_off": per_s["nanoserve-cache-off", "queries"],
        "query_prefix_cache_hit_rate": hit_rate,
        "st_docs_per_s": per_s[f"st-batch{bs_docs}", "docs"], "st_best_batch_size_docs": bs_docs,
        "st_docs_per_s_by_batch_size": {bs: per_s[f"st-batch{bs}", "docs"] for bs in sizes},
        "st_queries_per_s": per_s[f"st-batch{bs_q}", "queries"], "st_best_batch_size_queries": bs_q,
        "min_cosine_docs": _min_cosine(last["nanoserve", "docs"]["vectors"],
                                       last[f"st-batch{bs_docs}", "docs"]["vectors"]),
        "min_cosine_queries": _min_cosine(last["nanoserve", "queries"]["vectors"],
                                          last[f"st-batch{bs_q}", "queries"]["vectors"]),
        "min_cosine_cache_on_vs_off": _min_cosine(last["nanoserve", "queries"]["vectors"],
                                                  last["nanoserve-cache-off", "queries"]["vectors"]),
    })
    if settings is not None:
        report["vllm"] = {"skipped": peer_skipped} if peer is None else {
            "version": peer.version, "dtype": peer.settings.dtype,
            "docs_per_s": per_s["vllm", "docs"], "queries_per_s": per_s["vllm", "queries"],
            "nanoserve_speedup_docs": per_s["nanoserve", "docs"] / per_s["vllm", "docs"],
            "nanoserve_speedup_queries": per_s["nanoserve", "queries"] / per_s["vllm", "queries"],
        }
    _print_table(report, dtype, st_dtype, args.repeat)
    return finish_report(args, report)


def _print_table(r: dict, dtype: str, st_dtype: str, repeat: int) -> None:
    vllm = r.get("vllm") or {}
    has_vllm = "docs_per_s" in vllm
    head = f"| median of {repeat} rounds | nanoserve ({dtype}) | sentence-transformers ({st_dtype}, best batch) |"
    print("\n" + head + (f" vLLM {vllm['version']} pooling ({vllm['dtype']}) |" if has_vllm else ""))
    print("|---|---|---|" + ("---|" if has_vllm else ""))
    st_docs = r["st_docs_per_s"]
    row = (f"| corpus docs/s | {r['nanoserve_docs_per_s']:.3f} | {st_docs:.3f} (batch {r['st_best_batch_size_docs']}) "
           f"= nanoserve {r['nanoserve_docs_per_s'] / st_docs:.2f}x |")
    if has_vllm:
        row += f" {vllm['docs_per_s']:.3f} = nanoserve {vllm['nanoserve_speedup_docs']:.2f}x |"
    print(row)
    st_q = r["st_queries_per_s"]
    row = (f"| queries/s, prefix cache on ({r['query_prefix_cache_hit_rate']:.1%} hits) | "
           f"{r['nanoserve_queries_per_s_cache_on']:.2f} | {st_q:.2f} (batch {r['st_best_batch_size_queries']}) "
           f"= nanoserve {r['nanoserve_queries_per_s_cache_on'] / st_q:.2f}x |")
    if has_vllm:
        row += f" {vllm['queries_per_s']:.2f} = nanoserve {vllm['nanoserve_speedup_queries']:.2f}x |"
    print(row)
    off = r["nanoserve_queries_per_s_cache_off"]
    print(f"| queries/s, prefix cache off | {off:.2f} | |" + (" |" if has_vllm else ""))
    cache_ratio = r["nanoserve_queries_per_s_cache_on"] / r["nanoserve_queries_per_s_cache_off"]
    print(f"prefix cache on vs off (queries): {cache_ratio:.2f}x at hit rate {r['query_prefix_cache_hit_rate']:.1%}; "
          f"min cosine vs sentence-transformers: docs {r['min_cosine_docs']:.6f}, "
          f"queries {r['min_cosine_queries']:.6f}",
          flush=True)

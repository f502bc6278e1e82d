"""Start the peers asked for with --compare on nanoserve's settings; skip, with the reason, any that cannot run."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from nanoserve import LLM
from nanoserve.bench.machine import _cpuinfo
from nanoserve.bench.peers import PeerSettings, PeerUnavailable
from nanoserve.bench.roofline import Roofline
from nanoserve.bench.workloads import Request

# vLLM's peer settings of /work/shared/PEERS.md use max_model_len=1024; longer workloads need more.
VLLM_MIN_MODEL_LEN = 1024


def peer_settings(args: argparse.Namespace, llm: LLM) -> PeerSettings:
    """The peers' side of a fair comparison: nanoserve's checkpoint, dtype, threads and limits."""
    return PeerSettings(
        model=llm.config.model, dtype=str(llm.engine.model_runner.dtype).removeprefix("torch."),
        device=llm.engine.device.type, threads=torch.get_num_threads(), seed=args.seed,
        temperature=args.temperature, max_model_len=llm.config.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=llm.config.enable_prefix_caching, warmup=not args.no_warmup,
    )


def vllm_dtype(requested: str, ours: str, device: str) -> str:
    """vLLM's dtype for a comparison: `requested`, or with "auto" its fastest on this machine
    (PEERS.md): float32 on a CPU without bf16 dot products, where its bf16 GEMM falls back to a
    slow F.linear; else the dtype nanoserve runs."""
    if requested != "auto":
        return requested
    if device == "cpu" and ours == "bfloat16" and "avx512_bf16" not in _cpuinfo()[1]:
        return "float32"
    return ours


def _max_positions(model: str) -> int:
    """The longest input the checkpoint declares: config.json's positions and, for a
    sentence-transformers checkpoint, its max_seq_length (vLLM takes the smaller)."""
    limits = []
    for name, key in (("config.json", "max_position_embeddings"), ("sentence_bert_config.json", "max_seq_length")):
        path = os.path.join(model, name)
        if os.path.exists(path):
            with open(path) as f:
                limits.append(json.load(f).get(key))
    return min((x for x in limits if x), default=1 << 30)


def make_vllm_peer(args: argparse.Namespace, settings: PeerSettings, requests: list[Request],
                   roof: Roofline | None = None, **task):
    """vLLM on nanoserve's settings (its fastest dtype here, at least PEERS.md's model length);
    `task`: VLLMPeer's task, payloads and request_sets."""
    from nanoserve.bench.peers.vllm import VLLMPeer

    max_model_len = max(VLLM_MIN_MODEL_LEN, settings.max_model_len)
    if task.get("task") == "embed":  # an embedding checkpoint's own limit: vLLM refuses a longer one
        max_model_len = min(settings.max_model_len, _max_positions(settings.model))
    settings = dataclasses.replace(settings, max_model_len=max_model_len,
                                   dtype=vllm_dtype(args.vllm_dtype, settings.dtype, settings.device))
    return VLLMPeer(settings, requests, args.vllm_python, args.vllm_kv_cache_gib, args.vllm_timeout, roof, **task)


def start_vllm(peer) -> None:
    """Start one vLLM peer, printing its notes; PeerUnavailable (peer closed) if it cannot run."""
    print(f"[vllm] starting ({peer.task}, {peer.settings.dtype}) ...", flush=True)
    try:
        for note in peer.start() or []:
            print(f"[{peer.name}] {note}", flush=True)
    except PeerUnavailable:
        peer.close()
        raise


def _make(kind: str, args: argparse.Namespace, settings: PeerSettings, requests: list[Request],
          roof: Roofline | None) -> list:
    if kind == "hf":
        from nanoserve.bench.peers.hf import hf_peers

        paths = [p.strip() for p in args.hf_paths.split(",") if p.strip()]
        return hf_peers(settings, requests, paths, args.hf_batch_size, roof)
    if kind == "llamacpp":
        from nanoserve.bench.peers.llamacpp import llamacpp_peers

        if args.llamacpp_model:  # a pre-quantized --model: llama.cpp converts its float source instead
            settings = dataclasses.replace(settings, model=args.llamacpp_model)
        return llamacpp_peers(settings, requests, args.llamacpp_quants, args.llamacpp_dir, args.llamacpp_source, roof)
    return [make_vllm_peer(args, settings, requests, roof)]


def start_peers(args: argparse.Namespace, llm: LLM, requests: list[Request], roof: Roofline | None,
                report: dict) -> list:
    """Every peer of --compare, loaded and warmed up; the ones that cannot run are reported and left out."""
    settings = peer_settings(args, llm)
    started = []
    for kind in args.compare or []:
        print(f"[{kind}] starting ...", flush=True)
        peers = []
        try:
            peers = _make(kind, args, settings, requests, roof)
            for peer in peers:
                for note in peer.start() or []:
                    print(f"[{peer.name}] {note}", flush=True)
                started.append(peer)
        except PeerUnavailable as e:
            print(f"[{kind}] skipped: {e}", flush=True)
            report.setdefault("peers_skipped", {})[kind] = str(e)
            close_peers([p for p in peers if p not in started])
    return started


def close_peers(peers: list) -> None:
    for peer in peers:
        peer.close()

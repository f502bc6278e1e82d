"""Start the peers asked for with --compare on nanoserve's settings; skip, with the reason, any that cannot run."""
from __future__ import annotations

import argparse
import dataclasses

import torch

from nanoserve import LLM
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


def _make(kind: str, args: argparse.Namespace, settings: PeerSettings, requests: list[Request],
          roof: Roofline | None) -> list:
    if kind == "hf":
        from nanoserve.bench.peers.hf import hf_peers

        paths = [p.strip() for p in args.hf_paths.split(",") if p.strip()]
        return hf_peers(settings, requests, paths, args.hf_batch_size, roof)
    if kind == "llamacpp":
        from nanoserve.bench.peers.llamacpp import llamacpp_peers

        return llamacpp_peers(settings, requests, args.llamacpp_quants, args.llamacpp_dir, args.llamacpp_source, roof)
    from nanoserve.bench.peers.vllm import VLLMPeer

    vllm_settings = dataclasses.replace(settings, max_model_len=max(VLLM_MIN_MODEL_LEN, settings.max_model_len))
    return [VLLMPeer(vllm_settings, requests, args.vllm_python, args.vllm_kv_cache_gib, args.vllm_timeout, roof)]


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

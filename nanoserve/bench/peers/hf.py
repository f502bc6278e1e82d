"""HF transformers as a peer: padded batched `generate`, and its continuous-batching manager."""
from __future__ import annotations

import logging
import time

import torch

from nanoserve.bench.peers import PeerSettings
from nanoserve.bench.results import RunResult, peer_result
from nanoserve.bench.roofline import Roofline
from nanoserve.bench.workloads import Request

HF_PATHS = ("generate", "cb")


def _sampling_kwargs(settings: PeerSettings) -> dict:
    if settings.temperature > 0:
        return dict(do_sample=True, temperature=settings.temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False, temperature=None, top_k=None, top_p=None)


class _DropPsutilNotices(logging.Filter):
    """HF's CB manager logs an ERROR when psutil is missing on CPU; it only sizes its cache from
    free memory, which we size explicitly, so the notice is noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


class HFPeer:
    """One HF path ("generate" or "cb") on a model shared between paths."""

    def __init__(self, path: str, settings: PeerSettings, requests: list[Request], model,
                 batch_size: int | None = None, roof: Roofline | None = None) -> None:
        if path not in HF_PATHS:
            raise ValueError(f"HF path must be one of {', '.join(HF_PATHS)}, got {path!r}")
        self.path, self.settings, self.requests, self.model = path, settings, requests, model
        self.batch_size, self.roof = batch_size, roof
        self.name = {"generate": "hf generate (padded)", "cb": "hf continuous batching"}[path]

    def start(self) -> None:
        if self.settings.warmup:
            self._run([Request(self.requests[0].prompt[:32], 4), Request(self.requests[-1].prompt[:24], 4)])

    def run(self) -> list[RunResult]:
        counts, wall = self._run(self.requests)
        return [peer_result(self.name, self.requests, counts, wall, self.roof)]

    def close(self) -> None:
        self.model = None

    def _run(self, requests: list[Request]) -> tuple[list[int], float]:
        return self._generate(requests) if self.path == "generate" else self._continuous_batching(requests)

    @torch.inference_mode()
    def _generate(self, requests: list[Request]) -> tuple[list[int], float]:
        """Left-pad each batch and generate its longest output; each request counts only its own."""
        model, batch_size = self.model, self.batch_size or len(requests)
        pad = model.generation_config.pad_token_id
        counts = []
        torch.manual_seed(self.settings.seed)  # HF samples from torch's global generator
        start = time.perf_counter()
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            width = max(len(r.prompt) for r in batch)
            ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch],
                                device=model.device)
            new = max(r.max_tokens for r in batch)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 eos_token_id=None, pad_token_id=pad, **_sampling_kwargs(self.settings))
            generated = out.shape[1] - width  # ids: [batch, width + generated]
            counts += [min(generated, r.max_tokens) for r in batch]
        return counts, time.perf_counter() - start

    def _continuous_batching(self, requests: list[Request]) -> tuple[list[int], float]:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        cb_logger = logging.getLogger("ContinuousBatchingLogger")
        if not any(isinstance(f, _DropPsutilNotices) for f in cb_logger.filters):
            cb_logger.addFilter(_DropPsutilNotices())
        s = self.settings
        # transformers 5.17 names the KV page `block_size`, 5.24 `page_size`
        defaults = ContinuousBatchingConfig()
        page_field = "page_size" if hasattr(defaults, "page_size") else "block_size"
        page = s.block_size or getattr(defaults, page_field)
        longest = max(len(r.prompt) + r.max_tokens for r in requests)
        cb_config = ContinuousBatchingConfig(
            **{page_field: page},
            # Sized to the workload: left alone, HF sizes its cache from free memory (slow on CPU).
            num_blocks=-(-longest // page) * len(requests) + 1,
            # 512 was HF's fastest token budget on 2 CPU cores (256: same, 2048: 14% slower).
            max_batch_tokens=s.max_num_batched_tokens or 512,
            max_requests_per_batch=min(s.max_num_seqs or len(requests), len(requests)),
            seed=s.seed,
        )
        gen_config = GenerationConfig(eos_token_id=-1, pad_token_id=self.model.generation_config.pad_token_id,
                                      max_new_tokens=max(r.max_tokens for r in requests), **_sampling_kwargs(s))
        results = {}
        with self.model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=10,
                                                            continuous_batching_config=cb_config) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens, eos_token_id=-1) for r in requests]
            while len(results) < len(requests):
                result = manager.get_result(timeout=1)
                if result is not None and result.error is not None:
                    raise RuntimeError(f"HF continuous batching failed: {result.error}")
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing every request")
            wall = time.perf_counter() - start
        return [len(results[i].generated_tokens) for i in ids], wall


def load_hf_model(settings: PeerSettings):
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, settings.dtype)
    model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=dtype).to(settings.device).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    return model


def hf_peers(settings: PeerSettings, requests: list[Request], paths: list[str], batch_size: int | None = None,
             roof: Roofline | None = None) -> list[HFPeer]:
    """One peer per HF path, sharing one loaded model."""
    for path in paths:
        if path not in HF_PATHS:
            raise ValueError(f"--hf-paths: unknown path {path!r}; choose from {', '.join(HF_PATHS)}")
    model = load_hf_model(settings)
    return [HFPeer(path, settings, requests, model, batch_size, roof) for path in paths]

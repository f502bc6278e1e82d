"""The tqdm bar of `generate` and `generate_stream`: an `on_step` hook on the one step loop."""
from __future__ import annotations

import time
from collections.abc import Callable

from tqdm.auto import tqdm

from nanoserve.engine.llm_engine import LLMEngine, StepStats


class ProgressBar:
    """One tick per finished request; prefill and decode tok/s from each step's tokens (a mixed
    step's time is split between the two by token share); the prefix-cache hit rate at the end."""

    def __init__(self, engine: LLMEngine, total: int | None, use_tqdm: bool | Callable[..., tqdm]) -> None:
        self.engine = engine
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make_bar(total=total, desc="Generating", unit="req", dynamic_ncols=True, disable=not use_tqdm)
        self.enabled = bool(use_tqdm)
        self.tokens = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self._last = time.perf_counter()

    def __call__(self, stats: StepStats) -> None:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        counts = {"prefill": stats.num_prefill_tokens, "decode": stats.num_decode_tokens}
        total = sum(counts.values()) or 1
        for kind, n in counts.items():
            self.tokens[kind] += n
            self.seconds[kind] += elapsed * n / total
        self.bar.update(len(stats.finished))
        self.bar.set_postfix(**{k: f"{self.tokens[k] / max(self.seconds[k], 1e-9):.0f}tok/s" for k in self.tokens})

    def skip(self) -> None:
        """A request that finished without running (a RequestError)."""
        self.bar.update(1)

    def close(self) -> None:
        if self.enabled:
            rate = self.engine.block_manager.hit_rate
            self.bar.set_postfix_str(f"{self.bar.postfix}, prefix-cache hit rate={rate:.1%}")
        self.bar.close()

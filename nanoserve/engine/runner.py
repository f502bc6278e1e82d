"""What LLMEngine drives: ModelRunner (the model in this process) or TPModelRunner (rank 0 driving
workers). The engine reads the KV geometry once, to size the block manager, then calls `run` each
step and `close` at the end."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nanoserve.backends.base import Backend
    from nanoserve.engine.kv_cache_spec import KVCacheSpec
    from nanoserve.engine.model_runner import StepOutput
    from nanoserve.engine.scheduler import ScheduledBatch


@runtime_checkable
class Runner(Protocol):
    @property
    def kv_spec(self) -> KVCacheSpec: ...  # block size and count (the same on every rank), decided once

    @property
    def backend(self) -> Backend: ...  # the device kernels; smoke and bench describe a run with it

    def run(self, batch: ScheduledBatch) -> StepOutput: ...

    def close(self) -> None: ...  # release the model, the KV cache and any worker; idempotent

"""The engine's Runner for tensor_parallel_size > 1: rank 0 here, ranks 1..N-1 in workers (tp_worker.py).

Rank 0 owns a complete ModelRunner holding its shard, while the engine keeps the scheduler and
the sampling. Each step rank 0 builds the inputs on the host, sends the same bytes to every
worker, and all ranks run the forward together; the layers' all-reduces and the LM head's gather
meet over the process group, and only rank 0 gets logits and samples. KV-cache sizing: every rank
sizes its own cache, then all agree on the minimum, so the scheduler's block ids are valid on
every rank. After a failure inside a step the ranks may be out of step: the workers are
terminated and every later step raises. `rank0` is rank 0's ModelRunner (its model, KV cache).
"""
from __future__ import annotations

import logging
import weakref

import torch

from nanoserve.config import Config
from nanoserve.distributed import process_group
from nanoserve.distributed.channel import encode_message, pack
from nanoserve.distributed.group import TPGroup
from nanoserve.engine.model_runner import ModelRunner, StepOutput
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.tp_workers import Workers

logger = logging.getLogger(__name__)


class TPModelRunner:  # implements engine.runner.Runner
    def __init__(self, config: Config, device: torch.device) -> None:
        size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} CUDA devices (one per rank), "
                f"found {torch.cuda.device_count()}"
            )
        self.group = TPGroup(0, size)
        self.num_threads = process_group.threads_per_rank(size) if device.type == "cpu" else None
        self._workers = Workers(size)
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._broken: str | None = None
        self.rank0: ModelRunner | None = None
        try:
            self._workers.start(config, device, process_group.threads_per_rank(size))
            self._workers.wait_connecting()
            rank0_device = process_group.rank_device(device, 0)
            # Every rank connects before building its model: on CUDA the warm-up runs collectives.
            process_group.connect(self.group, rank0_device, self._workers.store)
            with process_group.torch_threads(self.num_threads):
                self.rank0 = ModelRunner(config, rank0_device, self.group)
            self._workers.wait_ready()
        except BaseException:
            self._workers.close(graceful=False)
            self.close()
            raise
        self.kv_spec = self.rank0.kv_spec  # every rank's ModelRunner agreed on the block count (the minimum)
        self.backend = self.rank0.backend
        logger.info("tensor parallel: %d ranks, %d KV blocks each", size, self.kv_spec.num_blocks)

    @property
    def worker_pids(self) -> list[int]:
        return self._workers.pids

    # ---- a step -------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> StepOutput:
        if self._broken:
            raise RuntimeError(f"the tensor-parallel engine is unusable: {self._broken}")
        try:
            self._workers.check_alive()
        except RuntimeError:
            self.close()
            raise
        with process_group.torch_threads(self.num_threads):
            inputs = self.rank0.prepare_inputs(batch)
            message = encode_message("step", pack(inputs))  # too big: refused before any rank moves
            try:
                self._workers.broadcast(message)
                logits = self.rank0.execute(inputs)
            except BaseException as exc:  # Ctrl-C too: the workers may be inside a collective
                self._fail(exc)
                raise
            return self.rank0.sample(batch, logits)  # rank 0 alone: a failure here leaves the ranks in step

    def _fail(self, exc: BaseException) -> None:
        """The ranks may now be out of step (some inside a collective): stop everything for good."""
        self._broken = f"a step failed ({type(exc).__name__}: {exc})"
        worker_error = self._workers.failure(exc)
        self._workers.close(graceful=False)  # none can take "stop" now
        self.close()
        if worker_error is not None:
            raise worker_error from exc

    def close(self) -> None:
        """Stop the workers and release rank 0's model and KV cache. Idempotent."""
        self._broken = self._broken or "it is closed"
        self._finalizer()
        self.group.process_group = None
        if self.rank0 is not None:
            self.rank0.close()

"""Tensor parallelism: rank 0 in this process, ranks 1..N-1 in spawned worker processes.

Layout
    `TPModelRunner` is what `LLMEngine` gets when tensor_parallel_size > 1. It has the interface
    of `ModelRunner` (`run(batch)`, `num_kvcache_blocks`, `close()`), and it *is* rank 0: it owns
    a ModelRunner holding rank 0's shard, while the engine keeps the scheduler and the sampling.
    Ranks 1..N-1 are worker processes (multiprocessing "spawn" context) that each build their own
    ModelRunner: same config, their own weight shard (the layers' weight loaders cut it, see
    nanoserve/layers/linear.py and embed_head.py) and their own KV cache, holding their
    num_key_value_heads / N heads. Each step, rank 0 prepares the inputs, sends them to every
    worker, and all ranks run the forward together; the layers' all-reduces and the LM head's
    gather (tp.py) meet over the process group, and only rank 0 gets logits and samples.

Process group
    One torch.distributed backend object per engine (ProcessGroupGloo on CPU, ProcessGroupNCCL on
    CUDA, one GPU per rank: cuda:0 .. cuda:N-1), rendezvousing through a TCPStore that rank 0
    opens on 127.0.0.1 port 0, i.e. a free port the OS picks. No fixed port, no shared-memory
    name, no global default process group: two engines in one process, or on one machine, never
    meet. Collectives time out after PROCESS_GROUP_TIMEOUT_S, so a rank that stops answering
    turns into an error rather than a hang (a rank that dies errors at once: its sockets close).

Channel (rank 0 -> workers)
    One `multiprocessing.Pipe` per worker. A message is `pickle.dumps((kind, payload))` sent with
    `send_bytes`; tensors inside a payload travel as raw bytes (dtype, shape, data: see
    `pack`; CUDA tensors are copied to the host first), never as pickled storages or shared
    memory. The size is checked on both ends: `encode_message` refuses a message over
    MAX_MESSAGE_BYTES with a ValueError, and the receiver reads with
    `recv_bytes(MAX_MESSAGE_BYTES)`, which refuses a longer one. A step's ModelInputs are a few
    int tensors of num_tokens or num_seqs x max_blocks elements: kilobytes to a few megabytes.
    Rank 0 pickles a step once and writes the same bytes to every worker's pipe.
      rank 0 -> worker:  ("step", packed ModelInputs)   ("stop", None)
      worker -> rank 0:  ("ready", local num_kvcache_blocks)   ("error", traceback text)
    KV-cache sizing: every rank sizes its own cache, then all agree on the minimum (all-reduce
    MIN), so the scheduler's block ids are valid on every rank.

Lifecycle
    * `close()` (also `with LLM(...)`, `LLM.close()`, garbage collection through
      `weakref.finalize`, and interpreter exit) sends "stop", joins each worker for
      JOIN_TIMEOUT_S, then terminates and finally kills what is left.
    * Workers die with the parent: a watchdog thread exits when os.getppid() changes, the pipe
      hits EOF when rank 0's end closes, and collectives with a dead rank 0 fail.
    * A worker exception is sent back as a traceback and raised in the parent as RuntimeError;
      the parent never waits on a worker without a timeout and an is_alive() check (startup
      polls every worker; the process-group rendezvous and collectives are bounded by
      PROCESS_GROUP_TIMEOUT_S), so a crashed or killed worker surfaces as an exception, never a
      hang. After a failure in a step the workers are terminated, the runner is closed and
      every later step raises.
    * Workers are started with the "spawn" method, so a script that creates
      LLM(tensor_parallel_size > 1) at import time must guard it with `if __name__ == "__main__":`
      (as with any multiprocessing or torch.distributed program).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.config import Config
from nanoserve.engine.model_runner import ModelInputs, ModelRunner, StepOutput, to_device
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.layers.tp import TPGroup, all_reduce, use_tp_group

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 2**20  # one step's inputs; real ones are KBs to a few MBs
PROCESS_GROUP_TIMEOUT_S = 60.0  # a collective waiting longer than this on a silent rank fails
STARTUP_TIMEOUT_S = 900.0  # building a worker's model (loading its shard) must finish in this
JOIN_TIMEOUT_S = 10.0  # close(): how long a worker gets to exit after "stop" before terminate()
WATCHDOG_INTERVAL_S = 0.5
FAILURE_REPORT_WAIT_S = 5.0  # after a failed step, how long to wait for a worker's traceback


# ---- the channel ------------------------------------------------------------------------------


class PackedTensor(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def pack(obj: Any) -> Any:
    """Replace every tensor in obj (dataclasses, lists, tuples, dicts of them) by its raw bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return PackedTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), data)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_fields(obj, pack)
    if isinstance(obj, (list, tuple)) and not isinstance(obj, PackedTensor):
        return type(obj)(pack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    return obj


def unpack(obj: Any) -> Any:
    """Inverse of `pack`: CPU tensors again."""
    if isinstance(obj, PackedTensor):
        dtype = getattr(torch, obj.dtype)
        if not obj.data:
            return torch.empty(obj.shape, dtype=dtype)
        return torch.frombuffer(bytearray(obj.data), dtype=torch.uint8).view(dtype).reshape(obj.shape)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_fields(obj, unpack)
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    return obj


def _map_fields(obj: Any, fn) -> Any:
    out = copy.copy(obj)  # no __init__ call: works for frozen dataclasses and init=False fields
    for f in dataclasses.fields(obj):
        object.__setattr__(out, f.name, fn(getattr(obj, f.name)))
    return out


def encode_message(kind: str, payload: Any = None) -> bytes:
    data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(
            f"tensor-parallel message {kind!r} is {len(data)} bytes, over the channel's limit of "
            f"MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}; lower max_num_batched_tokens or max_num_seqs"
        )
    return data


def send_message(conn, kind: str, payload: Any = None) -> None:
    conn.send_bytes(encode_message(kind, payload))


def recv_message(conn) -> tuple[str, Any]:
    return pickle.loads(conn.recv_bytes(MAX_MESSAGE_BYTES))


# ---- process group and devices ------------------------------------------------------------------


def connect_backend(device: torch.device, store, rank: int, size: int):
    """This engine's own process group: NCCL between GPUs, gloo on CPU (never the global default)."""
    timeout = timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, opts)
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def threads_per_rank(size: int) -> int:
    """Split this process's intra-op threads between the ranks, so N processes do not oversubscribe the cores."""
    return max(1, torch.get_num_threads() // size)


@contextmanager
def torch_threads(n: int | None):
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def agree_num_kvcache_blocks(runner: ModelRunner) -> int:
    """All ranks take the smallest cache any rank could afford, so block ids mean the same everywhere."""
    local = runner.num_kvcache_blocks
    count = torch.tensor([local], dtype=torch.int64, device=runner.device)
    agreed = int(all_reduce(count, "min").item())
    if agreed != local:
        for attn in runner.attention_layers:  # drop the old cache before allocating the new one
            attn.k_cache = attn.v_cache = torch.tensor([])
        runner.kv_cache = None
        runner.kv_cache = runner._allocate_kv_cache(agreed)
        runner.num_kvcache_blocks = agreed
    return agreed


# ---- workers (ranks 1..N-1) -----------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        if os.getppid() != parent_pid:
            os._exit(0)  # the engine is gone; nothing left to clean up for


def _worker_main(
    rank: int, size: int, config: Config, device_str: str, port: int,
    conn, parent_pid: int, num_threads: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="nanoserve-tp-watchdog").start()
    try:
        torch.set_num_threads(num_threads)
        device = torch.device(device_str)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = TPGroup(rank, size)
        with use_tp_group(group):
            runner = ModelRunner(config, device)
        send_message(conn, "ready", runner.num_kvcache_blocks)
        store = dist.TCPStore(
            "127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
        )
        group.backend = connect_backend(device, store, rank, size)
        with use_tp_group(group):
            agree_num_kvcache_blocks(runner)
            while True:
                kind, payload = recv_message(conn)
                if kind == "stop":
                    break
                if kind != "step":
                    raise RuntimeError(f"tensor-parallel worker {rank} got an unknown message {kind!r}")
                runner.execute(to_device(unpack(payload), device))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # rank 0's end of the pipe closed: the engine is gone
    except BaseException:
        try:
            send_message(conn, "error", traceback.format_exc())
        except Exception:
            pass
        raise SystemExit(1)


STARTUP_HINT = (
    "while starting. Workers are spawned: a script creating LLM(tensor_parallel_size > 1) at import "
    "time must guard it with `if __name__ == '__main__':`"
)


class _Workers:
    """The worker processes, their pipes and rank 0's group; `close` is also the GC finalizer.

    Holds no reference to the TPModelRunner, so weakref.finalize can call `close` after it died.
    """

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.procs: list[Any] = []  # index i is rank i + 1
        self.conns: list[Any] = []
        self.store = None
        self.closed = False

    def start(self, config: Config, device: torch.device, num_threads: int) -> None:
        # Rank 0 hosts the store on a free port the OS picks (port 0): engines never collide.
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.group.size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
        ctx = mp.get_context("spawn")
        for rank in range(1, self.group.size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.group.size, config, str(rank_device(device, rank)), self.store.port,
                      child_conn, os.getpid(), num_threads),
                name=f"nanoserve-tp-rank{rank}",
                daemon=True,  # multiprocessing also terminates daemonic children at interpreter exit
            )
            proc.start()
            child_conn.close()  # our copy: the worker's death must read as EOF on parent_conn
            self.procs.append(proc)
            self.conns.append(parent_conn)

    def wait_ready(self) -> list[int]:
        """Each worker's own num_kvcache_blocks once its model is built; raises if one fails."""
        blocks: dict[int, int] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(blocks) < len(self.procs):
            for i, (proc, conn) in enumerate(zip(self.procs, self.conns)):
                if i in blocks:
                    continue
                if not proc.is_alive():
                    raise self.dead_worker_error(i, STARTUP_HINT)
                if conn.poll(0.05):
                    kind, payload = self._recv(i, STARTUP_HINT)
                    if kind != "ready":
                        raise RuntimeError(f"tensor-parallel worker rank {i + 1} sent {kind!r} while starting")
                    blocks[i] = payload
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
        return [blocks[i] for i in range(len(self.procs))]

    def _recv(self, i: int, when: str = "") -> tuple[str, Any]:
        try:
            kind, payload = recv_message(self.conns[i])
        except (EOFError, OSError):
            self.procs[i].join(FAILURE_REPORT_WAIT_S)  # its channel closed: it is exiting
            raise self.dead_worker_error(i, when) from None
        if kind == "error":
            raise RuntimeError(f"tensor-parallel worker rank {i + 1} failed:\n{payload}")
        return kind, payload

    def dead_worker_error(self, i: int, when: str = "") -> RuntimeError:
        """The error a dead worker left in its channel, else one naming its exit code."""
        conn = self.conns[i]
        try:
            while conn.poll(0):
                kind, payload = recv_message(conn)
                if kind == "error":
                    return RuntimeError(f"tensor-parallel worker rank {i + 1} failed:\n{payload}")
        except (EOFError, OSError):
            pass
        code = self.procs[i].exitcode
        return RuntimeError(f"tensor-parallel worker rank {i + 1} died (exit code {code}) {when}".rstrip())

    def check_alive(self) -> None:
        """Raise if a worker died or reported an error since the last step."""
        for i, (proc, conn) in enumerate(zip(self.procs, self.conns)):
            if not proc.is_alive():
                raise self.dead_worker_error(i, "between steps")
            if conn.poll(0):
                self._recv(i)  # only an error (or EOF) arrives unasked: raises

    def broadcast(self, kind: str, payload: Any) -> None:
        data = encode_message(kind, payload)
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
                self.procs[i].join(FAILURE_REPORT_WAIT_S)
                raise self.dead_worker_error(i, "(its channel is closed)") from exc

    def failure(self, cause: BaseException) -> RuntimeError | None:
        """After a failed step: the error of a worker that failed or died, if one did; else None."""
        deadline = time.monotonic() + FAILURE_REPORT_WAIT_S
        while time.monotonic() < deadline:
            for i, proc in enumerate(self.procs):
                if not proc.is_alive():
                    return self.dead_worker_error(i, f"during a step ({type(cause).__name__}: {cause})")
            time.sleep(0.05)
        return None

    def close(self, graceful: bool = True) -> None:
        """Stop every worker: "stop" and a join when graceful (they are idle), else terminate at once."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            for conn in self.conns:
                try:
                    send_message(conn, "stop")
                except Exception:
                    pass  # already gone
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.group.backend = None  # rank 0's end of the process group goes with it
        self.store = None


# ---- rank 0 --------------------------------------------------------------------------------------


class _Rank0Runner(ModelRunner):
    """Rank 0's ModelRunner: each forward first sends its inputs to the workers."""

    workers: _Workers
    broken: str | None = None

    def execute(self, inputs: ModelInputs) -> torch.Tensor | None:
        if self.broken:
            raise RuntimeError(f"the tensor-parallel engine is unusable: {self.broken}")
        try:
            self.workers.broadcast("step", pack(inputs))
            return super().execute(inputs)
        except BaseException as exc:
            # The ranks may now be out of step (some inside a collective): never run again.
            self.broken = f"a step failed ({type(exc).__name__}: {exc})"
            raise


class TPModelRunner:
    """The engine's model runner for tensor_parallel_size > 1 (see the module docstring)."""

    def __init__(self, config: Config, device: torch.device) -> None:
        size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} CUDA devices (one per rank), "
                f"found {torch.cuda.device_count()}"
            )
        self.config = config
        self.size = size
        self.group = TPGroup(0, size)
        self.num_threads = threads_per_rank(size) if device.type == "cpu" else None
        self._workers = _Workers(self.group)
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._runner: _Rank0Runner | None = None
        try:
            self._workers.start(config, device, threads_per_rank(size))
            with use_tp_group(self.group), torch_threads(self.num_threads):
                runner = _Rank0Runner(config, rank_device(device, 0))
            runner.workers = self._workers
            self._workers.wait_ready()
            self.group.backend = connect_backend(runner.device, self._workers.store, 0, size)
            with use_tp_group(self.group):
                self.num_kvcache_blocks = agree_num_kvcache_blocks(runner)
            self._runner = runner
        except BaseException:
            self._workers.close(graceful=False)
            self.close()
            raise
        logger.info("tensor parallel: %d ranks, %d KV blocks each", size, self.num_kvcache_blocks)

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._workers.procs]

    def run(self, batch: ScheduledBatch) -> StepOutput:
        if self._runner is None:
            raise RuntimeError("this LLM's tensor-parallel runner is closed")
        try:
            self._workers.check_alive()
        except RuntimeError:
            self.close()
            raise
        try:
            with use_tp_group(self.group), torch_threads(self.num_threads):
                return self._runner.run(batch)
        except Exception as exc:
            if self._runner.broken is None:
                raise  # failed on rank 0 outside the forward (e.g. sampling): the ranks are still in step
            worker_error = self._workers.failure(exc)
            self._workers.close(graceful=False)  # the ranks are out of step: none can take "stop"
            self.close()
            if worker_error is not None:
                raise worker_error from exc
            raise

    def close(self) -> None:
        """Stop the workers and release rank 0's model and KV cache. Idempotent."""
        self._finalizer()
        self._runner = None

    def __getattr__(self, name: str) -> Any:
        # Anything else the engine may read (dtype, vocab_size, ...) is rank 0's runner's.
        runner = self.__dict__.get("_runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

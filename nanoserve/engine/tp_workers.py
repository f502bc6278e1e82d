"""The lifecycle of the worker processes (ranks 1..N-1): start, wait until ready, watch, stop.

* Workers are started with the "spawn" method, so a script that creates LLM(tensor_parallel_size
  > 1) at import time must guard it with `if __name__ == "__main__":` (as with any
  multiprocessing or torch.distributed program).
* `close()` (also `with LLM(...)`, `LLM.close()`, garbage collection through `weakref.finalize`,
  and interpreter exit) sends "stop", joins each worker for JOIN_TIMEOUT_S, then terminates and
  finally kills what is left.
* The parent never waits on a worker without a timeout and an is_alive() check (startup polls
  every worker, and rank 0 joins the rendezvous only once every worker says it is joining too;
  rendezvous and collectives are bounded by the process group's timeout), so a crashed or killed
  worker surfaces as an exception, never a hang.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from nanoserve.config import Config
from nanoserve.distributed import process_group
from nanoserve.distributed.channel import recv_message, send_message
from nanoserve.engine.tp_worker import worker_main

STARTUP_TIMEOUT_S = 900.0  # building a worker's model (loading its shard) must finish in this
JOIN_TIMEOUT_S = 10.0  # close(): how long a worker gets to exit after "stop" before terminate()
FAILURE_REPORT_WAIT_S = 5.0  # after a failed step, how long to wait for a worker's traceback
STARTUP_HINT = (
    "while starting. Workers are spawned: a script creating LLM(tensor_parallel_size > 1) at import "
    "time must guard it with `if __name__ == '__main__':`"
)


class Workers:
    """The worker processes, their pipes and rank 0's store; `close` doubles as the GC finalizer
    (it holds no reference to the runner that owns it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list[Any] = []  # index i is rank i + 1
        self.conns: list[Any] = []
        self.store = None
        self.closed = False

    def start(self, config: Config, device: torch.device, num_threads: int) -> None:
        self.store = process_group.open_store(self.size)
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.size, config, str(process_group.rank_device(device, rank)), self.store.path,
                      child_conn, os.getpid(), num_threads),
                name=f"nanoserve-tp-rank{rank}",
                daemon=True,  # multiprocessing also terminates daemonic children at interpreter exit
            )
            proc.start()
            child_conn.close()  # our copy: the worker's death must read as EOF on parent_conn
            self.procs.append(proc)
            self.conns.append(parent_conn)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def wait_connecting(self) -> None:
        """Until every worker has imported torch and is about to join the process group. A spawned
        process can take longer than the group's rendezvous timeout to get there on a busy
        machine (seen: a TP engine started beside 14 busy processes), so rank 0 joins only then."""
        self._wait_for("connecting")

    def wait_ready(self) -> list[int]:
        """Each worker's own num_kvcache_blocks once its model is built; raises if one fails."""
        return self._wait_for("ready")

    def _wait_for(self, expected: str) -> list[Any]:
        """Every worker's next message, which must be `expected`; polls liveness, bounded by STARTUP_TIMEOUT_S."""
        payloads: dict[int, Any] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(payloads) < len(self.procs):
            for i, (proc, conn) in enumerate(zip(self.procs, self.conns)):
                if i in payloads:
                    continue
                if not proc.is_alive():
                    raise self.dead_worker_error(i, STARTUP_HINT)
                if conn.poll(0.05):
                    kind, payload = self._recv(i, STARTUP_HINT)
                    if kind != expected:
                        raise RuntimeError(f"tensor-parallel worker rank {i + 1} sent {kind!r} while starting")
                    payloads[i] = payload
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
        return [payloads[i] for i in range(len(self.procs))]

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
            pass  # nothing more in the channel: report the exit code below
        code = self.procs[i].exitcode
        return RuntimeError(f"tensor-parallel worker rank {i + 1} died (exit code {code}) {when}".rstrip())

    def check_alive(self) -> None:
        """Raise if a worker died or reported an error since the last step."""
        for i, (proc, conn) in enumerate(zip(self.procs, self.conns)):
            if not proc.is_alive():
                raise self.dead_worker_error(i, "between steps")
            if conn.poll(0):
                self._recv(i)  # only an error (or EOF) arrives unasked: raises

    def broadcast(self, data: bytes) -> None:
        """Send one encoded message (channel.encode_message) to every worker."""
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
                except OSError:
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
        if self.store is not None:
            process_group.close_store(self.store.path)  # every rank is gone: nobody needs it
        self.store = None

"""A tensor-parallel worker process (ranks 1..N-1): build its shard, then run every step rank 0 sends.

Each worker builds its own ModelRunner: same config, its own weight shard (the layers' weight
loaders cut it) and its own KV cache holding num_key_value_heads / N heads. Workers die with the
parent: a watchdog thread exits when os.getppid() changes, the pipe hits EOF when rank 0's end
closes, and collectives with a dead rank 0 fail. A worker exception is sent back as a traceback.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import torch

from nanoserve.config import Config
from nanoserve.distributed import process_group
from nanoserve.distributed.channel import recv_message, send_message, unpack
from nanoserve.distributed.group import TPGroup
from nanoserve.engine.model_runner import ModelRunner

WATCHDOG_INTERVAL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        if os.getppid() != parent_pid:
            os._exit(0)  # the engine is gone; nothing left to clean up for


def worker_main(
    rank: int, size: int, config: Config, device_str: str, store_path: str,
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
        send_message(conn, "connecting", None)  # imports done: rank 0 joins the rendezvous now
        # Connected before the model is built: on CUDA its warm-up (memory profiling) runs collectives.
        process_group.connect(group, device, process_group.join_store(store_path, size))
        runner = ModelRunner(config, device, group)
        send_message(conn, "ready", runner.num_kvcache_blocks)
        while True:
            kind, payload = recv_message(conn)
            if kind == "stop":
                break
            if kind != "step":
                raise RuntimeError(f"tensor-parallel worker {rank} got an unknown message {kind!r}")
            runner.execute(unpack(payload))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # rank 0's end of the pipe closed: the engine is gone
    except BaseException:
        try:
            send_message(conn, "error", traceback.format_exc())
        except OSError:
            pass  # rank 0 is gone too: there is nobody to report to
        raise SystemExit(1)

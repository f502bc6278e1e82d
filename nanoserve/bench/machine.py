"""What ran the benchmark: the CPU and its flags that matter, threads, load, and the engine's paths."""
from __future__ import annotations

import os
import platform
import time

import torch

# The CPU flags that decide which GEMM and attention paths are fast.
FLAGS_THAT_MATTER = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; (platform.processor(), empty) elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or "unknown", set()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return model, set(flags)


def cpu_idle_fraction(seconds: float = 1.0) -> float | None:
    """Share of all CPUs' time spent idle over `seconds` (Linux /proc/stat), or None elsewhere."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (idle1 - idle0) / max(total1 - total0, 1)


def machine_info(device: torch.device) -> dict:
    model, flags = _cpuinfo()
    info = {
        "cpu": model,
        "cpu_flags": {f: f in flags for f in FLAGS_THAT_MATTER},
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": str(device),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    idle = cpu_idle_fraction()
    if idle is not None:  # other work on the machine skews CPU timings: keep it on record
        info["cpu_idle_before_run"] = idle
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = os.getloadavg()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def describe_machine(info: dict) -> str:
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in info["cpu_flags"].items())
    line = f"machine: {info['cpu']} ({info['cpu_count']} CPUs; {flags}); {info['threads']} threads"
    if "gpu" in info:
        line += f"; {info['gpu']}"
    if "cpu_idle_before_run" in info:
        line += f"; CPUs {info['cpu_idle_before_run']:.0%} idle before the run"
    return line


def engine_description(llm) -> dict[str, str]:
    """What the engine ran: the device backend's own description, and the dtype."""
    runner = llm.engine.model_runner
    dtype = str(runner.backend.dtype).removeprefix("torch.")
    return {**{str(k): str(v) for k, v in runner.backend.describe().items()}, "dtype": dtype}

"""torch.profiler's top ops for one prefill step and one decode step of the workload."""
from __future__ import annotations

from collections.abc import Callable

from nanoserve import LLM, SamplingParams
from nanoserve.bench.workloads import Request

MAX_STEPS = 100_000


def profile_steps(llm: LLM, requests: list[Request], params: Callable[[Request], SamplingParams],
                  top: int = 15) -> dict[str, str]:
    """Profile the first step (all prefill), then the first step after a decode-only step."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    for r in requests:
        engine.add_request(r.prompt, params(r))
    tables = {}
    try:
        with profile(activities=activities) as prof:
            engine.step()
        tables["prefill"] = prof.key_averages().table(sort_by=sort_key, row_limit=top)
        for _ in range(MAX_STEPS):  # until the batch is all decodes
            if engine.is_finished() or engine.step().num_prefill_tokens == 0:
                break
        if not engine.is_finished():
            with profile(activities=activities) as prof:
                stats = engine.step()
            name = f"decode ({stats.num_decode_tokens} seqs)" if stats.num_prefill_tokens == 0 else "mixed"
            tables[name] = prof.key_averages().table(sort_by=sort_key, row_limit=top)
    finally:
        engine.abort_all()
        llm.reset_prefix_cache()
    for name, table in tables.items():
        print(f"\n--- profile: one {name} step ---\n{table}")
    return tables

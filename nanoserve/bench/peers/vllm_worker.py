"""vLLM's offline LLM, driven by nanoserve's bench over a pipe. Run by vLLM's own interpreter
(it imports only the standard library and vllm, never nanoserve):

    <vllm-venv>/bin/python vllm_worker.py SPEC.json

SPEC.json: {"task", "llm": {LLM kwargs}, "requests": [...], "request_sets": {name: [...]} (optional),
"temperature", "seed", "warmup"}. Tasks
and what each request carries:
  generate  {"prompt": [ids], "max_tokens": n}: greedy/sampled output of exactly n tokens (ignore_eos)
  json      {"prompt": [ids], "max_tokens": n, "schema": {...}}: JSON-schema constrained output
            (vLLM's structured outputs, compact JSON), ended by the grammar or n
  mcq       {"prompt": [ids]}: one scoring request, prompt_logprobs=1 and one output token
  embed     {"text": str}: LLM.embed (the LLM is loaded with runner="pooling")
The worker loads the model, runs one short warm-up of its task, and writes one JSON line per
event to its stdout: {"event": "ready", ...}, then for each "run" line read on stdin
{"event": "result", "wall_s", "counts", "finished_stop"} (json: also "texts") ("run NAME": the request
set NAME); "quit" ends it. `counts` per request:
output tokens (generate, json), prompt positions with logprobs (mcq), vector length (embed).
vLLM's own logs go to stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything vLLM prints lands in the log, not in the protocol stream

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    with open(spec_path) as f:
        spec = json.load(f)
    # This script's folder (nanoserve/bench/peers) is sys.path[0], and its vllm.py would shadow vLLM.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    import vllm
    from vllm import LLM, SamplingParams

    task = spec.get("task", "generate")

    def params(r: dict, i: int) -> SamplingParams:
        seed = spec["seed"] + i if spec["temperature"] > 0 else None
        if task == "mcq":
            return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        if task == "json":
            from vllm.sampling_params import StructuredOutputsParams

            return SamplingParams(temperature=spec["temperature"], max_tokens=r["max_tokens"], seed=seed,
                                  structured_outputs=StructuredOutputsParams(json=r["schema"],
                                                                            disable_any_whitespace=True))
        return SamplingParams(temperature=spec["temperature"], max_tokens=r["max_tokens"], ignore_eos=True,
                              detokenize=False, seed=seed)

    def run(requests: list[dict]) -> tuple[list, float]:
        t0 = time.perf_counter()
        if task == "embed":
            outs = llm.embed([r["text"] for r in requests], use_tqdm=False)
        else:
            prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
            outs = llm.generate(prompts, [params(r, i) for i, r in enumerate(requests)], use_tqdm=False)
        return outs, time.perf_counter() - t0

    def count(out) -> int:
        if task == "embed":
            return len(out.outputs.embedding)
        if task == "mcq":
            return sum(p is not None for p in out.prompt_logprobs or [])
        return len(out.outputs[0].token_ids)

    start = time.perf_counter()
    llm = LLM(**spec["llm"])
    requests = spec["requests"]
    if spec["warmup"]:
        warm = [dict(r) for r in (requests[0], requests[-1])]
        for r in warm:
            if "prompt" in r:
                r["prompt"] = r["prompt"][:32]
            if "max_tokens" in r:
                r["max_tokens"] = min(r["max_tokens"], 4)
        run(warm)
    send({"event": "ready", "vllm_version": vllm.__version__, "load_s": time.perf_counter() - start})

    request_sets = spec.get("request_sets") or {}
    for line in sys.stdin:
        command, _, name = line.strip().partition(" ")
        if command == "quit":
            break
        if command != "run" or (name and name not in request_sets):
            raise ValueError(f"unknown command {line.strip()!r}: expected 'run', 'run NAME' "
                             f"(NAME one of {sorted(request_sets)}) or 'quit'")
        llm.reset_prefix_cache()  # every repeat starts from a cold cache, as nanoserve's do
        outs, wall = run(request_sets[name] if name else requests)
        finished_stop = sum(getattr(o.outputs[0], "finish_reason", None) == "stop" for o in outs) \
            if task in ("generate", "json") else None
        result = {"event": "result", "wall_s": wall, "counts": [count(o) for o in outs], "finished_stop": finished_stop}
        if task == "json":  # evidence that the grammar held: the texts, for the bench to check
            result["texts"] = [o.outputs[0].text for o in outs]
        send(result)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_worker.py SPEC.json")
    main(sys.argv[1])

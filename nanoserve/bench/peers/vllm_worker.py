"""vLLM's offline LLM, driven by nanoserve's bench over a pipe. Run by vLLM's own interpreter
(it imports only the standard library and vllm, never nanoserve):

    <vllm-venv>/bin/python vllm_worker.py SPEC.json

SPEC.json: {"llm": {LLM kwargs}, "requests": [{"prompt": [ids], "max_tokens": n}], "temperature",
"seed", "warmup"}. The worker loads the model, runs one short warm-up `generate`, and writes one
JSON line per event to its stdout: {"event": "ready", ...}, then for each "run" line read on stdin
{"event": "result", "wall_s", "counts"}; "quit" ends it. vLLM's own logs go to stderr.
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

    def params(max_tokens: int, i: int) -> SamplingParams:
        seed = spec["seed"] + i if spec["temperature"] > 0 else None
        return SamplingParams(temperature=spec["temperature"], max_tokens=max_tokens, ignore_eos=True,
                              detokenize=False, seed=seed)

    start = time.perf_counter()
    llm = LLM(**spec["llm"])
    requests = spec["requests"]
    prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
    sampling = [params(r["max_tokens"], i) for i, r in enumerate(requests)]
    if spec["warmup"]:
        warm = [{"prompt_token_ids": requests[0]["prompt"][:32]}, {"prompt_token_ids": requests[-1]["prompt"][:24]}]
        llm.generate(warm, [params(4, 0), params(4, 1)], use_tqdm=False)
    send({"event": "ready", "vllm_version": vllm.__version__, "load_s": time.perf_counter() - start})

    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            raise ValueError(f"unknown command {command!r}: expected 'run' or 'quit'")
        llm.reset_prefix_cache()  # every repeat starts from a cold cache, as nanoserve's do
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        send({"event": "result", "wall_s": wall, "counts": [len(o.outputs[0].token_ids) for o in outs]})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_worker.py SPEC.json")
    main(sys.argv[1])

"""`--workload json`: constrained decoding against its unconstrained twin, on the same prompts.

For each concurrency (the workload's --max-num-seqs, then 2 sequences at a time):
  1. constrained, jump-forward on: each request gets one of BENCH_SCHEMAS (compact JSON);
  2. constrained, jump-forward off (every token sampled, as vLLM does);
  3. the unconstrained twins: each request with max_tokens = its constrained sample's length
     and ignore_eos, so both sides produce the same number of tokens.
Each of 1-3 runs --repeat times; the run with the median ratio is reported. Reported: output tok/s
of each and the ratios, mask cost per token (llguidance, CPU), the fraction of tokens forced by
jump-forward, and the process RSS after each run (a long run's memory must stay flat: matchers are
freed with their requests). With --compare vllm, vLLM's structured outputs (xgrammar by default)
run the same prompts and schemas at the same concurrency, median of --repeat.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from nanoserve import LLM, SamplingParams
from nanoserve.bench.driver import drive, warm_up
from nanoserve.bench.peers import PeerUnavailable
from nanoserve.bench.peers.start import make_vllm_peer, peer_settings, start_vllm
from nanoserve.bench.workloads import Request
from nanoserve.structured.matcher import StructuredStats

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
# Extraction-style records: long key names and enums are what a grammar forces; strings and
# numbers are what the model chooses.
BENCH_SCHEMAS = [
    {"type": "object", "additionalProperties": False,
     "required": ["customer_name", "customer_email_address", "account_status", "lifetime_order_count"],
     "properties": {"customer_name": _NAME,
                    "customer_email_address": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
                    "account_status": {"enum": ["active", "suspended", "closed"]},
                    "lifetime_order_count": {"type": "integer", "minimum": 0, "maximum": 9999}}},
    {"type": "object", "additionalProperties": False, "required": ["invoice_number", "line_items", "currency"],
     "properties": {"invoice_number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
                    "currency": {"enum": ["USD", "EUR", "GBP"]},
                    "line_items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                        "type": "object", "additionalProperties": False,
                        "required": ["product_description", "quantity", "unit_price_cents"],
                        "properties": {"product_description": _NAME,
                                       "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                       "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 99999}}}}}},
    {"type": "object", "additionalProperties": False,
     "required": ["sentiment_label", "confidence_bucket", "mentions_competitor", "primary_topic"],
     "properties": {"sentiment_label": {"enum": ["very_negative", "negative", "neutral", "positive",
                                                 "very_positive"]},
                    "confidence_bucket": {"enum": ["low", "medium", "high"]},
                    "mentions_competitor": {"type": "boolean"},
                    "primary_topic": {"enum": ["pricing", "shipping", "quality", "support", "other"]}}},
    {"type": "object", "additionalProperties": False, "required": ["title", "summary", "keywords"],
     "properties": {"title": _NAME, "summary": {"type": "string", "maxLength": 80},
                    "keywords": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}},
]
LOW_CONCURRENCY = 2


def _constrained(r: Request, i: int, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed + i if temperature > 0 else None,
                          max_tokens=r.max_tokens, detokenize=False,
                          structured_outputs={"json": BENCH_SCHEMAS[i % len(BENCH_SCHEMAS)],
                                              "disable_any_whitespace": True})


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _run(llm: LLM, requests: list[Request], params, jump_forward: bool | None = None) -> dict:
    structured = llm.engine.structured
    if jump_forward is not None:
        structured.jump_forward = jump_forward  # what LLM(structured_outputs_jump_forward=...) sets
    structured.stats = StructuredStats()
    index = {id(r): i for i, r in enumerate(requests)}
    run = drive(llm, requests, lambda r: params(r, index[id(r)]))
    lengths = [len(o.outputs[0].token_ids) for o in run.outputs]
    stats = structured.stats
    return {"wall_s": run.wall_s, "output_tokens": sum(lengths), "output_tok_s": sum(lengths) / run.wall_s,
            "num_steps": len(run.steps), "lengths": lengths,
            "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in run.outputs),
            "mask_us_per_token": stats.mask_us_per_token, "forced_fraction": stats.forced_fraction,
            "rss_mb": _rss_mb()}


def _constrained_vs_twin(llm: LLM, requests: list[Request], args: argparse.Namespace, jump_forward: bool) -> dict:
    def constrained(r, i):
        return _constrained(r, i, args.temperature, args.seed)

    llm.reset_prefix_cache()
    res = _run(llm, requests, constrained, jump_forward)
    twins = [Request(r.prompt, n, r.arrival) for r, n in zip(requests, res.pop("lengths"))]
    llm.reset_prefix_cache()
    twin = _run(llm, twins, lambda r, i: SamplingParams(
        temperature=args.temperature, seed=args.seed + i if args.temperature > 0 else None,
        max_tokens=r.max_tokens, ignore_eos=True, detokenize=False))
    res["unconstrained_twin"] = {k: twin[k] for k in ("wall_s", "output_tok_s", "num_steps", "rss_mb")}
    res["speed_vs_unconstrained"] = res["output_tok_s"] / twin["output_tok_s"]
    return res


def _phase(llm: LLM, requests: list[Request], args: argparse.Namespace) -> dict:
    out = {}
    for name, jf in (("jump_forward_on", True), ("jump_forward_off", False)):
        runs = [_constrained_vs_twin(llm, requests, args, jf) for _ in range(args.repeat)]
        res = sorted(runs, key=lambda r: r["speed_vs_unconstrained"])[(len(runs) - 1) // 2]
        res["speed_vs_unconstrained_runs"] = [r["speed_vs_unconstrained"] for r in runs]
        out[name] = res
        twin = res["unconstrained_twin"]
        print(f"  {name} (median of {len(runs)}): {res['output_tok_s']:.1f} tok/s vs unconstrained twin "
              f"{twin['output_tok_s']:.1f} ({res['speed_vs_unconstrained']:.2f}x; runs "
              f"{', '.join(f'{x:.2f}' for x in res['speed_vs_unconstrained_runs'])}), wall {res['wall_s']:.2f} vs "
              f"{twin['wall_s']:.2f} s, steps {res['num_steps']} vs {twin['num_steps']}; "
              f"{res['finished_stop']}/{len(requests)} finished by the grammar; mask {res['mask_us_per_token']:.0f} "
              f"us/token; forced {res['forced_fraction']:.1%}; RSS {res['rss_mb']:.0f} MB", flush=True)
    return out


def _count_valid(texts: list[str], payloads: list[dict]) -> int | None:
    """How many of a peer's texts parse and validate against their schema (None: no jsonschema)."""
    try:
        import jsonschema
    except ImportError:
        return None
    valid = 0
    for text, payload in zip(texts, payloads):
        try:
            jsonschema.validate(json.loads(text), payload["schema"])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def _vs_vllm(args: argparse.Namespace, requests: list[Request], settings, concurrency: int, ours: dict) -> dict:
    """The same prompts and schemas through vLLM's structured outputs at the same concurrency."""
    payloads = [{"prompt": r.prompt, "max_tokens": r.max_tokens, "schema": BENCH_SCHEMAS[i % len(BENCH_SCHEMAS)]}
                for i, r in enumerate(requests)]
    peer = make_vllm_peer(args, dataclasses.replace(settings, max_num_seqs=concurrency), requests,
                          task="json", payloads=payloads)
    try:
        start_vllm(peer)
        runs = [peer.run_raw() for _ in range(args.repeat)]
    except PeerUnavailable as e:
        print(f"[vllm] skipped: {e}", flush=True)
        return {"skipped": str(e)}
    finally:
        peer.close()
    tok_s = [sum(r["counts"]) / r["wall_s"] for r in runs]
    median = statistics.median(tok_s)
    mid = runs[tok_s.index(sorted(tok_s)[(len(tok_s) - 1) // 2])]
    ours_tok_s = ours["jump_forward_on"]["output_tok_s"]
    out = {"version": peer.version, "dtype": peer.settings.dtype, "output_tok_s": median, "output_tok_s_runs": tok_s,
           "wall_s": mid["wall_s"], "output_tokens": sum(mid["counts"]), "finished_stop": mid["finished_stop"],
           "valid_json": _count_valid(mid.get("texts") or [], payloads), "nanoserve_speedup": ours_tok_s / median}
    print(f"  vLLM {peer.version} ({peer.settings.dtype}, structured outputs), median of {len(runs)}: "
          f"{median:.1f} tok/s, wall {mid['wall_s']:.2f} s for {out['output_tokens']} tokens, "
          f"{mid['finished_stop']}/{len(requests)} finished by the grammar ({out['valid_json']} parse and validate); "
          f"nanoserve jump-forward on "
          f"{out['nanoserve_speedup']:.2f}x its tok/s", flush=True)
    return out


def bench_json(args: argparse.Namespace, requests: list[Request], report: dict, make_llm) -> None:
    """`make_llm(args, requests, **overrides)` builds the engine (experiments.make_llm)."""
    report["json"] = {}
    phases = {args.max_num_seqs or len(requests): requests}
    phases.setdefault(LOW_CONCURRENCY, requests[: 2 * LOW_CONCURRENCY])
    for concurrency, reqs in phases.items():
        llm = make_llm(args, reqs, max_num_seqs=concurrency)
        if not args.no_warmup:
            warm_up(llm, args.seed)
            _run(llm, reqs[:1], lambda r, i: _constrained(r, i, args.temperature, args.seed))  # llguidance start-up
        settings = peer_settings(args, llm) if "vllm" in args.compare else None
        print(f"[json] {len(reqs)} requests, {concurrency} at a time", flush=True)
        phase = report["json"][f"concurrency_{concurrency}"] = _phase(llm, reqs, args)
        llm.close()
        if settings is not None:
            phase["vllm"] = _vs_vllm(args, reqs, settings, concurrency, phase)

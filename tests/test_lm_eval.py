"""NanoserveLM against lm-eval's own `hf` model on the same float32 checkpoint: the same
per-request loglikelihoods (1e-4), is_greedy flags and accuracy on a local multiple-choice task,
and the same rolling loglikelihoods and greedy generations."""
from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra is not installed (pip install nanoserve[eval])")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from nanoserve.integrations.lm_eval import NanoserveLM  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture(scope="module")
def models(tiny_model):
    ours = NanoserveLM(pretrained=tiny_model, dtype="float32", kvcache_block_size=8, num_kvcache_blocks=256,
                       max_model_len=512)
    theirs = HFLM(pretrained=tiny_model, dtype="float32", device="cpu", batch_size=4, max_length=512)
    return ours, theirs


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    """The task YAML with its data file's absolute path (datasets resolves paths from the cwd)."""
    root = tmp_path_factory.mktemp("tasks")
    yaml = (DATA / "nanoserve_mcq.yaml").read_text().replace("nanoserve_mcq.jsonl", str(DATA / "nanoserve_mcq.jsonl"))
    (root / "nanoserve_mcq.yaml").write_text(yaml)
    return TaskManager(include_path=str(root))


def evaluate(model, task_manager):
    result = lm_eval.simple_evaluate(model=model, tasks=["nanoserve_mcq"], task_manager=task_manager,
                                     log_samples=True, bootstrap_iters=0)
    samples = sorted(result["samples"]["nanoserve_mcq"], key=lambda s: s["doc_id"])
    return result["results"]["nanoserve_mcq"]["acc,none"], samples


def test_local_task_matches_lm_eval_hf_model(models, task_manager):
    ours, theirs = models
    acc, samples = evaluate(ours, task_manager)
    hf_acc, hf_samples = evaluate(theirs, task_manager)
    assert len(samples) == 6
    assert acc == hf_acc
    for s, h in zip(samples, hf_samples, strict=True):
        assert s["arguments"] == h["arguments"]  # same context / continuation strings
        for (lp, greedy), (hf_lp, hf_greedy) in zip((r[0] for r in s["resps"]), (r[0] for r in h["resps"]),
                                                    strict=True):
            assert lp == pytest.approx(hf_lp, abs=1e-4)
            assert greedy == hf_greedy
    # the four choices of a question share its context: the engine served it from the prefix cache
    assert ours.llm.prefix_cache_hit_rate > 0


def test_loglikelihood_rolling_and_generate_until_match_hf(models):
    ours, theirs = models
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a test of rolling windows."]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(theirs.loglikelihood_rolling(rolling), abs=1e-4)
    gen = [Instance("generate_until", {}, (t, {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}), i)
           for i, t in enumerate(texts)]
    assert ours.generate_until(gen) == theirs.generate_until(gen)


def test_cli_module_registers_the_model():
    from lm_eval.api.registry import get_model

    assert get_model("nanoserve") is NanoserveLM

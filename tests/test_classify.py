"""Sequence classifiers (`*ForSequenceClassification`, runner="pooling"): LLM.classify against HF
transformers' own classifier on the same tiny checkpoints, activations by problem type, errors."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_no_leak

from nanoserve import LLM, PoolingParams, SamplingParams
from nanoserve.utils.tiny_classifier import build_tiny_classifier_checkpoint

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 6, "x", "once upon a time " * 20]
ENGINE = {"device": "cpu", "dtype": "float32", "kvcache_block_size": 8, "num_kvcache_blocks": 128,
          "max_model_len": 256, "max_num_batched_tokens": 48}  # long texts prefill in chunks


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "qwen3": build_tiny_classifier_checkpoint(root / "qwen3", "qwen3", seed=7, num_labels=3),
        "llama-one-label": build_tiny_classifier_checkpoint(root / "llama", "llama", seed=8, num_labels=1),
        "qwen2-multi-label": build_tiny_classifier_checkpoint(root / "qwen2", "qwen2", seed=9, num_labels=4,
                                                              problem_type="multi_label_classification"),
        "mistral-regression": build_tiny_classifier_checkpoint(root / "mistral", "mistral", seed=10, num_labels=2,
                                                               problem_type="regression"),
    }


@torch.inference_mode()
def hf_logits(path: str, texts: list[str]) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [model(**tokenizer(t, return_tensors="pt")).logits[0] for t in texts]


@pytest.mark.parametrize("name, activation", [
    ("qwen3", lambda x: x.softmax(-1)),
    ("llama-one-label", torch.sigmoid),
    ("qwen2-multi-label", torch.sigmoid),
    ("mistral-regression", lambda x: x),
])
def test_probs_match_hf_classifier(ckpts, name, activation):
    llm = LLM(ckpts[name], **ENGINE)  # runner "auto": the architecture name says pooling
    try:
        assert llm.config.runner == "pooling" and llm.config.pooling.task == "classify"
        outs = llm.classify(TEXTS, use_tqdm=False)
        raw = llm.classify(TEXTS, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
        for out, plain, logits in zip(outs, raw, hf_logits(ckpts[name], TEXTS)):
            assert out.outputs.num_classes == logits.shape[0]
            torch.testing.assert_close(torch.tensor(out.outputs.probs), activation(logits), atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(torch.tensor(plain.outputs.probs), logits, atol=2e-5, rtol=1e-4)
        assert outs[1].num_cached_tokens == 0 and raw[1].num_cached_tokens > 0  # the second pass hit the cache
        assert_no_leak(llm)
    finally:
        llm.close()


def test_encode_gives_the_probs_as_a_tensor_and_keeps_order(ckpts):
    llm = LLM(ckpts["qwen3"], **ENGINE)
    try:
        probs = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
        encoded = llm.encode(list(reversed(TEXTS)), use_tqdm=False, pooling_task="classify")
        for out, expected in zip(encoded, reversed(probs)):
            assert out.outputs.data.dtype == torch.float32
            torch.testing.assert_close(out.outputs.data, torch.tensor(expected), atol=1e-6, rtol=0)
    finally:
        llm.close()


def test_tasks_and_runners_are_checked_before_work(ckpts, tiny_model, tmp_path):
    llm = LLM(ckpts["qwen3"], **ENGINE)
    try:
        next_id = llm.engine._next_request_id
        with pytest.raises(ValueError, match="sequence classifier; use llm.classify"):
            llm.embed(TEXTS)
        with pytest.raises(ValueError, match="sequence classifier; use llm.classify"):
            llm.encode(TEXTS, pooling_task="embed")
        with pytest.raises(ValueError, match="dimensions is for embeddings"):
            llm.classify(TEXTS, pooling_params=PoolingParams(dimensions=2))
        with pytest.raises(ValueError, match="num_labels=3"):
            llm.score(TEXTS[0], TEXTS[1])
        with pytest.raises(TypeError, match="does not generate"):
            llm.generate(TEXTS, SamplingParams(max_tokens=2))
        assert llm.engine._next_request_id == next_id
        assert_no_leak(llm)
    finally:
        llm.close()
    with pytest.raises(ValueError, match="sequence classifier without an LM head, so it cannot generate"):
        LLM(ckpts["qwen3"], runner="generate", device="cpu")
    generator = LLM(tiny_model, device="cpu", dtype="float32", num_kvcache_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generator.classify(TEXTS)


def test_bad_problem_type_is_refused(tmp_path):
    import json

    path = build_tiny_classifier_checkpoint(tmp_path / "bad", num_labels=2)
    config_path = f"{path}/config.json"
    with open(config_path) as f:
        config = json.load(f)
    config["problem_type"] = "ranking"
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="problem_type must be one of"):
        LLM(path, device="cpu")


def test_ray_predictor_classify_mode(ckpts):
    from nanoserve.ray import ERROR_COLUMN, LLMPredictor  # Ray itself is not needed to call an actor's class

    predictor = LLMPredictor(ckpts["qwen3"], engine_kwargs=ENGINE, task_type="classify", should_continue_on_error=True)
    batch = {"id": [0, 1, 2], "prompt": [TEXTS[0], "", TEXTS[1]]}
    out = predictor(batch)
    assert out["id"] == [0, 1, 2] and out["embeddings"][1] is None and "empty" in out[ERROR_COLUMN][1]
    expected = hf_logits(ckpts["qwen3"], [TEXTS[0], TEXTS[1]])
    for row, logits in zip((0, 2), expected):
        torch.testing.assert_close(torch.tensor(out["embeddings"][row]), logits.softmax(-1), atol=2e-5, rtol=1e-4)
    predictor.llm.close()
    with pytest.raises(ValueError, match="task 'embed' was asked, but .* is a sequence classifier"):
        LLMPredictor(ckpts["qwen3"], engine_kwargs=ENGINE, task_type="embed")


def test_task_and_convert_must_match_the_architecture(ckpts, tiny_model):
    with pytest.raises(ValueError, match="task 'classify' was asked, but 'Qwen3ForCausalLM' is an embedding"):
        LLM(tiny_model, task="classify", device="cpu")
    with pytest.raises(ValueError, match="task 'embed' was asked, but 'Qwen3ForSequenceClassification' is a sequence"):
        LLM(ckpts["qwen3"], convert="embed", device="cpu")
    llm = LLM(ckpts["qwen3"], task="classify", **ENGINE)
    try:
        assert llm.config.pooling.task == "classify"
        with pytest.raises(ValueError, match="sequence classifier; use llm.classify"):
            list(llm.embed_stream(TEXTS[:1]))
    finally:
        llm.close()


def test_pooler_config_sets_the_default_activation_a_request_may_override(ckpts):
    llm = LLM(ckpts["qwen3"], pooler_config={"use_activation": False}, **ENGINE)
    try:
        (logits,) = hf_logits(ckpts["qwen3"], TEXTS[:1])
        raw = llm.classify(TEXTS[:1], use_tqdm=False)[0].outputs.probs
        probs = llm.classify(TEXTS[:1], use_tqdm=False, pooling_params=PoolingParams(use_activation=True))[0]
        torch.testing.assert_close(torch.tensor(raw), logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(probs.outputs.probs), logits.softmax(-1), atol=2e-5, rtol=1e-4)
    finally:
        llm.close()


def test_score_with_a_one_label_classifier_is_cross_encoding(ckpts):
    """vLLM's cross-encoder scoring: each pair tokenized as text and text pair, the sigmoid of the one logit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = ckpts["llama-one-label"]
    llm = LLM(path, **ENGINE)
    try:
        query, docs = "what is a paged KV cache?", ["blocks of keys and values", "a kind of fish", "x"]
        outs = llm.score(query, docs, use_tqdm=False)
        tokenizer = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        for out, doc in zip(outs, docs):
            ids = tokenizer(text=query, text_pair=doc)["input_ids"]
            with torch.inference_mode():
                expected = hf(torch.tensor([ids])).logits[0, 0].sigmoid().item()
            assert out.prompt_token_ids == ids and out.outputs.score == pytest.approx(expected, abs=2e-5)
        assert_no_leak(llm)
    finally:
        llm.close()
    three = LLM(ckpts["qwen3"], **ENGINE)
    with pytest.raises(ValueError, match="num_labels=3"):
        three.score("a", "b")
    three.close()


def test_label_count_comes_from_id2label_first(tmp_path):
    import json

    path = build_tiny_classifier_checkpoint(tmp_path / "labels", num_labels=3)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config["num_labels"] = 5  # stale: transformers and vLLM count id2label
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    llm = LLM(path, **ENGINE)
    assert llm.config.pooling.num_labels == 3 and llm.classify(["hi"], use_tqdm=False)[0].outputs.num_classes == 3
    llm.close()

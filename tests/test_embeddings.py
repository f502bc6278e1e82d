"""Embeddings (runner="pooling"): vectors vs sentence-transformers on the same tiny checkpoint,
Matryoshka, truncation, errors before work, prefix-cache hits, run-batch /v1/embeddings."""
from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
import torch
from helpers import assert_no_leak, make_llm

from nanoserve import LLM, PoolingParams, RequestError, SamplingParams
from nanoserve.cli import main
from nanoserve.config import STEP_TOKENS, Config
from nanoserve.utils.tiny_embedding import build_tiny_embedding_checkpoint

# Docs of varied lengths (after tokenization about 5 to 300 tokens); with max_num_batched_tokens=64
# the long ones are prefilled in chunks over several steps, packed beside short ones.
DOCS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 8,
    "x",
    "def add(a, b):\n    return a + b\n" * 20,
    "Instruct: Given a web search query, retrieve relevant passages\nQuery: what is a paged KV cache?",
    "once upon a time " * 40,
]
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
QUERIES = [INSTRUCTION + q for q in ("paged attention", "prefix caching in vLLM", "what is a tokenizer", "rope")]
POOLING = {"device": "cpu", "dtype": "float32", "kvcache_block_size": 8, "num_kvcache_blocks": 256,
           "max_model_len": 512, "max_num_batched_tokens": 64, "runner": "pooling"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("embedding_models")
    return {
        # Qwen3-Embedding's layout: base model (no `model.` prefix, no LM head), last token, normalised.
        "last": build_tiny_embedding_checkpoint(root / "last", seed=3),
        # A causal-LM layout with an untied LM head in the file; mean pooling, no Normalize, no Matryoshka.
        "mean": build_tiny_embedding_checkpoint(root / "mean", seed=4, pooling_mode="mean", normalize=False,
                                                base_model=False, matryoshka=False, tie_word_embeddings=False),
        "cls": build_tiny_embedding_checkpoint(root / "cls", seed=5, pooling_mode="cls", matryoshka=[16, 32]),
    }


@pytest.fixture(scope="module")
def llm(ckpts) -> LLM:
    return LLM(ckpts["last"], **POOLING)


def st_encode(path: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    return model.encode(texts, batch_size=4, convert_to_numpy=True)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---- against sentence-transformers -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_vectors_match_sentence_transformers(ckpts, kind):
    llm = LLM(ckpts[kind], **POOLING) if kind != "last" else None
    try:
        llm = llm or LLM(ckpts[kind], **POOLING)
        outs = llm.embed(DOCS, use_tqdm=False)
        ref = st_encode(ckpts[kind], DOCS)
        tokenizer = llm.get_tokenizer()
        for doc, out, expected in zip(DOCS, outs, ref):
            assert out.prompt_token_ids == tokenizer(doc)["input_ids"]  # with the appended end-of-text
            assert out.outputs.hidden_size == expected.shape[0]
            assert cosine(out.outputs.embedding, expected) >= 0.9999
            if kind == "mean":  # no Normalize module: the raw mean, length included
                np.testing.assert_allclose(out.outputs.embedding, expected, rtol=1e-4, atol=1e-4)
            else:
                assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5
        # Mean and CLS read every position: their engines take no prefix-cache hits.
        assert llm.engine.block_manager.enable_prefix_caching == (kind == "last")
        assert_no_leak(llm)
    finally:
        llm.close()


def test_bf16_vectors_match_float32_with_p_rounded_for_p_v(ckpts, llm, monkeypatch):
    # A bf16 pooling engine: within bf16's error of the float32 one. On AVX512-BF16 CPUs its long query
    # runs take the dpbf16 prefill attention with P rounded to bf16 for P . V (a generating engine
    # keeps P in float32): the vectors must not drift further for it.
    from nanoserve.kernels import cpu_attention, cpu_kernels

    calls, dpbf16 = [], cpu_attention.prefill_attention_dpbf16
    monkeypatch.setattr(cpu_attention, "prefill_attention_dpbf16",
                        lambda *args, **kwargs: calls.append(kwargs.get("p_bf16")) or dpbf16(*args, **kwargs))
    ref = llm.embed(DOCS, use_tqdm=False)
    bf16 = LLM(ckpts["last"], **{**POOLING, "dtype": "bfloat16"})
    try:
        got = bf16.embed(DOCS, use_tqdm=False)
        assert_no_leak(bf16)
    finally:
        bf16.close()
    for a, b in zip(got, ref):
        assert cosine(a.outputs.embedding, b.outputs.embedding) >= 0.9995
    lib = cpu_kernels.load()
    if lib is not None and lib.prefill_attention_dpbf16_supported():  # the tiny model's head_dim is 16's multiple
        assert calls and all(calls)


def test_last_token_pooling_runs_the_last_layer_past_attention_on_pooled_rows_only(llm):
    # Past its attention the last layer computes only the rows the pooler reads (one a completing
    # prompt, or one when none completes); the layers before it, and its K/V, see every token.
    layers = llm.engine.model_runner.model.model.layers
    seen = {"first": [], "last": []}
    hooks = [layers[0].mlp.register_forward_hook(lambda m, args, out: seen["first"].append(args[0].shape[0])),
             layers[-1].mlp.register_forward_hook(lambda m, args, out: seen["last"].append(args[0].shape[0]))]
    try:
        llm.reset_prefix_cache()
        outs = llm.embed(DOCS, use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    tokens = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)
    assert sum(seen["first"]) == tokens
    assert len(seen["last"]) == len(seen["first"])  # one call a step
    assert len(DOCS) <= sum(seen["last"]) < tokens  # one row per prompt, plus one per step completing none
    assert sum(seen["last"]) <= len(DOCS) + len(seen["last"])


def test_no_lm_head_is_built(llm, ckpts):
    model = llm.engine.model_runner.model
    assert not hasattr(model, "lm_head")
    assert not any("lm_head" in name for name, _ in model.named_parameters())
    with LLM(ckpts["mean"], **POOLING) as untied:  # its file holds lm_head.weight: skipped, not loaded
        assert not hasattr(untied.engine.model_runner.model, "lm_head")


def test_encode_gives_the_same_vectors_as_a_tensor(llm):
    embedded = llm.embed(DOCS[:2], use_tqdm=False)
    encoded = llm.encode(DOCS[:2], use_tqdm=False, pooling_task="embed")
    for e, p in zip(embedded, encoded):
        assert p.outputs.data.dtype == torch.float32
        np.testing.assert_allclose(p.outputs.data.tolist(), e.outputs.embedding, atol=1e-6)  # 2nd run hits the cache
    with pytest.raises(ValueError, match="pooling_task"):
        llm.encode(DOCS[:1], pooling_task="classify")


def test_prompt_forms_and_order(llm):
    ids = llm.get_tokenizer().encode(DOCS[1])
    outs = llm.embed([{"prompt": DOCS[1]}, ids, {"prompt_token_ids": ids}, DOCS[1]], use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for out in outs[1:]:
        np.testing.assert_allclose(out.outputs.embedding, outs[0].outputs.embedding, atol=1e-6)


# ---- LLM.score: cosine of the two sides' embeddings, as vLLM scores with an embedding model ----


def test_score_pairs_one_to_n_and_n_to_n_against_sentence_transformers(ckpts):
    llm = LLM(ckpts["mean"], **POOLING)  # not normalised: the cosine must divide by both norms
    try:
        query, docs = QUERIES[0], DOCS[:3]
        ref = st_encode(ckpts["mean"], [query, *docs])
        one_to_n = llm.score(query, docs, use_tqdm=False)
        assert [round(o.outputs.score, 5) for o in one_to_n] == [round(cosine(ref[0], r), 5) for r in ref[1:]]
        n_to_n = llm.score(docs, list(reversed(docs)), use_tqdm=False)
        for out, (a, b) in zip(n_to_n, zip(docs, reversed(docs))):
            assert out.outputs.score == pytest.approx(cosine(ref[1 + docs.index(a)], ref[1 + docs.index(b)]), abs=1e-5)
        assert n_to_n[1].outputs.score == pytest.approx(1.0, abs=1e-6)  # the middle doc against itself
        (one,) = llm.score({"prompt": query}, {"prompt_token_ids": llm.get_tokenizer().encode(docs[0])},
                           use_tqdm=False)
        assert one.outputs.score == pytest.approx(one_to_n[0].outputs.score, abs=1e-6)
        assert_no_leak(llm)
    finally:
        llm.close()


def test_score_reports_both_prompts_token_ids_and_the_pair_id(llm):
    tokenizer = llm.get_tokenizer()
    out, = llm.score(DOCS[0], DOCS[2], use_tqdm=False)
    pad = [] if tokenizer.pad_token_id is None else [tokenizer.pad_token_id]
    assert out.prompt_token_ids == tokenizer(DOCS[0])["input_ids"] + pad + tokenizer(DOCS[2])["input_ids"]
    left, right = out.request_id.split("_")
    assert int(right) == int(left) + 1  # one batch: the left side first
    assert isinstance(out.outputs.score, float) and -1.0 <= out.outputs.score <= 1.0


@pytest.mark.parametrize("data_1, data_2, match", [
    (DOCS[:2], DOCS[:3], "1:1, 1:N or N:N; got 2 and 3"),
    ([], DOCS[:1], "at least one prompt in data_1"),
    (DOCS[0], [], "at least one prompt in data_2"),
    (DOCS[0], ["fine", ""], "prompt is empty"),  # a bad prompt on either side stops the whole call
])
def test_score_bad_pairings_fail_before_work(llm, data_1, data_2, match):
    next_id = llm.engine._next_request_id
    with pytest.raises(ValueError, match=match):
        llm.score(data_1, data_2)
    assert llm.engine._next_request_id == next_id  # nothing was queued
    assert_no_leak(llm)


def test_score_needs_a_pooling_engine(tiny_model):
    with pytest.raises(ValueError, match="runner='pooling'"):
        make_llm(tiny_model).score("a", "b")


# ---- Matryoshka, normalisation, truncation ---------------------------------------------------


def test_matryoshka_cuts_then_renormalises(llm):
    raw = llm.encode(DOCS[:3], PoolingParams(use_activation=False), use_tqdm=False)
    cut = llm.embed(DOCS[:3], PoolingParams(dimensions=16), use_tqdm=False)
    for r, c in zip(raw, cut):
        assert c.outputs.hidden_size == 16
        expected = torch.nn.functional.normalize(r.outputs.data[:16], dim=-1)
        np.testing.assert_allclose(c.outputs.embedding, expected.tolist(), atol=1e-6)
    old_name = llm.embed(DOCS[:1], PoolingParams(normalize=False), use_tqdm=False)[0]
    # Unnormalised (a batch of one against three: equal on the CPU, within float32 rounding on a GPU).
    np.testing.assert_allclose(old_name.outputs.embedding, raw[0].outputs.data.tolist(), rtol=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode(DOCS[3])
    assert len(ids) > 40
    out = llm.embed([DOCS[3]], truncate_prompt_tokens=40, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-40:]
    direct = llm.embed([ids[-40:]], use_tqdm=False)[0]
    np.testing.assert_allclose(out.outputs.embedding, direct.outputs.embedding, atol=1e-6)
    too_long = ids * 4  # 4 x > 512 tokens
    assert len(too_long) > 512
    out = llm.embed([too_long], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == too_long[-512:]
    for bad in (0, -2, 513, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.embed([DOCS[3]], truncate_prompt_tokens=bad)


# ---- errors, before any work -----------------------------------------------------------------


@pytest.mark.parametrize("prompt, params, kind, match", [
    ("", None, ValueError, "prompt is empty"),
    ([], None, ValueError, "at least one token"),
    ([7] * 600, None, ValueError, "longer than max_model_len=512; pass truncate_prompt_tokens"),
    ("hi", PoolingParams(dimensions=65), ValueError, "exceeds the model's hidden_size=64"),
    ("hi", SamplingParams(), TypeError, "must be PoolingParams"),
])
def test_bad_requests_fail_before_work(llm, prompt, params, kind, match):
    steps = llm.engine.scheduler.num_preemptions, llm.engine._next_request_id
    with pytest.raises(kind, match=match):
        llm.embed(["fine", prompt], params if not isinstance(params, SamplingParams) else [PoolingParams(), params])
    assert (llm.engine.scheduler.num_preemptions, llm.engine._next_request_id) == steps  # nothing was queued
    assert_no_leak(llm)


def test_dimensions_need_a_matryoshka_model(ckpts):
    with LLM(ckpts["mean"], **POOLING) as plain:
        with pytest.raises(ValueError, match="does not support Matryoshka"):
            plain.embed(["hi"], PoolingParams(dimensions=8))
    with LLM(ckpts["cls"], **POOLING) as listed:
        assert listed.embed(["hi"], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.hidden_size == 32
        with pytest.raises(ValueError, match=r"not one of the model's matryoshka_dimensions \[16, 32\]"):
            listed.embed(["hi"], PoolingParams(dimensions=24))


def test_one_runner_per_engine(llm, ckpts, tiny_model):
    with pytest.raises(TypeError, match="does not generate"):
        llm.generate(["hi"], SamplingParams(max_tokens=2))
    generator = make_llm(tiny_model)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generator.embed(["hi"])
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(ckpts["last"], runner="generate", device="cpu")


def test_runner_names_and_refusals(ckpts, tmp_path):
    for kwargs in ({}, {"task": "embed"}, {"convert": "embed"}, {"runner": "auto"}):  # Qwen3Model: auto pools
        kw = {**POOLING, **kwargs}
        kw.pop("runner") if "runner" not in kwargs else None
        with LLM(ckpts["last"], **kw) as llm:
            assert llm.config.runner == "pooling"
    with pytest.raises(ValueError, match="different runners"):
        LLM(ckpts["last"], runner="generate", task="embed")
    bidirectional = build_tiny_embedding_checkpoint(tmp_path / "bidi")
    _edit_json(bidirectional + "/config.json", is_causal=False)
    with pytest.raises(ValueError, match="is_causal: false.*bidirectional"):
        LLM(bidirectional, **POOLING)
    max_pooled = build_tiny_embedding_checkpoint(tmp_path / "max")
    _edit_json(max_pooled + "/1_Pooling/config.json", pooling_mode_lasttoken=False, pooling_mode_max_tokens=True)
    with pytest.raises(ValueError, match="pooling mode 'max' is not supported"):
        LLM(max_pooled, **POOLING)
    with LLM(max_pooled, pooler_config={"pooling_type": "LAST"}, **POOLING) as overridden:  # vLLM's override
        assert overridden.config.pooling.pooling_type == "LAST"


def test_step_budget_default_is_per_runner_and_device(ckpts, tiny_model):
    unset = {k: v for k, v in POOLING.items() if k != "max_num_batched_tokens"}
    assert Config(ckpts["last"], **unset).max_num_batched_tokens == STEP_TOKENS["pooling_cpu"]
    assert Config(ckpts["last"], **unset, max_num_batched_tokens=100).max_num_batched_tokens == 100
    assert Config(tiny_model, device="cpu").max_num_batched_tokens == STEP_TOKENS["default"]
    # Without chunked prefill the default grows to hold the longest prompt instead of refusing.
    longest = STEP_TOKENS["pooling_cpu"] + 8
    unchunked = Config(ckpts["last"], **{**unset, "max_model_len": longest}, enable_chunked_prefill=False)
    assert unchunked.max_num_batched_tokens == longest
    with pytest.raises(ValueError, match="max_num_batched_tokens=64 must be >= max_model_len"):
        Config(ckpts["last"], **{**POOLING, "max_model_len": longest}, enable_chunked_prefill=False)


def test_sentence_bert_config_lowercases_and_caps_the_default_length(tmp_path):
    # sentence_bert_config.json: do_lower_case (sentence-transformers and vLLM lowercase every text)
    # and max_seq_length (vLLM's default max_model_len; sentence-transformers cuts longer texts).
    path = build_tiny_embedding_checkpoint(tmp_path / "lower", seed=6, max_seq_length=24)
    _edit_json(path + "/sentence_bert_config.json", do_lower_case=True)
    texts = ["Hello World", "THE Quick Brown FOX", "hello world"]
    unset = {k: v for k, v in POOLING.items() if k != "max_model_len"}
    with LLM(path, **unset) as llm:
        assert llm.config.max_model_len == 24
        outs = llm.embed(texts, use_tqdm=False)
        assert outs[0].prompt_token_ids == outs[2].prompt_token_ids
        for out, expected in zip(outs, st_encode(path, texts)):
            assert cosine(out.outputs.embedding, expected) >= 0.9999
        with pytest.raises(ValueError, match="longer than max_model_len=24"):
            llm.embed(["once upon a time " * 10])
    with LLM(path, **unset, max_model_len=64) as llm:  # an explicit length is kept
        assert llm.config.max_model_len == 64


def test_config_sentence_transformers_truncate_dim_and_matryoshka(tmp_path):
    # truncate_dim: sentence-transformers cuts every vector to it, so a request asking for no size does
    # too (and may ask for another); matryoshka keys there count as they do in config.json.
    path = build_tiny_embedding_checkpoint(tmp_path / "cut", seed=7, matryoshka=False)
    _write_json(path + "/config_sentence_transformers.json", {"truncate_dim": 16, "prompts": {"query": "q: "}})
    with LLM(path, **POOLING) as llm:
        outs = llm.embed(DOCS[:3], use_tqdm=False)
        for out, expected in zip(outs, st_encode(path, DOCS[:3])):
            assert out.outputs.hidden_size == expected.shape[0] == 16
            assert cosine(out.outputs.embedding, expected) >= 0.9999
        full = llm.embed(DOCS[:1], PoolingParams(dimensions=64), use_tqdm=False)[0]
        np.testing.assert_allclose(torch.nn.functional.normalize(torch.tensor(full.outputs.embedding[:16]), dim=0),
                                   outs[0].outputs.embedding, atol=1e-5)
    _write_json(path + "/config_sentence_transformers.json", {"matryoshka_dimensions": [8, 16]})
    with LLM(path, **POOLING) as llm:
        assert llm.embed(["hi"], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.hidden_size == 8
        assert llm.embed(["hi"], use_tqdm=False)[0].outputs.hidden_size == 64
        with pytest.raises(ValueError, match="matryoshka_dimensions"):
            llm.embed(["hi"], PoolingParams(dimensions=12))
    _write_json(path + "/config_sentence_transformers.json", {"truncate_dim": 65})
    with pytest.raises(ValueError, match="truncate_dim must be an int in \\[1, hidden_size=64\\]"):
        LLM(path, **POOLING)


def test_include_prompt_false_pools_every_token_as_vllm(tmp_path):
    # sentence-transformers drops only a prompt passed apart from the text (encode(prompt=...)); a
    # prompt given to nanoserve is part of the text, so, as vLLM, every token is pooled: the same
    # vector as sentence-transformers' for the text alone.
    path = build_tiny_embedding_checkpoint(tmp_path / "no_prompt", seed=8, pooling_mode="mean")
    _edit_json(path + "/1_Pooling/config.json", include_prompt=False)
    with LLM(path, **POOLING) as llm:
        assert llm.config.pooling.pooling_type == "MEAN"
        for out, expected in zip(llm.embed(DOCS[:3], use_tqdm=False), st_encode(path, DOCS[:3])):
            assert cosine(out.outputs.embedding, expected) >= 0.9999


def test_hf_overrides_and_override_pooler_config_as_vllm(ckpts):
    # vLLM's docs give Qwen3-Embedding its Matryoshka sizes with hf_overrides; override_pooler_config
    # is vLLM's older name of pooler_config.
    with LLM(ckpts["mean"], **POOLING, hf_overrides={"matryoshka_dimensions": [8]},
             override_pooler_config={"pooling_type": "LAST"}) as llm:
        assert llm.config.pooling.pooling_type == "LAST"
        assert llm.embed(["hi"], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.hidden_size == 8
    with pytest.raises(ValueError, match="is_causal: false"):
        LLM(ckpts["last"], **POOLING, hf_overrides={"is_causal": False})
    with pytest.raises(TypeError, match="hf_overrides must be a dict"):
        LLM(ckpts["last"], **POOLING, hf_overrides=lambda cfg: cfg)


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def _edit_json(path: str, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)


# ---- the prefix cache ------------------------------------------------------------------------


def test_shared_instruction_hits_the_prefix_cache_with_the_same_vectors(llm, ckpts):
    with LLM(ckpts["last"], **{**POOLING, "enable_prefix_caching": False}) as cold:
        expected = cold.embed(QUERIES, use_tqdm=False)
    llm.reset_prefix_cache()
    llm.embed(QUERIES[:1], use_tqdm=False)  # warms the instruction's blocks
    before = llm.prefix_cache_stats["hits"]
    warm = llm.embed(QUERIES + QUERIES[:1], use_tqdm=False)
    prefix_len = len(llm.get_tokenizer().encode(INSTRUCTION)) - 1  # without the appended end-of-text
    for out, ref in zip(warm, expected + expected[:1]):
        assert out.num_cached_tokens >= (prefix_len // 8) * 8 > 0
        np.testing.assert_allclose(out.outputs.embedding, ref.outputs.embedding, atol=1e-5)
    # A fully cached prompt still computes its last position (what last-token pooling reads).
    assert warm[-1].num_cached_tokens < len(warm[-1].prompt_token_ids)
    assert llm.prefix_cache_stats["hits"] > before
    assert_no_leak(llm)


# ---- streams and run-batch -------------------------------------------------------------------


def test_embed_stream_yields_every_prompt_and_errors_in_place(llm):
    expected = llm.embed(DOCS, use_tqdm=False)
    got = dict(llm.embed_stream(iter(DOCS[:3] + [""] + DOCS[3:]), max_inflight=2, use_tqdm=False))
    assert isinstance(got[3], RequestError) and "empty" in got[3].message
    with pytest.raises(TypeError, match="one PoolingParams for every prompt"):
        llm.embed_stream(DOCS[:2], [PoolingParams(), PoolingParams()])
    for i, ref in zip([0, 1, 2, 4, 5, 6], expected):
        np.testing.assert_allclose(got[i].outputs.embedding, ref.outputs.embedding, atol=1e-6)
    assert_no_leak(llm)


def test_an_abandoned_stream_drops_the_mean_pooling_partials(ckpts):
    with LLM(ckpts["mean"], **POOLING) as llm:
        pooler = llm.engine.model_runner.pooler
        stream = llm.embed_stream(iter(["x", DOCS[5], DOCS[3]]), max_inflight=3, use_tqdm=False)
        index, _ = next(stream)
        assert index == 0 and pooler.num_partials > 0  # the long documents are part-way through their prefill
        stream.close()  # aborts them
        assert pooler.num_partials == 0
        assert_no_leak(llm)
        again = llm.embed(DOCS[5:6], use_tqdm=False)[0]
        np.testing.assert_allclose(again.outputs.embedding, st_encode(ckpts["mean"], DOCS[5:6])[0], rtol=1e-4,
                                   atol=1e-4)


def test_run_batch_embeddings(llm, ckpts, tmp_path):
    ids = llm.get_tokenizer().encode(DOCS[0])
    bodies = {
        "one": {"input": DOCS[1]},
        "many": {"input": DOCS[:3], "model": "last"},
        "ids": {"input": ids},
        "many-ids": {"input": [ids, ids[:2]]},
        "b64": {"input": DOCS[3], "encoding_format": "base64", "dimensions": 32},
    }
    lines = [{"custom_id": k, "method": "POST", "url": "/v1/embeddings", "body": b} for k, b in bodies.items()]
    lines += [
        {"custom_id": "gen", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}},
        {"custom_id": "big", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 999}},
        {"custom_id": "empty", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["a", ""]}},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in POOLING.items()]
    assert main(["run-batch", "-i", str(src), "-o", str(dst), "--model", ckpts["last"], "--no-progress-bar",
                 "--max-num-seqs=2", *flags]) == 1  # some lines failed
    records = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(records) == {line["custom_id"] for line in lines}
    for cid, match in (("gen", "URL '/v1/completions'"), ("big", "dimensions=999"), ("empty", "empty")):
        assert records[cid]["response"]["status_code"] == 400 and match in records[cid]["error"]["message"]

    def vectors(cid):
        body = records[cid]["response"]["body"]
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        return [d["embedding"] for d in body["data"]]

    for cid, prompts in (("one", [DOCS[1]]), ("many", DOCS[:3]), ("ids", [ids]), ("many-ids", [ids, ids[:2]])):
        expected = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
        np.testing.assert_allclose(vectors(cid), expected, atol=1e-5)
    usage = records["many"]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(len(llm.get_tokenizer().encode(d)) for d in DOCS[:3])
    (packed,) = vectors("b64")
    decoded = struct.unpack("<32f", base64.b64decode(packed))
    expected = llm.embed([DOCS[3]], PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(decoded, expected, atol=1e-5)


def test_ray_predictor_embed_mode_adds_embeddings(llm, ckpts):
    from nanoserve.ray import ERROR_COLUMN, LLMPredictor  # Ray itself is not needed to call an actor's class

    engine = {k: v for k, v in POOLING.items() if k != "runner"}
    predictor = LLMPredictor(ckpts["last"], engine_kwargs=engine, task_type="embed", should_continue_on_error=True,
                             pooling_params={"dimensions": 32})
    batch = {"id": [0, 1, 2], "prompt": [DOCS[0], "", DOCS[1]], "pooling_params": [None, None, {"dimensions": 16}]}
    out = predictor(batch)
    assert out["id"] == [0, 1, 2] and out[ERROR_COLUMN][0] is None and "empty" in out[ERROR_COLUMN][1]
    assert out["embeddings"][1] is None
    for i, dims in ((0, 32), (2, 16)):
        [expected] = llm.embed([batch["prompt"][i]], PoolingParams(dimensions=dims), use_tqdm=False)
        np.testing.assert_allclose(out["embeddings"][i], expected.outputs.embedding, atol=1e-6)
        assert out["num_input_tokens"][i] == len(expected.prompt_token_ids)
    predictor.llm.close()


def test_bench_embed_workload_runs_both_sides(ckpts):
    from nanoserve.bench.cli import main as bench_main

    report = bench_main(["--workload", "embed", "--model", ckpts["last"], "--num-seqs", "3", "--input-len", "8", "16",
                         "--repeat", "1", "--st-batch-sizes", "2", "--no-warmup", "--device", "cpu",
                         "--dtype", "float32"])
    # Each side in its fastest dtype: sentence-transformers in float32 on AVX2-only CPUs, bf16 with avx512_bf16.
    floor = 0.9999 if report["st_dtype"] == report["dtype"] == "float32" else 0.99
    assert report["min_cosine_docs"] >= floor and report["min_cosine_queries"] >= floor
    assert report["min_cosine_cache_on_vs_off"] >= 0.9999
    assert report["query_prefix_cache_hit_rate"] > 0  # the shared instruction is served from the cache
    assert report["nanoserve_docs_per_s"] > 0 and report["st_docs_per_s"] > 0


"""vLLM-parity sampling through LLM.generate: seeds, n > 1, stops, min_tokens, logprobs, chat."""
import json
import shutil

import pytest
import torch

from helpers import assert_no_leak, make_llm, random_prompts
from nanoserve import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model)


def tokens(out):
    return out.outputs[0].token_ids


def test_top_k_1_equals_greedy(llm):
    prompts = random_prompts(4, 5, 20, seed=1)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert [tokens(o) for o in greedy] == [tokens(o) for o in top1]


def test_seed_reproducible_alone_and_in_any_batch(llm):
    prompt = random_prompts(1, 12, 12, seed=2)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tokens(llm.generate([prompt], seeded, use_tqdm=False)[0])
    others = random_prompts(5, 3, 30, seed=3)
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = others[:2] + [prompt] + others[2:]
    params = [unseeded, unseeded, seeded, unseeded, unseeded, unseeded]
    mixed = llm.generate(batch, params, use_tqdm=False)
    assert tokens(mixed[2]) == alone
    reordered = llm.generate([prompt] + others, [seeded] + [unseeded] * 5, use_tqdm=False)
    assert tokens(reordered[0]) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert tokens(llm.generate([prompt], other_seed, use_tqdm=False)[0]) != alone


def test_engine_seed_makes_unseeded_runs_reproducible(tiny_model):
    prompts = random_prompts(3, 5, 10, seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = make_llm(tiny_model, seed=7).generate(prompts, params, use_tqdm=False)
    b = make_llm(tiny_model, seed=7).generate(prompts, params, use_tqdm=False)
    assert [tokens(o) for o in a] == [tokens(o) for o in b]


def test_n_samples_share_prompt_blocks(tiny_model):
    llm = make_llm(tiny_model, kvcache_block_size=8, enable_prefix_caching=False)
    prompt = random_prompts(1, 30, 30, seed=5)[0]  # 3 full blocks + 6 tokens
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    engine = llm.engine
    engine.add_request(prompt, params)
    engine.step()  # prefills the prompt once, samples, forks the other two samples
    bm = engine.block_manager
    assert bm.pool.num_blocks - bm.num_free_blocks == 4  # the prompt's blocks, not 3x them
    parent, *children = engine.scheduler.running
    assert len(children) == 2
    shared = parent.block_table[:3]
    assert all(bm.pool.blocks[b].ref_count == 3 for b in shared)
    assert all(c.block_table == shared for c in children)
    finished = []
    while not engine.is_finished():
        finished += engine.step().finished
    (out,) = finished
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_no_leak(llm)


def test_n_greedy_samples_are_identical(llm):
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def _greedy_with_text(llm, prompt, max_tokens=24):
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                   skip_special_tokens=False), use_tqdm=False)
    return out.outputs[0]


def _stop_across_a_token_boundary(llm):
    """A prompt, its greedy output, and a stop string first found in that output's text across a
    token boundary: the last two characters of one token and the first of the next. Prompts are
    tried in turn until one's output has such a boundary (the first one almost always does)."""
    for seed in range(6, 26):
        prompt = random_prompts(1, 8, 8, seed=seed)[0]
        full = _greedy_with_text(llm, prompt)
        text = full.text
        pieces = [llm.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
        for i in range(3, len(pieces) - 1):
            before, left, right = pieces[i - 1], pieces[i], pieces[i + 1]
            if not (all(text.startswith(p) for p in (before, left, right)) and len(left) - len(before) >= 2
                    and len(right) > len(left)):
                continue  # a token of less than two characters, or bytes of a character still pending
            stop = text[len(left) - 2: len(left) + 1]
            if "\ufffd" not in stop and text.index(stop) == len(left) - 2:
                return prompt, full, stop
    raise AssertionError("no greedy output of 20 prompts has a multi-character token followed by another one")


def test_stop_string_spanning_two_tokens(llm):
    prompt, full, stop = _stop_across_a_token_boundary(llm)
    cut = full.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], skip_special_tokens=False)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    o = out.outputs[0]
    assert o.text == full.text[:cut]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    params.include_stop_str_in_output = True
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].text == full.text[: cut + len(stop)]


def test_stop_token_ids(llm):
    prompt = random_prompts(1, 8, 8, seed=8)[0]
    full = _greedy_with_text(llm, prompt).token_ids
    stop_id = full[5]
    first = full.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id])
    o = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert o.token_ids == full[: first + 1]
    assert o.finish_reason == "stop" and o.stop_reason == stop_id



def test_stop_token_text_only_with_include_stop_str_in_output(llm):
    """vLLM: the text of the token that stopped a sample is left out unless include_stop_str_in_output."""
    prompt = random_prompts(1, 8, 8, seed=8)[0]
    full = _greedy_with_text(llm, prompt).token_ids
    cut = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, len(full) + 1)]
    # texts[i]: the text of i + 1 tokens
    texts = [o.outputs[0].text for o in llm.generate([prompt] * len(cut), cut, use_tqdm=False)]
    # a token that first appears at i and adds text of its own there
    i = next(i for i in range(1, len(full)) if full.index(full[i]) == i and texts[i] != texts[i - 1])
    for include, want in ((False, texts[i - 1]), (True, texts[i])):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[full[i]],
                                include_stop_str_in_output=include)
        o = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == (full[: i + 1], want, "stop", full[i])


def test_min_tokens_suppresses_stop_tokens(llm):
    prompt = random_prompts(1, 8, 8, seed=8)[0]
    stop_id = _greedy_with_text(llm, prompt).token_ids[1]

    def sample(stop_token_ids):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=stop_token_ids,
                                min_tokens=6)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    masked = sample([stop_id]).token_ids
    assert stop_id not in masked[:6]  # greedy's second token, held off for six tokens
    # A second stop id that greedy emits only after the first six tokens: masking it within them
    # changes nothing (it was never the top token there), so the sample follows `masked` and must
    # stop at the first stop id past min_tokens. The case exists whatever the model emits.
    later = [t for t in masked[6:] if t not in masked[:6]]
    assert later, f"greedy output {masked} repeats its first six tokens throughout"
    stops = [stop_id, later[0]]
    end = next(i for i in range(6, len(masked)) if masked[i] in stops)
    o = sample(stops)
    assert o.token_ids == masked[: end + 1]
    assert o.finish_reason == "stop" and o.stop_reason == masked[end]


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory, llm):
    """The tiny model with EOS redefined as a token greedy decoding is known to produce."""
    prompt = random_prompts(1, 8, 8, seed=9)[0]
    full = _greedy_with_text(llm, prompt).token_ids
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(tiny_model, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [full[4]]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path), prompt, full


def test_eos_stops_unless_ignored(eos_model):
    path, prompt, full = eos_model
    llm = make_llm(path)
    eos = full[4]
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert o.token_ids == full[: full.index(eos) + 1]
    # vLLM: an EOS id of generation_config.json other than the tokenizer's acts as a stop token id
    assert eos != llm.tokenizer.eos_token_id and o.finish_reason == "stop" and o.stop_reason == eos
    assert o.text == llm.tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True)  # EOS not in text
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert o.outputs[0].token_ids == full and o.outputs[0].finish_reason == "length"
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, min_tokens=10), use_tqdm=False)[0]
    assert eos not in o.outputs[0].token_ids[:10]


def test_logprobs_match_hf(tiny_model, hf, llm):
    prompts = random_prompts(3, 5, 15, seed=10)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        o = out.outputs[0]
        ref = hf.logprobs(tiny_model, prompt, o.token_ids)  # [num_out, vocab]
        assert len(o.logprobs) == len(o.token_ids) == 12
        total = 0.0
        for step, (token, entry) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            assert entry[token].logprob == pytest.approx(ref[step, token].item(), abs=1e-4)
            top = ref[step].topk(3)
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3)
            assert [t for _, t in ranked] == top.indices.tolist()
            total += ref[step, token].item()
        assert o.cumulative_logprob == pytest.approx(total, abs=1e-3)


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_token_comes_first_with_its_vocab_rank(tiny_model, hf, llm, k):
    """vLLM's sample logprobs: the sampled token first with its rank in the vocabulary (how many
    tokens score at least as high: vLLM's batched_count_greater_than), then the top k, ranks 1..k."""
    prompts = random_prompts(3, 5, 15, seed=12)
    params = SamplingParams(temperature=1.5, seed=5, max_tokens=12, ignore_eos=True, logprobs=k)
    outsiders = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        o = out.outputs[0]
        ref = hf.logprobs(tiny_model, prompt, o.token_ids)  # [num_out, vocab]
        for step, (token, entry) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            row, rank = ref[step], entry[token].rank
            assert list(entry)[0] == token
            # HF values tied within 1e-4 may order either way
            lo, hi = int((row > row[token] + 1e-4).sum()) + 1, int((row >= row[token] - 1e-4).sum())
            assert lo <= rank <= hi
            top = {t: lp.rank for t, lp in entry.items() if t != token or rank <= k}
            assert sorted(top.values()) == list(range(1, k + 1))
            if rank > k:
                outsiders += 1
                assert len(entry) == k + 1
            else:
                assert len(entry) == k and top[token] == rank
    assert outsiders > 0  # the case this test is about: a sampled token outside the top k


def test_default_params_come_from_generation_config(tiny_model, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_model, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.95, top_k=20)
    (path / "generation_config.json").write_text(json.dumps(gen))
    params = make_llm(str(path)).engine.default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "Tell me about the fox."}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (out,) = llm.chat(messages, params, use_tqdm=False)
    assert "<|im_start|>user" in out.prompt and out.prompt.rstrip().endswith("<|im_start|>assistant")
    (plain,) = llm.generate([out.prompt_token_ids], params, use_tqdm=False)
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids
    outs = llm.chat([messages, messages], params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert len(outs) == 2 and "<think>" in outs[0].prompt


def test_metrics_are_ordered(llm):
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token >= 0 and m.time_per_output_token >= 0
    assert m.num_generated_tokens == 6


def test_logit_bias_and_allowed_token_ids_as_vllm(tiny_model, hf, llm):
    """vLLM's logits processors: logit_bias is added to the logits, allowed_token_ids masks every
    other token; both act after the (raw) logprobs are taken, so logprobs stay the model's."""
    prompt = random_prompts(1, 8, 8, seed=13)[0]
    vocab = llm.engine.vocab_size
    allowed = list(range(100, 140))
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    first = hf.logprobs(tiny_model, prompt, plain[0].outputs[0].token_ids)[0].topk(2)
    runner_up = int(first.indices[1])  # biased past the argmax: the first token changes
    bias = {runner_up: float(first.values[0] - first.values[1]) + 0.5, int(first.indices[0]) - 1: -40.0, 9: 1.5}
    for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias, logprobs=0),
                   SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed,
                                  logit_bias={str(allowed[-1]): 2.0}, logprobs=0)):
        o = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ref = hf.logprobs(tiny_model, prompt, o.token_ids)  # [T, V]: the model's, unbiased
        shift = torch.zeros(vocab)
        for t, b in params.logit_bias.items():
            shift[t] = b
        if params.allowed_token_ids is not None:
            shift[[t for t in range(vocab) if t not in allowed]] = float("-inf")
        for step, token in enumerate(o.token_ids):
            assert token == int((ref[step] + shift).argmax())
            assert o.logprobs[step][token].logprob == pytest.approx(ref[step, token].item(), abs=1e-4)
        if params.allowed_token_ids is None:
            assert o.token_ids[0] == runner_up
        else:
            assert plain[0].outputs[0].token_ids[0] not in allowed  # the mask changed the first token
    sampled = llm.generate([prompt], SamplingParams(n=3, seed=1, max_tokens=12, ignore_eos=True, temperature=1.5,
                                                    allowed_token_ids=allowed), use_tqdm=False)[0].outputs
    assert all(t in allowed for c in sampled for t in c.token_ids)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    limited, free = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                   allowed_token_ids=allowed), greedy], use_tqdm=False)
    assert all(t in allowed for t in limited.outputs[0].token_ids)  # the mask is the limited row's only
    assert free.outputs[0].token_ids[:2] == plain[0].outputs[0].token_ids
    # allowed ids that min_tokens suppresses leave a row nothing: it keeps its other tokens rather than
    # drawing from an all -inf row (NaN weights, an id past the vocabulary)
    eos = llm.engine.eos_token_ids[0]
    for temperature in (0, 1.0):
        cornered = llm.generate([prompt], SamplingParams(temperature=temperature, seed=2, max_tokens=4, min_tokens=2,
                                                         allowed_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
        assert all(0 <= t < vocab for t in cornered.token_ids) and cornered.token_ids[-1] == eos
        assert eos not in cornered.token_ids[:2]
    for bad, match in ((dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
                       (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
                       (dict(logit_bias={1: float("nan")}), "logit_bias values must be finite")):
        with pytest.raises((ValueError, TypeError), match=match):
            SamplingParams(**bad)
    for bad in (dict(allowed_token_ids=[vocab]), dict(logit_bias={vocab: 1.0})):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} token ids must be in"):
            llm.generate([prompt], SamplingParams(max_tokens=2, **bad), use_tqdm=False)
    assert_no_leak(llm)


def test_bad_words_never_appear(llm):
    """vLLM's bad_words: a one-token word is banned everywhere; a longer word only at the step that
    would complete it (its last token after its other tokens)."""
    prompt = random_prompts(1, 8, 8, seed=14)[0]
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    tok = llm.get_tokenizer()
    # a word of one token (as written and mid-text): the greedy output loses it and goes on without it
    def one_token_word(t: int) -> bool:
        word = tok.decode([t]).strip()
        return bool(word) and len(tok.encode(word, add_special_tokens=False)) == 1

    i, word = next((i, tok.decode([t]).strip()) for i, t in enumerate(full) if one_token_word(t))
    banned = {tok.encode(w, add_special_tokens=False)[0] for w in (word, " " + word)
              if len(tok.encode(w, add_special_tokens=False)) == 1}
    o = llm.generate([prompt], SamplingParams(bad_words=[word], **greedy), use_tqdm=False)[0].outputs[0]
    assert o.token_ids[:i] == full[:i] and not banned & set(o.token_ids)
    # a two-token word: its first token still appears, only the completion is banned
    j = next(j for j in range(len(full) - 1)
             if tok.encode(tok.decode(full[j : j + 2]).lstrip(), add_special_tokens=False) == full[j : j + 2])
    pair = tok.decode(full[j : j + 2])
    o = llm.generate([prompt], SamplingParams(bad_words=[pair], **greedy), use_tqdm=False)[0].outputs[0]
    assert o.token_ids[: j + 1] == full[: j + 1] and o.token_ids[j + 1] != full[j + 1]
    with pytest.raises(ValueError, match="bad_words cannot contain an empty string"):
        SamplingParams(bad_words=[""])
    with pytest.raises(TypeError, match="bad_words must be a list of str"):
        SamplingParams(bad_words="word")
    assert_no_leak(llm)

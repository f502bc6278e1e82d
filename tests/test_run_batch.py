"""`nanoserve run-batch` end to end: mixed good and bad lines, SIGKILL then --resume, SIGINT."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields

import pytest
from helpers import make_llm

from nanoserve import SamplingParams
from nanoserve.cli import build_parser, engine_kwargs, main
from nanoserve.config import Config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "kvcache_block_size": 8,
          "num_kvcache_blocks": 256, "max_num_seqs": 8}
ENGINE_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
# The runs that get interrupted go two requests at a time, so there is a "mid-run" to hit.
SLOW_FLAGS = ["--max-num-seqs=2", "--max-inflight=2"]
NUM_GOOD = 36


def good_lines(model_name: str) -> list[dict]:
    lines = []
    for i in range(NUM_GOOD):
        common = {"temperature": 0, "max_tokens": 10 + i % 7, "ignore_eos": True}
        if i % 3 == 0:
            body = {"model": model_name, "messages": [{"role": "user", "content": f"tell me about {i}"}], **common}
            lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        else:
            body = {"prompt": f"once upon a time {i}" if i % 3 == 1 else [5 + i, 17, 42, 99], **common}
            lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return lines


# (raw line, the error it must produce: status code and a fragment of the message)
BAD_LINES = [
    ('{"custom_id": "broken", "method": ', 400, "invalid JSON"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), 400, "custom_id"),
    (json.dumps({"custom_id": "req-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
     400, "duplicate custom_id 'req-1'"),
    (json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}), 400, "URL"),
    (json.dumps({"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": "x", "temperature": -1}}), 400, "temperature"),
    (json.dumps({"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": list(range(5, 200))}}), 400, "maximum context length is 128"),
    (json.dumps({"custom_id": "bad-model", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}}), 404, "gpt-4o"),
]


@pytest.fixture(scope="module")
def batch(tiny_model, tmp_path_factory):
    """The input file (bad lines spread among the good ones) and greedy outputs from llm.generate / llm.chat."""
    root = tmp_path_factory.mktemp("run_batch")
    good = good_lines(os.path.basename(tiny_model))
    raw = [json.dumps(line) for line in good]
    for k, (line, _, _) in enumerate(BAD_LINES):
        raw.insert(3 + 5 * k, line)
    raw.insert(10, "")  # blank lines are skipped, as vLLM does
    path = root / "in.jsonl"
    path.write_text("\n".join(raw) + "\n")

    llm = make_llm(tiny_model, **ENGINE)
    chat = [line for line in good if "messages" in line["body"]]
    plain = [line for line in good if "prompt" in line["body"]]

    def params(lines):
        return [SamplingParams(temperature=0, max_tokens=line["body"]["max_tokens"], ignore_eos=True) for line in lines]

    outputs = llm.chat([line["body"]["messages"] for line in chat], params(chat), use_tqdm=False)
    outputs += llm.generate([line["body"]["prompt"] for line in plain], params(plain), use_tqdm=False)
    expected = {
        line["custom_id"]: (out.outputs[0].text, len(out.outputs[0].token_ids)) for line, out in zip(chat + plain, outputs)
    }
    return {"root": root, "input": str(path), "model": tiny_model, "expected": expected,
            "bad_line_numbers": [i + 1 for i, line in enumerate(raw) if line in {b[0] for b in BAD_LINES}]}


def run_in_process(batch, output, *extra) -> int:
    return main(["run-batch", "-i", batch["input"], "-o", str(output), "--model", batch["model"],
                 "--no-progress-bar", *ENGINE_FLAGS, *extra])


def start_subprocess(batch, output) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanoserve", "run-batch", "-i", batch["input"], "-o", str(output),
           "--model", batch["model"], *ENGINE_FLAGS, *SLOW_FLAGS]
    # One thread: the tiny model gains nothing from more, and pytest shares the cores with it.
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_lines(proc: subprocess.Popen, output, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if output.exists() and output.read_bytes().count(b"\n") >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"run-batch exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail("run-batch wrote no output in time")


def read_records(output) -> dict:
    """Records keyed by custom_id, or by input line for errors that have none; a key twice fails."""
    records = {}
    for text in output.read_text().splitlines():
        record = json.loads(text)
        key = record["custom_id"] if record["custom_id"] is not None else ("line", record["error"]["line"])
        assert key not in records, f"{key} written twice"
        records[key] = record
    return records


def summary(records: dict) -> dict:
    """What must be equal between two runs (ids and timestamps differ)."""
    out = {}
    for key, r in records.items():
        body = r["response"]["body"]
        if body is None:
            out[key] = (r["response"]["status_code"], r["error"]["message"])
        else:
            choice = body["choices"][0]
            text = choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]
            out[key] = (r["response"]["status_code"], text, body["usage"]["completion_tokens"])
    return out


@pytest.fixture(scope="module")
def reference(batch):
    output = batch["root"] / "uninterrupted.jsonl"
    assert run_in_process(batch, output) == 1  # some lines failed
    return read_records(output)


def test_mixed_lines_one_record_each_with_greedy_texts_of_generate(batch, reference):
    assert len(reference) == NUM_GOOD + len(BAD_LINES)
    for custom_id, (text, num_tokens) in batch["expected"].items():
        record = reference[custom_id]
        assert record["error"] is None and record["response"]["status_code"] == 200
        assert summary({custom_id: record})[custom_id] == (200, text, num_tokens)
        body = record["response"]["body"]
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + num_tokens
    errors = [r for r in reference.values() if r["error"] is not None]
    assert sorted(r["error"]["line"] for r in errors) == batch["bad_line_numbers"]
    for (_, code, fragment), line in zip(BAD_LINES, batch["bad_line_numbers"], strict=True):
        [record] = [r for r in errors if r["error"]["line"] == line]
        assert record["response"] == {**record["response"], "status_code": code, "body": None}
        assert fragment in record["error"]["message"]


def test_existing_output_without_resume_is_refused_untouched(batch, reference, tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text('{"custom_id": "x"}\n')
    before = output.read_bytes()
    assert run_in_process(batch, output) == 2
    assert output.read_bytes() == before


def test_unwritable_output_path_is_a_usage_error_before_the_model_loads(batch, tmp_path, monkeypatch):
    import nanoserve.entrypoints.run_batch as run_batch_module

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_batch_module, "LLM", no_model)
    assert run_in_process(batch, tmp_path / "missing-dir" / "out.jsonl") == 2
    assert run_in_process(batch, tmp_path) == 2  # a directory


def test_sigkill_then_resume_equals_uninterrupted_run(batch, reference, tmp_path):
    output = tmp_path / "out.jsonl"
    proc = start_subprocess(batch, output)
    wait_for_lines(proc, output, 4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = output.read_bytes()
    assert done.count(b"\n") < len(reference), "the run finished before it was killed"
    output.write_bytes(done[:-25])  # as if killed mid-write: the last line is torn
    assert run_in_process(batch, output, "--resume") == 1
    assert summary(read_records(output)) == summary(reference)


def test_sigint_finishes_in_flight_and_leaves_a_valid_file(batch, reference, tmp_path):
    output = tmp_path / "out.jsonl"
    proc = start_subprocess(batch, output)
    wait_for_lines(proc, output, 4)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr.decode()[-2000:]
    assert b"finishing the requests in flight" in stderr
    text = output.read_text()
    assert text.endswith("\n")
    partial = read_records(output)  # every line is whole JSON, no custom_id twice
    assert 4 <= len(partial) < len(reference)
    assert all(summary({k: r}) == summary({k: reference[k]}) for k, r in partial.items())
    assert run_in_process(batch, output, "--resume") == 1
    assert summary(read_records(output)) == summary(reference)


def test_every_llm_option_is_a_flag():
    args = ["run-batch", "-i", "in", "-o", "out", "--model", "m"]
    assert engine_kwargs(build_parser().parse_args(args)) == {}  # unset flags leave LLM's defaults
    flags = {"max_model_len": "--max-model-len=77", "enable_prefix_caching": "--no-enable-prefix-caching",
             "gpu_memory_utilization": "--gpu-memory-utilization=0.5", "dtype": "--dtype=float32",
             "attention_backend": "--attention-backend=triton"}
    parsed = engine_kwargs(build_parser().parse_args(args + list(flags.values())))
    assert parsed == {"max_model_len": 77, "enable_prefix_caching": False, "gpu_memory_utilization": 0.5,
                      "dtype": "float32", "attention_backend": "triton"}
    for f in fields(Config):  # each field, set alone, reaches LLM's kwargs
        if f.name in Config.field_names():
            flag = "--" + f.name.replace("_", "-") + ("" if f.type in ("bool", bool) else "=1")
            assert f.name in engine_kwargs(build_parser().parse_args(args + [flag])), flag


@pytest.fixture(scope="module")
def builder(tiny_model):
    from nanoserve.entrypoints.openai_request import RequestBuilder

    return RequestBuilder(make_llm(tiny_model, **ENGINE), tiny_model)


def test_body_fields_map_to_sampling_params_as_vllm(builder):
    defaults = builder.llm.engine.default_sampling_params()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    request = builder.build({"method": "POST", "url": "/v1/chat/completions", "body": {
        **chat, "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "seed": 11,
        "stop": "x", "n": 2, "presence_penalty": 0.5, "min_tokens": 1}})
    p = request.params
    assert (p.max_tokens, p.logprobs, p.seed, p.stop, p.n, p.presence_penalty, p.min_tokens) == (
        7, 3, 11, ["x"], 2, 0.5, 1)
    assert (p.temperature, p.top_p, p.top_k) == (defaults.temperature, defaults.top_p, defaults.top_k)
    # Chat without a cap: the rest of the context. Completions: 16, and logprobs is a count.
    p = builder.build({"method": "POST", "url": "/v1/chat/completions", "body": chat}).params
    assert p.max_tokens == ENGINE["max_model_len"] - len(builder.build(
        {"method": "POST", "url": "/v1/chat/completions", "body": chat}).prompt_token_ids)
    p = builder.build({"method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "logprobs": 2}}).params
    assert (p.max_tokens, p.logprobs) == (16, 2)
    # vLLM's server: logit_bias keys are token ids as strings, values clamped to [-100, 100]
    p = builder.build({"method": "POST", "url": "/v1/completions", "body": {
        "prompt": "a", "logit_bias": {"5": 1, "7": -300}, "allowed_token_ids": [5, 7, 9], "bad_words": ["x"]}}).params
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words) == ({5: 1.0, 7: -100.0}, [5, 7, 9], ["x"])
    for body, match in [({**chat, "top_logprobs": 2}, "`logprobs` must be set to true"),
                        ({**chat, "stream": True}, "`stream` is not supported"),
                        ({**chat, "logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
                        ({**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
                        ({"prompt": ["a", 5]}, r"`prompt\[1\]` must be a string"),
                        ({**chat, "logprobs": True, "top_logprobs": ""}, "`top_logprobs` must be an integer"),
                        ({**chat, "chat_template_kwargs": []}, "`chat_template_kwargs` must be an object")]:
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        with pytest.raises((ValueError, TypeError), match=match):
            builder.build({"method": "POST", "url": url, "body": body})


@pytest.mark.parametrize("temperature", [0, 2.0])
@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_response_logprobs_are_the_engines(builder, url, temperature):
    from nanoserve.entrypoints.openai_response import result_record
    from nanoserve.engine.request_stream import stream_requests

    body = {"temperature": temperature, "seed": 4, "max_tokens": 4, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
                if "chat" in url else {"prompt": "hello", "logprobs": 2})
    [(_, out)] = stream_requests(builder.llm.engine, [(0, builder.build({"method": "POST", "url": url, "body": body}))], 1)
    choice = result_record("c", url, out, "m", builder.llm.tokenizer, num_logprobs=2)["response"]["body"]["choices"][0]
    sample = out.outputs[0]
    expected = [step[t].logprob for t, step in zip(sample.token_ids, sample.logprobs, strict=True)]
    assert len(expected) == 4  # max_tokens, ignore_eos
    if "chat" in url:
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == expected
        assert all(len(c["top_logprobs"]) == 2 for c in choice["logprobs"]["content"])
        assert choice["message"]["content"] == sample.text
    else:
        assert choice["logprobs"]["token_logprobs"] == expected
        assert choice["logprobs"]["tokens"] == [builder.llm.tokenizer.decode([t]) for t in sample.token_ids]
        assert choice["text"] == sample.text
        # the sampled token first, then the top 2, keyed by text (the tiny vocabulary has tokens of one text)
        assert all(1 <= len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])
    if "chat" in url:  # the top 2 only, by rank; a sampled token outside them (vocab rank > 2) is not listed
        for step, got in zip(sample.logprobs, choice["logprobs"]["content"], strict=True):
            want = [lp.logprob for _, lp in sorted(step.items(), key=lambda e: e[1].rank)[:2]]
            assert [e["logprob"] for e in got["top_logprobs"]] == want


def test_a_one_prompt_list_is_that_prompt(builder):
    """OpenAI clients send `prompt` as a list even for one prompt; vLLM takes it."""
    def ids(prompt):
        return builder.build({"method": "POST", "url": "/v1/completions", "body": {"prompt": prompt}}).prompt_token_ids

    assert ids(["hello world"]) == ids("hello world") == builder.llm.tokenizer.encode("hello world")
    assert ids([[5, 6, 7]]) == ids([5, 6, 7]) == [5, 6, 7]


def test_several_prompts_and_echo_only_answer_as_vllm(tiny_model, tmp_path):
    """vLLM's completions take a list of prompts: choice i * n + j is prompt i's sample j, usage
    sums over the prompts; echo prefixes each prompt. Texts are those of llm.generate. Echo with
    max_tokens 0 returns the prompt and its logprobs only."""
    prompts = ["once upon a time", [5, 17, 42, 99], "the end"]
    common = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    lines = [{"custom_id": "multi", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": prompts, "n": 2, "echo": True, **common}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": ["ok", list(range(5, 200))], **common}}]
    # vLLM's echo with max_tokens 0 (scoring): the prompt and its logprobs alone
    lines += [{"custom_id": f"echo{k}", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "once upon a time", "echo": True, "logprobs": 1, "max_tokens": k, "temperature": 0}}
              for k in (0, 1)]
    path, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run-batch", "-i", str(path), "-o", str(output), "--model", tiny_model, "--no-progress-bar", *ENGINE_FLAGS]
    assert main(args + ["--max-inflight=2"]) == 1
    records = read_records(output)
    assert records["bad"]["error"]["code"] == 400
    assert records["bad"]["error"]["message"].startswith("`prompt[1]`: This model's maximum context length is 128")
    body = records["multi"]["response"]["body"]
    llm = make_llm(tiny_model, **ENGINE)
    expected = llm.generate(prompts, SamplingParams(n=2, **common), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [
        (p if isinstance(p, str) else tok.decode(p)) + c.text for p, out in zip(prompts, expected) for c in out.outputs]
    assert body["usage"]["prompt_tokens"] == sum(len(out.prompt_token_ids) for out in expected)
    assert body["usage"]["completion_tokens"] == 6 * 5
    (scored,), (one,) = (records[f"echo{k}"]["response"]["body"]["choices"] for k in (0, 1))
    num_prompt = len(tok.encode("once upon a time"))
    assert scored["text"] == "once upon a time" and one["text"].startswith("once upon a time")
    assert scored["logprobs"] == {k: v[:num_prompt] for k, v in one["logprobs"].items()}
    assert len(scored["logprobs"]["tokens"]) == num_prompt and scored["logprobs"]["token_logprobs"][0] is None


def test_fields_that_would_be_silently_dropped_are_refused(builder):
    """vLLM's run-batch refuses a request chat template (no --trust-request-chat-template) and
    honours the others; nanoserve cannot, so each is a 400, never a silent change of output."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for body, match in [({**chat, "chat_template": "{{ messages[0].content }}"}, "Chat template is passed"),
                        ({**chat, "chat_template_kwargs": {"chat_template": "x"}}, "Chat template is passed"),
                        ({**chat, "documents": [{"text": "d"}]}, "`documents` is not supported"),
                        ({**chat, "return_tokens_as_token_ids": True}, "`return_tokens_as_token_ids` is not"),
                        ({"prompt": "a", "return_token_ids": True}, "`return_token_ids` is not"),
                        ({"prompt": "a", "spaces_between_special_tokens": False}, "`spaces_between_special_tokens`")]:
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        with pytest.raises(ValueError, match=match):
            builder.build({"method": "POST", "url": url, "body": body})
    # The values that ask for nothing are taken.
    builder.build({"method": "POST", "url": "/v1/chat/completions", "body": {
        **chat, "documents": None, "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True}})


def test_generation_config_max_new_tokens_caps_outputs_as_vllm(tiny_model, tmp_path):
    """vLLM maps generation_config.json's max_new_tokens to max_tokens: the offline default, and
    in the server a cap on every request (an omitted one, and one asking for more)."""
    import shutil

    from nanoserve.entrypoints.openai_request import RequestBuilder

    path = tmp_path / "m"
    shutil.copytree(tiny_model, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 3}))
    builder = RequestBuilder(make_llm(str(path), **ENGINE), str(path))
    assert builder.llm.get_default_sampling_params().max_tokens == 3

    def max_tokens(url, body):
        return builder.build({"method": "POST", "url": url, "body": body}).params.max_tokens

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert max_tokens("/v1/chat/completions", chat) == 3
    assert max_tokens("/v1/chat/completions", {**chat, "max_tokens": 10}) == 3
    assert max_tokens("/v1/completions", {"prompt": "hi"}) == 3
    assert max_tokens("/v1/completions", {"prompt": "hi", "max_tokens": 2}) == 2

"""Tensor parallelism on CPU with gloo: the same greedy tokens as TP=1 and HF, and a clean lifecycle.

The "tied-gqa2" tiny model has 4 query heads and 2 KV heads, so TP=2 puts 2 query heads and one
KV head on each rank (and half the MLP and half the vocabulary).
"""
import gc
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import threading
import time

import pytest

import helpers
from helpers import child_pids, random_prompts
from nanoserve import SamplingParams
from nanoserve.distributed.group import TPGroup
from nanoserve.engine.runner import Runner

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def make_llm(path, tp=2, **kw):
    kw = {"num_kvcache_blocks": 64, "max_model_len": 256, "tensor_parallel_size": tp, **kw}
    return helpers.make_llm(path, **kw)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while any(pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_exists(p) for p in pids), f"worker processes {pids} outlived their engine"
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)


# ---- the channel (no processes) -----------------------------------------------------------------


def test_channel_packs_tensors_as_raw_bytes_and_checks_size(monkeypatch):
    import torch

    from nanoserve.backends.metadata import AttentionMetadata
    from nanoserve.distributed import channel
    from nanoserve.engine.model_inputs import ModelInputs

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([3, -1, 17]), num_decode_tokens=1,
        decode_block_tables=torch.tensor([[0, 4]], dtype=torch.int32),
        decode_context_lens=torch.tensor([5], dtype=torch.int32), decode_max_context_len=5,
        prefill_cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
        prefill_block_tables=torch.zeros(1, 0, dtype=torch.int32),
        prefill_context_lens=torch.tensor([2], dtype=torch.int32), prefill_max_seqlen_q=2, prefill_max_context_len=2,
        prefills_have_context=False,
    )
    inputs = ModelInputs(torch.tensor([9, 8, 7]), torch.tensor([4, 0, 1]), meta, torch.tensor([0, 2]))
    packed = channel.pack(inputs)
    assert not any(isinstance(v, torch.Tensor) for v in vars(packed.meta).values())
    kind, payload = pickle.loads(channel.encode_message("step", packed))
    out = channel.unpack(payload)
    assert kind == "step" and out.meta.decode_max_context_len == 5
    for a, b in [(out.input_ids, inputs.input_ids), (out.meta.slot_mapping, meta.slot_mapping),
                 (out.meta.decode_block_tables, meta.decode_block_tables),
                 (out.meta.prefill_block_tables, meta.prefill_block_tables)]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    half = torch.randn(3, 2).to(torch.bfloat16)
    assert torch.equal(channel.unpack(channel.pack(half)), half)

    monkeypatch.setattr(channel, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(ValueError, match="MAX_MESSAGE_BYTES=1000"):
        channel.encode_message("step", channel.pack(torch.zeros(1000)))


class _OtherRankHas25Blocks(TPGroup):
    """A one-rank group whose (imagined) other rank could afford only 25 KV blocks."""

    def all_reduce(self, t, op="sum"):
        return t.clamp_(max=25) if op == "min" else t


def test_ranks_agree_on_the_smallest_kv_cache(tiny_model):
    """A rank that could afford more blocks than another shrinks its cache to the agreed minimum."""
    import torch

    from nanoserve.config import Config
    from nanoserve.engine.model_runner import ModelRunner

    config = Config(tiny_model, device="cpu", dtype="float32", num_kvcache_blocks=40, max_model_len=64)
    runner = ModelRunner(config, torch.device("cpu"), _OtherRankHas25Blocks())
    assert isinstance(runner, Runner)
    assert runner.kv_spec.num_blocks == 25 and runner.kv_cache.shape[2] == 25
    assert all(a.k_cache.data_ptr() == runner.kv_cache[0, i].data_ptr() and a.k_cache.shape[0] == 25
               for i, a in enumerate(runner.attention_layers))


# ---- engines ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_holder(tiny_model):
    """One TP=2 engine shared by the tests below; the garbage-collection test takes it out last."""
    holder = {"llm": make_llm(tiny_model)}
    yield holder
    if "llm" in holder:
        holder.pop("llm").close()


@pytest.fixture
def tp2(tp2_holder):
    return tp2_holder["llm"]


def test_tp2_matches_tp1_and_hf(tp2, tiny_model, hf):
    prompts = random_prompts(6, 3, 40, seed=5)
    tp2_tokens = tokens(tp2.generate(prompts, GREEDY, use_tqdm=False))
    tp1_tokens = tokens(make_llm(tiny_model, tp=1).generate(prompts, GREEDY, use_tqdm=False))
    assert tp2_tokens == tp1_tokens
    assert tp2_tokens == [hf.greedy(tiny_model, p, 16) for p in prompts]
    assert len({t for row in tp2_tokens for t in row}) > 10, "outputs are degenerate"
    runner = tp2.engine.model_runner
    assert type(runner).__name__ == "TPModelRunner" and len(runner.worker_pids) == 1
    assert isinstance(runner, Runner) and runner.kv_spec.num_blocks == runner.rank0.num_kvcache_blocks
    # Rank 0 holds one KV head of two, a half-width MLP and half the vocabulary.
    attn = runner.rank0.attention_layers[0]
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert runner.rank0.kv_cache.shape[4] == 1


def test_tp2_prompt_logprobs_equal_tp1(tp2, tiny_model):
    """Prompt scoring gathers the vocabulary-parallel LM head's logits at every scored position."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 20, 40, seed=9)]
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=2)
    tp2_out = tp2.generate(prompts, params, use_tqdm=False)
    tp1_out = make_llm(tiny_model, tp=1).generate(prompts, params, use_tqdm=False)
    for got, want in zip(tp2_out, tp1_out, strict=True):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(got.prompt_token_ids)
        assert got.prompt_logprobs[0] is None
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert {t: lp.rank for t, lp in g.items() if lp.rank <= 2} == \
                {t: lp.rank for t, lp in w.items() if lp.rank <= 2}
            assert list(g)[0] == list(w)[0]  # the prompt token first
            assert [lp.logprob for lp in g.values()] == pytest.approx([lp.logprob for lp in w.values()], abs=1e-5)


def test_second_engine_while_first_alive_then_with_closes(tp2, tiny_model, hf):
    """Two TP engines at once (own process groups, own free ports); `with` leaves no child behind.

    The second one also runs chunked prefill (steps that sample nothing) and preemption.
    """
    first_pids = tp2.engine.model_runner.worker_pids
    long_prompt = random_prompts(1, 100, 100, seed=9)[0]
    prompts = random_prompts(5, 4, 30, seed=10) + [long_prompt]
    with make_llm(tiny_model, max_num_batched_tokens=32, num_kvcache_blocks=20, max_model_len=160) as second:
        pids = second.engine.model_runner.worker_pids
        assert not set(pids) & set(first_pids)
        outputs = second.generate(prompts, GREEDY, use_tqdm=False)
        assert second.engine.scheduler.num_preemptions > 0, "the test did not force preemption"
        assert tokens(outputs) == [hf.greedy(tiny_model, p, 16) for p in prompts]
        # The first engine is unaffected while the second is alive.
        assert tokens(tp2.generate(prompts[:2], GREEDY, use_tqdm=False)) == tokens(outputs[:2])
    assert_gone(pids)
    assert all(pid_exists(p) for p in first_pids)
    with pytest.raises(RuntimeError, match="closed"):
        second.generate(prompts[:1], GREEDY, use_tqdm=False)
    second.close()  # idempotent


def test_killed_worker_raises_instead_of_hanging(tiny_model, hf):
    others = child_pids()  # e.g. the shared engine's worker
    llm = make_llm(tiny_model)
    (pid,) = llm.engine.model_runner.worker_pids
    prompts = random_prompts(8, 3, 20, seed=3)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    # Kill rank 1 while the engine is mid-generation: rank 0 is somewhere in a step.
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RuntimeError, match="worker rank 1"):
            llm.generate(prompts, long, use_tqdm=False)
    finally:
        killer.cancel()
    assert time.monotonic() - start < 30
    assert_gone([pid])
    with pytest.raises(RuntimeError):  # the engine stays failed, it never hangs
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    llm.close()
    assert child_pids() <= others, "close() left a process behind"
    # A new engine starts in the same process and gives the same tokens as ever.
    with make_llm(tiny_model) as again:
        (new_pid,) = again.engine.model_runner.worker_pids
        assert tokens(again.generate(prompts[:3], GREEDY, use_tqdm=False)) == [
            hf.greedy(tiny_model, p, 16) for p in prompts[:3]]
    assert_gone([new_pid])


def test_worker_exception_reaches_the_parent_with_its_traceback(tiny_model):
    llm = make_llm(tiny_model)
    runner = llm.engine.model_runner
    (pid,) = runner.worker_pids
    from nanoserve.distributed.channel import encode_message

    runner._workers.broadcast(encode_message("no-such-message"))  # the worker raises on it, then exits
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)worker rank 1 failed.*Traceback.*unknown message"):
        llm.generate(random_prompts(2, 3, 9), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.close()
    assert_gone([pid])


def test_bad_tensor_parallel_sizes(tiny_model, tmp_path):
    children = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the checkpoint's num_key_value_heads=2"):
        make_llm(tiny_model, tp=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        make_llm(tiny_model, tp=0)
    with pytest.raises(TypeError, match="tensor_parallel_size must be an int"):
        make_llm(tiny_model, tp="2")
    # KV heads split, but the MLP does not.
    odd = shutil.copytree(tiny_model, tmp_path / "odd-mlp")
    config = json.loads((odd / "config.json").read_text())
    config["intermediate_size"] = 129
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the checkpoint's num_key_value_heads"):
        make_llm(str(odd), tp=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the checkpoint's intermediate_size=129"):
        make_llm(str(odd), tp=2)
    assert set(multiprocessing.active_children()) == children  # refused before any worker started


def test_garbage_collection_closes_workers(tp2_holder):
    """Runs last: dropping the shared engine without close() stops its workers gracefully."""
    llm = tp2_holder.pop("llm")
    procs = llm.engine.model_runner._workers.procs
    pids = [p.pid for p in procs]
    assert all(pid_exists(p) for p in pids)
    del llm
    gc.collect()
    assert_gone(pids)
    assert [p.exitcode for p in procs] == [0]  # stopped by its "stop" message, not terminated



def test_rank0_joins_the_rendezvous_once_the_workers_are_joining(tiny_model, tmp_path, monkeypatch):
    """A spawned worker can take longer to import torch than the rendezvous timeout (a loaded
    machine): rank 0 starts that clock only once each worker says it is joining. The workers are
    slowed by a sitecustomize (run at their start-up) past the parent's shortened timeout."""
    from nanoserve.distributed import process_group

    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(6)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(process_group, "PROCESS_GROUP_TIMEOUT_S", 3.0)
    prompts = random_prompts(2, 3, 10, seed=5)
    with make_llm(tiny_model) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 4 for out in outs)

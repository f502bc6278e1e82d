"""nanoserve.ray.LLMPredictor on a local Ray instance: two actors give single-process greedy output, row for row."""
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")  # Ray without its data extra

from helpers import make_llm  # noqa: E402

from nanoserve import SamplingParams  # noqa: E402
from nanoserve.ray import ERROR_COLUMN, LLMPredictor  # noqa: E402

ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "kvcache_block_size": 8, "num_kvcache_blocks": 128}
SHARED = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def rows() -> list[dict]:
    out = []
    for i in range(12):
        row = {"id": i, "prompt": f"the story of number {i}", "sampling_params": {"max_tokens": 3 + i % 5}}
        row["messages"] = [{"role": "user", "content": f"what is {i}?"}] if i % 3 == 0 else None
        out.append(row)
    return out


def test_two_actors_equal_single_process_greedy(tiny_model, local_ray):
    ds = ray.data.from_items(rows(), override_num_blocks=3).map_batches(
        LLMPredictor, concurrency=2, batch_size=4,
        fn_constructor_kwargs={"model": tiny_model, "sampling_params": SHARED, "engine_kwargs": ENGINE},
    )
    got = sorted(ds.take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in got] == list(range(12))

    llm = make_llm(tiny_model, **ENGINE)
    for row, result in zip(rows(), got, strict=True):
        params = SamplingParams(**{**SHARED, **row["sampling_params"]})
        if row["messages"] is not None:
            [expected] = llm.chat(row["messages"], params, use_tqdm=False)
        else:
            [expected] = llm.generate([row["prompt"]], params, use_tqdm=False)
        first = expected.outputs[0]
        assert list(result["generated_tokens"]) == first.token_ids
        assert result["generated_text"] == first.text
        assert result["num_generated_tokens"] == len(first.token_ids) == row["sampling_params"]["max_tokens"]
        assert result["num_input_tokens"] == len(expected.prompt_token_ids)
        assert result["finish_reason"] == "length"
        assert result["prompt"] == row["prompt"]  # input columns pass through


def test_bad_rows_raise_or_are_kept_with_an_error(tiny_model):
    batch = {"prompt": ["fine", "", "also fine"], "sampling_params": [None, None, {"temperature": -1}]}
    predictor = LLMPredictor(tiny_model, SHARED, ENGINE)
    with pytest.raises(ValueError, match="row 1 of the batch: prompt is empty"):
        predictor(batch)
    predictor.should_continue_on_error = True
    out = predictor(batch)
    assert out[ERROR_COLUMN][0] is None and out["num_generated_tokens"][0] == SHARED["max_tokens"]
    assert "prompt is empty" in out[ERROR_COLUMN][1] and out["generated_tokens"][1] == []
    assert "temperature must be >= 0" in out[ERROR_COLUMN][2]

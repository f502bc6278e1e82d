"""Ray Data on many machines: `LLMPredictor`, a callable class for `Dataset.map_batches`.

Each of the `concurrency=N` actors Ray starts builds one `LLM` and runs the batches it is given:

    ds = ray.data.read_json("s3://bucket/prompts/")
    ds = ds.map_batches(LLMPredictor, concurrency=2, batch_size=64, fn_constructor_kwargs={
        "model": "/mnt/models/Qwen3-0.6B",
        "sampling_params": {"temperature": 0, "max_tokens": 16},
        "engine_kwargs": {"dtype": "bfloat16"},
    })

A row holds `prompt` (text or token ids) or `messages` (a chat, through the chat template), and
optionally its own `sampling_params` dict that overrides the shared one. Rows come back with the
columns of Ray's own LLM processor added: `generated_text`, `generated_tokens`,
`num_generated_tokens`, `num_input_tokens` and `finish_reason` (of the first sample), and
`prompt_logprobs` when a row's sampling_params ask for them (per prompt token None, or a list of
{"token_id", "logprob", "rank"}: the prompt token first, then the top k).
With `task_type="embed"` (Ray's name) the actors build embedding engines (runner="pooling") and
add `embeddings` (a list of floats per row, None for a kept bad row) and `num_input_tokens`
instead; `pooling_params` (a dict of PoolingParams fields) is shared, a row's own overrides.
`task_type="classify"` runs a `*ForSequenceClassification` checkpoint the same way, each row's
class probabilities in `embeddings` (the column Ray's processor fills for every pooling task). This module
does not import Ray; `pip install "nanoserve[ray]"` installs Ray Data for the driver and workers.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nanoserve.chat import render_conversations
from nanoserve.llm import LLM
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams
from nanoserve.engine.input_processor import RequestError
from nanoserve.engine.request_stream import default_max_inflight, stream_requests

OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "num_generated_tokens", "num_input_tokens", "finish_reason")
EMBED_COLUMNS = ("embeddings", "num_input_tokens")  # task_type="embed" or "classify"
TASK_TYPES = ("generate", "embed", "classify")
ERROR_COLUMN = "__inference_error__"  # Ray's name, for rows kept with should_continue_on_error


def _plain(value: Any) -> Any:
    """Arrow/numpy values as plain Python: arrays to lists, recursively (chats come as arrays of dicts)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class LLMPredictor:
    """One LLM per actor; `__call__` maps a batch (a dict of columns) to the same batch plus outputs.

    should_continue_on_error: as in Ray's processor, False raises on the first invalid row (and
    Ray fails the task); True keeps such rows with `__inference_error__` set and empty outputs.
    """

    def __init__(
        self,
        model: str,
        sampling_params: dict | None = None,
        engine_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        should_continue_on_error: bool = False,
        task_type: str = "generate",
        pooling_params: dict | None = None,
    ) -> None:
        if task_type not in TASK_TYPES:
            raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
        self.embed = task_type != "generate"  # a pooling task: embed or classify
        if self.embed:  # Config checks the task against the checkpoint before any weight is read
            engine_kwargs = {"runner": "pooling", "pooling_task": task_type, **(engine_kwargs or {})}
        self.pooling_params = dict(pooling_params or {})
        PoolingParams(**self.pooling_params)
        self.llm = LLM(model, **(engine_kwargs or {}))
        self.sampling_params = dict(sampling_params or {})
        SamplingParams(**self.sampling_params)  # a bad shared value fails here, once, not per row
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.should_continue_on_error = should_continue_on_error

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list]:
        columns = {name: list(values) for name, values in dict(batch).items()}  # pandas or numpy batches
        num_rows = len(next(iter(columns.values()), []))
        items = []  # a batch is small: every row is prepared (tokenized, validated) before any generation
        for i in range(num_rows):
            row = {name: values[i] for name, values in columns.items()}
            try:
                prompt, tokenization_kwargs = self._prompt(row)
                params = self._pooling_params(row) if self.embed else self._params(row)
                request = self.llm.engine.input_processor.prepare(prompt, params, i, tokenization_kwargs)
            except (TypeError, ValueError) as e:
                request = RequestError(str(e), type(e))
            if isinstance(request, RequestError) and not self.should_continue_on_error:
                raise request.error_type(f"row {i} of the batch: {request.message}")
            items.append((i, request))
        window = default_max_inflight(self.llm.config.max_num_seqs)
        results = dict(stream_requests(self.llm.engine, items, window))
        return {**columns, **self._output_columns([results[i] for i in range(num_rows)])}

    def _output_columns(self, results: list) -> dict[str, list]:
        if self.embed:
            return self._embedding_columns(results)
        out: dict[str, list] = {name: [] for name in OUTPUT_COLUMNS}
        errors = []
        for i, result in enumerate(results):
            if isinstance(result, RequestError):
                values = ("", [], 0, 0, None)
                errors.append(f"{result.error_type.__name__}: {result.message}")
            else:
                first = result.outputs[0]
                values = (first.text, list(first.token_ids), len(first.token_ids), len(result.prompt_token_ids),
                          first.finish_reason)
                errors.append(None)
            for name, value in zip(OUTPUT_COLUMNS, values):
                out[name].append(value)
        if any(not isinstance(r, RequestError) and r.prompt_logprobs is not None for r in results):
            out["prompt_logprobs"] = [None if isinstance(r, RequestError) else _prompt_logprobs_column(r)
                                      for r in results]
        if self.should_continue_on_error:
            out[ERROR_COLUMN] = errors
        return out

    def _embedding_columns(self, results: list) -> dict[str, list]:
        failed = [isinstance(r, RequestError) for r in results]
        out = {
            "embeddings": [None if bad else r.outputs.data.tolist() for r, bad in zip(results, failed)],
            "num_input_tokens": [0 if bad else len(r.prompt_token_ids) for r, bad in zip(results, failed)],
        }
        if self.should_continue_on_error:
            out[ERROR_COLUMN] = [f"{r.error_type.__name__}: {r.message}" if bad else None
                                 for r, bad in zip(results, failed)]
        return out

    def _pooling_params(self, row: dict) -> PoolingParams:
        own = _plain(row.get("pooling_params")) or {}
        if not isinstance(own, dict):
            raise TypeError(f"a row's `pooling_params` must be a dict, got {type(own).__name__}")
        return PoolingParams(**{**self.pooling_params, **{k: v for k, v in own.items() if v is not None}})

    def _prompt(self, row: dict) -> tuple[Any, dict | None]:
        """(prompt, tokenization_kwargs): text or token ids, or a chat rendered by its template."""
        messages = _plain(row.get("messages"))
        if messages is None:
            if row.get("prompt") is None:
                raise ValueError("a row needs a `prompt` (text or token ids) or `messages` column")
            return _plain(row["prompt"]), None
        (text,) = render_conversations(self.llm.tokenizer, [messages], chat_template_kwargs=self.chat_template_kwargs)
        return text, {"add_special_tokens": False}  # the template wrote every special token

    def _params(self, row: dict) -> SamplingParams:
        """The shared sampling_params updated with the row's; null keys are absent (Arrow fills them in)."""
        own = _plain(row.get("sampling_params")) or {}
        if not isinstance(own, dict):
            raise TypeError(f"a row's `sampling_params` must be a dict, got {type(own).__name__}")
        return SamplingParams(**{**self.sampling_params, **{k: v for k, v in own.items() if v is not None}})


def _prompt_logprobs_column(result) -> list | None:
    """Arrow-friendly prompt logprobs: a struct of fixed fields per entry, not a dict keyed by id."""
    if result.prompt_logprobs is None:
        return None
    return [
        None if step is None else [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank} for t, lp in step.items()]
        for step in result.prompt_logprobs
    ]

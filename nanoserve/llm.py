"""`LLM`: the user-facing facade, with vLLM's names so scripts can switch between the two."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any

from tqdm.auto import tqdm

from nanoserve.beam_search import BeamSearchOutput, run_beam_search
from nanoserve.chat import render_conversations
from nanoserve.config import Config
from nanoserve.engine.input_processor import RequestError, encode_kwargs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.request_stream import default_max_inflight, stream_requests
from nanoserve.engine_args import NO_LORA, log_no_effect_once, refuse_unless_off, resolve_engine_args
from nanoserve.inputs import PromptType, TokensPrompt, as_prompt_list, parse_prompt
from nanoserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from nanoserve.pooling.api import check_task, params_per_prompt
from nanoserve.pooling.score import cosine_scores, cross_encoder_prompts, pair_score, score_sides
from nanoserve.pooling_params import PoolingParams
from nanoserve.progress import ProgressBar
from nanoserve.sampling_params import BeamSearchParams, SamplingParams, num_logprobs
from nanoserve.structured.openai import with_guided_options

# Arguments older vLLM versions' generate() took; accepted when they ask for nothing.
_LEGACY_GENERATE_ARGS = {
    "prompt_adapter_request": "nanoserve has no prompt adapters",
}
_MISSING = object()


class LLM:
    """Offline batch generation.

    >>> llm = LLM("path/to/Qwen3-0.6B", dtype="bfloat16")
    >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

    Keyword arguments are nanoserve's `Config` fields or vLLM's engine-argument names; see
    `nanoserve.engine_args` for which vLLM arguments are mapped, ignored or refused.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        config_kwargs, no_effect = resolve_engine_args(kwargs)
        self.config = Config(model, **config_kwargs)
        log_no_effect_once(no_effect)
        self.engine = LLMEngine(self.config)

    # ---- tokenizer and defaults --------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """Use another (HF) tokenizer for prompts and output text; EOS ids stay the checkpoint's."""
        self.engine.tokenizer = tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the checkpoint's generation_config.json defaults (as vLLM)."""
        return self.engine.default_sampling_params()

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
        **legacy: Any,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.

        prompts: a str, a list of str, a list of token ids, a list of token-id lists, or
        `TextPrompt` / `TokensPrompt` dicts. `sampling_params`: one for all prompts or one per
        prompt; None = `get_default_sampling_params()`. `use_tqdm` may be a tqdm-like factory.
        `lora_request` must be None and `priority` None or all 0 (no LoRA, first-come-first-served).
        `guided_options_request` (older vLLM): a dict of guided_json / guided_regex / ... applied
        to every prompt's SamplingParams, as `GuidedDecodingParams`.
        """
        guided = legacy.pop("guided_options_request", None)
        self._check_generate_options(lora_request, legacy)
        prompts = as_prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if guided is not None:
            params = with_guided_options(params, guided)
        _check_priority(priority, len(prompts))
        _check_lora_list(lora_request, len(prompts))
        return self._run(prompts, params, use_tqdm, tokenization_kwargs)

    def _run(self, prompts: list, params: list, use_tqdm, tokenization_kwargs) -> list:
        """Prepare every request (all checks before any work), then run them through the step loop."""
        prepare = self.engine.input_processor.prepare
        requests = [(i, prepare(prompt, p, i, tokenization_kwargs)) for i, (prompt, p) in enumerate(zip(prompts, params))]
        bar = ProgressBar(self.engine, len(requests), use_tqdm)
        try:
            results = dict(stream_requests(self.engine, requests, len(requests), bar, "generate()"))
        finally:
            bar.close()
        return [results[i] for i in range(len(requests))]

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (nanoserve/beam_search.py): each prompt's best `beam_width` sequences,
        best first, `.tokens` including the prompt, `.text` its decoding, `.cum_logprob`.
        `concurrency_limit` prompts are searched at a time (None: all)."""
        refuse_unless_off("beam_search()", "lora_request", lora_request, (None,), NO_LORA)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        cap = num_logprobs(self.config.max_logprobs, self.engine.vocab_size)
        if 2 * params.beam_width > cap:
            raise ValueError(f"beam_width={params.beam_width} takes {2 * params.beam_width} logprobs a step, more than "
                             f"max_logprobs allows ({cap}); raise LLM(max_logprobs=...)")
        limit_ok = isinstance(concurrency_limit, int) and not isinstance(concurrency_limit, bool) and concurrency_limit > 0
        if concurrency_limit is not None and not limit_ok:
            raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
        tokens = [self._beam_prompt_tokens(prompt, i) for i, prompt in enumerate(as_prompt_list(prompts))]
        step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)

        def generate_step(beams: list[list[int]]) -> list:
            outs = self.generate([TokensPrompt(prompt_token_ids=t) for t in beams], step_params, use_tqdm=False)
            return [out.outputs[0].logprobs[0] if out.outputs[0].logprobs else None for out in outs]

        tokenizer = self.get_tokenizer()
        limit = concurrency_limit or len(tokens)
        bar = tqdm(total=-(-len(tokens) // limit) * params.max_tokens, desc="Beam search", disable=not use_tqdm)
        try:
            instances = run_beam_search(generate_step, tokens, params, tokenizer.eos_token_id,
                                        self.config.max_model_len, limit, step_done=bar.update)
        finally:
            bar.close()
        for instance in instances:
            for beam in instance.completed:
                beam.text = tokenizer.decode(beam.tokens)
        return [BeamSearchOutput(sequences=instance.completed) for instance in instances]

    def _beam_prompt_tokens(self, prompt: PromptType, i: int) -> list[int]:
        """A beam search prompt's token ids (text tokenized as vLLM's beam search does), checked."""
        text, ids = parse_prompt(prompt, i)
        ids = ids if ids is not None else self.get_tokenizer().encode(text)
        vocab = self.engine.vocab_size
        if not ids or len(ids) > self.config.max_model_len:
            raise ValueError(f"a beam search prompt needs 1 to max_model_len={self.config.max_model_len} tokens, "
                             f"got {len(ids)}")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in ids):
            raise ValueError(f"beam search prompt token ids must be integers in [0, {vocab}) (the model's vocab_size)")
        return ids

    def generate_stream(
        self,
        prompts: Iterable[PromptType],
        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
        *,
        max_inflight: int | None = None,
        use_tqdm: bool = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[tuple[int, RequestOutput | RequestError]]:
        """Yield `(index, RequestOutput)` for each prompt as it finishes, reading `prompts` lazily.

        At most `max_inflight` requests (default 2 * max_num_seqs) are in the engine at once, so
        memory does not grow with the input. A prompt or SamplingParams that `generate` would
        reject yields `(index, RequestError)` with the same message instead of raising.
        `sampling_params` is one SamplingParams for all, or an iterable read in step with
        `prompts`. Closing the generator early aborts the requests in flight.
        """
        if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Iterable):
            raise TypeError(
                f"prompts must be an iterable of prompts (wrap a single prompt in a list), got {type(prompts).__name__}"
            )
        if max_inflight is None:
            max_inflight = default_max_inflight(self.config.max_num_seqs)
        if not isinstance(max_inflight, int) or isinstance(max_inflight, bool):
            raise TypeError(f"max_inflight must be an int, got {max_inflight!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        encode_kwargs(tokenization_kwargs)
        params, lockstep = self._params_source(sampling_params)
        items = self._stream_items(prompts, params, lockstep, tokenization_kwargs)
        total = len(prompts) if isinstance(prompts, Sized) else None
        return self._stream_with_progress(items, max_inflight, total, use_tqdm)

    def _stream_items(self, prompts, params: Iterator[Any], lockstep: bool, tokenization_kwargs):
        prepare = self.engine.input_processor.prepare_or_error
        for i, prompt in enumerate(prompts):
            p = next(params, _MISSING)
            if p is _MISSING:
                yield i, RequestError(f"sampling_params ran out at prompt {i}; pass one, or one per prompt")
            else:
                yield i, prepare(prompt, p, i, tokenization_kwargs)
        if lockstep and next(params, _MISSING) is not _MISSING:
            raise ValueError("sampling_params has more entries than prompts; pass one, or one per prompt")

    def _stream_with_progress(self, items, max_inflight: int, total: int | None, use_tqdm: bool):
        bar = ProgressBar(self.engine, total, use_tqdm)
        results = stream_requests(self.engine, items, max_inflight, bar)
        try:
            for key, result in results:
                if isinstance(result, RequestError):
                    bar.skip()
                yield key, result
        finally:
            results.close()  # abort in-flight requests now, not whenever the inner generator is collected
            bar.close()

    # ---- inputs ----------------------------------------------------------------------------

    @staticmethod
    def _check_generate_options(lora_request: Any, legacy: dict[str, Any]) -> None:
        for name, value in legacy.items():
            if name not in _LEGACY_GENERATE_ARGS:
                raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
            refuse_unless_off("generate()", name, value, (None,), _LEGACY_GENERATE_ARGS[name])
        if not isinstance(lora_request, (list, tuple)):
            refuse_unless_off("generate()", "lora_request", lora_request, (None,), NO_LORA)

    def _params_per_prompt(self, params, num_prompts: int) -> list:
        """One SamplingParams per prompt (each entry is type-checked when its request is prepared)."""
        if params is None or isinstance(params, SamplingParams):
            return [params or self.get_default_sampling_params()] * num_prompts
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}")
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts; pass one, or one per prompt")
        return list(params)

    def _params_source(self, params) -> tuple[Iterator[Any], bool]:
        """generate_stream's SamplingParams for each prompt, and whether they come one per prompt."""
        if params is None or isinstance(params, (SamplingParams, PoolingParams)):
            return itertools.repeat(params or self.get_default_sampling_params()), False
        if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
            raise TypeError(
                f"sampling_params must be SamplingParams or an iterable of them (one per prompt), got {type(params).__name__}"
            )
        return iter(params), True

    # ---- embeddings (runner="pooling"): the same request path, PoolingParams in, vectors out ----

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: Any = None,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (`.outputs.embedding`: a list of floats).

        Needs `LLM(model, runner="pooling")`. Prompts in every form `generate` takes.
        `truncate_prompt_tokens=k` keeps each prompt's last k tokens (-1: max_model_len).
        """
        outputs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request, "embed",
                              tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        /,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: Any = None,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt, in input order (`.outputs.probs`), from a
        `*ForSequenceClassification` checkpoint (`LLM(model, runner="pooling")`): its `score` head on
        the last token, softmax (sigmoid for one label or multi-label; none for regression or with
        `PoolingParams(use_activation=False)`)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request, "classify",
                              tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(out) for out in outputs]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: Any = None,
        pooling_task: str | None = None,
        *,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Like `embed` / `classify`, each result's `.outputs.data` a float32 tensor; pooling_task
        "embed" or "classify", the engine's (None: whichever it is)."""
        check_task(self.config.pooling, pooling_task)
        refuse_unless_off("encode()", "lora_request", lora_request, (None,), NO_LORA)
        prompts = as_prompt_list(prompts)
        params = params_per_prompt(pooling_params, len(prompts), truncate_prompt_tokens)
        return self._run(prompts, params, use_tqdm, tokenization_kwargs)

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Score of each pair <data_1, data_2> (1:1, 1:N or N:N), as vLLM scores: with an embedding
        model the cosine of the two embeddings, with a one-label sequence classifier (a cross-encoder
        reranker) its probability for the pair tokenized together. `.outputs.score` is a float, in
        pair order."""
        pooling = self.config.pooling
        if pooling is None or (pooling.task == "classify" and pooling.num_labels != 1):
            raise ValueError("LLM.score() needs an embedding model or a one-label sequence classifier "
                             "(LLM(model, runner='pooling')); this one "
                             + ("generates" if pooling is None else f"has num_labels={pooling.num_labels}"))
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams or None, got {type(pooling_params).__name__}")
        left, right = score_sides(data_1, data_2)
        if pooling.task == "classify":
            pairs = cross_encoder_prompts(self.get_tokenizer(), left, right, tokenization_kwargs)
            outs = self.encode(pairs, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request, "classify")
            return [pair_score(out) for out in outs]
        encoded = self.encode(left + right, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request,
                              tokenization_kwargs=tokenization_kwargs)
        pad_token_id = getattr(self.get_tokenizer(), "pad_token_id", None)
        return cosine_scores(encoded[: len(left)], encoded[len(left):], pad_token_id)

    def embed_stream(
        self,
        prompts: Iterable[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        max_inflight: int | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> Iterator[tuple[int, EmbeddingRequestOutput | RequestError]]:
        """`embed` for inputs too large for memory: yields `(index, EmbeddingRequestOutput)` as each
        finishes, reading `prompts` lazily, like `generate_stream` (a bad prompt yields a RequestError)."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"embed_stream takes one PoolingParams for every prompt (or None), got "
                            f"{type(pooling_params).__name__}")
        check_task(self.config.pooling, "embed")
        (params,) = params_per_prompt(pooling_params, 1, truncate_prompt_tokens)
        return _as_embeddings(self.generate_stream(prompts, params, max_inflight=max_inflight, use_tqdm=use_tqdm))

    # ---- chat and cache ----------------------------------------------------------------------

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them via a chat template.

        The template is `chat_template` (a Jinja string) or the tokenizer's; `tools` and
        `chat_template_kwargs` are passed to it. Each output's `prompt` is the rendered text.
        """
        refuse_unless_off("chat()", "mm_processor_kwargs", mm_processor_kwargs, (None,), "nanoserve is text-only")
        texts = render_conversations(
            self.tokenizer, messages, chat_template=chat_template,
            chat_template_content_format=chat_template_content_format,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, chat_template_kwargs=chat_template_kwargs,
        )
        # The template already wrote every special token: do not let the tokenizer add a BOS.
        return self.generate(texts, sampling_params, use_tqdm, lora_request,
                             tokenization_kwargs={"add_special_tokens": False, **encode_kwargs(tokenization_kwargs)})

    @property
    def prefix_cache_stats(self) -> dict[str, float]:
        bm = self.engine.block_manager
        return {"queries": bm.num_queried_tokens, "hits": bm.num_hit_tokens, "hit_rate": self.prefix_cache_hit_rate}

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.engine.block_manager.hit_rate

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached block; True once done (as vLLM). Nothing runs between generate()
        calls and there is no KV connector, so vLLM's two flags change nothing here."""
        self.engine.reset_prefix_cache()
        return True

    def close(self) -> None:
        """Release the model, the KV cache and any tensor-parallel workers; generate() raises after this."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_priority(priority: list[int] | None, num_prompts: int) -> None:
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or len(priority) != num_prompts:
        raise ValueError(f"priority must be None or a list of {num_prompts} ints (one per prompt), got {priority!r}")
    if any(p != 0 for p in priority):
        raise ValueError(
            f"priority={list(priority)} is not supported: nanoserve schedules first come, first served "
            "(vLLM's default policy), so every priority must be 0 or priority=None"
        )


def _check_lora_list(lora_request: Any, num_prompts: int) -> None:
    """vLLM also takes one lora_request per prompt: a list of None asks for nothing."""
    if not isinstance(lora_request, (list, tuple)):
        return
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {len(lora_request)} lora_request entries for {num_prompts} prompts")
    for r in lora_request:
        refuse_unless_off("generate()", "lora_request", r, (None,), NO_LORA)


def _as_embeddings(results: Iterator) -> Iterator:
    """embed_stream's results; closing it closes the stream (which aborts what is in flight)."""
    try:
        for i, out in results:
            yield i, out if isinstance(out, RequestError) else EmbeddingRequestOutput.from_base(out)
    finally:
        results.close()

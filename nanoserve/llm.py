"""`LLM`: the user-facing facade, with vLLM's names so scripts can switch between the two."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from nanoserve.chat import render_conversations
from nanoserve.config import Config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine_args import NO_LORA, log_no_effect_once, refuse_unless_off, resolve_engine_args
from nanoserve.inputs import PromptType, TokensPrompt, parse_prompts
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.streaming import RequestError, generate_stream

# Arguments older vLLM versions' generate() took; accepted when they ask for nothing.
_LEGACY_GENERATE_ARGS = {
    "prompt_adapter_request": "nanoserve has no prompt adapters",
    "guided_options_request": "nanoserve has no guided decoding",
}
# tokenization_kwargs keys nanoserve honours (they go to tokenizer.encode).
_TOKENIZATION_KEYS = ("add_special_tokens",)


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
        """
        self._check_generate_options(lora_request, legacy)
        parsed = parse_prompts(prompts)
        encode_kwargs = _encode_kwargs(tokenization_kwargs)
        token_prompts = [(text, ids if ids is not None else self.tokenizer.encode(text, **encode_kwargs))
                         for text, ids in parsed]
        params = self._params_per_prompt(sampling_params, len(token_prompts))
        _check_priority(priority, len(token_prompts))
        _check_lora_list(lora_request, len(token_prompts))
        specs = [self.engine.validate_request(ids, p) for (_, ids), p in zip(token_prompts, params)]
        with self.engine.exclusive("generate()"):
            request_ids = [self.engine.add_request(ids, p, text, spec)
                           for (text, ids), p, spec in zip(token_prompts, params, specs)]
            outputs = self._run_engine(use_tqdm)
        return [outputs[rid] for rid in request_ids]

    def generate_stream(
        self,
        prompts: Iterable[PromptType],
        sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
        *,
        max_inflight: int | None = None,
        use_tqdm: bool = True,
    ) -> Iterator[tuple[int, RequestOutput | RequestError]]:
        """Yield `(index, RequestOutput)` for each prompt as it finishes, reading `prompts` lazily.

        At most `max_inflight` requests (default 2 * max_num_seqs) are in the engine at once, so
        memory does not grow with the input. A prompt or SamplingParams that `generate` would
        reject yields `(index, RequestError)` with the same message instead of raising.
        `sampling_params` is one SamplingParams for all, or an iterable read in step with
        `prompts`. Closing the generator early aborts the requests in flight. See
        nanoserve/streaming.py.
        """
        return generate_stream(self, prompts, sampling_params, max_inflight, use_tqdm)

    def _run_engine(self, use_tqdm: bool | Callable[..., tqdm]) -> dict[str, RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        total = len(self.engine.requests)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tokens = decode_tokens = 0
        prefill_time = decode_time = 0.0
        try:
            while not self.engine.is_finished():
                start = time.perf_counter()
                stats = self.engine.step()
                elapsed = time.perf_counter() - start
                # A mixed step's time is split between prefill and decode by token share.
                tokens = stats.num_prefill_tokens + stats.num_decode_tokens
                prefill_time += elapsed * stats.num_prefill_tokens / tokens
                decode_time += elapsed * stats.num_decode_tokens / tokens
                prefill_tokens += stats.num_prefill_tokens
                decode_tokens += stats.num_decode_tokens
                for out in stats.finished:
                    outputs[out.request_id] = out
                bar.update(len(stats.finished))
                bar.set_postfix(
                    prefill=f"{prefill_tokens / max(prefill_time, 1e-9):.0f}tok/s",
                    decode=f"{decode_tokens / max(decode_time, 1e-9):.0f}tok/s",
                )
            if use_tqdm:
                bar.set_postfix_str(f"{bar.postfix}, prefix-cache hit rate={self.prefix_cache_hit_rate:.1%}")
        except BaseException:
            self.engine.abort_all()  # leave the engine usable and every block free
            raise
        finally:
            bar.close()
        return outputs

    # ---- inputs ----------------------------------------------------------------------------

    @staticmethod
    def _check_generate_options(lora_request: Any, legacy: dict[str, Any]) -> None:
        for name, value in legacy.items():
            if name not in _LEGACY_GENERATE_ARGS:
                raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
            refuse_unless_off("generate()", name, value, (None,), _LEGACY_GENERATE_ARGS[name])
        if not isinstance(lora_request, (list, tuple)):
            refuse_unless_off("generate()", "lora_request", lora_request, (None,), NO_LORA)

    def _params_per_prompt(self, params, num_prompts: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if isinstance(params, (list, tuple)):
            if len(params) != num_prompts:
                raise ValueError(
                    f"got {len(params)} sampling_params for {num_prompts} prompts; pass one, or one per prompt"
                )
            for p in params:
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params entries must be SamplingParams, got {type(p).__name__}")
            return list(params)
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}")

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
        encode_kwargs = {"add_special_tokens": False, **_encode_kwargs(tokenization_kwargs)}
        prompts = [TokensPrompt(prompt_token_ids=self.tokenizer.encode(t, **encode_kwargs), prompt=t) for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    @property
    def prefix_cache_stats(self) -> dict[str, float]:
        bm = self.engine.block_manager
        return {"queries": bm.num_queried_tokens, "hits": bm.num_hit_tokens, "hit_rate": self.prefix_cache_hit_rate}

    @property
    def prefix_cache_hit_rate(self) -> float:
        bm = self.engine.block_manager
        return bm.num_hit_tokens / bm.num_queried_tokens if bm.num_queried_tokens else 0.0

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


def _encode_kwargs(tokenization_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if tokenization_kwargs is None:
        return {}
    if not isinstance(tokenization_kwargs, dict):
        raise TypeError(f"tokenization_kwargs must be a dict or None, got {type(tokenization_kwargs).__name__}")
    unsupported = sorted(set(tokenization_kwargs) - set(_TOKENIZATION_KEYS))
    if unsupported:
        raise ValueError(f"tokenization_kwargs {unsupported} are not supported; nanoserve takes {_TOKENIZATION_KEYS}")
    return dict(tokenization_kwargs)


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

"""`LLM`: the user-facing facade, with vLLM's names so scripts can switch between the two."""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from numbers import Integral
from typing import Any

from tqdm.auto import tqdm

from nanoserve.config import Config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.streaming import RequestError, generate_stream

PromptType = str | list[int] | dict


class LLM:
    """Offline batch generation.

    >>> llm = LLM("path/to/Qwen3-0.6B", dtype="bfloat16")
    >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - Config.field_names())
        if unknown:
            raise TypeError(
                f"LLM() got unknown argument(s) {unknown}; valid ones are: {', '.join(sorted(Config.field_names()))}"
            )
        self.config = Config(model, **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.

        prompts: a str, a list of str, a list of token ids, a list of token-id lists, or
        vLLM-style dicts {"prompt": str} / {"prompt_token_ids": [...]}.
        """
        token_prompts = self._tokenize(self._as_prompt_list(prompts))
        params = self._params_per_prompt(sampling_params, len(token_prompts))
        for (_, ids), p in zip(token_prompts, params):
            self.engine.validate_request(ids, p)
        if not self.engine.is_finished():
            raise RuntimeError("generate() called while another generate() is running on this LLM")
        request_ids = [self.engine.add_request(ids, p, text) for (text, ids), p in zip(token_prompts, params)]
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

    def _run_engine(self, use_tqdm: bool) -> dict[str, RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        total = len(self.engine.requests)
        bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
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
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, SequenceABC) or isinstance(prompts, bytes):
            raise TypeError(f"prompts must be a str, a list of str, or token ids; got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(p, Integral) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)

    def _tokenize(self, prompts: list) -> list[tuple[str | None, list[int]]]:
        return [self._tokenize_one(i, prompt) for i, prompt in enumerate(prompts)]

    def _tokenize_one(self, i: int, prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of prompt number i; errors name it by that number."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
                raise TypeError(f"prompt {i} must hold int token ids, got {prompt[:5]!r}...")
            return None, [int(t) for t in prompt]
        raise TypeError(f"prompt {i} must be a str or a list of token ids, got {type(prompt).__name__}")

    def _params_per_prompt(self, params, num_prompts: int) -> list[SamplingParams]:
        if params is None:
            return [self.engine.default_sampling_params()] * num_prompts
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
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them via the tokenizer's chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
            )
            for conv in conversations
        ]
        token_prompts = [{"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)} for p in prompts]
        outputs = self.generate(token_prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    @property
    def prefix_cache_stats(self) -> dict[str, float]:
        bm = self.engine.block_manager
        return {"queries": bm.num_queried_tokens, "hits": bm.num_hit_tokens, "hit_rate": self.prefix_cache_hit_rate}

    @property
    def prefix_cache_hit_rate(self) -> float:
        bm = self.engine.block_manager
        return bm.num_hit_tokens / bm.num_queried_tokens if bm.num_queried_tokens else 0.0

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Stop tensor-parallel workers (a no-op for a single-process engine)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

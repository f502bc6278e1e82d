"""vLLM's `LLMEngine` API: a loop the caller drives, one request at a time in and one engine step
at a time out (vLLM's examples/offline_inference/llm_engine_example.py), over nanoserve's engine.

    engine = LLMEngine.from_engine_args(EngineArgs(model="/path/to/Qwen3-0.6B"))
    engine.add_request("0", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():          # the requests that got tokens this step
            if out.finished:
                print(out.outputs[0].text)

`LLM` drives the same engine for whole batches; this is for callers who add requests while others
run. Request ids are the caller's, as in vLLM.
"""
from __future__ import annotations

from typing import Any

from nanoserve.arg_utils import EngineArgs
from nanoserve.config import Config
from nanoserve.engine.llm_engine import LLMEngine as _Engine
from nanoserve.engine_args import NO_LORA, log_no_effect_once, refuse_unless_off, resolve_engine_args
from nanoserve.inputs import PromptType
from nanoserve.outputs import PoolingRequestOutput, RequestOutput
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams


class LLMEngine:
    """vLLM's LLMEngine: add_request / step / has_unfinished_requests / abort_request /
    reset_prefix_cache.

    step() returns an output for every request that got a token in the step: the running ones
    with their text and tokens so far (vLLM's default, cumulative outputs) and `finished=False`,
    then the ones that finished, `finished=True`.
    """

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self._ids: dict[str, str] = {}  # nanoserve's request id -> the caller's

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        if not engine_args.model:
            raise ValueError("EngineArgs.model: pass a checkpoint directory (nanoserve has no model hub)")
        config_kwargs, no_effect = resolve_engine_args(engine_args.kwargs)
        config = Config(engine_args.model, **config_kwargs)
        log_no_effect_once(no_effect)
        return cls(_Engine(config))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
    ) -> None:
        """Queue `prompt`; every check runs now (ValueError / TypeError naming the field)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._ids.values():
            raise ValueError(f"request_id {request_id!r} is already running; request ids must be unique")
        refuse_unless_off("add_request()", "lora_request", lora_request, (None,), NO_LORA)
        refuse_unless_off("add_request()", "priority", priority, (0,), "nanoserve schedules first come, first served")
        # arrival_time and trace_headers change no result: nanoserve times requests itself, traces nothing.
        request = self.engine.input_processor.prepare(prompt, params, tokenization_kwargs=tokenization_kwargs)
        self._ids[self.engine.add_request(request)] = request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self._ids)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drop these requests (the caller's ids); unknown or finished ones are ignored."""
        wanted = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        ours = [ours for ours, theirs in self._ids.items() if theirs in wanted]
        self.engine.abort_request(ours)
        for request_id in ours:
            del self._ids[request_id]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drop every cached block; as vLLM's, False (and nothing dropped) while requests hold blocks.
        `reset_connector`: nanoserve has no KV connector, so there is nothing more to reset."""
        if self.engine.is_finished():
            self.engine.reset_prefix_cache()
            return True
        if reset_running_requests:
            raise ValueError(
                "reset_prefix_cache(reset_running_requests=True) is not supported: nanoserve does not preempt "
                "running requests to reset the cache; call it when has_unfinished_requests() is False"
            )
        return False

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        try:
            stats = self.engine.step()
        except BaseException:
            # Every request in flight is dropped, blocks freed: the model run's failures abort them
            # already; one after it (stop checks, detokenizing) would otherwise leave them half done.
            self.engine.abort_all()
            self._ids.clear()
            raise
        finished = {out.request_id: out for out in stats.finished}
        running = [rid for rid in dict.fromkeys(e.request_id for e in stats.entries if e.sampled)
                   if rid not in finished and rid in self.engine.requests]
        outputs = [self.engine.output_so_far(rid) for rid in running] + list(finished.values())
        for out in outputs:
            out.request_id = self._ids.pop(out.request_id) if out.finished else self._ids[out.request_id]
        return outputs

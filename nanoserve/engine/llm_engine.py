"""The engine loop: requests in, one scheduled step at a time, finished RequestOutputs out."""
from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from nanoserve.checkpoint import eos_token_ids, load_tokenizer, read_generation_config
from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.input_processor import EngineRequest, InputProcessor
from nanoserve.engine.model_runner import ModelRunner, StepOutput, resolve_device
from nanoserve.engine.prompt_logprobs import PromptLogprobs, PromptLogprobsRecord
from nanoserve.engine.runner import Runner
from nanoserve.engine.scheduler import ScheduledBatch, Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.inputs import PromptType
from nanoserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanoserve.engine.pooling_requests import PoolingSpec, finish_pooling_request, make_pooling_request
from nanoserve.pooling.tokenizer import lowercase_inputs
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.manager import StructuredOutputManager


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    num_finished: int = 0
    prompt_logprobs: PromptLogprobsRecord | None = None  # filled step by step when params.prompt_logprobs is set

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


class StepEntry(NamedTuple):
    """One sequence's share of a step: what a benchmark needs to model the step's cost."""

    request_id: str
    num_computed_tokens: int  # tokens with K/V in the cache before the step
    num_new_tokens: int
    sampled: bool  # did the sequence get a new token this step


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    finished: list[RequestOutput] = field(default_factory=list)
    entries: list[StepEntry] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: Config) -> None:
        self.config = config
        tokenizer = load_tokenizer(config.tokenizer)
        if config.pooling is not None and config.pooling.lower_case:
            lowercase_inputs(tokenizer)
        self.generation_config = read_generation_config(config.model)
        self.eos_token_ids = eos_token_ids(tokenizer, self.generation_config)
        self.vocab_size = config.hf_config["vocab_size"]
        self.structured = StructuredOutputManager(
            lambda: self.tokenizer, self.vocab_size, self.eos_token_ids, config.structured_outputs_jump_forward
        )
        self.input_processor = InputProcessor(config, tokenizer, self.vocab_size, self.eos_token_ids, self.structured)
        self.device = resolve_device(config.device)
        self.model_runner = self._make_runner()
        self.kv_spec = self.model_runner.kv_spec  # block size and count, decided once (kv_cache_spec.py)
        self.num_kvcache_blocks, self.block_size = self.kv_spec.num_blocks, self.kv_spec.block_size
        # Mean and CLS pooling read every prompt position, which a prefix-cache hit skips.
        prefix_caching = config.enable_prefix_caching and (config.pooling is None or config.pooling.uses_prefix_cache)
        self.block_manager = BlockManager(self.num_kvcache_blocks, self.block_size, prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self._rng = random.Random(config.seed)  # seeds for requests that bring none
        self._next_request_id = 0
        self._next_seq_id = 0
        self.is_closed = False
        self.requests: dict[str, Request] = {}
        self._user: str | None = None  # who holds the engine (see exclusive)

    def _make_runner(self) -> Runner:
        if self.config.tensor_parallel_size > 1:
            from nanoserve.engine.tp_runner import TPModelRunner  # spawns workers: TP engines only

            return TPModelRunner(self.config, self.device)
        return ModelRunner(self.config, self.device)

    # ---- requests --------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.input_processor.tokenizer = tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's behaviour: the checkpoint's generation_config.json sets the sampling defaults."""
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        kwargs = {k: self.generation_config[k] for k in keys if k in self.generation_config}
        if self.generation_config.get("max_new_tokens") is not None:  # HF's name for max_tokens, mapped as vLLM does
            kwargs["max_tokens"] = self.generation_config["max_new_tokens"]
        return SamplingParams(**kwargs)

    def add_request(self, request: EngineRequest | PromptType, params: SamplingParams | None = None) -> str:
        """Queue a request prepared by `input_processor` (a raw prompt and params are prepared now)."""
        if self.is_closed:
            raise RuntimeError("this engine is closed (LLM.close() released its model and KV cache); build a new LLM")
        if not isinstance(request, EngineRequest):
            request = self.input_processor.prepare(request, params)
        prompt_token_ids, params, spec, prompt = request
        request_id = str(self._next_request_id)
        self._next_request_id += 1
        if isinstance(spec, PoolingSpec):  # an embedding request: one prefill-only sequence
            request = make_pooling_request(request_id, self._next_seq_id, prompt, params, spec)
            self._next_seq_id += 1
            self.requests[request_id] = request
            self.scheduler.add(request.seqs[0])
            return request_id
        limit = max(self.config.max_model_len, len(prompt_token_ids) + 1)
        max_total = limit if params.max_tokens is None else min(len(prompt_token_ids) + params.max_tokens, limit)
        seqs = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            seqs.append(Sequence(self._next_seq_id, request_id, i, prompt_token_ids, params, max_total, seed, spec))
            self._next_seq_id += 1
        seqs[0].children = seqs[1:]
        detokenizers = [self._detokenizer(prompt_token_ids, params) for _ in seqs]
        self.structured.attach(seqs, detokenizers, params)  # a matcher per sample, + forced start tokens
        self.requests[request_id] = Request(
            request_id, prompt, list(prompt_token_ids), params, seqs, detokenizers, RequestMetrics(time.perf_counter()),
            prompt_logprobs=PromptLogprobsRecord.for_request(prompt_token_ids, params, spec.prompt_logprobs),
        )
        self.scheduler.add(seqs[0])
        return request_id

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens, min_tokens=params.min_tokens,
        )

    # ---- the loop --------------------------------------------------------------------------

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    @contextmanager
    def exclusive(self, user: str) -> Iterator[None]:
        """Hold the engine for one caller at a time (a generate() call, a stream for its lifetime):
        two callers stepping one engine would take each other's results."""
        if self._user is not None:
            raise RuntimeError(f"{user} was started while {self._user} is running on this LLM; finish or close it first")
        self._user = user
        try:
            yield
        finally:
            self._user = None

    def step(self) -> StepStats:
        try:
            batch = self.scheduler.schedule()
            scheduled_at = time.perf_counter()
            for seq in batch.seqs:
                metrics = self.requests[seq.request_id].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = scheduled_at
            entries = [
                StepEntry(seq.request_id, seq.num_computed_tokens, n, samples)
                for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples)
            ]
            out = self.model_runner.run(batch)
        except BaseException:
            # Blocks published for this step hold no K/V, and sequences that hit them in this step
            # would read garbage: the abort forgets those blocks and drops every request in flight.
            self.abort_all()
            raise
        for chunk in out.prompt_logprobs:
            self.requests[batch.seqs[chunk.batch_index].request_id].prompt_logprobs.record(chunk)
        now = time.perf_counter()
        stats = StepStats(*self._count_tokens(batch), entries=entries)
        if out.pooled is not None:  # pooling requests finish the step their prompt completes
            done = self.scheduler.postprocess_prefill_only(batch)
            stats.finished = [finish_pooling_request(self.requests.pop(seq.request_id), vec, now)
                              for seq, vec in zip(done, out.pooled)]
            return stats
        got_token = self.scheduler.postprocess(batch, out.token_ids)
        for i, seq in enumerate(got_token):
            request = self.requests[seq.request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self._record_logprobs(seq, out, i)
            if seq.matcher is not None:
                seq.matcher.accept(seq.token_ids[-1])
            if self._check_stop(seq, request) or self._after_constrained_token(seq, request):
                self.scheduler.finish(seq)
                request.num_finished += 1
                if request.finished:
                    request.metrics.finished_time = now
                    stats.finished.append(self._make_output(self.requests.pop(request.request_id)))
        return stats

    @staticmethod
    def _count_tokens(batch: ScheduledBatch) -> tuple[int, int]:
        prefill = sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens) if n > 1 or seq.is_prefill)
        return prefill, batch.num_tokens - prefill

    def _record_logprobs(self, seq: Sequence, out: StepOutput, i: int) -> None:
        if seq.params.logprobs is None or out.logprobs is None:
            return
        token = seq.token_ids[-1]
        seq.cumulative_logprob += out.logprobs[i]
        # vLLM's layout: the sampled token first with its rank in the vocabulary, then the top k
        # with ranks 1..k (a sampled token among them keeps its place first and takes its top-k rank).
        entry = {token: Logprob(out.logprobs[i], out.ranks[i])}
        top = list(out.top_logprobs[i].items())[: seq.sampling_spec.logprobs]  # -1 resolved to the vocabulary
        for rank, (t, lp) in enumerate(top, start=1):
            entry[t] = Logprob(lp, rank)
        seq.logprobs.append(entry)

    def _check_stop(self, seq: Sequence, request: Request) -> bool:
        params, token = seq.params, seq.token_ids[-1]
        past_min = seq.num_output_tokens > params.min_tokens  # EOS/stop ids were masked until then
        detok = request.detokenizers[seq.sample_index]
        stop_token = past_min and ((not params.ignore_eos and token in self.eos_token_ids)
                                   or token in params.stop_token_ids)
        if stop_token:
            seq.finish_reason = "stop"
            # vLLM's EOS is the tokenizer's; generation_config's other EOS ids act as stop_token_ids
            # (a sample they end reports them as its stop_reason).
            seq.stop_reason = None if token == self.tokenizer.eos_token_id and not params.ignore_eos else token
            # vLLM's detokenizer renders the token that stopped the sample only with
            # include_stop_str_in_output (and then a stop string it completes is the stop_reason).
            if detok is not None and params.include_stop_str_in_output:
                seq.stop_reason = detok.update([token]) or seq.stop_reason
            return True
        if detok is not None:
            stop = detok.update([token])
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        if seq.num_tokens >= seq.max_total_tokens:
            seq.finish_reason = "length"
            return True
        return False

    def _after_constrained_token(self, seq: Sequence, request: Request) -> bool:
        """Structured outputs, after the sampled token passed the stop checks: a complete grammar
        ends the sample ("stop"); otherwise the tokens the grammar forces are appended (jump-forward;
        they enter the model with the next step as a multi-token chunk), each checked like a
        sampled token. True when the sequence finished."""
        if seq.matcher is None:
            return False
        if not seq.matcher.is_finished:
            for token in seq.matcher.forced_tokens(seq.max_total_tokens - seq.num_tokens):
                seq.append_token(token)
                if self._check_stop(seq, request):
                    return True
        if seq.matcher.is_finished:
            seq.finish_reason = "stop"
            return True
        return False

    def output_so_far(self, request_id: str) -> RequestOutput:
        """A running request's output: its samples' text and tokens so far, `finished=False`
        (what vLLM's LLMEngine.step returns for a request still running)."""
        out = self._make_output(self.requests[request_id])
        out.finished = False
        return out

    def _make_output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq, detok in zip(request.seqs, request.detokenizers):
            wants_logprobs = seq.params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=detok.output_text if detok is not None else "",
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
                    logprobs=self._decoded(seq.logprobs, seq.params) if wants_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        request.metrics.num_generated_tokens = max(len(o.token_ids) for o in outputs)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            num_cached_tokens=request.seqs[0].num_cached_tokens or 0,
            finished=True,
            metrics=request.metrics,
            prompt_logprobs=self._prompt_logprobs(request),
        )

    def _decoded(self, logprobs: list[dict[int, Logprob]], params: SamplingParams) -> list[dict[int, Logprob]]:
        """vLLM's decoded_token of sample logprobs: each token decoded alone (None when detokenize=False)."""
        if params.detokenize:
            texts: dict[int, str] = {}  # the top k repeat across steps: one decode per distinct token
            for step in logprobs:
                for t, lp in step.items():
                    if t not in texts:
                        texts[t] = self.tokenizer.decode([t])
                    lp.decoded_token = texts[t]
        return logprobs

    def _prompt_logprobs(self, request: Request) -> PromptLogprobs | None:
        if request.prompt_logprobs is None:
            return None
        # vLLM's decoded_token: the single token detokenized (None when detokenize=False).
        decode = (lambda t: self.tokenizer.decode([t])) if request.params.detokenize else None
        return request.prompt_logprobs.output(decode)

    # ---- cache management ------------------------------------------------------------------

    def close(self) -> None:
        """Release the model, the KV cache and (with tensor parallelism) the worker processes."""
        self.abort_all()
        self.model_runner.close()
        self.is_closed = True

    def abort_all(self) -> None:
        self.scheduler.abort_all()
        pooler = getattr(self.model_runner, "pooler", None)  # runner="pooling" only (never tensor-parallel)
        if pooler is not None:
            pooler.reset()
        self.requests.clear()

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drop unfinished requests (vLLM's name); unknown or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.scheduler.abort(request.seqs)
                pooler = getattr(self.model_runner, "pooler", None)
                if pooler is not None:  # a mean/CLS request split over chunks carries a partial
                    pooler.forget([seq.seq_id for seq in request.seqs])

    def reset_prefix_cache(self) -> None:
        if not self.is_finished():
            raise RuntimeError("reset_prefix_cache() refused: requests are still running")
        self.block_manager.reset_prefix_cache()

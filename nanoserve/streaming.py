"""Feed the engine from an iterable and hand back results as they finish, in bounded memory.

`LLM.generate` needs every prompt up front and returns when the last one is done. A stream
reads its input only while fewer than `max_inflight` requests are in the engine, so memory is
set by that window and not by the input's size, and yields each result the step it finishes.
A bad item (a prompt or SamplingParams that `generate` would reject) becomes a `RequestError`
in the output instead of an exception, so one bad line never ends a run of millions.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from tqdm.auto import tqdm

from nanoserve.inputs import parse_prompt
from nanoserve.outputs import RequestOutput
from nanoserve.sampling import SamplingSpec
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.engine.llm_engine import LLMEngine, StepStats
    from nanoserve.llm import LLM

K = TypeVar("K")
_MISSING = object()


@dataclass(frozen=True)
class RequestError:
    """Yielded in place of a RequestOutput for an item that was rejected before it ran.

    `message` is the text `LLM.generate` would raise for the same item, `error_type` its class
    (ValueError or TypeError); `raise err.exception()` turns it back into that exception.
    """

    message: str
    error_type: type[Exception] = ValueError

    def exception(self) -> Exception:
        return self.error_type(self.message)


class EngineRequest(NamedTuple):
    """A validated, tokenized request, ready for `LLMEngine.add_request`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    spec: SamplingSpec  # what LLMEngine.validate_request returned
    prompt: str | None = None


def default_max_inflight(max_num_seqs: int) -> int:
    """A full batch running and as many queued to refill it as requests finish."""
    return 2 * max_num_seqs


def stream_requests(
    engine: LLMEngine,
    items: Iterable[tuple[K, EngineRequest | RequestError]],
    max_inflight: int,
    on_step: Callable[[StepStats], None] | None = None,
) -> Iterator[tuple[K, RequestOutput | RequestError]]:
    """Run `(key, request)` items through the engine, yielding `(key, result)` as each finishes.

    `items` is read only while fewer than `max_inflight` requests are running or waiting; an
    item that is already a RequestError is passed straight through. If `items` itself raises,
    the requests in flight are finished and yielded first, then the error is raised. Closing
    the generator early aborts what is in flight and frees its KV blocks.
    """
    with engine.exclusive("a generate_stream() stream"):
        yield from _stream(engine, iter(items), max_inflight, on_step)


def _stream(engine, items, max_inflight, on_step):
    inflight: dict = {}  # engine request id -> caller's key
    exhausted = False
    input_error: Exception | None = None
    try:
        while True:
            while not exhausted and len(inflight) < max_inflight:
                try:
                    key, request = next(items)
                except StopIteration:
                    exhausted = True
                except Exception as e:  # re-raised below, once nothing in flight can be lost
                    input_error, exhausted = e, True
                else:
                    if isinstance(request, RequestError):
                        yield key, request
                    else:
                        request_id = engine.add_request(request.prompt_token_ids, request.params, request.prompt,
                                                        request.spec)
                        inflight[request_id] = key
            if not inflight:
                break
            stats = engine.step()
            if on_step is not None:
                on_step(stats)
            for out in stats.finished:
                yield inflight.pop(out.request_id), out
    finally:
        engine.abort_request(list(inflight))  # only non-empty when closed early or on an error
    if input_error is not None:
        raise input_error


# ---- LLM.generate_stream -------------------------------------------------------------------


def generate_stream(
    llm: LLM,
    prompts: Iterable[Any],
    sampling_params: SamplingParams | Iterable[SamplingParams] | None,
    max_inflight: int | None,
    use_tqdm: bool,
) -> Iterator[tuple[int, RequestOutput | RequestError]]:
    """The body of `LLM.generate_stream`: argument checks now, the work when iterated."""
    if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Iterable):
        raise TypeError(
            f"prompts must be an iterable of prompts (wrap a single prompt in a list), got {type(prompts).__name__}"
        )
    if max_inflight is None:
        max_inflight = default_max_inflight(llm.config.max_num_seqs)
    if not isinstance(max_inflight, int) or isinstance(max_inflight, bool):
        raise TypeError(f"max_inflight must be an int, got {max_inflight!r}")
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    params, lockstep = _params_source(llm, sampling_params)
    total = len(prompts) if isinstance(prompts, Sized) else None
    items = _prepare(llm, prompts, params, lockstep)
    return _with_progress(stream_requests(llm.engine, items, max_inflight), total, use_tqdm)


def _params_source(llm: LLM, sampling_params) -> tuple[Iterator[Any], bool]:
    """SamplingParams for each prompt, and whether they come one per prompt (read in lockstep)."""
    if sampling_params is None:
        return itertools.repeat(llm.engine.default_sampling_params()), False
    if isinstance(sampling_params, SamplingParams):
        return itertools.repeat(sampling_params), False
    if isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Iterable):
        raise TypeError(
            "sampling_params must be SamplingParams or an iterable of them (one per prompt), "
            f"got {type(sampling_params).__name__}"
        )
    return iter(sampling_params), True


def _prepare(llm: LLM, prompts: Iterable[Any], params: Iterator[Any], lockstep: bool):
    for i, prompt in enumerate(prompts):
        p = next(params, _MISSING)
        if p is _MISSING:
            yield i, RequestError(f"sampling_params ran out at prompt {i}; pass one, or one per prompt")
        else:
            yield i, prepare_request(llm, i, prompt, p)
    if lockstep and next(params, _MISSING) is not _MISSING:
        raise ValueError("sampling_params has more entries than prompts; pass one, or one per prompt")


def prepare_request(llm: LLM, i: int, prompt: Any, params: Any) -> EngineRequest | RequestError:
    """Tokenize and validate one prompt exactly as `generate` does, turning its error into a result."""
    try:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params entries must be SamplingParams, got {type(params).__name__}")
        text, token_ids = parse_prompt(prompt, i)
        if token_ids is None:
            token_ids = llm.get_tokenizer().encode(text)
        spec = llm.engine.validate_request(token_ids, params)
    except (ValueError, TypeError) as e:
        return RequestError(str(e), type(e))
    return EngineRequest(token_ids, params, spec, text)


def _with_progress(results: Iterator, total: int | None, use_tqdm: bool) -> Iterator:
    bar = tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True, disable=not use_tqdm)
    try:
        for result in results:
            bar.update(1)
            yield result
    finally:
        results.close()  # abort in-flight requests now, not whenever the inner generator is collected
        bar.close()

"""The one step loop: requests in, `LLMEngine.step()` until they finish, results out as they finish.

`generate` feeds it every request at once; `generate_stream`, run-batch and Ray read their input
only while fewer than `max_inflight` requests are in flight (memory is set by that window, not by
the input); the benchmark driver adds requests between steps as they arrive.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING

from nanoserve.engine.input_processor import EngineRequest, RequestError
from nanoserve.outputs import RequestOutput

if TYPE_CHECKING:
    from nanoserve.engine.llm_engine import LLMEngine, StepStats

Result = RequestOutput | RequestError


def default_max_inflight(max_num_seqs: int) -> int:
    """A full batch running and as many queued to refill it as requests finish."""
    return 2 * max_num_seqs


class RequestStream:
    """Requests in flight on one engine, keyed by the caller's keys. Holds the engine while open
    (two callers stepping one engine would take each other's results); `close` aborts what is left."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[StepStats], None] | None = None,
                 user: str = "generate()") -> None:
        self.engine = engine
        self.on_step = on_step
        self.inflight: dict[str, Hashable] = {}  # engine request id -> caller's key
        self._hold = engine.exclusive(user)
        self._hold.__enter__()

    def add(self, key: Hashable, request: EngineRequest) -> str:
        """Queue `request` under the caller's `key`; returns the engine's request id."""
        request_id = self.engine.add_request(request)
        self.inflight[request_id] = key
        return request_id

    def step(self) -> list[tuple[Hashable, RequestOutput]]:
        """One engine step; the (key, output) of each request it finished."""
        stats = self.engine.step()
        if self.on_step is not None:
            self.on_step(stats)
        return [(self.inflight.pop(out.request_id), out) for out in stats.finished]

    def close(self) -> None:
        """Abort what is still in flight (closed early or on an error) and let go of the engine."""
        try:
            self.engine.abort_request(list(self.inflight))
            self.inflight.clear()
        finally:
            self._hold.__exit__(None, None, None)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_requests(
    engine: LLMEngine,
    items: Iterable[tuple[Hashable, EngineRequest | RequestError]],
    max_inflight: int,
    on_step: Callable[[StepStats], None] | None = None,
    user: str = "a generate_stream() stream",
) -> Iterator[tuple[Hashable, Result]]:
    """Run `(key, request)` items through the engine, yielding `(key, result)` as each finishes.

    A RequestError item passes straight through (one bad line never ends a run of millions). If
    `items` raises, what is in flight is finished first. Closing early aborts what is in flight.
    """
    items = iter(items)
    input_error: Exception | None = None
    with RequestStream(engine, on_step, user) as stream:
        exhausted = False
        while True:
            while not exhausted and len(stream.inflight) < max_inflight:
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
                        stream.add(key, request)
            if not stream.inflight:
                break
            yield from stream.step()
    if input_error is not None:
        raise input_error

"""Beam search on top of `generate`, as vLLM's `LLM.beam_search` runs it (vLLM's names and rules).

Every step asks the engine for one token of every live beam with 2 x beam_width logprobs (the
candidates HF transformers' beam search keeps per beam), extends each beam by each candidate,
and keeps a prompt's best beam_width by score = cumulative logprob / length ** length_penalty
(the length counts the prompt; a final EOS does not count). A candidate ending in EOS is
finished. A beam's tokens are a prompt the prefix cache already holds but for its tail, so a
step recomputes at most a block per beam.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from nanoserve.outputs import Logprob
from nanoserve.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` include the prompt; `logprobs` holds each generated step's candidate dict."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] == eos_token_id)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearchInstance:
    """One prompt's search: the live beams and the finished ones."""

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.beams = [BeamSearchSequence(tokens=list(prompt_tokens))]
        self.completed: list[BeamSearchSequence] = []


def expand(beam: BeamSearchSequence, candidates: dict[int, Logprob], eos_token_id: int | None, ignore_eos: bool,
           instance: BeamSearchInstance) -> list[BeamSearchSequence]:
    """The beam extended by each candidate; those ending in EOS go to the instance's finished ones."""
    live = []
    for token_id, logprob in candidates.items():
        child = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [candidates],
                                   lora_request=beam.lora_request, cum_logprob=beam.cum_logprob + logprob.logprob)
        if token_id == eos_token_id and not ignore_eos:
            instance.completed.append(child)
        else:
            live.append(child)
    return live


def run_beam_search(
    generate_step: Callable[[list[list[int]]], list[dict[int, Logprob] | None]],
    prompt_tokens: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_id: int | None,
    max_model_len: int,
    concurrency_limit: int,
    step_done: Callable[[], None] = lambda: None,
) -> list[BeamSearchInstance]:
    """The search for every prompt, `concurrency_limit` prompts at a time. `generate_step(beams)` returns
    each beam's candidate dict for its next token (None if it could not grow). A beam that reached
    max_model_len is finished (vLLM drops it; here every prompt keeps an output)."""
    instances = [BeamSearchInstance(tokens) for tokens in prompt_tokens]
    key = partial(beam_score, eos_token_id=eos_token_id, length_penalty=params.length_penalty)
    for start in range(0, len(instances), concurrency_limit):
        batch = instances[start : start + concurrency_limit]
        for _ in range(params.max_tokens):
            for instance in batch:
                full = [b for b in instance.beams if len(b.tokens) >= max_model_len]
                instance.completed += full
                instance.beams = [b for b in instance.beams if len(b.tokens) < max_model_len]
            beams = [beam for instance in batch for beam in instance.beams]
            if not beams:
                break
            candidates = iter(generate_step([beam.tokens for beam in beams]))
            for instance in batch:
                children = []
                for beam in instance.beams:
                    step = next(candidates)
                    if step is None:
                        instance.completed.append(beam)
                    else:
                        children += expand(beam, step, eos_token_id, params.ignore_eos, instance)
                instance.beams = sorted(children, key=key, reverse=True)[: params.beam_width]
            step_done()
    for instance in instances:
        instance.completed = sorted(instance.completed + instance.beams, key=key, reverse=True)[: params.beam_width]
        instance.beams = []
    return instances

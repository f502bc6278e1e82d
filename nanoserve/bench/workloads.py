"""Benchmark workloads: random token-id prompts with per-request lengths, as nano-vllm's bench.py.

Every workload is a list of `Request`s built from a seed, so nanoserve and its peers run exactly
the same prompts (token ids) and output lengths. EOS is ignored, so any token id works.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# Per-workload defaults; every value can be overridden from the command line.
PRESETS: dict[str, dict] = {
    # Sized so `--compare hf` finishes in about five minutes on 2 AVX2 cores, where HF's bf16 GEMMs
    # run at ~20 GFLOP/s. A longer CPU workload: --input-len 64 256 --output-len 64 256.
    "random": dict(num_seqs=16, input_len=(32, 64), output_len=(32, 64)),
    # Many requests share one long system prompt; their own tails and outputs are short.
    "shared-prefix": dict(num_seqs=16, input_len=(16, 64), output_len=(16, 32), prefix_len=512),
    # Short prompts decode while long prompts arrive one by one.
    "mixed": dict(num_seqs=8, input_len=(32, 64), output_len=(96, 96), long_len=(768, 768), num_long=3,
                  long_every=24, max_num_batched_tokens=256),
    # A few long prompts and short outputs: prefill-bound. Also probes a one-block prefix-cache hit.
    "long-prompt": dict(num_seqs=3, input_len=(4000, 4000), output_len=(16, 16)),
    # Structured outputs (bench/structured.py): JSON-schema constrained vs its unconstrained twin;
    # output_len is each request's max_tokens (the grammar usually ends it sooner).
    "json": dict(num_seqs=16, input_len=(32, 64), output_len=(160, 160)),
    # Multiple-choice scoring (lm-eval's loglikelihood): num_seqs questions, each a context of
    # input_len tokens and MCQ_CHOICES continuations of output_len tokens, scored by prompt logprobs.
    "mcq": dict(num_seqs=8, input_len=(300, 800), output_len=(1, 20)),
    # Embeddings (nanoserve/bench/embed.py): documents of 64-512 tokens, and as many queries.
    "embed": dict(num_seqs=32, input_len=(64, 512), output_len=(1, 1)),
}
MCQ_CHOICES = 4

# Workloads whose requests all arrive at once: a peer engine (HF, vLLM) can run them as one batch.
# Which peers each workload runs side by side (--compare); the others compare nanoserve settings.
PEER_WORKLOADS = {"random": ("hf", "vllm", "llamacpp"), "long-prompt": ("hf", "vllm", "llamacpp"), "json": ("vllm",), "mcq": ("vllm",),
                  "embed": ("vllm",)}


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    # 0: present from the start. k > 0: added once every request present from the start has made
    # k output tokens (or finished); the mixed and shared-prefix workloads use it.
    arrival: int = 0
    # mcq: a scoring request (max_tokens 1); its prompt tokens from this index on are scored.
    score_from: int | None = None


@dataclass
class WorkloadSpec:
    name: str
    num_seqs: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0
    prefix_len: int | None = None  # shared-prefix
    long_len: tuple[int, int] | None = None  # mixed
    num_long: int | None = None  # mixed
    long_every: int | None = None  # mixed

    def __post_init__(self) -> None:
        if self.name not in PRESETS:
            raise ValueError(f"workload must be one of {', '.join(PRESETS)}, got {self.name!r}")
        if self.num_seqs < 1:
            raise ValueError(f"num_seqs must be >= 1, got {self.num_seqs}")
        for field_name in ("input_len", "output_len", "long_len"):
            rng = getattr(self, field_name)
            if rng is not None and not (len(rng) == 2 and 1 <= rng[0] <= rng[1]):
                raise ValueError(f"{field_name} needs (MIN, MAX) with 1 <= MIN <= MAX, got {rng}")
        needed = {"shared-prefix": ("prefix_len",), "mixed": ("long_len", "num_long", "long_every")}
        for field_name in needed.get(self.name, ()):
            value = getattr(self, field_name)
            if value is None or (isinstance(value, int) and value < 1):
                raise ValueError(f"workload {self.name!r} needs {field_name} >= 1, got {value}")


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # nano-vllm draws ids below 10000; any id works since EOS is ignored.
    return [rng.randrange(0, min(vocab, 10000)) for _ in range(n)]


def make_requests(spec: WorkloadSpec, vocab: int) -> list[Request]:
    rng = random.Random(spec.seed)

    def length(bounds: tuple[int, int]) -> int:
        return rng.randint(*bounds)

    if spec.name in ("random", "long-prompt", "json"):
        return [Request(random_tokens(rng, length(spec.input_len), vocab), length(spec.output_len))
                for _ in range(spec.num_seqs)]
    if spec.name == "mcq":
        requests = []
        for _ in range(spec.num_seqs):
            context = random_tokens(rng, length(spec.input_len), vocab)
            requests += [Request(context + random_tokens(rng, length(spec.output_len), vocab), 1, score_from=len(context))
                         for _ in range(MCQ_CHOICES)]
        return requests
    if spec.name == "shared-prefix":
        # The first request arrives alone (a system prompt the server has seen before); the rest
        # arrive once it has its first token, so caching can serve their prefix.
        prefix = random_tokens(rng, spec.prefix_len, vocab)
        return [Request(prefix + random_tokens(rng, length(spec.input_len), vocab), length(spec.output_len),
                        arrival=0 if i == 0 else 1) for i in range(spec.num_seqs)]
    # mixed: short requests from the start, then long prompts every `long_every` tokens of progress.
    short = [Request(random_tokens(rng, length(spec.input_len), vocab), length(spec.output_len))
             for _ in range(spec.num_seqs)]
    long = [Request(random_tokens(rng, length(spec.long_len), vocab), 16, arrival=(i + 1) * spec.long_every)
            for i in range(spec.num_long)]
    return short + long


def one_block_hit_pair(prompt: list[int], block_size: int, vocab: int, seed: int) -> tuple[list[int], list[int]]:
    """(cold, hit): `hit` has `cold`'s length and shares exactly its first block, no more."""
    if len(prompt) <= 2 * block_size:
        raise ValueError(f"the prefix-hit probe needs a prompt longer than two blocks ({2 * block_size} tokens), "
                         f"got {len(prompt)}")
    rng = random.Random(seed)
    tail = random_tokens(rng, len(prompt) - block_size, vocab)
    if tail[0] == prompt[block_size]:  # make sure the second block differs
        tail[0] = (tail[0] + 1) % min(vocab, 10000)
    return prompt, prompt[:block_size] + tail

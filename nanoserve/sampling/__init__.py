"""Sampling, one job per module.

metadata.py  SamplingSpec (a request's parameters, checked once when it is added), SamplingRow
             (one row of a step) and SamplingMetadata (a step's per-row tensors)
filters.py   penalties, the top-k / top-p / min-p cutoff, inverse-CDF draws
rng.py       counter-based uniforms: SplitMix64 of (seed, step)
bad_words.py vLLM's bad_words: the token sequences of the words, the tokens banned at a step
sampler.py   Sampler: logits -> SamplerOutput, in vLLM's order of operations
"""
from nanoserve.sampling.metadata import NUM_CANDIDATES, SamplingMetadata, SamplingRow, SamplingSpec
from nanoserve.sampling.sampler import Sampler, SamplerOutput

__all__ = ["NUM_CANDIDATES", "Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow", "SamplingSpec"]

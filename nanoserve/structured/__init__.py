"""Structured outputs: constrain generation to a JSON schema, regex, choice list or grammar.

params.py    StructuredOutputsParams / GuidedDecodingParams (vLLM's names), ConstraintSpec
grammar.py   specs -> llguidance grammars, checked against the tokenizer, LRU-cached
matcher.py   SequenceMatcher: one sequence's grammar state; jump-forward; StructuredStats
bitmask.py   a step's token masks for the constrained rows (CPU), unpacked for the sampler
manager.py   the engine's hooks: check at validation, attach at sequence creation
openai.py    OpenAI / vLLM server request fields (response_format, guided_*) -> params

llguidance is imported only when a request is constrained (pip install "nanoserve[structured]").
"""
from nanoserve.structured.params import ConstraintSpec, GuidedDecodingParams, StructuredOutputsParams

__all__ = ["ConstraintSpec", "GuidedDecodingParams", "StructuredOutputsParams"]

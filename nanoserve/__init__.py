"""nanoserve: a small, fast offline batch LLM inference engine."""
from nanoserve.config import Config
from nanoserve.inputs import TextPrompt, TokensPrompt
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanoserve.engine.input_processor import RequestError
from nanoserve.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "Config",
    "TextPrompt", "TokensPrompt", "RequestError", "StructuredOutputsParams", "GuidedDecodingParams",
]
__version__ = "0.1.0"

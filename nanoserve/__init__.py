"""nanoserve: a small, fast offline batch LLM inference engine."""
from nanoserve.config import Config
from nanoserve.inputs import TextPrompt, TokensPrompt
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.engine.input_processor import RequestError

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "Config",
    "TextPrompt", "TokensPrompt", "RequestError",
]
__version__ = "0.1.0"

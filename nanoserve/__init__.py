"""nanoserve: a small, fast offline batch LLM inference engine."""
from nanoserve.arg_utils import EngineArgs
from nanoserve.beam_search import BeamSearchOutput, BeamSearchSequence
from nanoserve.config import Config
from nanoserve.engine.input_processor import RequestError
from nanoserve.engine_api import LLMEngine
from nanoserve.inputs import TextPrompt, TokensPrompt
from nanoserve.llm import LLM
from nanoserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from nanoserve.pooling.config import PoolerConfig
from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob", "Config",
    "TextPrompt", "TokensPrompt", "RequestError", "StructuredOutputsParams", "GuidedDecodingParams",
    "PoolingParams", "PoolerConfig", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
    "EmbeddingRequestOutput", "ScoringOutput", "ScoringRequestOutput",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "ClassificationOutput",
    "ClassificationRequestOutput", "EngineArgs", "LLMEngine",
]
__version__ = "0.1.0"

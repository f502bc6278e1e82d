"""The decoder of a generative architecture as a pooling model: hidden states out, no LM head.

The same model code runs both runners; the pooling one is a subclass that builds no LM head
(nor its packed copy: a quarter of Qwen3-0.6B's weights) and reads both checkpoint layouts an
embedding model ships in: a causal LM's (`model.layers...`, maybe `lm_head.weight`, skipped)
and a base model's saved with HF's AutoModel (`layers...`, no `model.` prefix, no head). A
sequence classifier (`*ForSequenceClassification`) adds HF's `score` head, which the runner
applies to the pooled rows only.
"""
from __future__ import annotations

from functools import cache

import torch
from torch import nn

from nanoserve.pooling.config import classifier_num_labels

_BODY_PREFIX = "model."
_HEAD_PREFIX = "lm_head."
_SCORE_PREFIX = "score."


@cache
def embedding_model_class(causal_lm_class: type[nn.Module]) -> type[nn.Module]:
    """`causal_lm_class` (e.g. Qwen3ForCausalLM) without its LM head; one subclass per class."""

    class EmbeddingModel(causal_lm_class):
        has_lm_head = False

        def checkpoint_name_to_param(self, name: str) -> tuple[str | None, object]:
            if name.startswith(_HEAD_PREFIX):
                return None, None  # never used for embeddings
            if not name.startswith(_BODY_PREFIX):
                name = _BODY_PREFIX + name  # a base-model checkpoint
            return super().checkpoint_name_to_param(name)

        def compute_logits(self, hidden: torch.Tensor) -> None:
            return None  # no LM head: the runner pools hidden states instead

        def pooled_output(self, pooled: torch.Tensor) -> torch.Tensor:
            return pooled  # the pooled hidden state is the embedding

    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = causal_lm_class.__name__.replace(
        "ForCausalLM", "ForEmbedding"
    )
    return EmbeddingModel


@cache
def classifier_model_class(causal_lm_class: type[nn.Module]) -> type[nn.Module]:
    """`causal_lm_class` as HF's *ForSequenceClassification: the decoder and `score`, a bias-free
    [num_labels, hidden_size] linear layer on the pooled hidden state."""

    class ClassifierModel(embedding_model_class(causal_lm_class)):
        def __init__(self, hf_config: dict, *args, **kwargs) -> None:
            super().__init__(hf_config, *args, **kwargs)
            self.score = nn.Linear(hf_config["hidden_size"], classifier_num_labels(hf_config), bias=False)

        def checkpoint_name_to_param(self, name: str) -> tuple[str | None, object]:
            if name.startswith(_SCORE_PREFIX):
                return name, None
            return super().checkpoint_name_to_param(name)

        def pooled_output(self, pooled: torch.Tensor) -> torch.Tensor:
            """[n, hidden] pooled rows -> [n, num_labels] logits, computed in the model's dtype on its device."""
            weight = self.score.weight
            return self.score(pooled.to(weight.device, weight.dtype))

    ClassifierModel.__name__ = ClassifierModel.__qualname__ = causal_lm_class.__name__.replace(
        "ForCausalLM", "ForSequenceClassification"
    )
    return ClassifierModel

"""The decoder of a generative architecture, as an embedding model: hidden states out, no LM head.

The same model code runs both runners; the pooling one is a subclass that builds no LM head
(nor its packed copy: a quarter of Qwen3-0.6B's weights) and reads both checkpoint layouts an
embedding model ships in: a causal LM's (`model.layers...`, maybe `lm_head.weight`, skipped)
and a base model's saved with HF's AutoModel (`layers...`, no `model.` prefix, no head).
"""
from __future__ import annotations

from functools import cache

import torch
from torch import nn

_BODY_PREFIX = "model."
_HEAD_PREFIX = "lm_head."


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

    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = causal_lm_class.__name__.replace(
        "ForCausalLM", "ForEmbedding"
    )
    return EmbeddingModel

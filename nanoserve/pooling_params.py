"""PoolingParams with vLLM's names: what an embedding request asks of the pooled vector."""
from __future__ import annotations

import copy
from dataclasses import dataclass


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class PoolingParams:
    """How to turn one prompt's pooled hidden state into its result (vLLM's PoolingParams).

    dimensions: keep the first `dimensions` values (Matryoshka), then re-normalise; only for
        checkpoints trained for it (config.json `is_matryoshka` or `matryoshka_dimensions`).
    use_activation: normalise the vector to unit length (None = the checkpoint's pooling config,
        e.g. a sentence-transformers `Normalize` module). `normalize` is vLLM's older name.
    truncate_prompt_tokens: keep only the last k prompt tokens (-1 = max_model_len); None = a
        prompt longer than max_model_len is an error.
    """

    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (again when the request is added: fields may be set after construction)."""
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be None or an int >= 1, got {self.dimensions!r}")
        for name in ("use_activation", "normalize"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be None or a bool, got {value!r}")
        if self.use_activation is not None and self.normalize is not None and self.use_activation != self.normalize:
            raise ValueError(
                f"use_activation={self.use_activation} and normalize={self.normalize} disagree; "
                "pass one (normalize is vLLM's older name for use_activation)"
            )
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1, got {k!r}")

    @property
    def wants_normalize(self) -> bool | None:
        """The request's normalisation choice; None leaves it to the checkpoint."""
        return self.use_activation if self.use_activation is not None else self.normalize

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)

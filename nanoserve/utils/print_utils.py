"""vLLM's print helper that its embedding examples import (vllm.utils.print_utils)."""
from __future__ import annotations


def print_embeddings(embeds: list[float], prefix: str = "Embeddings") -> None:
    """Print the first four values and the size, as vLLM's does."""
    embeds_trimmed = (str(embeds[:4])[:-1] + ", ...]") if len(embeds) > 4 else embeds
    print(f"{prefix}: {embeds_trimmed} (size={len(embeds)})")

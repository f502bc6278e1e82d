"""The tokenizer of a pooling engine, set up as sentence-transformers sets up its own."""
from __future__ import annotations


def lowercase_inputs(tokenizer) -> None:
    """sentence_bert_config.json `do_lower_case`: texts are lowercased before tokenizing. Done as
    sentence-transformers does it, a Lowercase normalizer ahead of the tokenizer's own, so special
    tokens written in a text (matched before normalizing) and the ids come out the same as there."""
    from tokenizers.normalizers import Lowercase, Sequence

    if not getattr(tokenizer, "is_fast", False):  # a slow (Python) tokenizer lowercases by its flag
        tokenizer.do_lower_case = True
        return
    backend = tokenizer.backend_tokenizer
    current = backend.normalizer
    rest = list(current) if isinstance(current, Sequence) else [current] if current is not None else []
    if any(isinstance(n, Lowercase) for n in rest):
        return
    backend.normalizer = Sequence([Lowercase(), *rest])

"""Run llama.cpp's convert_hf_to_gguf.py on a bench checkpoint (a subprocess of the llama.cpp peer).

Usage: python llamacpp_convert.py LLAMACPP_SOURCE MODEL_DIR [converter flags...]

The bench's random checkpoints carry a small locally trained BPE tokenizer whose pre-tokenizer
hash the converter does not know, and it stops with "BPE pre-tokenizer was not recognized". Only
then is the tokenizer tagged as Qwen's (`qwen2`) pre-tokenizer: llama-batched-bench feeds token ids
and never runs the tokenizer, so the tag changes no figure. A known tokenizer keeps its own tag.
This file runs in its own process, so the converter's classes are changed for that process only.
"""
from __future__ import annotations

import logging
import os
import sys

FALLBACK_PRE_TOKENIZER = "qwen2"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: llamacpp_convert.py LLAMACPP_SOURCE MODEL_DIR [convert_hf_to_gguf.py flags...]")
    source, model, flags = argv[0], argv[1], argv[2:]
    sys.path.insert(0, source)
    import convert_hf_to_gguf  # noqa: E402  (llama.cpp's, from `source`)
    from conversion.base import TextModel  # noqa: E402

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.getLogger(__name__).warning("unknown BPE pre-tokenizer: tagged %r (batched-bench feeds ids)",
                                                FALLBACK_PRE_TOKENIZER)
            return FALLBACK_PRE_TOKENIZER

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [os.path.join(source, "convert_hf_to_gguf.py"), model, *flags]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])

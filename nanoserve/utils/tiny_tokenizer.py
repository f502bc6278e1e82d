"""The tokenizer of the tiny checkpoints: byte-level BPE trained on a built-in corpus.

Like Qwen's tokenizers it has <|endoftext|>, <|im_start|> and <|im_end|> as special tokens
with the highest ids, <think>/</think> as added (non-special) tokens, and a ChatML chat
template. Training is deterministic, so the same vocab size always gives the same files.
"""
from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Like Qwen3, the think markers are added tokens that are *not* special: they survive
# skip_special_tokens=True.
THINK_TOKENS = ("<think>", "</think>")
DEFAULT_TOKENIZER_VOCAB_SIZE = 1000
# The byte alphabet and the added tokens must fit.
MIN_TOKENIZER_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS)

# Qwen3's ChatML template, reduced to what an offline engine needs (no tools). Like Qwen3,
# enable_thinking=False pre-fills an empty think block so the model answers directly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_CORPUS_PARAGRAPHS = (
    ("The quick brown fox jumps over the lazy dog. The dog does not mind, because the sun is "
     "warm and the grass is soft. Later the fox returns to the forest, where the trees are tall "
     "and the river runs cold and clear over smooth grey stones."),
    ("Once upon a time there was a small village at the edge of a great forest. The people of "
     "the village were farmers and builders, and every morning they walked to the fields while "
     "the children went to school. In the evening they told stories about the old king, the "
     "lost city, and the dragon that slept under the mountain."),
    ("A language model reads a sequence of tokens and predicts the next token. During "
     "generation the model repeats this step many times: it samples a token, appends it to the "
     "sequence, and runs again. A key and value cache stores the attention state of earlier "
     "tokens, so each new step only has to process one new token."),
    ("The weather today is cloudy with a chance of rain in the afternoon. Tomorrow will be "
     "sunny and warmer, with light winds from the west. On the weekend the temperature will "
     "drop, and there may be snow in the hills. Please remember to bring a coat."),
    ("To make a simple bread, mix four cups of flour, one cup of warm water, a spoon of sugar, "
     "a spoon of salt and a little yeast. Knead the dough for ten minutes, let it rise for one "
     "hour, then bake it in a hot oven for thirty minutes until the crust is golden brown."),
    ("What is the capital of France? The capital of France is Paris. What is two plus two? "
     "Two plus two is four. Can you help me write a short poem about the sea? Of course! The "
     "sea is wide, the sea is deep, it sings the sailors off to sleep."),
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, 1))\n",
    ("Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 42 100 256 1000 2024. Dates like 2024-01-31 "
     "and times like 12:30 are common. Prices such as $3.50 or 7% appear in many texts."),
)


def _corpus() -> list[str]:
    # A few paragraphs are too little text for ~1000 merges; deterministic variants (lower
    # case, title case, sentences rotated) add repetition without adding new words.
    texts = []
    for paragraph in _CORPUS_PARAGRAPHS:
        sentences = paragraph.split(". ")
        rotated = ". ".join(sentences[1:] + sentences[:1])
        texts += [paragraph, paragraph.lower(), paragraph.title(), rotated]
    return texts


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer on the built-in corpus (deterministic; cached)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    num_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # Added after training so, like Qwen, the control tokens get the highest ids.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tokenizer.to_str()


def make_hf_tokenizer(vocab_size: int, model_max_length: int):
    """A transformers tokenizer over the trained vocabulary, ready for save_pretrained."""
    # transformers is imported lazily: it is slow to import and only needed when building.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        # Declared so skip_special_tokens (convert_ids_to_tokens) skips every control token,
        # like the backend's decode() does.
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (IM_END, ENDOFTEXT)],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # Qwen's setting; keeps decode() == joined pieces
        model_max_length=model_max_length,
    )

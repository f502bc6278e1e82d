"""Shared fixtures: tiny random Qwen3 checkpoints and HF transformers as the greedy oracle."""
from __future__ import annotations

import random

import pytest
import torch

from nanoserve.utils.tiny_checkpoint import build_tiny_qwen3

# Two shapes unlike each other: tied embeddings with GQA 2, and untied with GQA 4 and a
# head_dim that is not a power of two.
MODEL_CONFIGS = {
    "tied-gqa2": dict(seed=0),
    "untied-gqa4": dict(
        seed=1, hidden_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
        intermediate_size=160, num_hidden_layers=3, tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_qwen3(root / name, **kw) for name, kw in MODEL_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_model(model_dirs) -> str:
    return model_dirs["tied-gqa2"]


class HFOracle:
    """HF transformers' own model classes (float32 unless asked), with results memoised across tests."""

    def __init__(self) -> None:
        self._models = {}
        self._cache = {}

    def model(self, path: str, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        if (path, dtype) not in self._models:
            self._models[path, dtype] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return self._models[path, dtype]

    @torch.inference_mode()
    def greedy_with_gaps(self, path: str, prompt: list[int], max_new_tokens: int, dtype: torch.dtype):
        """Greedy tokens in `dtype`, and at each step the gap between HF's top-2 logits."""
        out = self.model(path, dtype).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
        gaps = [float(top[0] - top[1]) for top in (s[0].float().topk(2).values for s in out.logits)]
        return out.sequences[0, len(prompt):].tolist(), gaps

    @torch.inference_mode()
    def greedy(self, path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (path, tuple(prompt), max_new_tokens)
        if key not in self._cache:
            model = self.model(path)
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
            )
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]

    @torch.inference_mode()
    def logprobs(self, path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
        """log_softmax over the vocabulary at each output position: [len(output), vocab]."""
        ids = torch.tensor([prompt + output])
        logits = self.model(path)(ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="session")
def hf() -> HFOracle:
    return HFOracle()


def random_prompts(num: int, min_len: int, max_len: int, vocab: int = 900, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]

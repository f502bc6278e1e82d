"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM checkpoints): the Llama decoder with biases on q, k and v."""
from nanoserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_biases(cls, cfg: dict) -> tuple[bool, bool]:
        return True, False

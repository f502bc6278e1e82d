"""Mistral (MistralForCausalLM checkpoints): the Llama decoder without biases.

Sliding-window attention is not implemented: a checkpoint whose window is shorter than
max_model_len is refused at startup (nanoserve.config.Config), so every sequence nanoserve
runs fits in the window, where windowed and full causal attention are the same.
"""
from nanoserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_biases(cls, cfg: dict) -> tuple[bool, bool]:
        return False, False

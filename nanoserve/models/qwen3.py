"""Qwen3 (Qwen3ForCausalLM checkpoints): the Llama decoder with a per-head RMSNorm of q and k."""
from nanoserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

"""Model architectures by the name HF checkpoints give in config.json's `architectures`."""
from nanoserve.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {"Qwen3ForCausalLM": Qwen3ForCausalLM}

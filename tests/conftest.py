"""Fixtures: tiny random Qwen3 checkpoints and HF transformers as the greedy oracle.

Only fixtures and hooks live here; what tests call directly is in helpers.py."""
from __future__ import annotations

import pytest

from helpers import MODEL_CONFIGS, HFOracle
from nanoserve.utils.tiny_checkpoint import build_tiny_qwen3


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_qwen3(root / name, **kw) for name, kw in MODEL_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_model(model_dirs) -> str:
    return model_dirs["tied-gqa2"]


@pytest.fixture(scope="session")
def hf() -> HFOracle:
    return HFOracle()

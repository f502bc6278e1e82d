"""One backend per device class, chosen once at startup (see base.py for what a backend owns).

  cpu         CPUBackend: C kernels and a GEMM choice per CPU class (the CPU default)
  torch       the pure-PyTorch reference (on CUDA: with the Triton K/V store)
  triton      TritonBackend: Triton paged attention (the CUDA default without flash-attn)
  flash_attn  FlashAttnBackend: flash-attn 2 (the CUDA default where installed and usable)
"""
from __future__ import annotations

import logging

import torch

from nanoserve.backends.base import Backend
from nanoserve.backends.metadata import AttentionMetadata
from nanoserve.config import ATTENTION_BACKENDS as BACKEND_NAMES

logger = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "Backend", "BACKEND_NAMES", "select_backend"]


def select_backend(device: torch.device, dtype: torch.dtype, requested: str, block_size: int | None) -> Backend:
    """The backend for this device: `requested` if it can run here, else a clear ValueError."""
    if requested not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {requested!r}")
    backend = _select_cuda(device, dtype, requested, block_size) if device.type == "cuda" else _select_cpu(
        device, dtype, requested
    )
    logger.info("backend: %s", backend.describe())
    return backend


def _select_cpu(device: torch.device, dtype: torch.dtype, requested: str) -> Backend:
    if requested in ("triton", "flash_attn"):
        raise ValueError(f"attention_backend={requested!r} needs CUDA; on CPU 'cpu' (the default) or 'torch' run")
    if requested == "torch":
        return Backend(device, dtype)
    from nanoserve.backends.cpu import CPUBackend, CPUOptions

    return CPUBackend(device, dtype, CPUOptions.from_env())


def _select_cuda(device: torch.device, dtype: torch.dtype, requested: str, block_size: int | None) -> Backend:
    from nanoserve.kernels import flash_attn as fa

    if requested == "cpu":
        raise ValueError("attention_backend='cpu' runs on CPU only; on CUDA: 'flash_attn', 'triton' or 'torch'")
    if requested == "torch":
        from nanoserve.backends.triton import CUDATorchBackend

        return CUDATorchBackend(device, dtype)
    half = dtype in (torch.float16, torch.bfloat16)
    page_ok = block_size is None or fa.flash_attn_supports_block_size(block_size)
    flash_ok = fa.flash_attn_available() and page_ok and half
    if requested == "flash_attn" and not flash_ok:
        raise ValueError(
            "attention_backend='flash_attn' needs the flash-attn package (pip install nanoserve[cuda]), "
            f"a kvcache_block_size that is a multiple of {fa.FLASH_ATTN_PAGE_BLOCK_MULTIPLE} (got {block_size}) "
            f"and a float16/bfloat16 dtype (got {dtype})"
        )
    if requested == "flash_attn" or (requested == "auto" and flash_ok):
        from nanoserve.backends.flash_attn import FlashAttnBackend

        return FlashAttnBackend(device, dtype)
    from nanoserve.backends.triton import TritonBackend

    return TritonBackend(device, dtype)

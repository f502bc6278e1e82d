"""One backend per device class, chosen once at startup (see base.py for what a backend owns).

  cpu         CPUBackend: C kernels and a GEMM choice per CPU class (the CPU default)
  torch       the pure-PyTorch reference (on CUDA: with the Triton K/V store, no CUDA graphs)
  triton      TritonBackend: Triton paged attention (the CUDA default without flash-attn)
  flash_attn  FlashAttnBackend: flash-attn 2 (the CUDA default where installed and usable)

`attention_backend` may also be a Backend subclass, built as cls(device, dtype): a new device
(or a test double) plugs in without touching the engine.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from nanoserve.backends.base import Backend
from nanoserve.backends.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "Backend", "BACKEND_NAMES", "select_backend"]
BACKEND_NAMES = ("auto", "cpu", "torch", "flash_attn", "triton")  # or a Backend subclass


def select_backend(
    device: torch.device, dtype: torch.dtype, requested: str | type, block_size: int | None, head_dim: int,
    batch_invariant: bool = False, quantization: str | None = None, prefill_only: bool = False,
) -> Backend:
    """The backend for this device: `requested` if it can run here, else a clear ValueError.
    batch_invariant: only kernels whose per-row results do not depend on the batch (CPU only).
    quantization (Config.quantization) runs on the CPU backend only. prefill_only: an engine without
    decode steps (runner="pooling"), whose GEMMs all see hundreds of rows (CPU)."""
    on_cpu_backend = device.type == "cpu" and requested in ("auto", "cpu")
    # Only the CPU backend's own kernels give a row the same bits whatever shares its step (cuBLAS,
    # the CUDA attention kernels and the torch reference pick tiles by batch size), and only they run
    # integer weights.
    for option, asked in ((f"quantization={quantization!r}", quantization is not None),
                          ("batch_invariant=True", batch_invariant)):
        if asked and not on_cpu_backend:
            raise ValueError(f"{option} runs on the CPU backend only (device='cpu', attention_backend 'auto' or "
                             f"'cpu'); got device {device.type}, attention_backend {requested!r}")
    if isinstance(requested, type):
        if not issubclass(requested, Backend):
            raise TypeError(f"attention_backend must be a name or a Backend subclass, got {requested!r}")
        backend = requested(device, dtype)
    elif requested not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {requested!r}")
    elif device.type == "cuda":
        backend = _select_cuda(device, dtype, requested, block_size, head_dim)
    else:
        backend = _select_cpu(device, dtype, requested, batch_invariant, quantization, prefill_only)
    logger.info("backend: %s", backend.describe())
    return backend


def _select_cpu(device: torch.device, dtype: torch.dtype, requested: str, batch_invariant: bool = False,
                quantization: str | None = None, prefill_only: bool = False) -> Backend:
    if requested in ("triton", "flash_attn"):
        raise ValueError(f"attention_backend={requested!r} needs CUDA; on CPU 'cpu' (the default) or 'torch' run")
    if requested == "torch":
        return Backend(device, dtype)
    from nanoserve.backends.cpu import CPUBackend, CPUOptions

    options = CPUOptions.from_env()
    if batch_invariant:
        options = dataclasses.replace(options, batch_invariant=True)
    if prefill_only:
        options = dataclasses.replace(options, prefill_only=True)
    return CPUBackend(device, dtype, options, quantization)


def flash_attn_unusable(
    device: torch.device, dtype: torch.dtype, block_size: int | None, head_dim: int
) -> str | None:
    """Why flash-attn 2 cannot run this engine here, or None if it can."""
    from nanoserve.kernels import flash_attn as fa

    reason = fa.flash_attn_unusable_reason()
    if reason is not None:
        return reason
    capability = torch.cuda.get_device_capability(device)
    if capability < fa.MIN_COMPUTE_CAPABILITY:
        return f"flash-attn 2 needs compute capability >= 8.0, this GPU has {capability[0]}.{capability[1]}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn 2 needs float16 or bfloat16, got {dtype}"
    if block_size is not None and not fa.flash_attn_supports_block_size(block_size):
        return f"flash-attn 2 needs a kvcache_block_size that is a multiple of 256, got {block_size}"
    if not fa.flash_attn_supports_head_dim(head_dim):
        return f"flash-attn 2 needs a head_dim that is a multiple of 8 and <= 256, got {head_dim}"
    return None


def _select_cuda(
    device: torch.device, dtype: torch.dtype, requested: str, block_size: int | None, head_dim: int
) -> Backend:
    if requested == "cpu":
        raise ValueError("attention_backend='cpu' runs on CPU only; on CUDA: 'flash_attn', 'triton' or 'torch'")
    if os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1":  # a warning: vLLM users may export it everywhere
        logger.warning("VLLM_BATCH_INVARIANT=1 is honoured on the CPU backend only: on CUDA a request's bits "
                       "may depend on what shares its steps")
    if requested == "torch":
        from nanoserve.backends.triton import CUDATorchBackend

        return CUDATorchBackend(device, dtype)
    if requested in ("auto", "flash_attn"):
        reason = flash_attn_unusable(device, dtype, block_size, head_dim)
        if reason is None:
            from nanoserve.backends.flash_attn import FlashAttnBackend

            return FlashAttnBackend(device, dtype)
        if requested == "flash_attn":
            raise ValueError(f"attention_backend='flash_attn' cannot run: {reason}")
        logger.info("flash-attn is not used (%s): the Triton backend runs instead", reason)
    from nanoserve.backends.triton import TritonBackend

    return TritonBackend(device, dtype)

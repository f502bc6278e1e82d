"""The flash-attn 2 backend (CUDA, fp16/bf16): flash-attn for attention, Triton for the K/V store."""
from __future__ import annotations

from nanoserve.backends.triton import TritonBackend
from nanoserve.kernels import flash_attn as fa


class FlashAttnBackend(TritonBackend):
    name = "flash_attn"
    preferred_block_size = fa.FLASH_ATTN_PAGE_BLOCK_MULTIPLE  # flash-attn 2's paged-KV minimum

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "attention": "flash-attn 2"}

    def decode(self, q, k_cache, v_cache, meta, scale):
        return fa.paged_attention_decode_flash(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.decode_max_context_len, scale
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        return fa.paged_attention_varlen_flash(
            q, k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, meta.prefill_block_tables,
            meta.prefill_max_seqlen_q, meta.prefill_max_context_len, scale,
        )

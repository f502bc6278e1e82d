"""The KV cache's geometry, decided once by the ModelRunner (block size: the config's or the
backend's preferred one; block count: the config's or the memory budget's, `sized`) and handed to
the engine, block manager, scheduler, CUDA graphs (block-table width) and warm-up (scratch cache)."""
from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 2**30


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # tokens per block
    max_model_len: int
    num_blocks: int = 0  # 0 until sized

    @property
    def blocks_per_seq(self) -> int:  # the widest block table
        return -(-self.max_model_len // self.block_size)

    def sized(self, available: int, max_num_seqs: int, block_bytes: int, budget: str | None = None) -> "KVCacheSpec":
        """This geometry with `available` blocks (capped: never more than every sequence at full
        length could use). The one fit check: a ValueError with the numbers when not even one
        sequence fits. `budget`: how a measured GPU budget was computed (None: a configured size)."""
        need = self.blocks_per_seq
        if available < need and budget is not None:
            raise ValueError(
                f"not enough GPU memory for the KV cache: {budget}, but one sequence of "
                f"max_model_len={self.max_model_len} needs {need * block_bytes / GiB:.3f} GiB ({need} "
                f"blocks of {block_bytes} bytes). Raise gpu_memory_utilization, lower max_model_len or "
                "max_num_batched_tokens, or close other engines on this GPU"
            )
        if available < need:
            raise ValueError(
                f"the KV cache has {available} blocks of {self.block_size} tokens, but one sequence of "
                f"max_model_len={self.max_model_len} tokens needs {need}; raise num_kvcache_blocks "
                "(or the memory budget) or lower max_model_len"
            )
        return replace(self, num_blocks=min(available, max_num_seqs * need))

"""Owns the model and the KV cache; turns a ScheduledBatch into tensors, runs it, samples.

The KV cache is ONE tensor [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim];
attention layers hold views of it. Addressing: slot = block_table[pos // block_size] *
block_size + pos % block_size.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from nanoserve.config import Config
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import Attention, AttentionMetadata, select_attention_backend
from nanoserve.kernels.cpu import use_cpu_gemm
from nanoserve.layers.linear import prepare_cpu_gemm
from nanoserve.layers.tp import tp_size
from nanoserve.models import MODEL_REGISTRY
from nanoserve.models.loader import load_weights
from nanoserve.sampling import Sampler, SamplingMetadata, SamplingRow

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ModelInputs:
    """Everything one forward pass needs; plain tensors so it can be sent to TP workers."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_rows] rows of the hidden states to project


@dataclass
class StepOutput:
    token_ids: list[int]  # one per sampling entry of the batch, in batch order
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.bfloat16
    checkpoint = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return DTYPES.get(checkpoint, torch.bfloat16)


class ModelRunner:
    def __init__(self, config: Config, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.kvcache_block_size
        cfg = config.hf_config
        self.dtype = resolve_dtype(config.dtype, cfg, device)
        self.vocab_size = cfg["vocab_size"]
        self.backend = select_attention_backend(device, config.attention_backend, self.block_size, self.dtype)

        torch.manual_seed(config.seed)
        with torch.device(device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = MODEL_REGISTRY[cfg["architectures"][0]](cfg)
            finally:
                torch.set_default_dtype(default_dtype)
        load_weights(self.model, config.model)
        if use_cpu_gemm(self.dtype, device):  # oneDNN / skinny bf16 GEMMs on CPU: see kernels/cpu.py
            prepare_cpu_gemm(self.model)
        self.model.eval()
        self.sampler = Sampler()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kvcache_blocks = self._num_kvcache_blocks()
        self.kv_cache = self._allocate_kv_cache(self.num_kvcache_blocks)
        self._cuda_graphs = None  # decode CUDA graphs (cuda_graph.py), captured at the first decode step

    # ---- KV cache --------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def _num_kvcache_blocks(self) -> int:
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.config.gpu_memory_utilization)
        else:
            budget = self.config.cpu_kvcache_space_gib * 2**30
        # Never more than every sequence at full length could use.
        blocks_per_seq = (self.config.max_model_len + self.block_size - 1) // self.block_size
        useful = self.config.max_num_seqs * blocks_per_seq
        return max(0, min(int(budget // self.kv_block_bytes), useful))

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        layer = self.attention_layers[0]
        # Zeros, not empty: masked-out positions still meet the CPU kernel's matmul, and NaN * 0 = NaN.
        kv_cache = torch.zeros(
            2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
            dtype=self.dtype, device=self.device,
        )
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = kv_cache[0, i], kv_cache[1, i]
            attn.backend = self.backend
        return kv_cache

    # ---- inputs ----------------------------------------------------------------------------

    def prepare_inputs(self, batch: ScheduledBatch) -> ModelInputs:
        seqs, num_new = batch.seqs, batch.num_new_tokens
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, num_new):
            input_ids.extend(seq.token_ids[start : start + n])

        q_lens = torch.tensor(num_new, dtype=torch.int64)
        context_lens = torch.tensor(starts, dtype=torch.int64) + q_lens
        cu_seqlens_q = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=cu_seqlens_q[1:])
        block_tables = self._block_tables(seqs)

        # Positions and slots of every new token, vectorised: token t of sequence s is at
        # position start_s + (t - cu_seqlens_q[s]).
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = torch.arange(len(input_ids)) - cu_seqlens_q[:-1][seq_of_token] + torch.tensor(starts)[seq_of_token]
        physical = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = physical * self.block_size + positions % self.block_size

        nd = batch.num_decode_seqs
        prefill_q_lens = q_lens[nd:]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=nd,
            decode_block_tables=block_tables[:nd],
            decode_context_lens=context_lens[:nd].int(),
            decode_max_context_len=int(context_lens[:nd].max()) if nd else 0,
            prefill_cu_seqlens_q=(cu_seqlens_q[nd:] - nd).int(),
            prefill_block_tables=block_tables[nd:],
            prefill_context_lens=context_lens[nd:].int(),
            prefill_max_seqlen_q=int(prefill_q_lens.max()) if len(prefill_q_lens) else 0,
            prefill_max_context_len=int(context_lens[nd:].max()) if len(prefill_q_lens) else 0,
        )
        sampling = torch.tensor(batch.samples, dtype=torch.bool)
        inputs = ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=positions,
            meta=meta,
            logits_indices=(cu_seqlens_q[1:] - 1)[sampling],
        )
        return to_device(inputs, self.device)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
        return torch.tensor(rows, dtype=torch.int32)  # [num_seqs, max_blocks], -1 = no block

    # ---- forward and sampling ---------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Run the model; logits [num_sampling_rows, vocab] on rank 0 (None elsewhere)."""
        graphs = self._graphs_for(inputs)
        if graphs is not None:
            hidden = graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def _graphs_for(self, inputs: ModelInputs):
        """The decode CUDA graphs if this step can replay them (CUDA, not enforce_eager, decode only)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        from nanoserve.engine import cuda_graph  # CUDA only: a CPU run never imports it

        if not cuda_graph.is_decode_only(inputs):
            return None
        if self._cuda_graphs is None:
            self._cuda_graphs = cuda_graph.CUDAGraphRunner(
                self.model, self.config.max_num_seqs, self.config.max_model_len, self.block_size, self.device
            )
            self._cuda_graphs.capture()
        return self._cuda_graphs if self._cuda_graphs.can_run(inputs) else None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        logits = self.execute(self.prepare_inputs(batch))
        rows = [seq for seq, samples in zip(batch.seqs, batch.samples) if samples]
        if not rows:
            return StepOutput([], None, None)
        meta = SamplingMetadata.build([sampling_row(seq) for seq in rows], self.vocab_size, self.device)
        out = self.sampler(logits, meta)
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return StepOutput(token_ids, None, None)
        top = [
            dict(zip(ids, lps))
            for ids, lps in zip(out.topk_token_ids.tolist(), out.topk_logprobs.tolist())
        ]
        return StepOutput(token_ids, out.logprobs.tolist(), top)


def sampling_row(seq: Sequence) -> SamplingRow:
    """The sampler's view of a sequence: its spec and its own token list (not a copy)."""
    assert seq.sampling_spec is not None, f"sequence {seq.seq_id} has no SamplingSpec: the engine sets it"
    return SamplingRow(seq.sampling_spec, seq.seed, seq.token_ids, seq.num_prompt_tokens)


def to_device(inputs: ModelInputs, device: torch.device) -> ModelInputs:
    if device.type == "cpu":
        return inputs
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    meta = inputs.meta
    meta = AttentionMetadata(
        **{k: move(v) if isinstance(v, torch.Tensor) else v for k, v in vars(meta).items()}
    )
    return ModelInputs(move(inputs.input_ids), move(inputs.positions), meta, move(inputs.logits_indices))

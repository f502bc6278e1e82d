"""Owns the model, its backend and the KV cache; turns a ScheduledBatch into tokens.

The KV cache is ONE tensor [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim];
attention layers hold views of it. A step is three calls: `prepare_inputs` (host tensors),
`execute` (forward pass, logits of the sampling rows), `sample`; a tensor-parallel engine sends
the prepared inputs to every rank between the first two (tp_runner.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from nanoserve.backends import select_backend
from nanoserve.config import Config, resolve_dtype
from nanoserve.distributed.group import TPGroup
from nanoserve.engine import memory as mem
from nanoserve.engine import warmup
from nanoserve.engine.kv_cache_spec import KVCacheSpec
from nanoserve.engine.memory import CudaMemory, DeviceMemory
from nanoserve.engine.model_inputs import ModelInputs, build_model_inputs, to_device
from nanoserve.engine.prompt_logprobs import PromptLogprobsChunk, scored_positions
from nanoserve.engine.scheduler import ScheduledBatch
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.attention import Attention
from nanoserve.layers.context import ModelContext
from nanoserve.layers.pooler import Pooler
from nanoserve.models import head_dim_of, model_class
from nanoserve.models.loader import load_weights, prepare_weights
from nanoserve.pooling.model import classifier_model_class, embedding_model_class
from nanoserve.quantization.checkpoint import LOAD_TIME
from nanoserve.sampling import Sampler, SamplingMetadata, SamplingRow
from nanoserve.sampling.prompt_scores import score_tokens

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    token_ids: list[int]  # one per sampling entry of the batch, in batch order
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    ranks: list[int] | None = None  # the sampled token's rank in the vocabulary; with logprobs
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)  # sequences scoring their prompt
    pooled: torch.Tensor | None = None  # runner="pooling": [num_completing, hidden] float32, in batch order


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False")
    return torch.device(device)


class ModelRunner:
    def __init__(
        self, config: Config, device: torch.device, tp: TPGroup | None = None, memory: DeviceMemory | None = None
    ) -> None:
        """memory: the device memory API the KV cache is sized with (torch.cuda on CUDA when
        num_kvcache_blocks is not given; tests pass a fake)."""
        self.config = config
        self.device = device
        cfg = config.hf_config
        self.dtype = resolve_dtype(config.dtype, cfg, device)
        self.vocab_size = cfg["vocab_size"]
        self.backend = select_backend(
            device, self.dtype, config.attention_backend, config.kvcache_block_size, head_dim_of(cfg),
            batch_invariant=config.batch_invariant,
            quantization=LOAD_TIME if config.quantization == LOAD_TIME else None,  # a checkpoint's format: any backend
            prefill_only=config.pooling is not None,
        )
        self.kv_spec = KVCacheSpec(config.kvcache_block_size or self.backend.preferred_block_size, config.max_model_len)
        self.sampler = Sampler()
        self.pooler = Pooler(config.pooling.pooling_type) if config.pooling is not None else None
        self.kv_cache = torch.empty(0)
        self._cuda_graphs = None  # decode CUDA graphs (cuda_graph.py), captured once the KV cache exists
        self.tp = tp or TPGroup()
        ctx = ModelContext(self.backend, self.tp)
        if memory is None and device.type == "cuda" and config.num_kvcache_blocks is None:
            memory = CudaMemory(device)
        budget = None
        if memory is None:
            self._load_model(ctx)
            available = self._configured_num_blocks()
        else:
            profile = mem.profile(
                memory, lambda: self._load_model(ctx), self.profile_run,
                self._decode_profile_run if self.uses_cuda_graphs else None,
            )
            available = profile.kv_cache_budget(config.gpu_memory_utilization) // self.kv_block_bytes
            budget = profile.describe(config.gpu_memory_utilization)
            logger.info("KV cache: %s", budget)
        spec = self.kv_spec.sized(available, config.max_num_seqs, self.kv_block_bytes, budget)
        # Every rank takes the smallest cache any rank could afford (block ids mean the same on all),
        # before the graphs bake in the cache's address.
        agreed = self.tp.all_reduce(torch.tensor([spec.num_blocks], device=device), "min")
        self.kv_spec = replace(spec, num_blocks=int(agreed.item()))
        self._allocate_kv_cache(self.kv_spec.num_blocks)
        if self.uses_cuda_graphs:
            self._capture_cuda_graphs()

    def _load_model(self, ctx: ModelContext) -> None:
        cfg = self.config.hf_config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                cls = model_class(cfg)
                if self.config.pooling is not None:  # hidden states out, no LM head (a classifier: its score head)
                    classify = self.config.pooling.task == "classify"
                    cls = (classifier_model_class if classify else embedding_model_class)(cls)
                model = cls(cfg, ctx)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(model, self.config.model, self.config.quantization)
        prepare_weights(model)
        self.model = model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # The transformer body without a reference back to the runner, for the CUDA graphs to hold.
        self.forward = partial(run_model, self.model, self.backend)

    @property
    def uses_cuda_graphs(self) -> bool:
        # Pooling steps are all prefills: decode graphs would never be replayed.
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.backend.supports_cuda_graphs
                and self.pooler is None)

    # ---- KV cache --------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.kv_spec.block_size

    @property
    def num_kvcache_blocks(self) -> int:
        return self.kv_cache.shape[2] if self.kv_cache.dim() == 6 else 0

    @property
    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def _configured_num_blocks(self) -> int:
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        return int(self.config.cpu_kvcache_space_gib * 2**30 // self.kv_block_bytes)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """The cache with `num_blocks` blocks (tensor parallelism: the count every rank agreed on)."""
        self.kv_spec = replace(self.kv_spec, num_blocks=num_blocks)
        self._allocate_kv_cache(num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocate the KV tensor with `num_blocks` blocks and bind every layer's views to it."""
        layer = self.attention_layers[0]
        for attn in self.attention_layers:  # drop the old views first, so the old cache can be freed
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.kv_cache = torch.empty(0)
        # Zeros, not empty: masked-out positions still meet the CPU kernel's matmul, and NaN * 0 = NaN.
        self.kv_cache = torch.zeros(
            2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
            dtype=self.dtype, device=self.device,
        )
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # ---- warm-up: the worst-case step, for peak memory -------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> int:
        """A forward at max_num_batched_tokens tokens and a sampler pass at max_num_seqs rows with
        logprobs, over a scratch KV cache of one sequence (freed after); returns its bytes."""
        cfg = self.config
        self._allocate_kv_cache(self.kv_spec.blocks_per_seq)
        batch = warmup.prefill_batch(cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs,
                                     self.kv_spec.blocks_per_seq)
        self.execute(self.prepare_inputs(batch))
        hidden = torch.zeros(cfg.max_num_seqs, cfg.hf_config["hidden_size"], dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        if logits is not None:  # rank 0
            rows = warmup.sampling_rows(cfg.max_num_seqs, self.vocab_size, cfg.max_logprobs)
            self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, self.device))
        self._allocate_kv_cache(0)
        return self.kv_spec.blocks_per_seq * self.kv_block_bytes

    @torch.inference_mode()
    def _decode_profile_run(self) -> int:
        """A decode of max_num_seqs sequences: what the CUDA graphs' shared pool will hold."""
        self._allocate_kv_cache(self.kv_spec.blocks_per_seq)
        inputs = to_device(self.prepare_inputs(warmup.decode_batch(self.config.max_num_seqs, 1)), self.device)
        self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        self._allocate_kv_cache(0)
        return self.kv_spec.blocks_per_seq * self.kv_block_bytes

    def close(self) -> None:
        """Release the model, the KV cache and the CUDA graphs (a second engine gets their memory). Idempotent."""
        if self.model is None:
            return
        self._cuda_graphs = None
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.model = self.forward = None
        self.attention_layers = []
        self.kv_cache = torch.empty(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- a step ----------------------------------------------------------------------------

    def prepare_inputs(self, batch: ScheduledBatch) -> ModelInputs:
        return build_model_inputs(batch, self.block_size, pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Run the model; logits [num_sampling_rows + num_prompt_logprob_rows, vocab] on rank 0 (None elsewhere)."""
        if self.model is None:
            raise RuntimeError("this LLM is closed")
        inputs = to_device(inputs, self.device)
        graphs = self._cuda_graphs
        if graphs is not None and graphs.can_run(inputs):  # a decode-only step that fits a bucket
            hidden = graphs.run(inputs)
        else:
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def _capture_cuda_graphs(self) -> None:
        """Capture the decode graphs at startup, right after the KV cache they read (vLLM's order).
        A failed capture leaves decode eager, logged; with tensor parallelism it raises, since the
        ranks' collectives would no longer meet."""
        from nanoserve.engine import cuda_graph  # CUDA only: a CPU run never imports it

        graphs = cuda_graph.CUDAGraphRunner(self.forward, self.config.max_num_seqs, self.kv_spec, self.device)
        try:
            graphs.capture()  # kept only when every bucket was captured: never replay a partial capture
        except Exception as exc:
            if self.tp.size > 1:
                raise
            logger.warning("%s; decode steps run eagerly", exc)
            return
        self._cuda_graphs = graphs

    @torch.inference_mode()
    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepOutput:
        rows = [seq for seq, samples in zip(batch.seqs, batch.samples) if samples]
        prompt_logprobs = score_prompts(batch, logits[len(rows) :])
        out = self._sample_rows(rows, logits[: len(rows)])
        out.prompt_logprobs = prompt_logprobs
        return out

    def _sample_rows(self, rows: list[Sequence], logits: torch.Tensor) -> StepOutput:
        if not rows:
            return StepOutput([], None, None)
        meta = SamplingMetadata.build([sampling_row(seq) for seq in rows], self.vocab_size, self.device)
        out = self.sampler(logits, meta)
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return StepOutput(token_ids, None, None)
        # The top k is the batch's largest; each row keeps its own k before leaving the tensor (one
        # whole-vocabulary request must not turn every row's into a vocabulary-sized dict).
        own_k = [seq.sampling_spec.logprobs or 0 for seq in rows]
        ids, lps = out.topk_token_ids, out.topk_logprobs
        if all(k == ids.shape[1] for k in own_k):  # the usual batch: one k, one copy out of the tensors
            top = [dict(zip(a, b)) for a, b in zip(ids.tolist(), lps.tolist())]
        else:
            top = [dict(zip(ids[i, :k].tolist(), lps[i, :k].tolist())) if k else {} for i, k in enumerate(own_k)]
        return StepOutput(token_ids, out.logprobs.tolist(), top, out.ranks.tolist())

    def run(self, batch: ScheduledBatch) -> StepOutput:
        if self.pooler is not None:
            return self.pool(batch)
        return self.sample(batch, self.execute(self.prepare_inputs(batch)))

    @torch.inference_mode()
    def pool(self, batch: ScheduledBatch) -> StepOutput:
        """runner="pooling": the decoder's hidden states, pooled for each prompt the step completes."""
        if self.model is None:
            raise RuntimeError("this LLM is closed")
        inputs = to_device(self.prepare_inputs(batch), self.device)
        rows = self.pooler.output_rows(batch.num_new_tokens, batch.samples)
        if rows is not None:  # last-token pooling: past attention, the last layer computes these rows alone
            # (every row's K/V is still cached); with none completing, one row keeps the shapes non-empty
            keep = torch.tensor(rows or [inputs.input_ids.shape[0] - 1], dtype=torch.int64, device=self.device)
            hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta, keep)
            return StepOutput([], None, None, pooled=self.model.pooled_output(hidden[: len(rows)]).float().cpu())
        hidden = self.forward(inputs.input_ids, inputs.positions, inputs.meta)  # [num_tokens, hidden]
        seqs = batch.seqs
        pooled = self.pooler(hidden, [s.seq_id for s in seqs], [s.num_computed_tokens for s in seqs],
                             batch.num_new_tokens, batch.samples)
        return StepOutput([], None, None, pooled=self.model.pooled_output(pooled).float().cpu())


def run_model(
    model: torch.nn.Module, backend, input_ids: torch.Tensor, positions: torch.Tensor, meta,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The transformer body: hidden states [num_tokens, hidden] (only rows `out_rows` if given).
    CUDA graphs capture this."""
    return model(input_ids, positions, backend.prepare_metadata(meta), out_rows)


def score_prompts(batch: ScheduledBatch, logits: torch.Tensor) -> list[PromptLogprobsChunk]:
    """The prompt logprobs of this step: `logits` are the rows after the sampling rows, one per
    scored position, in batch order (model_inputs._prompt_logprob_rows)."""
    spans = [(i, scored_positions(seq, n)) for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))]
    spans = [(i, positions) for i, positions in spans if positions]
    assert sum(len(p) for _, p in spans) == logits.shape[0], "prompt-logprob rows do not match the batch"
    if not spans:
        return []
    targets = [batch.seqs[i].token_ids[p + 1] for i, positions in spans for p in positions]
    k = max(batch.seqs[i].sampling_spec.prompt_logprobs for i, _ in spans)
    scores = score_tokens(logits, torch.tensor(targets, device=logits.device), k)
    logprobs, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
    chunks, at = [], 0
    for i, positions in spans:
        own_k = batch.seqs[i].sampling_spec.prompt_logprobs  # k is the batch's largest: each keeps its own
        end = at + len(positions)
        chunks.append(PromptLogprobsChunk(
            i, positions.start, logprobs[at:end], ranks[at:end],
            scores.topk_ids[at:end, :own_k].tolist(), scores.topk_logprobs[at:end, :own_k].tolist(),
        ))
        at = end
    return chunks


def sampling_row(seq: Sequence) -> SamplingRow:
    """The sampler's view of a sequence: its spec and its own token list (not a copy)."""
    assert seq.sampling_spec is not None, f"sequence {seq.seq_id} has no SamplingSpec: the engine sets it"
    return SamplingRow(seq.sampling_spec, seq.seed, seq.token_ids, seq.num_prompt_tokens, seq.matcher)

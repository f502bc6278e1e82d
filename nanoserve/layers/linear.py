"""Linear layers whose weight loaders shard HF weights for tensor parallelism.

Column-parallel layers split the output dim across ranks, row-parallel ones the input dim (and
all-reduce their output). Packed layers (QKV, gate_up) load several HF tensors into one weight.
The matmul itself is the backend's: after loading, `process_weights_after_loading` asks it for
the layer's GEMM (plain F.linear, or e.g. a prepacked float32 copy on a CPU without bf16 math).
A pre-quantized checkpoint's layer (`make_quantized`, called by the loader) holds int8 weights
with group scales instead, sharded the same way (input shards on group boundaries; an act-order
row-parallel layer's rank keeps its inputs' columns of every group, QuantizedWeight.input_shard).
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.layers.context import ModelContext
from nanoserve.quantization.weight import QuantizedWeight


def weights_not_loaded(*args) -> torch.Tensor:
    raise RuntimeError("layer used before its weights were loaded and prepared")


def shard_of(loaded: torch.Tensor, full_shape, dim: int, rank: int, shard: int) -> torch.Tensor:
    """Rank `rank`'s `shard` entries along `dim` of a checkpoint tensor, which must have exactly the
    unsharded shape `full_shape`: a larger tensor must not be cut silently to fit."""
    if tuple(loaded.shape) != tuple(full_shape):
        raise ValueError(f"the checkpoint tensor must have shape {list(full_shape)}")
    return loaded.narrow(dim, rank * shard, shard)


def expect_shards(param: nn.Parameter, shards) -> None:
    """Declare the parts a packed parameter is loaded from; the loader refuses a checkpoint that lacks one."""
    param.expected_shards = frozenset(shards)
    param.loaded_shards = set()


class LinearBase(nn.Module):
    input_is_sharded = False  # row-parallel layers split the input dim across ranks
    # loaded dequantized from a quantized checkpoint's tensors (models/loader.py): runs in float,
    # never quantized at load a second time (quantization="int8")
    dequantized = False

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext) -> None:
        super().__init__()
        self.backend, self.tp = ctx.backend, ctx.tp
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.gemm = weights_not_loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(shard_of(loaded, param.shape, 0, 0, param.shape[0]))  # no broadcasting

    def make_quantized(self, group_size: int, act_order: bool) -> None:
        """Hold the weight as a pre-quantized checkpoint decodes (nanoserve/quantization/weight.py):
        int8 [out, in] with float32 scales per group of `group_size` inputs (the whole input when
        group_size >= it) and, for act-order, the input permutation, instead of a float weight."""
        out_local, in_local = self.weight.shape
        in_full = in_local * self.tp.size if self.input_is_sharded else in_local
        per_channel = group_size >= in_full
        # act-order with split inputs: every rank loads the whole sorted weight, scales and permutation
        # (vLLM keeps act-order scales whole on every rank too) and keeps its inputs' part after loading
        self.act_order_shard = in_local != in_full and act_order
        if in_local != in_full and not per_channel and not act_order and in_local % group_size:
            raise ValueError(
                f"a quantized layer of input size {in_full} in groups of {group_size} cannot be split across "
                f"tensor_parallel_size={self.tp.size} ranks: each rank's {in_local} inputs must be whole groups"
            )
        self.group_size = in_local if per_channel else group_size  # per channel: one group per rank
        in_held = in_full if self.act_order_shard else in_local
        shards = getattr(self.weight, "expected_shards", None)
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(out_local, in_held, dtype=torch.int8, device=device),
                                   requires_grad=False)
        groups = -(-in_held // self.group_size)
        self.weight_scale = nn.Parameter(torch.empty(out_local, groups, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.weight.weight_loader = self.weight_scale.weight_loader = self.weight_loader
        if in_local != in_full and (per_channel or act_order):  # every rank scales its partial sums by whole groups
            self.weight_scale.weight_loader = self._replicated_loader
        if self.act_order_shard:
            self.weight.weight_loader = self._replicated_loader
        params = [self.weight, self.weight_scale]
        if act_order:
            self.weight_perm = nn.Parameter(torch.empty(in_held, dtype=torch.int64, device=device),
                                            requires_grad=False)
            self.weight_perm.weight_loader = self._perm_loader
            params.append(self.weight_perm)
        if shards is not None:
            for param in params:
                expect_shards(param, shards)

    @staticmethod
    def _replicated_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(shard_of(loaded, param.shape, 0, 0, param.shape[0]))

    @staticmethod
    def _perm_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """The act-order permutation of the inputs: one for the whole layer, so the parts of a fused
        layer (q/k/v, gate/up: quantized on the same inputs) must agree."""
        loaded = shard_of(loaded, param.shape, 0, 0, param.shape[0]).to(param.device)  # the file's is on the CPU
        if shard_id is not None and param.loaded_shards and not torch.equal(param.data, loaded):
            raise ValueError("the parts of this fused layer have different act-order input orders (g_idx); "
                             "nanoserve runs one order per fused layer")
        param.data.copy_(loaded)
        if shard_id is not None:
            param.loaded_shards.add(shard_id)

    def process_weights_after_loading(self) -> None:
        if self.weight.dtype == torch.int8:  # make_quantized
            perm = self.weight_perm.data if hasattr(self, "weight_perm") else None
            quantized = QuantizedWeight(self.weight.data, self.weight_scale.data, self.group_size, perm)
            if self.act_order_shard:
                in_local = self.weight.shape[1] // self.tp.size
                quantized = quantized.input_shard(self.tp.rank * in_local, (self.tp.rank + 1) * in_local)
            self.gemm = self.backend.prepare_quantized_linear(quantized, self.bias)
            self.weight = self.weight_scale = None  # the GEMM holds what it runs
            if perm is not None:
                self.weight_perm = None
            if self.backend.packs_weights:
                self.bias = None
            return
        # the keyword only where it is False: a user's Backend subclass may predate it
        extra = {"quantize": False} if self.dequantized else {}
        self.gemm = self.backend.prepare_linear(self.weight, self.bias, **extra)
        if self.backend.packs_weights:
            self.weight = self.bias = None  # the GEMM holds its own copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (e.g. an MoE router)."""


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext) -> None:
        super().__init__(input_size, ctx.tp.shard(output_size, "output_size"), bias, ctx)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = param.data.shape[0]
        full = (shard * self.tp.size, *param.shape[1:])
        param.data.copy_(shard_of(loaded, full, 0, self.tp.rank, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight, e.g. gate_proj and up_proj."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ctx: ModelContext) -> None:
        for i, size in enumerate(output_sizes):  # each part is split on its own, so each must divide
            ctx.tp.shard(size, f"output_sizes[{i}]")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, ctx)
        for param in self.parameters():
            expect_shards(param, range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        shard = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        full = (self.output_sizes[shard_id], *param.shape[1:])
        param.data.narrow(0, offset, shard).copy_(shard_of(loaded, full, 0, self.tp.rank, shard))
        param.loaded_shards.add(shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight; each rank holds its share of query and KV heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, ctx: ModelContext
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = ctx.tp.shard(num_heads, "num_attention_heads")  # per rank
        self.num_kv_heads = ctx.tp.shard(num_kv_heads, "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, ctx)
        for param in self.parameters():
            expect_shards(param, "qkv")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, shard = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        full = (shard * self.tp.size, *param.shape[1:])
        param.data.narrow(0, offset, shard).copy_(shard_of(loaded, full, 0, self.tp.rank, shard))
        param.loaded_shards.add(shard_id)


class RowParallelLinear(LinearBase):
    input_is_sharded = True

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ModelContext) -> None:
        super().__init__(ctx.tp.shard(input_size, "input_size"), output_size, bias, ctx)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, on rank 0, after the all-reduce would double it
            loaded = shard_of(loaded, param.shape, 0, 0, param.shape[0])
            param.data.copy_(loaded if self.tp.rank == 0 else torch.zeros_like(loaded))
            return
        shard = param.data.shape[1]
        full = (param.shape[0], shard * self.tp.size)
        param.data.copy_(shard_of(loaded, full, 1, self.tp.rank, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.gemm(x))

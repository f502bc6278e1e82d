"""Linear layers whose weight loaders shard HF weights for tensor parallelism.

Column-parallel layers split the output dim across ranks, row-parallel ones the input dim (and
all-reduce their output). Packed layers (QKV, gate_up) load several HF tensors into one weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.cpu import CPUWeight
from nanoserve.layers.tp import all_reduce, divide, tp_rank, tp_size


class LinearBase(nn.Module):
    # Set by prepare_cpu_gemm on CPU: the weight as the CPU GEMMs want it (see kernels/cpu.py).
    cpu_weight: CPUWeight | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cpu_weight)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cpu_weight: CPUWeight | None = None
) -> torch.Tensor:
    return cpu_weight(x) if cpu_weight is not None else F.linear(x, weight, bias)


def prepare_cpu_gemm(model: nn.Module) -> None:
    """Give every linear layer and the LM head a CPUWeight (see nanoserve.kernels.cpu).

    Their parameters stay as loaded; the float32 copies cost 4 bytes per weight on top.
    """
    from nanoserve.layers.embed_head import ParallelLMHead

    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            module.cpu_weight = CPUWeight(module.weight, getattr(module, "bias", None))


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_size(), "output_size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = param.data.shape[0]
        param.data.copy_(loaded.narrow(0, tp_rank() * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight, e.g. gate_proj and up_proj."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        for i, size in enumerate(output_sizes):  # each part is split on its own, so each must divide
            divide(size, tp_size(), f"output_sizes[{i}]")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        shard = self.output_sizes[shard_id] // tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp_size()
        param.data.narrow(0, offset, shard).copy_(loaded.narrow(0, tp_rank() * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight; each rank holds its share of query and KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size(), "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, tp_size(), "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, shard = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        param.data.narrow(0, offset, shard).copy_(loaded.narrow(0, tp_rank() * shard, shard))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, tp_size(), "input_size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, on rank 0, after the all-reduce would double it
            param.data.copy_(loaded if tp_rank() == 0 else torch.zeros_like(loaded))
            return
        shard = param.data.shape[1]
        param.data.copy_(loaded.narrow(1, tp_rank() * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(linear(x, self.weight, self.bias, self.cpu_weight))

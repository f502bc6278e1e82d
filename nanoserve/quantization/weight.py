"""The one form every pre-quantized linear weight is decoded into, whatever its file format.

    w[n, perm[j]] = qweight[n, j] * scales[n, j // group_size]

qweight holds small signed integers as int8: GPTQ/AWQ/compressed-tensors int4 with zero points
store w = (q - z) * s per group, and q - z lies in [-16, 15], an exact int8 value under the same
group scale; int8 formats are int8 already. So the int8 kernels (nanoserve/kernels/cpu_int8.c)
run every integer format exactly, with group_size = the format's group.

perm is None unless the checkpoint is act-order GPTQ (g_idx not in k order): its input columns
are then stored here sorted by group, so that groups are contiguous, and the GEMM multiplies
x[:, perm] (the activations gathered the same way) by them. A tensor-parallel rank's part of such a
weight (`input_shard`) may also hold zero columns (perm then repeats an input; they add nothing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# A rank's act-order columns of a group are padded with zero weights to whole sub-groups of
# gcd(group_size, SHARD_BLOCK) inputs: small enough to waste little, and W4A8's activation block
# (cpu_int8.W4A8_BLOCK), so that a rank's groups still run W4A8 where the whole weight's did.
SHARD_BLOCK = 32


@dataclass(frozen=True)
class QuantizedWeight:
    qweight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, ceil(K / group_size)] float32
    group_size: int  # K when there is one scale per output channel
    perm: torch.Tensor | None = None  # [K] int64: kernel column j multiplies x[:, perm[j]]

    def __post_init__(self) -> None:
        n, k = self.qweight.shape
        assert self.qweight.dtype == torch.int8, f"qweight must be int8, got {self.qweight.dtype}"
        assert self.scales.dtype == torch.float32, f"scales must be float32, got {self.scales.dtype}"
        assert tuple(self.scales.shape) == (n, -(-k // self.group_size)), (
            f"scales {list(self.scales.shape)} do not match qweight {[n, k]} in groups of {self.group_size}")
        assert self.perm is None or tuple(self.perm.shape) == (k,), "perm must have one entry per input column"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for, in the checkpoint's column order."""
        k = self.qweight.shape[1]
        w = self.qweight.float() * self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]
        if self.perm is None:
            return w
        # a sum, not an assignment: a shard's zero pad columns repeat an input of their sub-group (and
        # make it wider than its inputs, every one of which perm names)
        return w.new_zeros(w.shape[0], int(self.perm.max()) + 1).index_add_(1, self.perm, w)

    def input_shard(self, start: int, stop: int) -> QuantizedWeight:
        """The part of an act-order weight that multiplies inputs [start, stop), a row-parallel rank's
        (vLLM's act-order row-parallel layers keep every group's scales on every rank and split g_idx
        with the weight, as here). The rank's columns of a group are not whole groups, so each group's
        are padded with zero weights to whole sub-groups of gcd(group_size, SHARD_BLOCK) inputs, each
        sub-group carrying its group's scale: the kernels' fixed groups then fit, exactly. A pad
        column reads an input of its own sub-group: it adds 0 and leaves W4A8's block scale as it was."""
        assert self.perm is not None, "input_shard splits an act-order weight; shard others by column ranges"
        n, dev = self.qweight.shape[0], self.qweight.device
        group = self.group_size
        sub = math.gcd(group, SHARD_BLOCK)
        # sorted column j belongs to group j // group (act_order sorted them so); keep this rank's, in order
        cols = torch.nonzero((self.perm >= start) & (self.perm < stop)).flatten()  # [k_rank]
        owner = cols // group
        groups = self.scales.shape[1]
        count = torch.bincount(owner, minlength=groups)  # [G] this rank's columns of each group
        padded = (count + sub - 1) // sub * sub
        first = torch.cumsum(padded, 0) - padded  # [G] where each group starts in the shard
        rank_in_group = torch.arange(len(cols), device=dev) - (torch.cumsum(count, 0) - count)[owner]
        pos = first[owner] + rank_in_group  # [k_rank] each real column's place in the shard
        width = int(padded.sum())
        qweight = self.qweight.new_zeros(n, width)
        qweight[:, pos] = self.qweight[:, cols]
        perm = torch.empty(width, dtype=torch.int64, device=dev)
        perm[pos] = self.perm[cols] - start
        # a pad column repeats the input of its group's last real column (in the same sub-group)
        group_of = torch.repeat_interleave(torch.arange(groups, device=dev), padded)  # [width]
        within = torch.arange(width, device=dev) - first[group_of]
        last_real = (first + count - 1)[group_of]
        perm = perm[torch.where(within < count[group_of], torch.arange(width, device=dev), last_real)]
        scales = self.scales[:, torch.repeat_interleave(torch.arange(groups, device=dev), padded // sub)]
        return QuantizedWeight(qweight, scales.contiguous(), sub, perm)

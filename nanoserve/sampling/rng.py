"""Counter-based random numbers: one uniform per (seed, step), from SplitMix64 on int64 tensors.

A row's uniform depends only on its seed and on how many tokens it has generated so far (its
step), never on a generator's state: so a row draws the same token whatever batch it is in, at
whatever position, and after a preemption that recomputes it.

int64 multiply wraps mod 2**64 like uint64; `>>` on int64 is arithmetic, so a logical shift masks
off the copied sign bits afterwards.
"""
from __future__ import annotations

import torch


def _as_int64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)  # SplitMix64's stream increment
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)
_UNIFORM_BITS = 52  # (k + 0.5) / 2**52 is exact in float64 and lies strictly inside (0, 1)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (as if uint64)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, elementwise on int64 (read as uint64)."""
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    return x ^ _shr(x, 31)


def stream_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[N] int64 key per (seed, step): output number `step` of a SplitMix64 stream seeded by `seed`."""
    return splitmix64(splitmix64(seeds) + (steps + 1) * _GOLDEN)


def row_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[N] float64 U(0, 1), never exactly 0 or 1: the top 52 bits k of the (seed, step) key as
    (k + 0.5) / 2**52."""
    k = _shr(stream_keys(seeds, steps), 64 - _UNIFORM_BITS)
    return (k.double() + 0.5) * 2.0**-_UNIFORM_BITS

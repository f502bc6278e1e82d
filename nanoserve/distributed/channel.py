"""The rank-0 -> worker message channel: one `multiprocessing.Pipe` per worker.

A message is `pickle.dumps((kind, payload))` sent with `send_bytes`; tensors inside a payload
travel as raw bytes (dtype, shape, data: see `pack`), never as pickled storages or shared memory.
The size is checked on both ends: `encode_message` refuses a message over MAX_MESSAGE_BYTES with a
ValueError, and the receiver reads with `recv_bytes(MAX_MESSAGE_BYTES)`, which refuses a longer
one. A step's ModelInputs are a few int tensors of num_tokens or num_seqs x max_blocks elements:
kilobytes to a few megabytes. Rank 0 pickles a step once and writes the same bytes to every pipe.
  rank 0 -> worker:  ("step", packed ModelInputs)   ("stop", None)
  worker -> rank 0:  ("ready", local num_kvcache_blocks)   ("error", traceback text)
"""
from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any, NamedTuple

import torch

MAX_MESSAGE_BYTES = 256 * 2**20  # one step's inputs; real ones are KBs to a few MBs


class PackedTensor(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def pack(obj: Any) -> Any:
    """Replace every tensor in obj (dataclasses, lists, tuples, dicts of them) by its raw bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return PackedTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), data)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_fields(obj, pack)
    if isinstance(obj, (list, tuple)) and not isinstance(obj, PackedTensor):
        return type(obj)(pack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    return obj


def unpack(obj: Any) -> Any:
    """Inverse of `pack`: CPU tensors again."""
    if isinstance(obj, PackedTensor):
        dtype = getattr(torch, obj.dtype)
        if not obj.data:
            return torch.empty(obj.shape, dtype=dtype)
        return torch.frombuffer(bytearray(obj.data), dtype=torch.uint8).view(dtype).reshape(obj.shape)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_fields(obj, unpack)
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    return obj


def _map_fields(obj: Any, fn) -> Any:
    out = copy.copy(obj)  # no __init__ call: works for frozen dataclasses and init=False fields
    for f in dataclasses.fields(obj):
        object.__setattr__(out, f.name, fn(getattr(obj, f.name)))
    return out


def encode_message(kind: str, payload: Any = None) -> bytes:
    data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(
            f"tensor-parallel message {kind!r} is {len(data)} bytes, over the channel's limit of "
            f"MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}; lower max_num_batched_tokens or max_num_seqs"
        )
    return data


def send_message(conn, kind: str, payload: Any = None) -> None:
    conn.send_bytes(encode_message(kind, payload))


def recv_message(conn) -> tuple[str, Any]:
    return pickle.loads(conn.recv_bytes(MAX_MESSAGE_BYTES))

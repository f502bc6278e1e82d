"""Writers of each format, from the published layouts (AutoGPTQ's and AutoAWQ's pack functions,
compressed-tensors' pack_to_int32, Qwen's FP8 configs): a float checkpoint in, the same model
quantized (round to nearest, no calibration) in that exact layout out, and beside it a float32 twin
holding the very weights the quantized one stands for (the oracle HF transformers runs).

Tests build tiny checkpoints with it and benchmarks a Qwen3-0.6B-shaped one. Each packer computes
its dequantized weight from its own integers, not through nanoserve's decoders.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanoserve.quantization.awq import ORDER as AWQ_ORDER

# the linear weights a packer quantizes (Llama/Qwen names); others (embeddings, norms, lm_head unless asked) stay float
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
FP8_MAX = 448.0  # the largest float8_e4m3fn


def pack_fields(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-wide values packed into int32 along `dim`, the first in the lowest bits."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.unflatten(-1, (-1, per_word))  # [..., W, per_word]
    words = (v << (torch.arange(per_word) * bits)).sum(-1)  # disjoint fields: the sum is an OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # the same 32 bits, as int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0):
    """Round-to-nearest, GPTQ's grid: unsigned q [N, K] in [0, 2**bits), zeros z [N, G] and scales s [N, G]
    (float16 values, as stored) with w ~ (q - z[g_idx]) * s[g_idx]. sym: z = 2**(bits-1)."""
    maxq = 2**bits - 1
    groups = int(g_idx.max()) + 1
    n = w.shape[0]
    lo = torch.zeros(n, groups).scatter_reduce(1, g_idx.expand(n, -1), w, "amin", include_self=False)
    hi = torch.zeros(n, groups).scatter_reduce(1, g_idx.expand(n, -1), w, "amax", include_self=False)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if sym:
        amax = torch.maximum(-lo, hi)
        s = 2 * amax / maxq
        z = torch.full_like(s, (maxq + 1) // 2)
    else:
        s = (hi - lo) / maxq
        z = torch.round(-lo / torch.where(s > 0, s, torch.ones_like(s))).clamp(min_zero, maxq)
    s = torch.where(s > 0, s, torch.ones_like(s)).half().float()  # what the file will hold
    q = torch.round(w / s[:, g_idx]) + z[:, g_idx]
    return q.clamp(0, maxq).to(torch.int32), z.to(torch.int32), s


def grouping(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    """g_idx: k // group, or GPTQ desc_act's: columns visited in a random order, grouped in that order."""
    if not act_order:
        return torch.arange(k) // group
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    return g_idx


def gptq(w: torch.Tensor, bits=4, group_size=32, sym=True, act_order=False, version=1, seed=0):
    n, k = w.shape
    group = k if group_size == -1 else group_size
    g_idx = grouping(k, group, act_order, seed=k + seed)  # one order per input size: fused parts agree
    # v1 stores z - 1, so z = 0 would wrap to 2**bits (AutoGPTQ's known quirk): asymmetric zeros start at 1
    q, z, s = quantize_groups(w, bits, group, sym, g_idx, min_zero=1 if version == 1 else 0)
    tensors = {
        "qweight": pack_fields(q.T, bits, dim=0),  # [K / f, N]
        "qzeros": pack_fields((z - (1 if version == 1 else 0)).T, bits, dim=1),  # [G, N / f]
        "scales": s.T.half().contiguous(),  # [G, N]
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, ((q - z[:, g_idx]) * s[:, g_idx]).float()


def awq(w: torch.Tensor, group_size=32, **_):
    n, k = w.shape
    group = k if group_size == -1 else group_size
    g_idx = torch.arange(k) // group
    q, z, s = quantize_groups(w, 4, group, False, g_idx)

    def pack(values):  # [R, N] -> [R, N / 8]: field j of word i holds column 8i + ORDER[j]
        cols = values.unflatten(1, (-1, 8))[:, :, list(AWQ_ORDER)].flatten(1)
        return pack_fields(cols, 4, dim=1)

    tensors = {"qweight": pack(q.T.contiguous()), "qzeros": pack(z.T.contiguous()), "scales": s.T.half().contiguous()}
    return tensors, ((q - z[:, g_idx]) * s[:, g_idx]).float()


def ct_pack_quantized(w: torch.Tensor, bits=4, group_size=32, sym=True, act_order=False, seed=0):
    n, k = w.shape
    group = k if group_size == -1 else group_size
    g_idx = grouping(k, group, act_order, seed=k + seed)
    q, z, s = quantize_groups(w, bits, group, sym, g_idx)
    tensors = {  # offset-binary: the signed value q - 2**(bits-1) is stored as q itself (and so is the zero point)
        "weight_packed": pack_fields(q, bits, dim=1),
        "weight_scale": s.half(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not sym:
        tensors["weight_zero_point"] = pack_fields(z, bits, dim=0)  # packed along N
    if act_order:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, ((q - z[:, g_idx]) * s[:, g_idx]).float()


def ct_int_quantized(w: torch.Tensor, **_):
    s = (w.abs().amax(dim=1, keepdim=True) / 127).half().float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s).clamp(-127, 127)
    return {"weight": q.to(torch.int8), "weight_scale": s.half()}, (q * s).float()


def fp8(w: torch.Tensor, block=(128, 128), **_):
    n, k = w.shape
    bn, bk = block
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [N/bn, bn, K/bk, bk]
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [N/bn, K/bk]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale.float()}, q.float() * full


PACKERS = {"gptq": gptq, "awq": awq, "ct-pack": ct_pack_quantized, "ct-int8": ct_int_quantized, "fp8": fp8}


def quantization_config(kind: str, bits=4, group_size=32, sym=True, act_order=False, version=1, block=(128, 128),
                        w8a8=False) -> dict:
    """config.json's quantization_config for what PACKERS[kind] writes, as the format's tools write it."""
    if kind == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq" if version == 1 else "gptq_v2", "static_groups": False,
                "true_sequential": True, "damp_percent": 0.01}
    if kind == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if kind == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    fmt = "pack-quantized" if kind == "ct-pack" else "int-quantized"
    weights = {"num_bits": bits if kind == "ct-pack" else 8, "type": "int", "symmetric": sym if kind == "ct-pack"
               else True, "strategy": "group" if kind == "ct-pack" and group_size != -1 else "channel",
               "group_size": group_size if kind == "ct-pack" and group_size != -1 else None, "dynamic": False,
               "actorder": "group" if act_order else None, "observer": "minmax", "block_structure": None}
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                   "group_size": None, "observer": None} if w8a8 else None
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None,
                                          "format": fmt}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def write_quantized_checkpoint(src: str, dst: str, kind: str, float_dst: str | None = None, skip=(),
                               lm_head: bool = False, **options) -> dict[str, torch.Tensor]:
    """Quantize every linear weight of the float checkpoint `src` (except modules matching `skip`)
    with PACKERS[kind](weight, **options), write it to `dst` with its quantization_config and, if
    float_dst is given, the float32 twin there. Returns the dequantized weights by tensor name.
    lm_head (GPTQ only): quantize the LM head too, GPTQModel's "lm_head": true; a tied head is
    written as its own lm_head (both configs then untied; the embedding stays float)."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(src, name), framework="pt") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys()})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if lm_head:
        if kind != "gptq":
            raise ValueError(f"lm_head=True is written for kind 'gptq' only, got {kind!r}")
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
        config["tie_word_embeddings"] = False
    packed, twin, dequantized = {}, {}, {}
    for name, tensor in tensors.items():
        module = name.rpartition(".")[0]
        quantize = LINEAR.search(name) or (lm_head and name == "lm_head.weight")
        if quantize and not any(re.search(p, module) for p in skip):
            parts, dq = PACKERS[kind](tensor.float(), **options)
            packed.update({f"{module}.{suffix}": t.contiguous() for suffix, t in parts.items()})
            twin[name] = dequantized[name] = dq
        else:
            packed[name] = tensor
            twin[name] = tensor.float()
    qcfg_options = {k: v for k, v in options.items() if k in ("bits", "group_size", "sym", "act_order", "version",
                                                              "block", "w8a8")}
    qcfg = quantization_config(kind, **qcfg_options)
    if kind == "gptq":
        qcfg["lm_head"] = lm_head
    quantized_config = {**config, "quantization_config": qcfg}
    for out, weights, cfg in ((dst, packed, quantized_config), (float_dst, twin, {**config, "torch_dtype": "float32"})):
        if out is None:
            continue
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(src):
            if not name.endswith(".safetensors") and name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(os.path.join(src, name), os.path.join(out, name))
        save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    return dequantized


def main(argv: list[str] | None = None) -> None:
    """python -m nanoserve.quantization.pack SRC DST --kind gptq [--group-size 128] ...: a float
    checkpoint written in a quantized format (round to nearest), e.g. for bench.py --model DST."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m nanoserve.quantization.pack", description=main.__doc__)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--kind", choices=list(PACKERS), default="gptq")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="zero points per group (GPTQ, compressed-tensors)")
    p.add_argument("--act-order", action="store_true", help="GPTQ desc_act / compressed-tensors actorder group")
    p.add_argument("--lm-head", action="store_true", help="GPTQ: quantize the LM head too (GPTQModel's lm_head)")
    p.add_argument("--float-twin", help="also write the dequantized float32 weights here")
    args = p.parse_args(argv)
    options = {"gptq": dict(bits=args.bits, group_size=args.group_size, sym=not args.asym, act_order=args.act_order),
               "awq": dict(group_size=args.group_size),
               "ct-pack": dict(bits=args.bits, group_size=args.group_size, sym=not args.asym,
                               act_order=args.act_order),
               "ct-int8": {}, "fp8": {}}[args.kind]
    write_quantized_checkpoint(args.src, args.dst, args.kind, args.float_twin, lm_head=args.lm_head, **options)
    print(f"wrote {args.dst} ({args.kind}, {options})")


if __name__ == "__main__":
    main()

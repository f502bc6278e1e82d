"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8), built here from a random float
Qwen3 by the packers of nanoserve/quantization/pack.py (written from each format's published
layout), then: the decoded weights are exactly what the packer encoded; nanoserve's greedy tokens
equal HF transformers' (float32) on a float twin holding those same weights; tensor parallelism
shards them; and every unsupported or inconsistent checkpoint is a ValueError naming the file,
the tensor or the field. compressed-tensors' own decompressor is a second oracle where installed."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.kernels import cpu_kernels
from nanoserve.kernels.cpu_gemm import Int4Gemm, Int8Gemm
from nanoserve.layers.linear import LinearBase
from nanoserve.quantization.checkpoint import open_checkpoint
from nanoserve.quantization.pack import write_quantized_checkpoint
from nanoserve.quantization.weight import QuantizedWeight

# name -> (packer, options); the tiny "untied-gqa4" model: hidden 96, q/k/v inputs in 3 groups of 32,
# down_proj's 160 inputs in 5, k/v outputs 48 (a multiple of the 8 int4 values per int32 word)
CASES = {
    "gptq-sym": ("gptq", {}),
    "gptq-asym-act-order": ("gptq", dict(sym=False, act_order=True)),
    "gptq-v2-asym-per-channel": ("gptq", dict(sym=False, version=2, group_size=-1)),
    "gptq-8bit": ("gptq", dict(bits=8)),
    # desc_act with group_size not dividing K (96, 160): the last group of each module is partial
    "gptq-act-order-partial-groups": ("gptq", dict(act_order=True, group_size=64)),
    # 8 bits with real zero points: q - z spans [-255, 255], so these modules run in float
    "gptq-8bit-asym": ("gptq", dict(bits=8, sym=False)),
    "ct-w8a16-asym": ("ct-pack", dict(bits=8, sym=False)),
    "awq": ("awq", {}),
    "ct-w4a16": ("ct-pack", {}),
    "ct-w4a16-asym": ("ct-pack", dict(sym=False)),
    "ct-w4a16-asym-act-order": ("ct-pack", dict(sym=False, act_order=True)),
    "ct-w8a8": ("ct-int8", dict(w8a8=True)),
    "fp8": ("fp8", dict(block=(16, 32))),
}
METHODS = {"gptq": "gptq", "awq": "awq", "ct-pack": "compressed-tensors", "ct-int8": "compressed-tensors",
           "fp8": "fp8"}
RUN_IN_FLOAT = {"fp8", "gptq-8bit-asym", "ct-w8a16-asym"}  # decoded to float weights, run by the float GEMM
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=128, num_kvcache_blocks=64)


@pytest.fixture(scope="module")
def checkpoints(model_dirs, tmp_path_factory):
    """name -> (quantized dir, float twin dir, the packer's dequantized weights)."""
    root = tmp_path_factory.mktemp("quantized")
    built = {}
    for name, (kind, options) in CASES.items():
        dst, twin = str(root / name), str(root / f"{name}-float")
        built[name] = (dst, twin, write_quantized_checkpoint(model_dirs["untied-gqa4"], dst, kind, twin, **options))
    return built


def _decoded(path: str) -> dict[str, QuantizedWeight | torch.Tensor]:
    """Every quantized module of the checkpoint, decoded by nanoserve's reader, by weight name."""
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    files = [os.path.join(path, "model.safetensors")]
    quantized = open_checkpoint(path, hf_config, files)
    out = {}
    with safe_open(files[0], framework="pt") as f:
        for module in quantized.specs:
            tensors = {k.rpartition(".")[2]: f.get_tensor(k) for k in f.keys() if k.rpartition(".")[0] == module}
            out[f"{module}.weight"] = quantized.decode(module, tensors)
    return out


@pytest.mark.parametrize("name", CASES)
def test_decoded_weights_are_exactly_what_the_packer_encoded(checkpoints, name):
    path, _, encoded = checkpoints[name]
    decoded = _decoded(path)
    assert set(decoded) == set(encoded)  # every linear of every layer, nothing else
    for weight_name, want in encoded.items():
        got = decoded[weight_name]
        if isinstance(got, QuantizedWeight):
            int4 = CASES[name][1].get("bits", 8 if CASES[name][0] == "ct-int8" else 4) == 4
            lo, hi = (-16, 15) if int4 else (-128, 127)  # int4: q - z (GPTQ v1 zeros reach 16)
            assert got.qweight.dtype == torch.int8 and lo <= int(got.qweight.min()) and int(got.qweight.max()) <= hi
            assert (got.perm is not None) == (CASES[name][1].get("act_order", False)), weight_name
            got = got.dequantize()
        assert torch.equal(got, want), weight_name


def _int4(name: str) -> bool:
    kind, options = CASES[name]
    return kind in ("gptq", "awq", "ct-pack") and options.get("bits", 4) == 4


@pytest.mark.parametrize("name, int8_path", [(name, "auto") for name in CASES] + [("gptq-asym-act-order", "w8a16")])
def test_greedy_tokens_equal_hf_on_the_dequantized_weights(checkpoints, hf, monkeypatch, name, int8_path):
    """By default in float32, int4 checkpoints run W4A16 and 8-bit ones the int8 kernels (W8A16); int4
    integers also through the int8 kernels (w8a16): all exact, so HF's tokens."""
    monkeypatch.setenv("NANOSERVE_CPU_INT8", int8_path)
    path, twin, _ = checkpoints[name]
    llm = LLM(path, **ENGINE)
    assert llm.engine.config.quantization == METHODS[CASES[name][0]]
    gemms = [m.gemm for m in llm.engine.model_runner.model.modules() if isinstance(m, LinearBase)]
    if name in RUN_IN_FLOAT:
        assert not any(isinstance(g, (Int4Gemm, Int8Gemm)) for g in gemms)
    elif llm.engine.model_runner.backend.int8 is not None:  # the integers run as they are
        expected = Int4Gemm if _int4(name) and int8_path == "auto" else Int8Gemm
        assert gemms and all(type(g) is expected for g in gemms)
        assert not any(isinstance(g, Int4Gemm) and g.weight.w4a8 for g in gemms)  # float32: activations exact
        assert any(g.perm is not None for g in gemms) == CASES[name][1].get("act_order", False)
    prompts = random_prompts(3, 4, 12, seed=7)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == hf.greedy(twin, prompt, GREEDY.max_tokens), name


@pytest.mark.parametrize("name", ["gptq-sym", "awq", "ct-w4a16-asym-act-order"])
def test_int4_runs_w4a8_by_default_in_bf16_within_the_accuracy_gate(checkpoints, name):
    """The default int4 path in bf16 rounds activations to int8 per run of 128 inputs (outliers exact): against
    the exact W4A16 on the same weights, teacher-forced, it may differ no more than bf16 activations do.
    A float32 model asked for exact activations: there the default is W4A16."""
    import random

    from nanoserve.bench.accuracy import measure_accuracy

    path, _, _ = checkpoints[name]
    for dtype, w4a8, described in (("bfloat16", True, "int4 W4A8"), ("float32", False, "int4 W4A16")):
        llm = LLM(path, **{**ENGINE, "dtype": dtype})
        if llm.engine.model_runner.backend.int8 is None:
            pytest.skip("no AVX2/FMA build of the CPU kernels")
        gemms = [m.gemm for m in llm.engine.model_runner.model.modules() if isinstance(m, LinearBase)]
        assert gemms and all(isinstance(g, Int4Gemm) and g.weight.w4a8 == w4a8 for g in gemms), dtype
        assert llm.engine.model_runner.backend.describe()["quantized linears"] == described  # what bench.py prints
        del llm
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(4, 16))] for _ in range(8)]
    paths = {"W4A16": {"int8": "w4a16"}, "W4A8": {"int8": "w4a8"},
             "W4A16 bf16": {"int8": "w4a16", "llm": {"dtype": "bfloat16"}}}
    got = {r.path: r for r in measure_accuracy(path, prompts, 24, paths, **ENGINE)[0]}
    floor = got["W4A16 bf16"]
    assert got["W4A8"].top1_agreement >= floor.top1_agreement - 0.05
    assert got["W4A8"].mean_abs_logprob_diff <= 2 * floor.mean_abs_logprob_diff + 1e-3


def test_bf16_engine_runs_an_int4_checkpoint_close_to_its_float_twin(checkpoints):
    """The default dtype (bf16 activations): the same first tokens as float32 on the same weights."""
    path, _, _ = checkpoints["gptq-sym"]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 4, 12, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bf16 = LLM(path, max_model_len=128, num_kvcache_blocks=64).generate(prompts, params, use_tqdm=False)
    fp32 = LLM(path, **ENGINE).generate(prompts, params, use_tqdm=False)
    first = [a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(bf16, fp32)]
    assert sum(first) >= 3


def test_mixed_checkpoints_load_with_the_float_modules_as_float(model_dirs, hf, tmp_path):
    """Layer 1's MLP left in float, and layer 0's k_proj alone: that fused q/k/v layer loads dequantized."""
    dst, twin = str(tmp_path / "mixed"), str(tmp_path / "mixed-float")
    skip = (r"layers\.1\.mlp", r"layers\.0\.self_attn\.k_proj")
    write_quantized_checkpoint(model_dirs["untied-gqa4"], dst, "gptq", twin, skip=skip)
    llm = LLM(dst, **ENGINE)
    model = llm.engine.model_runner.model
    if llm.engine.model_runner.backend.int8 is not None:
        layers = model.model.layers
        assert isinstance(layers[0].mlp.down_proj.gemm, Int4Gemm)
        assert isinstance(layers[1].self_attn.qkv_proj.gemm, Int4Gemm)
        assert not isinstance(layers[1].mlp.down_proj.gemm, (Int4Gemm, Int8Gemm))
        assert not isinstance(layers[0].self_attn.qkv_proj.gemm, (Int4Gemm, Int8Gemm))
    prompt = [5, 9, 14, 3, 77]
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf.greedy(twin, prompt, GREEDY.max_tokens)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_gptq_g_idx_saved_as_int64_decodes_the_same(checkpoints, tmp_path):
    """A packer that leaves g_idx as torch's default int64 (AutoGPTQ writes int32) means the same groups."""
    path, _, _ = checkpoints["gptq-asym-act-order"]
    dst = str(tmp_path / "int64")
    os.makedirs(dst)
    for name in os.listdir(path):
        if name != "model.safetensors":
            os.symlink(os.path.join(path, name), os.path.join(dst, name))
    tensors = {k: v.long() if k.endswith(".g_idx") else v for k, v in _tensors(path).items()}
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    want, got = _decoded(path), _decoded(dst)
    assert set(got) == set(want)
    for name, weight in want.items():
        assert torch.equal(got[name].perm, weight.perm) and torch.equal(got[name].dequantize(), weight.dequantize())


def test_fused_parts_with_different_act_orders_load_as_float(model_dirs, hf, tmp_path):
    """desc_act g_idx drawn per module: layer 0's k_proj has an input order unlike q/v's, and a fused q/k/v
    layer runs one order, so that layer loads dequantized; the other layers keep their integers."""
    dst, other, twin = str(tmp_path / "q"), str(tmp_path / "other-order"), str(tmp_path / "float")
    write_quantized_checkpoint(model_dirs["untied-gqa4"], dst, "gptq", twin, act_order=True)
    other_weights = write_quantized_checkpoint(model_dirs["untied-gqa4"], other, "gptq", act_order=True, seed=1)
    k_proj = "model.layers.0.self_attn.k_proj."
    packed, spliced = _tensors(dst), _tensors(other)
    packed.update({k: v for k, v in spliced.items() if k.startswith(k_proj)})
    assert not torch.equal(packed[k_proj + "g_idx"], packed[k_proj.replace("k_proj", "q_proj") + "g_idx"])
    save_file(packed, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_file({**_tensors(twin), k_proj + "weight": other_weights[k_proj + "weight"]},
              os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(dst, **ENGINE)
    layers = llm.engine.model_runner.model.model.layers
    if llm.engine.model_runner.backend.int8 is not None:
        assert not isinstance(layers[0].self_attn.qkv_proj.gemm, (Int4Gemm, Int8Gemm))
        assert all(isinstance(layer.mlp.gate_up_proj.gemm, Int4Gemm) for layer in layers)
        qkv = layers[1].self_attn.qkv_proj.gemm
        assert isinstance(qkv, Int4Gemm) and qkv.perm is not None
    prompt = [5, 9, 14, 3, 77]
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf.greedy(twin, prompt, GREEDY.max_tokens)


# ---- compressed-tensors' own decompressor as a second oracle -----------------------------------


@pytest.mark.parametrize("name", ["ct-w4a16", "ct-w4a16-asym", "ct-w8a8"])
def test_compressed_tensors_library_decompresses_to_the_same_weights(checkpoints, name):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    path, _, _ = checkpoints[name]
    with open(os.path.join(path, "config.json")) as f:
        group = json.load(f)["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    decoded = _decoded(path)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        for weight_name, ours in list(decoded.items())[:6]:
            module = weight_name.rpartition(".")[0]
            state = {k.rpartition(".")[2]: f.get_tensor(k) for k in f.keys() if k.rpartition(".")[0] == module}
            theirs = compressor.decompress(state, scheme)["weight"]  # computed in the scales' dtype (fp16)
            assert theirs.dtype == torch.float16
            assert torch.equal(ours.dequantize().half(), theirs), weight_name  # one rounding of the same product


@pytest.mark.parametrize("bits, strategy, group_size, symmetric, activations", [
    (4, "tensor", None, False, False),  # pack-quantized: a per-tensor zero point stays an unpacked int8 [1]
    (8, "tensor", None, False, False),
    (4, "group", 128, True, True),  # the W4A8 preset: int-quantized, 4-bit values one per int8
    (4, "group", 64, False, True),
])
def test_compressed_tensors_library_modules_decode_as_the_library_decompresses_them(
        tmp_path, bits, strategy, group_size, symmetric, activations):
    """Modules compressed by the compressed-tensors library itself, in the format it infers for the scheme."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)
    per_token = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights,
                                input_activations=per_token if activations else None)
    fmt = infer_module_format(torch.nn.Linear, scheme).value
    assert fmt == ("int-quantized" if activations else "pack-quantized")
    compressor = BaseCompressor.get_value_from_registry(fmt)
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(0)) + 0.5  # off-centre: real zero points
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    groups = w.reshape(1, -1) if strategy == "tensor" else w.reshape(24, -1, group_size)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (torch.maximum(-lo, hi) * 2 if symmetric else hi - lo) / (qmax - qmin)
    state = {"weight": w, "weight_scale": scale.reshape(1) if strategy == "tensor" else scale}
    if not symmetric:
        zero_point = torch.round(qmin - lo / scale).clamp(qmin, qmax)
        state["weight_zero_point"] = zero_point.to(torch.int8).reshape(scale.shape)
    state = compressor.compress(state, scheme)
    module = "model.layers.0.mlp.down_proj"
    save_file({f"{module}.{k}": v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                              ignore=["lm_head"]).model_dump()
    checkpoint = open_checkpoint(str(tmp_path), {"quantization_config": qcfg}, [str(tmp_path / "model.safetensors")])
    decoded = checkpoint.decode(module, dict(state))
    ours = decoded if isinstance(decoded, torch.Tensor) else decoded.dequantize()
    assert torch.equal(ours, compressor.decompress(dict(state), scheme)["weight"])


# ---- tensor parallelism -------------------------------------------------------------------------


@pytest.mark.parametrize("kind, options", [("gptq", dict(group_size=16)),
                                           ("gptq", dict(sym=False, version=2, group_size=-1))])
def test_tensor_parallel_shards_quantized_layers_on_group_boundaries(model_dirs, tmp_path, kind, options):
    """Groups of 16 split evenly (each rank: 48 of 96 hidden inputs, 80 of 160 MLP ones); per channel,
    every rank scales its partial sums by the whole channel's scale."""
    path = str(tmp_path / kind)
    write_quantized_checkpoint(model_dirs["untied-gqa4"], path, kind, **options)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 10, seed=5)]
    _assert_tp2_equals_tp1(path, prompts, LLM(path, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))


def _assert_tp2_equals_tp1(path: str, prompts, tp1) -> None:
    tp2_llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        tp2 = tp2_llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        tp2_llm.close()
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]


def test_desc_act_with_g_idx_in_input_order_runs_and_shards_as_plain_groups(model_dirs, tmp_path):
    """desc_act: true whose g_idx is k // group_size (GPTQ static groups): no permutation to run, so the
    layers shard over tensor parallelism like any grouped weight (act-order proper: test_quant_gaps.py)."""
    path = str(tmp_path / "in-order")
    write_quantized_checkpoint(model_dirs["untied-gqa4"], path, "gptq", group_size=16)
    static = _with_config(path, tmp_path / "static", desc_act=True, static_groups=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 4, 10, seed=5)]
    llm = LLM(static, **ENGINE)
    assert all(getattr(m.gemm, "perm", None) is None for m in llm.engine.model_runner.model.modules()
               if isinstance(m, LinearBase))
    tp1 = llm.generate(prompts, GREEDY, use_tqdm=False)
    del llm
    _assert_tp2_equals_tp1(static, prompts, tp1)


def test_tensor_parallel_refuses_layouts_that_cannot_shard(checkpoints):
    path, _, _ = checkpoints["gptq-sym"]  # groups of 32: down_proj's 160 inputs split into 80 per rank
    with pytest.raises(ValueError, match=r"input size 160 in groups of 32 cannot be split across "
                                         r"tensor_parallel_size=2 ranks: each rank's 80 inputs must be whole groups"):
        LLM(path, tensor_parallel_size=2, **ENGINE)


# ---- refusals --------------------------------------------------------------------------------


def _with_config(path: str, dst, **changes) -> str:
    """A copy of the checkpoint `path` with quantization_config fields changed (None deletes one)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(path):
        if name != "config.json":
            os.symlink(os.path.join(path, name), os.path.join(dst, name))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is None:
            config["quantization_config"].pop(key, None)
        else:
            config["quantization_config"][key] = value
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize("name, changes, message", [
    ("gptq-sym", dict(bits=3), r"quantization_config.bits=3 is not supported \(4 or 8\)"),
    ("gptq-sym", dict(group_size=7), r"quantization_config.group_size=7 is not supported"),
    ("gptq-sym", dict(checkpoint_format="marlin"), r"quantization_config.checkpoint_format='marlin'"),
    ("gptq-sym", dict(checkpoint_format=["gptq"]), r"quantization_config.checkpoint_format=\['gptq'\]"),
    ("gptq-sym", dict(quant_method="bitsandbytes"), r"quant_method='bitsandbytes' is not supported"),
    ("awq", dict(version="gemv"), r"quantization_config.version='gemv' is not supported"),
    ("awq", dict(zero_point=False), r"quantization_config.zero_point=False"),
    ("fp8", dict(activation_scheme="static"), r"activation_scheme='static'"),
    ("fp8", dict(weight_block_size=None), r"weight_block_size=None"),
    ("ct-w4a16", dict(format="float-quantized"), r"config_groups.group_0.format='float-quantized'"),
    ("ct-w4a16", dict(quantization_status="frozen"), r"quantization_status='frozen'"),
    ("ct-w4a16", dict(ignore=["lm_head", None]), r"quantization_config.ignore=\['lm_head', None\] is not supported"),
    ("ct-w4a16", dict(sparsity_config=["dense"]), r"quantization_config.sparsity_config=\['dense'\] is not supported"),
])
def test_unsupported_configs_are_refused_by_field(checkpoints, tmp_path, name, changes, message):
    path, _, _ = checkpoints[name]
    if name.startswith("ct-") and "format" in changes:  # the scheme's own format wins over the top-level one
        with open(os.path.join(path, "config.json")) as f:
            groups = json.load(f)["quantization_config"]["config_groups"]
        groups["group_0"]["format"] = changes["format"]
        changes = dict(config_groups=groups)
    bad = _with_config(path, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message) as info:
        LLM(bad, **ENGINE)
    assert os.path.join(bad, "config.json") in str(info.value)


def test_tensors_that_disagree_with_the_config_are_refused_naming_file_and_tensor(checkpoints, tmp_path):
    path, _, _ = checkpoints["gptq-sym"]
    bad = tmp_path / "bad"
    os.makedirs(bad)
    for name in os.listdir(path):
        if name != "model.safetensors":
            os.symlink(os.path.join(path, name), bad / name)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    victim = "model.layers.1.mlp.down_proj.scales"
    tensors[victim] = tensors[victim][:-1].clone()  # one group short
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{victim}' .* must have shape \[5, 96\] "
                                         r"\(bits=4, group_size=32"):
        LLM(str(bad), **ENGINE)
    # a config that declares another bit width than the tensors hold: the shapes disagree
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.down_proj.scales' .* must have shape"):
        LLM(_with_config(path, tmp_path / "bits8", bits=8), **ENGINE)


def test_the_quantization_argument_must_agree_with_the_checkpoint(checkpoints, tiny_model):
    path, _, _ = checkpoints["gptq-sym"]
    for name in ("gptq", "gptq_marlin"):  # vLLM's kernel name for the format is the format
        assert LLM(path, quantization=name, **ENGINE).engine.config.quantization == "gptq"
    for wrong in ("awq", "awq_marlin"):
        with pytest.raises(ValueError, match=rf"quantization='{wrong}' disagrees with .*config.json.*'gptq'"):
            LLM(path, quantization=wrong, **ENGINE)
    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported \(.*config.json has no quantization_config"):
        LLM(tiny_model, quantization="fp8")


# ---- a quantized LM head (GPTQModel's "lm_head": true, vLLM's lm_head_quantized) ---------------


@pytest.mark.parametrize("model, options", [("tied-gqa2", {}), ("untied-gqa4", dict(sym=False, act_order=True))])
def test_a_quantized_lm_head_runs_its_integers(model_dirs, hf, tmp_path, monkeypatch, model, options):
    """The head's integers run through the int4 GEMM like any layer's (exact W4A16: HF's tokens on
    the float twin); a tied head unties, the embedding staying float; TP 2 splits it by vocab rows."""
    dst, twin = str(tmp_path / "q"), str(tmp_path / "f")
    dequantized = write_quantized_checkpoint(model_dirs[model], dst, "gptq", twin, lm_head=True, **options)
    assert "lm_head.weight" in dequantized
    monkeypatch.setenv("NANOSERVE_CPU_INT8", "w4a16")
    prompts = random_prompts(3, 4, 12, seed=8)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(dst, **ENGINE)
    head = llm.engine.model_runner.model.lm_head
    if llm.engine.model_runner.backend.int8 is not None:  # prepare_quantized_logits' wrapper holds the int4 GEMM
        assert any(isinstance(cell.cell_contents, Int4Gemm) for cell in head.gemm.__closure__)
    assert head.weight is None and not head._tied_to
    outputs = llm.generate(requests, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == hf.greedy(twin, prompt, GREEDY.max_tokens)
    # The same tensors under a config that still says tie_word_embeddings: the head unties and loads.
    tied = tmp_path / "tied"
    tied.mkdir()
    for name in os.listdir(dst):
        if name != "config.json":
            os.symlink(os.path.join(dst, name), tied / name)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    again = LLM(str(tied), **ENGINE).generate(requests, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    if options.get("act_order"):
        return  # an act-order MLP cannot be split across ranks (test_tensor_parallel_refuses_...)
    with LLM(dst, tensor_parallel_size=2, **ENGINE) as tp2:
        sharded = tp2.generate(requests, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in outputs]


# ---- quantization="int8" on a pre-quantized checkpoint: its float layers too ---------------------

_LIB = cpu_kernels.load()
needs_int8 = pytest.mark.skipif(_LIB is None or not _LIB.int8_gemm_supported(),
                                reason="quantization='int8' needs the CPU kernels built with AVX2 and FMA")


@needs_int8
@pytest.mark.parametrize("model", ["tied-gqa2", "untied-gqa4"])
def test_int8_quantizes_the_float_head_a_quantized_checkpoint_left(model_dirs, tmp_path, model):
    """The checkpoint's integers run as they are (int4), its float LM head is quantized per channel at
    load, and a tied embedding reads the head's int8 rows instead of keeping the float vocabulary;
    teacher-forced against the checkpoint in float32, no further from it than its bf16 head is."""
    from nanoserve.bench.accuracy import measure_accuracy

    dst = str(tmp_path / "q")
    write_quantized_checkpoint(model_dirs[model], dst, "gptq", str(tmp_path / "f"))
    bf16 = {**ENGINE, "dtype": "bfloat16"}
    llm = LLM(dst, quantization="int8", **bf16)
    assert llm.engine.config.quantization == "int8"
    model_ = llm.engine.model_runner.model
    gemms = [m.gemm for m in model_.modules() if isinstance(m, LinearBase)]
    assert gemms and all(type(g) is Int4Gemm for g in gemms)
    head, embedding = model_.lm_head, model_.model.embed_tokens
    assert type(head.gemm) is Int8Gemm and head.gemm.per_channel
    ids = torch.arange(embedding.vocab_size)
    if model.startswith("tied"):
        assert embedding.weight is None
        assert torch.equal(embedding(ids), head.gemm.rows(ids).bfloat16())
    else:
        assert embedding.weight is not None and embedding.weight.dtype == torch.bfloat16
    outputs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, 4, 12, seed=4)], GREEDY,
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    del llm
    paths = {"float32": {"llm": {"dtype": "float32"}}, "bf16": {}, "bf16, int8 head": {"quantization": "int8"}}
    got = {r.path: r for r in measure_accuracy(dst, random_prompts(8, 4, 16, seed=9), 16, paths, **bf16)[0]}
    floor = got["bf16"]
    assert got["bf16, int8 head"].top1_agreement >= floor.top1_agreement - 0.05
    assert got["bf16, int8 head"].mean_abs_logprob_diff <= 2 * floor.mean_abs_logprob_diff + 1e-3


@needs_int8
@pytest.mark.parametrize("name", ["mixed", "fp8", "gptq-8bit-asym"])
def test_int8_never_requantizes_what_the_checkpoint_quantized(checkpoints, model_dirs, tmp_path, name):
    """Only layers stored in float are quantized at load: layers decoded to float from the checkpoint's
    quantized tensors (FP8, 8-bit q - z beyond int8, a fused layer quantized in part) run in float as
    they do without the argument, never rounded a second time; layers the checkpoint left in float and
    the LM head become int8."""
    if name == "mixed":  # layer 1's MLP stored in float; layer 0's q/k/v quantized only in k_proj
        path = str(tmp_path / "mixed")
        write_quantized_checkpoint(model_dirs["untied-gqa4"], path, "gptq", str(tmp_path / "f"),
                                   skip=(r"layers\.1\.mlp", r"layers\.0\.self_attn\.k_proj"))
    else:
        path = checkpoints[name][0]
    default, int8 = LLM(path, **ENGINE), LLM(path, quantization="int8", **ENGINE)
    stored_float = {"model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"} if name == "mixed" else set()
    layers = dict(default.engine.model_runner.model.named_modules())
    checked = 0
    for layer_name, layer in int8.engine.model_runner.model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        before = layers[layer_name].gemm
        if layer_name in stored_float:
            assert type(layer.gemm) is Int8Gemm and not isinstance(before, (Int4Gemm, Int8Gemm)), layer_name
        else:
            assert type(layer.gemm) is type(before), layer_name
            checked += not isinstance(before, (Int4Gemm, Int8Gemm))  # a dequantized layer kept in float
        assert layer.dequantized == layers[layer_name].dequantized
    assert checked > 0  # every case has layers decoded to float
    assert type(int8.engine.model_runner.model.lm_head.gemm) is Int8Gemm
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 4, 12, seed=5)]
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in int8.generate(prompts, GREEDY, use_tqdm=False))


@needs_int8
def test_int8_head_rows_shard_with_the_vocabulary(tiny_model):
    """Tensor parallelism: each rank's tied embedding reads its own vocabulary shard of the int8 head.
    Only the row-parallel layers quantize differently per rank (their scales span a rank's inputs),
    so TP 2 stays next to TP 1; a wrong shard of rows would scramble every token."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 4, 12, seed=11)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    kw = dict(dtype="float32", max_model_len=128, num_kvcache_blocks=64, quantization="int8")
    tp1 = LLM(tiny_model, **kw).generate(prompts, params, use_tqdm=False)
    with LLM(tiny_model, tensor_parallel_size=2, **kw) as llm:
        tp2 = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(tp1, tp2):
        token = a.outputs[0].token_ids[0]
        assert b.outputs[0].token_ids[0] == token
        assert abs(a.outputs[0].logprobs[0][token].logprob - b.outputs[0].logprobs[0][token].logprob) < 0.05

"""Two ways a pre-quantized checkpoint used to be refused and now loads as vLLM loads it:

- its quantization config in AutoGPTQ's / AutoAWQ's own file (quantize_config.json, quant_config.json)
  instead of config.json, read when quantization="gptq" / "awq" is given;
- act-order GPTQ (g_idx not in input order) under tensor parallelism: each row-parallel rank keeps its
  inputs' columns of every group with the whole groups' scales (QuantizedWeight.input_shard).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import random_prompts
from nanoserve import LLM, SamplingParams
from nanoserve.layers.linear import RowParallelLinear
from nanoserve.quantization.common import TensorMeta, act_order
from nanoserve.quantization.pack import write_quantized_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=64, num_kvcache_blocks=32)
MODEL = "untied-gqa4"  # hidden 96, 8 heads of 24 (o_proj: 192 inputs), MLP 160: 96 and 80 inputs per rank at TP=2

# the files as the tools wrote them: AutoGPTQ without quant_method / checkpoint_format (v1 zeros), AutoAWQ
# in its own field names
AUTOGPTQ = {"bits": 4, "group_size": 32, "damp_percent": 0.01, "desc_act": True, "static_groups": False,
            "sym": False, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model"}
AUTOAWQ = {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}
PACKED = {"gptq": dict(sym=False, act_order=True), "awq": {}}


@pytest.fixture(scope="module")
def packed(model_dirs, tmp_path_factory):
    """kind -> (checkpoint with config.json's quantization_config, its greedy tokens)."""
    root = tmp_path_factory.mktemp("quant-gaps")
    prompts = _prompts()
    out = {}
    for kind, options in PACKED.items():
        path = str(root / kind)
        write_quantized_checkpoint(model_dirs[MODEL], path, kind, **options)
        out[kind] = (path, _tokens(LLM(path, **ENGINE), prompts))
    return out


def _prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(3, 4, 10, seed=7)]


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


def _standalone(path: str, dst, files: dict[str, dict]) -> str:
    """A copy of `path` whose config.json has no quantization_config, with `files` (name -> JSON) beside it."""
    os.makedirs(dst)
    for name in os.listdir(path):
        if name != "config.json":
            os.symlink(os.path.join(path, name), os.path.join(dst, name))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    for name, content in {"config.json": config, **files}.items():
        with open(os.path.join(dst, name), "w") as f:
            json.dump(content, f)
    return str(dst)


# ---- a quantization config outside config.json ----------------------------------------------------


@pytest.mark.parametrize("kind, file, content, quantization", [
    ("gptq", "quantize_config.json", AUTOGPTQ, "gptq"),
    ("gptq", "quantize_config.json", {**AUTOGPTQ, "quant_method": "gptq", "checkpoint_format": "gptq"}, "gptq_marlin"),
    ("awq", "quant_config.json", AUTOAWQ, "awq"),
    ("awq", "quantize_config.json", AUTOAWQ, "awq_marlin"),  # AutoAWQ's older name for it, as vLLM reads
])
def test_a_config_in_the_quantizers_own_file_loads_the_same_checkpoint(packed, tmp_path, kind, file, content,
                                                                        quantization):
    path, expected = packed[kind]
    standalone = _standalone(path, tmp_path / "standalone", {file: content})
    llm = LLM(standalone, quantization=quantization, **ENGINE)
    assert llm.engine.config.quantization == kind
    assert _tokens(llm, _prompts()) == expected


def test_a_config_outside_config_json_is_checked_like_config_jsons(packed, tmp_path):
    gptq, _ = packed["gptq"]
    file = os.path.join(str(tmp_path / "plain"), "quantize_config.json")
    plain = _standalone(gptq, tmp_path / "plain", {"quantize_config.json": AUTOGPTQ})
    # vLLM reads the file only when the method is given; without it the checkpoint is not taken for a float one
    for quantization in (None, "int8"):
        with pytest.raises(ValueError, match=rf"{file}: .* read with quantization='gptq' or 'awq' given, as in vLLM; "
                                             rf"got quantization={quantization!r}"):
            LLM(plain, quantization=quantization, **ENGINE)
    cases = {  # file content -> the error, naming the file and the field
        "bits3": ({**AUTOGPTQ, "bits": 3}, r"quantize_config.json: bits=3 is not supported \(4 or 8\)"),
        "marlin": ({**AUTOGPTQ, "checkpoint_format": "marlin"}, r"quantize_config.json: checkpoint_format='marlin'"),
        "is-marlin": ({**AUTOGPTQ, "is_marlin_format": True}, r"quantize_config.json: is_marlin_format=True"),
        "method": ({**AUTOGPTQ, "quant_method": "awq"},
                   r"quantize_config.json: quant_method='awq' disagrees with quantization='gptq'"),
        # present but inconsistent with the tensors: 8 bits declared, 4-bit tensors stored
        "bits8": ({**AUTOGPTQ, "bits": 8}, r"model.safetensors: tensor '.*' .* must have shape .*\(bits=8, "
                                           r"group_size=32 as .*quantize_config.json declares"),
        "group64": ({**AUTOGPTQ, "group_size": 64}, r"must have shape .*\(bits=4, group_size=64 as "
                                                    r".*quantize_config.json declares"),
        "in-order": ({**AUTOGPTQ, "desc_act": False},
                     r"g_idx' is not in input order .* but .*quantize_config.json declares desc_act=false"),
    }
    for name, (content, message) in cases.items():
        bad = _standalone(gptq, tmp_path / name, {"quantize_config.json": content})
        with pytest.raises(ValueError, match=message):
            LLM(bad, quantization="gptq", **ENGINE)
    awq, _ = packed["awq"]
    both = _standalone(awq, tmp_path / "both", {"quant_config.json": AUTOAWQ, "quantize_config.json": AUTOAWQ})
    with pytest.raises(ValueError, match=r"quantization='awq': .* holds several quantization configs "
                                         r"\(quant_config.json, quantize_config.json\): keep one"):
        LLM(both, quantization="awq", **ENGINE)
    none = _standalone(awq, tmp_path / "none", {})
    with pytest.raises(ValueError, match=r"quantization='awq_marlin' is not supported \(.*config.json has no "
                                         r"quantization_config and .* no quant_config.json or quantize_config.json"):
        LLM(none, quantization="awq_marlin", **ENGINE)
    with pytest.raises(ValueError, match=r"quant_config.json: must hold a JSON object"):
        LLM(_standalone(awq, tmp_path / "list", {"quant_config.json": [AUTOAWQ]}), quantization="awq", **ENGINE)


def test_a_leftover_quantizer_file_beside_float_weights_is_ignored_as_vllm(model_dirs, tmp_path, caplog):
    float_dir = tmp_path / "dequantized"
    os.makedirs(float_dir)
    for name in os.listdir(model_dirs[MODEL]):
        os.symlink(os.path.join(model_dirs[MODEL], name), os.path.join(float_dir, name))
    with open(float_dir / "quantize_config.json", "w") as f:
        json.dump(AUTOGPTQ, f)
    prompts = _prompts()
    expected = _tokens(LLM(model_dirs[MODEL], **ENGINE), prompts)
    with caplog.at_level("WARNING"):
        llm = LLM(str(float_dir), **ENGINE)
    assert llm.engine.config.quantization is None and "has float weights" in caplog.text
    assert _tokens(llm, prompts) == expected


# ---- act-order under tensor parallelism ------------------------------------------------------------


@pytest.mark.parametrize("k, group", [(160, 32), (96, 64), (160, 48), (192, 2)])
def test_a_ranks_input_shard_of_an_act_order_weight_is_exactly_its_columns(k, group):
    """Each rank's shard (its inputs' columns of every group, padded with zero columns to whole
    sub-groups, the group's scale on each) dequantizes to exactly those columns of the whole weight."""
    gen = torch.Generator().manual_seed(k + group)
    n, groups = 24, -(-k // group)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // group
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, groups, generator=gen)
    whole = act_order(q, scales, g_idx, group, TensorMeta("model.safetensors", "g_idx", (k,), "I32"))
    reference = q.float() * scales[:, g_idx]
    assert torch.equal(whole.dequantize(), reference)
    for rank in range(2):
        start, stop = rank * k // 2, (rank + 1) * k // 2
        shard = whole.input_shard(start, stop)
        assert torch.equal(shard.dequantize(), reference[:, start:stop])
        assert shard.shape[1] % shard.group_size == 0 and shard.shape[1] <= 2 * (stop - start)


@pytest.mark.parametrize("kind, options", [("gptq", dict(sym=False, act_order=True)),
                                           ("gptq", dict(act_order=True, group_size=64)),  # 96, 160: partial groups
                                           ("ct-pack", dict(sym=False, act_order=True))])  # actorder: group
def test_act_order_row_parallel_layers_shard_and_tp2_equals_tp1(model_dirs, tmp_path, kind, options):
    path = str(tmp_path / "act-order")
    write_quantized_checkpoint(model_dirs[MODEL], path, kind, **options)
    prompts = _prompts()
    llm = LLM(path, **ENGINE)
    rows = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, RowParallelLinear)]
    assert rows and all(m.gemm.perm is not None for m in rows)  # o_proj, down_proj run act-order
    tp1 = _tokens(llm, prompts)
    del llm
    assert _tokens(LLM(path, tensor_parallel_size=2, **ENGINE), prompts) == tp1

"""A tied embedding on the panel GEMM path: the LM head's bf16 panels are the only copy of the
vocabulary matrix, and the embedding reads its rows back from them bit for bit.

The int8 head gives back its rows as it multiplies them (q * scale), so quantization="int8" keeps
no float vocabulary either. Elsewhere (oneDNN, the torch backend, untied models) the embedding keeps
its own loaded weight, as before.
"""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from helpers import make_llm, random_prompts
from nanoserve import SamplingParams
from nanoserve.backends.cpu import CPUBackend, CPUOptions, gemm_unavailable
from nanoserve.distributed.group import TPGroup
from nanoserve.kernels import cpu_kernels
from nanoserve.kernels.cpu_gemm import PanelGemm
from nanoserve.layers.context import ModelContext
from nanoserve.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoserve.checkpoint import read_json
from nanoserve.models import model_class
from nanoserve.models.loader import load_weights, prepare_weights
from nanoserve.quantization.pack import write_quantized_checkpoint
from nanoserve.utils.tiny_checkpoint import build_tiny_qwen3

MAX_TOKENS = 12
# One bf16 step of logits in [8, 16), where this model's top logits lie.
HF_BF16_TIE = 2.0**-4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def _panel_kernels() -> cpu_kernels.CPUKernels:
    lib = cpu_kernels.load()
    kernels = cpu_kernels.CPUKernels(lib) if lib is not None else None
    reason = gemm_unavailable("panel", torch.bfloat16, kernels)
    if reason is not None:
        pytest.skip(reason)
    return kernels


@pytest.fixture
def panel(monkeypatch) -> cpu_kernels.CPUKernels:
    """The panel GEMM forced on (auto picks oneDNN's bf16 GEMM on CPUs with bf16 dot products)."""
    kernels = _panel_kernels()
    monkeypatch.setenv("NANOSERVE_CPU_GEMM", "panel")
    return kernels


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bf16 compared bit for bit (-0.0, NaN payloads)


def _random_bf16(rows: int, cols: int, seed: int) -> torch.Tensor:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).bfloat16()
    w[0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), 1e-40])  # bits a float round trip could change
    return w


@pytest.fixture(scope="module")
def tied_bf16(tmp_path_factory) -> str:
    # vocab 1000 = 62 full panels and a last one of 8 rows
    return build_tiny_qwen3(tmp_path_factory.mktemp("tied") / "m", seed=5, dtype="bfloat16")


# ---- PanelGemm.rows -------------------------------------------------------------------------------


def test_rows_read_back_the_weight_bit_for_bit():
    kernels = _panel_kernels()
    weight = _random_bf16(16 * 4 + 5, 40, seed=0)  # 4 full panels and a partial one
    gemm = PanelGemm(weight, None, kernels, torch.float32)
    ids = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(_bits(gemm.rows(ids)), _bits(weight[ids]))
    grid = torch.tensor([[0, 7, 8, 15], [16, 31, 64, 68]])  # both halves of a panel, the last row
    assert gemm.rows(grid).shape == (2, 4, 40)
    assert torch.equal(_bits(gemm.rows(grid)), _bits(weight[grid]))


# ---- tensor-parallel shards -----------------------------------------------------------------------


class _OneRank(TPGroup):
    """One rank of a group seen alone: all_reduce returns this rank's part (what it contributes)."""

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return x


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_reads_its_own_vocabulary_shard(rank):
    _panel_kernels()
    vocab, hidden = 101, 48  # shards of 51 rows: rank 1 holds 50 and one padding row
    weight = _random_bf16(vocab, hidden, seed=2)
    ctx = ModelContext(CPUBackend(torch.device("cpu"), torch.bfloat16, CPUOptions(gemm="panel")), _OneRank(rank, 2))
    with torch.device("cpu"):
        embedding = VocabParallelEmbedding(vocab, hidden, ctx).bfloat16()
        head = ParallelLMHead(vocab, hidden, ctx)
    head.tie(embedding)
    embedding.weight.weight_loader(embedding.weight, weight)
    head.process_weights_after_loading()
    assert embedding.weight is None and head.weight is None
    shard = slice(51 * rank, min(51 * (rank + 1), vocab))
    mine = weight[shard]
    local = torch.arange(mine.shape[0])
    assert torch.equal(_bits(embedding.rows(local)), _bits(mine))
    out = embedding(torch.arange(vocab))  # [vocab, hidden]: this rank's rows, zeros for the others'
    assert torch.equal(_bits(out[shard]), _bits(mine))
    assert not out[: shard.start].any() and not out[shard.stop :].any()


# ---- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untied_twin(tied_bf16, tmp_path_factory) -> str:
    """The same weights with lm_head.weight written out and tie_word_embeddings false: the engine
    keeps both loaded matrices, so bit-identical rows must give bit-identical logprobs."""
    from safetensors.torch import load_file, save_file

    twin = build_tiny_qwen3(tmp_path_factory.mktemp("untied") / "m", seed=5, dtype="bfloat16",
                            tie_word_embeddings=False)
    weights = load_file(f"{tied_bf16}/model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, f"{twin}/model.safetensors", metadata={"format": "pt"})
    return twin


def _loaded(path: str, backend: CPUBackend):
    """The bf16 model of `path` after loading (as the model runner builds it), and a weak
    reference to its loaded embedding weight."""
    cfg = read_json(f"{path}/config.json")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = model_class(cfg)(cfg, ModelContext(backend))
    finally:
        torch.set_default_dtype(default)
    load_weights(model, path)
    return model, weakref.ref(model.model.embed_tokens.weight)


def _alive(ptr: int) -> list[torch.Tensor]:
    """Every live tensor whose storage is the one at `ptr`."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance touches deprecated module attributes among the objects
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    # oneDNN's opaque tensors (other tests' engines) and meta tensors have no storage to compare
    plain = (t for t in tensors if t.layout == torch.strided and t.device.type == "cpu")
    return [t for t in plain if t.untyped_storage().data_ptr() == ptr]


def test_the_tied_embedding_leaves_no_second_copy_alive(tied_bf16, panel):
    model, loaded = _loaded(tied_bf16, CPUBackend(torch.device("cpu"), torch.bfloat16, CPUOptions(gemm="panel")))
    ptr = loaded().untyped_storage().data_ptr()
    assert model.lm_head.weight is loaded() and _alive(ptr)
    prepare_weights(model)
    assert loaded() is None and not _alive(ptr)
    embedding = model.model.embed_tokens
    assert embedding.weight is None and model.lm_head.weight is None
    assert embedding.rows == model.lm_head.gemm.rows
    assert "model.embed_tokens.weight" not in dict(model.named_parameters())


def test_onednn_keeps_the_loaded_embedding(tied_bf16):
    """oneDNN's blocked copy does not give rows back."""
    _panel_kernels()
    backend = CPUBackend(torch.device("cpu"), torch.bfloat16, options=CPUOptions(gemm="onednn-fp32"))
    model, loaded = _loaded(tied_bf16, backend)
    before = loaded().clone()
    prepare_weights(model)
    assert model.model.embed_tokens.weight is loaded() and model.model.embed_tokens.rows is None
    assert torch.equal(_bits(model.model.embed_tokens.weight), _bits(before))


def test_an_int8_head_gives_its_quantized_rows_to_the_embedding(tied_bf16):
    """quantization="int8": the loaded vocabulary is released; each row comes back as the head
    multiplies it, q * scale rounded to bf16, within half an int8 step of the loaded row."""
    _panel_kernels()  # int8 needs the same AVX2/FMA build
    model, loaded = _loaded(tied_bf16, CPUBackend(torch.device("cpu"), torch.bfloat16, quantization="int8"))
    before = loaded().float().clone()
    prepare_weights(model)
    embedding = model.model.embed_tokens
    assert embedding.weight is None and embedding.rows is not None
    gc.collect()
    assert loaded() is None  # no copy of the float vocabulary is left
    ids = torch.arange(before.shape[0])
    rows = embedding(ids)
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, model.lm_head.gemm.rows(ids).bfloat16())
    step = before.abs().amax(dim=1, keepdim=True) / 127
    assert ((rows.float() - before).abs() <= step / 2 + before.abs() / 256 + 1e-7).all()  # + bf16's rounding


def test_an_untied_model_keeps_its_embedding(untied_twin, panel):
    model, loaded = _loaded(untied_twin, CPUBackend(torch.device("cpu"), torch.bfloat16, CPUOptions(gemm="panel")))
    prepare_weights(model)
    assert model.model.embed_tokens.weight is loaded() and model.model.embed_tokens.rows is None
    assert model.lm_head.weight is None


def _generate(path: str, prompts: list[list[int]]):
    llm = make_llm(path, device="cpu", dtype="bfloat16")
    assert llm.engine.model_runner.backend.describe()["gemm"] == "panel"
    return llm.engine.model_runner.model, llm.generate(prompts, GREEDY, use_tqdm=False)


def test_shared_rows_give_hf_tokens_and_the_untied_twin_logprobs(tied_bf16, untied_twin, hf, panel):
    prompts = random_prompts(4, 4, 40, seed=8)
    model, outs = _generate(tied_bf16, prompts)
    assert model.model.embed_tokens.weight is None  # the rows come from the panels
    whole = 0
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.outputs[0].token_ids
        ref, gaps = hf.greedy_with_gaps(tied_bf16, prompt, MAX_TOKENS, torch.bfloat16)
        step = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        # HF rounds its logits to bf16: a top-2 gap of one step there is a tie it broke its way.
        assert step is None or gaps[step] <= HF_BF16_TIE, f"left HF at step {step} (gap {gaps[step]})"
        whole += step is None
    assert whole >= 3
    twin, refs = _generate(untied_twin, prompts)
    assert twin.model.embed_tokens.weight is not None
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def test_a_gptq_checkpoint_shares_its_float_embedding(tied_bf16, untied_twin, panel, tmp_path):
    """The packer leaves the embedding (and an untied lm_head) in bf16: the same quantized layers
    with a shared or a separate vocabulary matrix give the same logprobs."""
    tied, untied = str(tmp_path / "tied"), str(tmp_path / "untied")
    write_quantized_checkpoint(tied_bf16, tied, "gptq", group_size=32)
    write_quantized_checkpoint(untied_twin, untied, "gptq", group_size=32)
    prompts = random_prompts(2, 4, 12, seed=9)
    model, outs = _generate(tied, prompts)
    assert model.model.embed_tokens.weight is None and model.model.embed_tokens.rows == model.lm_head.gemm.rows
    _, refs = _generate(untied, prompts)
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def test_tensor_parallel_ranks_share_their_shards(tied_bf16, untied_twin, panel):
    """TP=2: each rank's embedding shard is its LM-head shard (vocab 1000: 500 rows each)."""
    prompts = random_prompts(2, 4, 12, seed=10)
    outputs = []
    for path in (tied_bf16, untied_twin):
        with make_llm(path, device="cpu", dtype="bfloat16", tensor_parallel_size=2, num_kvcache_blocks=64) as llm:
            assert llm.engine.model_runner.backend.describe()["gemm"] == "panel"
            outputs.append(llm.generate(prompts, GREEDY, use_tqdm=False))
    for out, ref in zip(*outputs, strict=True):
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs

"""A small Qwen3 trained for a few minutes on local text: the accuracy gate's realistic checkpoint.

Random weights make a poor judge of quantization: their next-token distributions are flat (the
top token is the maximum of a Gaussian, a hair above the next), so any rounding flips them, and
nothing about them resembles what a trained model predicts. This one is trained (AdamW, a few
minutes on two cores) on the Python standard library's sources, which every machine with Python
has, until its held-out predictions look like a language model's (mean top-1 probability ~0.4).
It is trained *with* the outlier statistics of bench/accuracy.py (large RMSNorm gains on a few
hidden channels, a per-output-channel weight-scale spread) from the first step, so the weights
learn to live with their outlier channels as trained LLaMA/Qwen-class models do, rather than
having outliers bolted on after training. The last HELDOUT_FRACTION of the token stream is never
trained on; `heldout_windows` cuts the gate's prompts and teacher tokens from it.
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import sysconfig

import torch

from nanoserve.bench.accuracy import CHANNEL_SPREAD, OUTLIER_CHANNELS, OUTLIER_GAINS, with_outlier_statistics
from nanoserve.utils import tiny_checkpoint
from nanoserve.utils.tiny_checkpoint import build_cached, build_tiny_checkpoint

TRAINED_SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024}
TRAIN_STEPS = 1200  # ~6 min on 2 Zen 5 cores; held-out mean top-1 probability ~0.4, NLL ~2.7 nats a token
BATCH, SEQ_LEN = 16, 128
PEAK_LR, WARMUP_STEPS = 3e-3, 30  # linear warmup, times a cosine decay to zero over all steps
ADAM_BETAS, GRAD_CLIP = (0.9, 0.95), 1.0
CORPUS_CHARS = 1_500_000
MIN_CORPUS_CHARS = 200_000  # below this a build would be a different, much weaker model
HELDOUT_FRACTION = 0.05
HELDOUT_FILE = "heldout_tokens.json"
TRAINED_FORMAT_VERSION = 1  # bump when the training recipe changes in a way the fingerprint cannot see


def corpus_text(chars: int = CORPUS_CHARS) -> str:
    """The first `chars` characters of the standard library's top-level modules, in name order."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    parts, total = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
        total += len(parts[-1])
        if total >= chars:
            break
    if total < MIN_CORPUS_CHARS:
        raise ValueError(f"the standard library's sources under {sysconfig.get_paths()['stdlib']} hold {total} "
                         f"characters; the trained checkpoint needs >= {MIN_CORPUS_CHARS}")
    return "".join(parts)[:chars]


def ensure_trained_checkpoint(steps: int = TRAIN_STEPS, seed: int = 0, **shape) -> str:
    """The trained checkpoint (TRAINED_SHAPE, overridable), built once into the cache and reused."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    shape = {**TRAINED_SHAPE, **shape}
    # The corpus is the running Python's standard library: its hash keeps one build per version.
    corpus = hashlib.sha256(corpus_text().encode()).hexdigest()
    recipe = {"version": TRAINED_FORMAT_VERSION, "tiny_format": tiny_checkpoint.FORMAT_VERSION, "steps": steps,
              "seed": seed, "shape": shape, "batch": BATCH, "seq_len": SEQ_LEN, "lr": PEAK_LR,
              "warmup": WARMUP_STEPS, "betas": ADAM_BETAS, "clip": GRAD_CLIP, "heldout": HELDOUT_FRACTION,
              "corpus_sha256": corpus, "outliers": [OUTLIER_CHANNELS, OUTLIER_GAINS, CHANNEL_SPREAD]}
    fingerprint = json.loads(json.dumps(recipe, sort_keys=True))  # tuples as the JSON on disk reads back
    tag = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    name = f"qwen3-trained-h{shape['hidden_size']}-l{shape['num_hidden_layers']}-s{steps}-{tag}"
    return build_cached(name, fingerprint, lambda tmp: train_checkpoint(tmp, steps, seed, **shape))


def train_checkpoint(path: str, steps: int, seed: int = 0, **shape) -> str:
    """Write a random Qwen3 of `shape` into `path` (tokenizer, config), give it the outlier statistics,
    train it `steps` steps on corpus_text() and save its weights in bf16 with the held-out tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow to import; only a build needs it

    build_tiny_checkpoint(path, "qwen3", seed, "bfloat16", **shape)
    with open(os.path.join(path, "config.json")) as f:
        config_text = f.read()  # save_pretrained rewrites it; the builder's version is kept
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = 1 << 30  # the corpus is tokenized as one stream, never fed whole
    ids = torch.tensor(tokenizer(corpus_text())["input_ids"])
    split = int(len(ids) * (1 - HELDOUT_FRACTION))
    train_ids, heldout = ids[:split], ids[split:]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = with_outlier_statistics(model.state_dict(), shape["hidden_size"], seed)
    model.load_state_dict(state)
    _train(model, train_ids, steps, torch.Generator().manual_seed(seed))

    model.to(torch.bfloat16).save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(config_text)
    with open(os.path.join(path, HELDOUT_FILE), "w") as f:
        json.dump(heldout.tolist(), f)
    return path


def _train(model: torch.nn.Module, ids: torch.Tensor, steps: int, g: torch.Generator) -> None:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=ADAM_BETAS, weight_decay=0.0)
    for step in range(steps):
        lr = PEAK_LR * min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(ids) - SEQ_LEN, (BATCH,), generator=g)
        batch = torch.stack([ids[s: s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
    model.eval()


def heldout_windows(path: str, num: int, prompt_len: int, teacher_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """`num` evenly spaced windows of the held-out tokens: each a prompt and the text's next tokens."""
    for field, value in (("num", num), ("prompt_len", prompt_len), ("teacher_len", teacher_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"heldout_windows: {field} must be an int >= 1, got {value!r}")
    with open(os.path.join(path, HELDOUT_FILE)) as f:
        heldout = json.load(f)
    window = prompt_len + teacher_len
    if num * window > len(heldout):
        raise ValueError(f"{num} windows of {window} tokens do not fit in the {len(heldout)} held-out tokens")
    stride = len(heldout) // num
    starts = [i * stride for i in range(num)]
    return ([heldout[s: s + prompt_len] for s in starts],
            [heldout[s + prompt_len: s + window] for s in starts])

"""lm-evaluation-harness on nanoserve: `NanoserveLM`, registered as model "nanoserve".

    lm_eval.simple_evaluate(model=NanoserveLM(pretrained=path, dtype="float32"), tasks=[...])
    python -m nanoserve.integrations.lm_eval run --model nanoserve --model_args pretrained=PATH --tasks hellaswag

(the `lm_eval` command imports no third-party model; this module registers ours, then runs lm-eval's
own CLI with the same arguments). Tokenization is TemplateLM's, the same as lm-eval's `hf` model
(context and continuation encoded together, then split), so scores compare one for one.

Scoring: each (context, continuation) is one request over context + continuation with
`prompt_logprobs=0` and `prompt_logprobs_start=len(context)`: only the continuation's positions are
scored, so the context's blocks are served by the prefix cache, and all of a task's requests go
to the engine at once so the choices of one question share their context's K/V.
"""
from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's `hf` default


@register_model("nanoserve")
class NanoserveLM(TemplateLM):
    def __init__(
        self,
        pretrained: str,
        max_length: int | None = None,
        add_bos_token: bool = False,
        prefix_token_id: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        batch_size: Any = None,  # lm-eval passes it; every request goes to the engine at once anyway
        device: str = "cpu",
        **engine_kwargs: Any,
    ) -> None:
        super().__init__()
        if max_length is not None:
            engine_kwargs.setdefault("max_model_len", int(max_length))
        self.llm = LLM(pretrained, device=device, **engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.max_gen_toks = max_gen_toks

    # ---- what TemplateLM asks ----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """As lm-eval's `hf`: the given id, else BOS, else EOS (the context of an empty context)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.llm.engine.config.max_model_len

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token  # lm-eval's `hf` default for causal models
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each continuation token was the argmax)."""
        prompts, params = [], []
        for _, context_enc, continuation_enc in requests:
            tokens = (context_enc + continuation_enc)[-self.max_length :]  # left-truncate the context
            prompts.append({"prompt_token_ids": tokens})
            params.append(SamplingParams(
                temperature=0.0, max_tokens=1, detokenize=False,
                prompt_logprobs=0, prompt_logprobs_start=len(tokens) - len(continuation_enc),
            ))
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        results = []
        for (cache_key, _, continuation_enc), out in zip(requests, outputs, strict=True):
            tokens = out.prompt_token_ids
            scored = out.prompt_logprobs[len(tokens) - len(continuation_enc) :]
            entries = [entry[token] for token, entry in zip(continuation_enc, scored, strict=True)]
            answer = (sum(e.logprob for e in entries), all(e.rank == 1 for e in entries))
            results.append(answer)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity-style scores: each text in disjoint windows of at most max_length tokens."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1, context_len=1,
            )):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id])
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            tokens = self.tok_encode(context)[-(self.max_length - max_gen_toks) :]
            prompts.append({"prompt_token_ids": tokens})
            params.append(SamplingParams(temperature=temperature, max_tokens=max_gen_toks, stop=until))
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = [out.outputs[0].text for out in outputs]
        for req, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts


def main() -> None:
    """lm-eval's own CLI, with model "nanoserve" registered (this module's import did it)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()

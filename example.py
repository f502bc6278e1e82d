"""Generate with nanoserve.

    python example.py                          # a tiny random-weight Qwen3 built locally (text is noise)
    python example.py --model ~/Qwen3-0.6B     # a real checkpoint directory
"""
import argparse

from nanoserve import LLM, SamplingParams
from nanoserve.utils.tiny_checkpoint import ensure_tiny_qwen3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF-format Qwen3 checkpoint directory (default: a tiny random demo model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()

    model = args.model
    if model is None:
        model = ensure_tiny_qwen3()
        print(f"Using the tiny demo model at {model}.")
        print("Its weights are random: the text below is meaningless, only the machinery is real.\n")

    llm = LLM(model, device=args.device, dtype=args.dtype, max_model_len=1024)
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seed=0)
    conversations = [
        [{"role": "user", "content": "Introduce yourself in one sentence."}],
        [{"role": "user", "content": "List three prime numbers."}],
    ]
    outputs = llm.chat(conversations, params, chat_template_kwargs={"enable_thinking": False})
    outputs += llm.generate(["The quick brown fox"], params)
    for out in outputs:
        print(f"prompt: {out.prompt!r}")
        print(f"output: {out.outputs[0].text!r}  ({len(out.outputs[0].token_ids)} tokens, "
              f"finish_reason={out.outputs[0].finish_reason})\n")


if __name__ == "__main__":
    main()

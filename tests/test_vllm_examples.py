"""vLLM's other offline examples, in miniature, run with only the import changed.

test_vllm_compat.py runs examples/offline_inference/basic/{basic,generate,chat}.py; here are the
examples for the other features nanoserve has: structured outputs (both API generations),
prefix caching, embeddings (basic/embed.py, Matryoshka, Qwen3-Embedding's instruct-style
snippet), classification (basic/classify.py), the argparse-driven basic scripts (EngineArgs.add_cli_args), llm_engine_example.py
(LLMEngine, logprobs, prompt_logprobs), reproducibility.py, the Ray Data predictor of
distributed.py and the openai_batch/ file.

Each test copies the example's code as vLLM writes it, `vllm` replaced by `nanoserve` in the
imports; what the miniature changes is said where it happens: a tiny local random checkpoint for
the hub model id, fewer prompts or tokens, a flag on the "command line" the script parses.
Then it asserts what the example claims or prints: constrained text matches its constraint,
cached greedy text equals uncached greedy text, vectors have the right size, unit norm and equal
a plain transformers forward pass.
"""
from __future__ import annotations

import os
import random
import re
from enum import Enum

import pytest
import regex
import torch
from pydantic import BaseModel

from nanoserve import LLM, EngineArgs, PoolingParams, SamplingParams
from nanoserve.utils.tiny_embedding import build_tiny_embedding_checkpoint


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory) -> str:
    # Qwen3-Embedding's layout (last-token pooling, normalised), Matryoshka enabled.
    return build_tiny_embedding_checkpoint(tmp_path_factory.mktemp("embed") / "qwen3-embedding", seed=7)


def hf_last_token_embeddings(path: str, texts: list[str]) -> torch.Tensor:
    """The reference: transformers' own model, the last token's hidden state, unit length."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")
            rows.append(model(**ids).last_hidden_state[0, -1])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def prefix_of_a_match(pattern: str, text: str) -> bool:
    """`text` is a whole match of `pattern`, or what a match cut at max_tokens starts with."""
    return regex.fullmatch(pattern, text, partial=True) is not None


# ---- examples/offline_inference/structured_outputs.py -----------------------------------------


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


SQL = r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"
_STRING = r'"(?:[^"\\]|\\.)*"'
# CarDescription as JSON text, keys in the schema's order (the order a constrained sample writes).
CAR_JSON = (rf'\{{\s*"brand"\s*:\s*{_STRING}\s*,\s*"model"\s*:\s*{_STRING}\s*,'
            r'\s*"car_type"\s*:\s*"(?:sedan|SUV|Truck|Coupe)"\s*\}')


def check_structured_outputs(outputs: dict[str, object]) -> None:
    """Each constraint of the example holds: whole where the sample finished, a prefix where it
    ran into max_tokens / max_model_len (a random model wanders inside JSON strings)."""
    choice = outputs["choice"]
    assert choice.text in ("Positive", "Negative") and choice.finish_reason == "stop"
    email = outputs["regex"]
    if email.finish_reason == "stop":
        assert email.stop_reason == "\n" and re.fullmatch(r"\w+@\w+\.com", email.text)
    else:
        assert prefix_of_a_match(r"\w+@\w+\.com\n", email.text), email.text
    car = outputs["json"]
    if car.finish_reason == "stop":
        CarDescription.model_validate_json(car.text)
    else:
        assert prefix_of_a_match(CAR_JSON, car.text), car.text
    sql = outputs["grammar"]
    assert (re.fullmatch(SQL, sql.text) if sql.finish_reason == "stop" else prefix_of_a_match(SQL, sql.text)), sql.text


def test_structured_outputs_example(tiny_model):
    """vLLM >= 0.11 (StructuredOutputsParams, `structured_outputs=`; MAX_TOKENS = 50)."""
    pytest.importorskip("llguidance")
    from nanoserve.sampling_params import StructuredOutputsParams

    MAX_TOKENS = 50

    # Structured outputs by Choice (list of possible options)
    structured_outputs_params_choice = StructuredOutputsParams(
        choice=["Positive", "Negative"]
    )
    sampling_params_choice = SamplingParams(
        structured_outputs=structured_outputs_params_choice
    )
    prompt_choice = "Classify this sentiment: vLLM is wonderful!"

    # Structured outputs by Regex
    structured_outputs_params_regex = StructuredOutputsParams(regex=r"\w+@\w+\.com\n")
    sampling_params_regex = SamplingParams(
        structured_outputs=structured_outputs_params_regex,
        stop=["\n"],
        max_tokens=MAX_TOKENS,
    )
    prompt_regex = (
        "Generate an email address for Alan Turing, who works in Enigma."
        "End in .com and new line. Example result:"
        "alan.turing@enigma.com\n"
    )

    json_schema = CarDescription.model_json_schema()
    structured_outputs_params_json = StructuredOutputsParams(json=json_schema)
    sampling_params_json = SamplingParams(
        structured_outputs=structured_outputs_params_json, max_tokens=MAX_TOKENS
    )
    prompt_json = (
        "Generate a JSON with the brand, model and car_type of "
        "the most iconic car from the 90's"
    )

    # Structured outputs by Grammar
    simplified_sql_grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
    structured_outputs_params_grammar = StructuredOutputsParams(
        grammar=simplified_sql_grammar
    )
    sampling_params_grammar = SamplingParams(
        structured_outputs=structured_outputs_params_grammar,
        max_tokens=MAX_TOKENS,
    )
    prompt_grammar = (
        "Generate an SQL query to show the 'username' and 'email' from the 'users' table."
    )

    def generate_output(prompt: str, sampling_params: SamplingParams, llm: LLM):
        outputs = llm.generate(prompt, sampling_params=sampling_params)
        return outputs[0].outputs[0]  # the example returns `.text`; the test reads finish_reason too

    llm = LLM(model=tiny_model, max_model_len=100)  # was: "Qwen/Qwen2.5-3B-Instruct"
    check_structured_outputs({
        "choice": generate_output(prompt_choice, sampling_params_choice, llm),
        "regex": generate_output(prompt_regex, sampling_params_regex, llm),
        "json": generate_output(prompt_json, sampling_params_json, llm),
        "grammar": generate_output(prompt_grammar, sampling_params_grammar, llm),
    })


def test_guided_decoding_example(tiny_model):
    """vLLM 0.8-0.10 (GuidedDecodingParams, `guided_decoding=`, default max_tokens 16,
    `generate(prompts=..., sampling_params=...)` by keyword)."""
    pytest.importorskip("llguidance")
    from nanoserve.sampling_params import GuidedDecodingParams

    # Guided decoding by Choice (list of possible options)
    guided_decoding_params_choice = GuidedDecodingParams(choice=["Positive", "Negative"])
    sampling_params_choice = SamplingParams(guided_decoding=guided_decoding_params_choice)
    prompt_choice = "Classify this sentiment: vLLM is wonderful!"

    # Guided decoding by Regex
    guided_decoding_params_regex = GuidedDecodingParams(regex=r"\w+@\w+\.com\n")
    sampling_params_regex = SamplingParams(
        guided_decoding=guided_decoding_params_regex, stop=["\n"]
    )
    prompt_regex = (
        "Generate an email address for Alan Turing, who works in Enigma."
        "End in .com and new line. Example result:"
        "alan.turing@enigma.com\n"
    )

    json_schema = CarDescription.model_json_schema()
    guided_decoding_params_json = GuidedDecodingParams(json=json_schema)
    sampling_params_json = SamplingParams(guided_decoding=guided_decoding_params_json)
    prompt_json = (
        "Generate a JSON with the brand, model and car_type of"
        "the most iconic car from the 90's"
    )

    # Guided decoding by Grammar
    simplified_sql_grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
    guided_decoding_params_grammar = GuidedDecodingParams(grammar=simplified_sql_grammar)
    sampling_params_grammar = SamplingParams(guided_decoding=guided_decoding_params_grammar)
    prompt_grammar = (
        "Generate an SQL query to show the 'username' and 'email'from the 'users' table."
    )

    def generate_output(prompt: str, sampling_params: SamplingParams, llm: LLM):
        outputs = llm.generate(prompts=prompt, sampling_params=sampling_params)
        return outputs[0].outputs[0]

    llm = LLM(model=tiny_model, max_model_len=100)
    check_structured_outputs({
        "choice": generate_output(prompt_choice, sampling_params_choice, llm),
        "regex": generate_output(prompt_regex, sampling_params_regex, llm),
        "json": generate_output(prompt_json, sampling_params_json, llm),
        "grammar": generate_output(prompt_grammar, sampling_params_grammar, llm),
    })


# ---- examples/offline_inference/prefix_caching.py, automatic_prefix_caching.py ------------------


def test_prefix_caching_example(tiny_model):
    from nanoserve.distributed import cleanup_dist_env_and_memory

    # Common prefix.
    prefix = (
        "You are an expert school principal, skilled in effectively managing "
        "faculty and staff. Draft 10-15 questions for a potential first grade "
        "Head Teacher for my K-12, all-girls', independent school that emphasizes "
        "community, joyful discovery, and life-long learning. The candidate is "
        "coming in for a first-round panel interview for a 8th grade Math "
        "teaching role. They have 5 years of previous teaching experience "
        "as an assistant teacher at a co-ed, public school with experience "
        "in middle school math teaching. Based on these information, fulfill "
        "the following paragraph: "
    )

    # Sample prompts.
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]

    generating_prompts = [prefix + prompt for prompt in prompts]

    # Create a sampling params object.
    sampling_params = SamplingParams(temperature=0.0)

    # Create an LLM without prefix caching as a baseline.
    regular_llm = LLM(model=tiny_model, gpu_memory_utilization=0.4)  # was: "facebook/opt-125m"

    outputs = regular_llm.generate(generating_prompts, sampling_params)

    regular_generated_texts = []
    for output in outputs:
        regular_generated_texts.append(output.outputs[0].text)

    # Destroy the LLM object and free up the GPU memory.
    del regular_llm
    cleanup_dist_env_and_memory()

    # Create an LLM with prefix caching enabled.
    prefix_cached_llm = LLM(
        model=tiny_model,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.4,
    )

    # Warmup so that the shared prompt's KV cache is computed.
    prefix_cached_llm.generate(generating_prompts[0], sampling_params)

    # Generate with prefix caching.
    outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)

    cached_generated_texts = []
    for output in outputs:
        cached_generated_texts.append(output.outputs[0].text)

    # Compare the results and display the speedup
    generated_same = all(
        regular_generated_texts[i] == cached_generated_texts[i]
        for i in range(len(prompts))
    )
    assert generated_same
    # What the example means to show: the second engine read the shared prefix from the cache
    # (all of its full blocks), and its greedy text is what an engine that caches nothing writes.
    block = prefix_cached_llm.engine.block_size
    prefix_tokens = len(prefix_cached_llm.get_tokenizer().encode(prefix))
    assert all(o.num_cached_tokens >= (prefix_tokens - 1) // block * block > 0 for o in outputs)
    uncached = LLM(model=tiny_model, enable_prefix_caching=False).generate(generating_prompts, sampling_params)
    assert [o.outputs[0].text for o in uncached] == cached_generated_texts
    assert all(o.num_cached_tokens == 0 for o in uncached)


# A prompt containing a large markdown table (the first rows of the example's GPT-4 table).
LONG_PROMPT = (
    "You are a helpful assistant in recognizes the content of tables in markdown format. Here is a table as follows.\n# Table\n"  # noqa: E501
    + """
| ID  | Name          | Age | Occupation    | Country       | Email                  | Phone Number   | Address                       |
|-----|---------------|-----|---------------|---------------|------------------------|----------------|------------------------------|
| 1   | John Doe      | 29  | Engineer      | USA           | john.doe@example.com   | 555-1234       | 123 Elm St, Springfield, IL  |
| 2   | Jane Smith    | 34  | Doctor        | Canada        | jane.smith@example.com | 555-5678       | 456 Oak St, Toronto, ON      |
| 3   | Alice Johnson | 27  | Teacher       | UK            | alice.j@example.com    | 555-8765       | 789 Pine St, London, UK      |
| 28  | Zack Blue     | 30  | Lawyer        | Australia     | zack.b@example.com     | 555-3436       | 135 Birch St, Adelaide, SA   |
"""  # noqa: E501
)


def test_automatic_prefix_caching_example(tiny_model, capsys):
    import time

    def get_generation_time(llm, sampling_params, prompts):
        # time the generation
        start_time = time.time()
        output = llm.generate(prompts, sampling_params=sampling_params)
        end_time = time.time()
        # print the output and generation time
        print("-" * 30)
        print(f"Output: {output[0].outputs[0].text}")
        print(f"Generation time: {end_time - start_time} seconds.")
        print("-" * 30)

    # set enable_prefix_caching=True to enable APC
    llm = LLM(model=tiny_model, enable_prefix_caching=True)  # was: "lmsys/longchat-13b-16k"

    sampling_params = SamplingParams(temperature=0, max_tokens=100)

    # Querying the age of John Doe
    john = LONG_PROMPT + "Question: what is the age of John Doe? Your answer: The age of John Doe is "
    get_generation_time(llm, sampling_params, john)
    # Querying the age of Zack Blue
    # This query will be faster since vllm avoids computing the KV cache of LONG_PROMPT again.
    zack = LONG_PROMPT + "Question: what is the age of Zack Blue? Your answer: The age of Zack Blue is "
    before = llm.prefix_cache_stats
    get_generation_time(llm, sampling_params, zack)
    after = llm.prefix_cache_stats

    # The second query read LONG_PROMPT's full blocks from the cache, and printed what an engine
    # without a cache generates for it.
    block = llm.engine.block_size
    shared = len(os.path.commonprefix([llm.get_tokenizer().encode(john), llm.get_tokenizer().encode(zack)]))
    assert after["hits"] - before["hits"] == shared // block * block > 0
    printed = re.findall(r"^Output: (.*)$", capsys.readouterr().out, flags=re.M)
    reference = LLM(model=tiny_model, enable_prefix_caching=False)
    want = [reference.generate(p, sampling_params, use_tqdm=False)[0].outputs[0].text for p in (john, zack)]
    assert printed == [w.split("\n")[0] for w in want]  # the regex reads each printed output's first line


# ---- examples/offline_inference/basic/{embed,generate,chat}.py with EngineArgs.add_cli_args --------


def test_embed_example(embedding_model, capsys):
    """basic/embed.py as of vLLM >= 0.11 (runner="pooling", print_embeddings)."""
    from argparse import Namespace

    from nanoserve.utils.argparse_utils import FlexibleArgumentParser
    from nanoserve.utils.print_utils import print_embeddings

    def parse_args(argv):
        parser = FlexibleArgumentParser()
        parser = EngineArgs.add_cli_args(parser)
        # Set example specific arguments
        parser.set_defaults(
            model=embedding_model,  # was: "intfloat/e5-small" (a BERT model nanoserve does not run)
            runner="pooling",
            enforce_eager=True,
        )
        return parser.parse_args(argv)  # the example reads sys.argv

    def main(args: Namespace):
        prompts = [
            "Hello, my name is",
            "The president of the United States is",
            "The capital of France is",
            "The future of AI is",
        ]
        llm = LLM(**vars(args))
        outputs = llm.embed(prompts)
        print("\nGenerated Outputs:\n" + "-" * 60)
        for prompt, output in zip(prompts, outputs):
            embeds = output.outputs.embedding
            print(f"Prompt: {prompt!r}")
            print_embeddings(embeds)
            print("-" * 60)
        return prompts, outputs

    args = parse_args(["--dtype", "float32"])  # as `python embed.py --dtype float32` (exact vs the reference)
    assert vars(args) == {"model": embedding_model, "runner": "pooling", "enforce_eager": True, "dtype": "float32"}
    prompts, outputs = main(args)
    vectors = torch.tensor([o.outputs.embedding for o in outputs])
    reference = hf_last_token_embeddings(embedding_model, prompts)
    assert vectors.shape == reference.shape
    torch.testing.assert_close(vectors, reference, atol=1e-4, rtol=1e-4)
    printed = re.findall(r"^Embeddings: .* \(size=(\d+)\)$", capsys.readouterr().out, flags=re.M)
    assert printed == [str(reference.shape[1])] * len(prompts)


def test_classify_example(tmp_path, capsys):
    """basic/classify.py (vLLM >= 0.11): a Qwen2 sequence classifier through llm.classify."""
    from argparse import Namespace

    from nanoserve.utils.argparse_utils import FlexibleArgumentParser
    from nanoserve.utils.tiny_classifier import build_tiny_classifier_checkpoint

    model = build_tiny_classifier_checkpoint(tmp_path / "apeach", "qwen2", seed=3, num_labels=2)

    def parse_args(argv):
        parser = FlexibleArgumentParser()
        parser = EngineArgs.add_cli_args(parser)
        # Set example specific arguments
        parser.set_defaults(
            model=model,  # was: "jason9693/Qwen2.5-1.5B-apeach" (a Qwen2ForSequenceClassification)
            runner="pooling",
            enforce_eager=True,
        )
        return parser.parse_args(argv)

    def main(args: Namespace):
        prompts = [
            "Hello, my name is",
            "The president of the United States is",
            "The capital of France is",
            "The future of AI is",
        ]
        llm = LLM(**vars(args))
        outputs = llm.classify(prompts)
        print("\nGenerated Outputs:\n" + "-" * 60)
        for prompt, output in zip(prompts, outputs):
            probs = output.outputs.probs
            probs_trimmed = (str(probs[:16])[:-1] + ", ...]" if len(probs) > 16 else probs)
            print(f"Prompt: {prompt!r} \nClass Probabilities: {probs_trimmed} (size={len(probs)})")
            print("-" * 60)
        return prompts, outputs

    prompts, outputs = main(parse_args(["--dtype", "float32"]))
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    with torch.inference_mode():
        expected = [hf(**tokenizer(p, return_tensors="pt")).logits[0].softmax(-1) for p in prompts]
    for output, probs in zip(outputs, expected):
        torch.testing.assert_close(torch.tensor(output.outputs.probs), probs, atol=1e-5, rtol=1e-4)
    assert capsys.readouterr().out.count("(size=2)") == len(prompts)


def test_embed_matryoshka_example(embedding_model):
    """examples/pooling/embed/embed_matryoshka_fy_offline.py (vLLM >= 0.11; embed_matryoshka_fy.py
    before, with task="embed")."""
    from nanoserve.utils.argparse_utils import FlexibleArgumentParser

    def parse_args(argv):
        parser = FlexibleArgumentParser()
        parser = EngineArgs.add_cli_args(parser)
        # Set example specific arguments
        parser.set_defaults(
            model=embedding_model, runner="pooling", trust_remote_code=True  # was: "jinaai/jina-embeddings-v3"
        )
        return parser.parse_args(argv)

    # Sample prompts.
    prompts = [
        "Follow the white rabbit.",  # English
        "Sigue al conejo blanco.",  # Spanish
        "Suis le lapin blanc.",  # French
        "跟着白兔走。",  # Chinese
        "اتبع الأرنب الأبيض.",  # Arabic
        "Folge dem weißen Kaninchen.",  # German
    ]
    llm = LLM(**vars(parse_args(["--dtype=float32"])))
    outputs = llm.embed(prompts, pooling_params=PoolingParams(dimensions=32))

    # Matryoshka: the full vector's first 32 values, re-normalised.
    full = hf_last_token_embeddings(embedding_model, prompts)
    expected = torch.nn.functional.normalize(full[:, :32], dim=-1)
    vectors = torch.tensor([o.outputs.embedding for o in outputs])
    assert vectors.shape == (len(prompts), 32)
    torch.testing.assert_close(vectors, expected, atol=1e-4, rtol=1e-4)


def test_qwen3_embedding_model_card_snippet(embedding_model):
    """The vLLM usage on Qwen3-Embedding's model card (vLLM >= 0.8.5): instruction-prefixed
    queries, plain documents, `task="embed"`, scores as dot products of unit vectors."""

    def get_detailed_instruct(task_description: str, query: str) -> str:
        return f'Instruct: {task_description}\nQuery:{query}'

    # Each query must come with a one-sentence instruction that describes the task
    task = 'Given a web search query, retrieve relevant passages that answer the query'

    queries = [
        get_detailed_instruct(task, 'What is the capital of China?'),
        get_detailed_instruct(task, 'Explain gravity')
    ]
    # No need to add instruction for retrieval documents
    documents = [
        "The capital of China is Beijing.",
        "Gravity is a force that attracts two bodies towards each other. It gives weight to physical objects and "
        "is responsible for the movement of planets around the sun."
    ]
    input_texts = queries + documents

    model = LLM(model=embedding_model, task="embed")  # was: "Qwen/Qwen3-Embedding-8B"

    outputs = model.embed(input_texts)
    embeddings = torch.tensor([o.outputs.embedding for o in outputs])
    scores = (embeddings[:2] @ embeddings[2:].T)

    reference = hf_last_token_embeddings(embedding_model, input_texts)
    assert model.config.runner == "pooling" and embeddings.shape == reference.shape
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(len(input_texts)), atol=1e-5, rtol=0)
    # bf16 (the CPU's default dtype) against the float32 reference: the scores to two decimals.
    torch.testing.assert_close(scores, reference[:2] @ reference[2:].T, atol=2e-2, rtol=0)


def test_generate_example_with_engine_args_on_a_group(tiny_model, capsys):
    """basic/generate.py of vLLM 0.8-0.10: EngineArgs.add_cli_args on an argument group, the
    old `from vllm.utils import FlexibleArgumentParser`; flags as `python generate.py ...`."""
    from nanoserve.utils import FlexibleArgumentParser

    def main(args: dict):
        # Pop arguments not used by LLM
        max_tokens = args.pop("max_tokens")
        temperature = args.pop("temperature")
        top_p = args.pop("top_p")
        top_k = args.pop("top_k")

        # Create an LLM
        llm = LLM(**args)

        # Create a sampling params object
        sampling_params = llm.get_default_sampling_params()
        if max_tokens is not None:
            sampling_params.max_tokens = max_tokens
        if temperature is not None:
            sampling_params.temperature = temperature
        if top_p is not None:
            sampling_params.top_p = top_p
        if top_k is not None:
            sampling_params.top_k = top_k

        prompts = [
            "Hello, my name is",
            "The president of the United States is",
            "The capital of France is",
            "The future of AI is",
        ]
        outputs = llm.generate(prompts, sampling_params)
        # Print the outputs.
        for output in outputs:
            prompt = output.prompt
            generated_text = output.outputs[0].text
            print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
        return llm, prompts, outputs

    parser = FlexibleArgumentParser()
    # Add engine args
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model=tiny_model)  # was: "meta-llama/Llama-3.2-1B-Instruct"
    # Add sampling params
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    argv = ["--max_tokens", "5", "--temperature=0", "--block-size", "8", "--max-model-len", "128",
            "--dtype", "float32", "--no-enable-prefix-caching"]
    args: dict = vars(parser.parse_args(argv))
    llm, prompts, outputs = main(args)

    c = llm.config
    assert (c.kvcache_block_size, c.max_model_len, c.dtype, c.enable_prefix_caching) == (8, 128, "float32", False)
    explicit = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) <= 5 for o in outputs)
    assert capsys.readouterr().out.count("Generated text: ") == len(prompts)


def test_chat_example_with_engine_args(tiny_model, tmp_path):
    """basic/chat.py as of vLLM >= 0.11 (create_parser, --chat-template-path)."""
    from nanoserve.utils.argparse_utils import FlexibleArgumentParser

    def create_parser():
        parser = FlexibleArgumentParser()
        # Add engine args
        EngineArgs.add_cli_args(parser)
        parser.set_defaults(model=tiny_model)  # was: "meta-llama/Llama-3.2-1B-Instruct"
        # Add sampling params
        sampling_group = parser.add_argument_group("Sampling parameters")
        sampling_group.add_argument("--max-tokens", type=int)
        sampling_group.add_argument("--temperature", type=float)
        sampling_group.add_argument("--top-p", type=float)
        sampling_group.add_argument("--top-k", type=int)
        # Add example params
        parser.add_argument("--chat-template-path", type=str)

        return parser

    def main(args: dict):
        # Pop arguments not used by LLM
        max_tokens = args.pop("max_tokens")
        temperature = args.pop("temperature")
        top_p = args.pop("top_p")
        top_k = args.pop("top_k")
        chat_template_path = args.pop("chat_template_path")

        # Create an LLM
        llm = LLM(**args)

        # Create sampling params object
        sampling_params = llm.get_default_sampling_params()
        if max_tokens is not None:
            sampling_params.max_tokens = max_tokens
        if temperature is not None:
            sampling_params.temperature = temperature
        if top_p is not None:
            sampling_params.top_p = top_p
        if top_k is not None:
            sampling_params.top_k = top_k

        results = []
        conversation = [
            {"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hello! How can I assist you today?"},
            {
                "role": "user",
                "content": "Write an essay about the importance of higher education.",
            },
        ]
        outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
        results.append(outputs)

        # You can run batch inference with llm.chat API
        conversations = [conversation for _ in range(10)]

        # We turn on tqdm progress bar to verify it's indeed running batch inference
        outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
        results.append(outputs)

        # A chat template can be optionally supplied.
        # If not, the model will use its default chat template.
        if chat_template_path is not None:
            with open(chat_template_path) as f:
                chat_template = f.read()

            outputs = llm.chat(
                conversations,
                sampling_params,
                use_tqdm=False,
                chat_template=chat_template,
            )
            results.append(outputs)
        return results

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    parser = create_parser()
    argv = ["--max-tokens", "4", "--temperature", "0", "--chat-template-path", str(template), "--max-model-len", "256"]
    one, batch, templated = main(vars(parser.parse_args(argv)))
    texts = [o.outputs[0].text for o in batch]
    assert len(one) == 1 and len(batch) == 10 and texts == [one[0].outputs[0].text] * 10  # greedy: one answer
    assert all(o.prompt.startswith("<system>You are a helpful assistant\n") for o in templated)
    assert templated[0].prompt.endswith("higher education.\n<assistant>")
    assert all(len(o.outputs[0].token_ids) <= 4 for o in one + batch + templated)


def test_flexible_argument_parser_takes_both_spellings():
    from nanoserve.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    dashed = vars(parser.parse_args(["--model", "m", "--max-num-seqs", "3", "--enable-prefix-caching"]))
    underscored = vars(parser.parse_args(["--model=m", "--max_num_seqs=3", "--enable_prefix_caching"]))
    assert dashed == underscored == {"model": "m", "max_num_seqs": 3, "enable_prefix_caching": True}
    assert vars(parser.parse_args(["--task", "embed", "--trust-remote-code", "--no-enforce-eager"])) == {
        "task": "embed", "trust_remote_code": True, "enforce_eager": False}
    with pytest.raises(SystemExit):  # an unknown flag is argparse's usage error, as in vLLM
        parser.parse_args(["--max-num-sequences", "3"])
    # Every flag is a keyword LLM takes, and each of vLLM's other names for a Config field has one.
    from nanoserve.arg_utils import _VLLM_ONLY_FLAGS
    from nanoserve.config import Config
    from nanoserve.engine_args import RENAMED, RUNNER_ALIASES, valid_names

    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests <= valid_names() | {"model"}
    assert dests >= Config.field_names() | set(RENAMED) | set(RUNNER_ALIASES) | {"model"}
    assert not set(_VLLM_ONLY_FLAGS) & Config.field_names()


# ---- examples/offline_inference/reproducibility.py ---------------------------------------------


def test_reproducibility_example(tiny_model):
    # V1 only: Turn off multiprocessing to make the scheduling deterministic.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # no effect on nanoserve (one process)

    # V0 only: Set the global seed. The default seed is None, which is
    # not reproducible.
    SEED = 42

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

    def main():
        llm = LLM(model=tiny_model, seed=SEED)  # was: "facebook/opt-125m"
        outputs = llm.generate(prompts, sampling_params)
        return [output.outputs[0].text for output in outputs]

    try:
        state = random.getstate()
        first, second = main(), main()
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert first == second  # the same seed, the same samples
    SEED = 43
    assert main() != first  # and the seed is what decides them
    # Unlike vLLM (whose example prints a random number to show it moved the user's random state),
    # nanoserve leaves the global random state alone: its seeds are its own.
    assert random.getstate() == state


# ---- examples/offline_inference/openai_batch/ --------------------------------------------------

OPENAI_EXAMPLE_BATCH = [  # openai_example_batch.jsonl, one dict per line
    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "meta-llama/Meta-Llama-3-8B-Instruct",
              "messages": [{"role": "system", "content": "You are a helpful assistant."},
                           {"role": "user", "content": "Hello world!"}], "max_completion_tokens": 1000}},
    {"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "meta-llama/Meta-Llama-3-8B-Instruct",
              "messages": [{"role": "system", "content": "You are an unhelpful assistant."},
                           {"role": "user", "content": "Hello world!"}], "max_completion_tokens": 1000}},
]


def test_openai_batch_example(tiny_model, tmp_path):
    """`python -m vllm.entrypoints.openai.run_batch -i openai_example_batch.jsonl -o results.jsonl
    --model ...` is `nanoserve run-batch` with the same flags; the file's model id becomes the tiny
    checkpoint's path and max_completion_tokens 1000 becomes 8."""
    import json

    from transformers import AutoTokenizer

    from nanoserve.cli import main

    requests = tmp_path / "openai_example_batch.jsonl"
    lines = json.loads(json.dumps(OPENAI_EXAMPLE_BATCH))
    for line in lines:
        line["body"].update(model=tiny_model, max_completion_tokens=8)
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = tmp_path / "results.jsonl"
    assert main(["run-batch", "-i", str(requests), "-o", str(results), "--model", tiny_model,
                 "--max-model-len", "256", "--no-progress-bar"]) == 0

    records = sorted((json.loads(r) for r in results.read_text().splitlines()), key=lambda r: r["custom_id"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert [r["custom_id"] for r in records] == ["request-1", "request-2"]
    for line, record in zip(lines, records):
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        text = tokenizer.apply_chat_template(line["body"]["messages"], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        choice = body["choices"][0]
        assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert 1 <= body["usage"]["completion_tokens"] <= 8
        assert choice["finish_reason"] == "length" or body["usage"]["completion_tokens"] < 8


# ---- examples/offline_inference/llm_engine_example.py ------------------------------------------


def test_llm_engine_example(tiny_model, hf, capsys):
    """LLMEngine driven by hand, with logprobs and prompt_logprobs (vLLM >= 0.8's version); run as
    `python llm_engine_example.py --model TINY --dtype float32` (float32: compared with HF)."""
    import argparse

    from nanoserve import LLMEngine, RequestOutput
    from nanoserve.utils import FlexibleArgumentParser

    def create_test_prompts() -> list[tuple[str, SamplingParams]]:
        """Create a list of test prompts with their sampling parameters."""
        return [
            (
                "A robot may not injure a human being",
                SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1),
            ),
            (
                "To be or not to be,",
                SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2),
            ),
            (
                "What is the meaning of life?",
                SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1),
            ),
        ]

    seen: list[RequestOutput] = []  # the test's: every output step() returned

    def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
        """Continuously process a list of prompts and handle the outputs."""
        request_id = 0

        print("-" * 50)
        while test_prompts or engine.has_unfinished_requests():
            if test_prompts:
                prompt, sampling_params = test_prompts.pop(0)
                engine.add_request(str(request_id), prompt, sampling_params)
                request_id += 1

            request_outputs: list[RequestOutput] = engine.step()
            seen.extend(request_outputs)

            for request_output in request_outputs:
                if request_output.finished:
                    print(request_output)
                    print("-" * 50)

    def initialize_engine(args: argparse.Namespace) -> LLMEngine:
        """Initialize the LLMEngine from the command line arguments."""
        engine_args = EngineArgs.from_cli_args(args)
        return LLMEngine.from_engine_args(engine_args)

    def parse_args(argv):
        parser = FlexibleArgumentParser(
            description="Demo on using the LLMEngine class directly"
        )
        parser = EngineArgs.add_cli_args(parser)
        return parser.parse_args(argv)

    args = parse_args(["--model", tiny_model, "--dtype", "float32", "--max-model-len", "128"])
    engine = initialize_engine(args)
    process_requests(engine, create_test_prompts())

    finished = {o.request_id: o for o in seen if o.finished}
    assert sorted(finished) == ["0", "1", "2"] and not engine.has_unfinished_requests()
    assert capsys.readouterr().out.count("RequestOutput(request_id=") == 3
    assert [len(finished[i].outputs) for i in "012"] == [1, 1, 2]
    # Running requests came back each step with their output so far (vLLM's cumulative outputs).
    for request_id, done in finished.items():  # one a step, from the first token to the one before the last
        running = sum(o.request_id == request_id and not o.finished for o in seen)
        assert running == max(len(c.token_ids) for c in done.outputs) - 1 > 0
    for o in seen:
        if not o.finished:
            final = finished[o.request_id].outputs
            assert all(final[c.index].token_ids[: len(c.token_ids)] == c.token_ids for c in o.outputs)
    # Request 0: greedy, with the sampled token's and the prompt tokens' logprobs: HF's.
    greedy = finished["0"]
    prompt, sample = greedy.prompt_token_ids, greedy.outputs[0]
    assert sample.token_ids == hf.greedy(tiny_model, prompt, len(sample.token_ids))
    reference = hf.logprobs(tiny_model, prompt, sample.token_ids)
    for i, (token, step) in enumerate(zip(sample.token_ids, sample.logprobs)):
        assert step[token].rank == 1 and step[token].logprob == pytest.approx(float(reference[i, token]), abs=1e-4)
    prompt_reference = hf.logprobs(tiny_model, prompt[:1], prompt[1:])
    assert greedy.prompt_logprobs[0] is None and len(greedy.prompt_logprobs) == len(prompt)
    for i, (token, step) in enumerate(zip(prompt[1:], greedy.prompt_logprobs[1:])):
        assert step[token].logprob == pytest.approx(float(prompt_reference[i, token]), abs=1e-4)


def test_llm_engine_request_ids_abort_and_refusals(tiny_model):
    from nanoserve import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model, dtype="float32", max_model_len=128))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", "Hello", params)
    engine.add_request("b", [5, 6, 7], params)
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.add_request("a", "Hello", params)
    with pytest.raises(ValueError, match="lora_request"):
        engine.add_request("c", "Hello", params, lora_request=object())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("c", "Hello", SamplingParams(max_tokens=0))
    engine.abort_request("a")
    assert engine.get_num_unfinished_requests() == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"b"} and outputs[-1].finished
    want = LLM(tiny_model, dtype="float32", max_model_len=128).generate({"prompt_token_ids": [5, 6, 7]}, params)
    assert outputs[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert engine.reset_prefix_cache() is True
    engine.add_request("a", "Hello", params)  # a finished or aborted id may be used again
    assert engine.has_unfinished_requests()
    # vLLM's llm_engine_reset_kv.py resets with a request running; nanoserve does not preempt for it.
    assert engine.reset_prefix_cache() is False
    with pytest.raises(ValueError, match="reset_running_requests"):
        engine.reset_prefix_cache(reset_running_requests=True)
    with pytest.raises(ValueError, match="EngineArgs.model"):
        LLMEngine.from_engine_args(EngineArgs(dtype="float32"))
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs(model=tiny_model, max_num_seq=3)


def test_llm_engine_step_failing_after_the_model_run_drops_every_request(tiny_model, monkeypatch):
    from helpers import assert_no_leak

    from nanoserve import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model, dtype="float32", max_model_len=128))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)

    def broken(*args):
        raise RuntimeError("stop check failed")

    monkeypatch.setattr(engine.engine, "_check_stop", broken)  # fails after the tokens are sampled
    with pytest.raises(RuntimeError, match="stop check failed"):
        engine.step()
    monkeypatch.undo()
    assert not engine.has_unfinished_requests() and not engine.engine.requests
    assert_no_leak(engine)  # every block free or only cached
    engine.add_request("a", [5, 6, 7], params)  # the id is free again, the engine usable
    while engine.has_unfinished_requests():
        engine.step()


def test_llm_engine_embeds(embedding_model):
    from nanoserve import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=embedding_model, runner="pooling", dtype="float32"))
    texts = ["Follow the white rabbit.", "Folge dem weißen Kaninchen."]
    for i, text in enumerate(texts):
        engine.add_request(f"doc-{i}", text, PoolingParams())
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted(o.request_id for o in outputs) == ["doc-0", "doc-1"] and all(o.finished for o in outputs)
    vectors = torch.stack([o.outputs.data for o in sorted(outputs, key=lambda o: o.request_id)])
    torch.testing.assert_close(vectors, hf_last_token_embeddings(embedding_model, texts), atol=1e-4, rtol=1e-4)


# ---- examples/offline_inference/distributed.py (Ray Data, vLLM 0.6-0.8) ------------------------


def test_ray_data_distributed_example_predictor(tiny_model):
    """The example defines its own LLMPredictor around `LLM`; Ray Data calls it with each batch as
    a dict of numpy columns (`batch["text"]` an array of str), which is what this test does.
    Starting Ray around it (read_text, map_batches(..., concurrency=1), take) gave the same rows,
    but takes ~20 s; tests/test_ray.py covers Ray itself with nanoserve's own predictor."""
    from typing import Dict  # noqa: UP035 (the example's spelling)

    import numpy as np

    # Create a sampling params object.
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

    # Set tensor parallelism per instance.
    tensor_parallel_size = 1

    # Create a class to do batch inference.
    class LLMPredictor:

        def __init__(self):
            # Create an LLM.
            self.llm = LLM(model=tiny_model,  # was: "meta-llama/Llama-2-7b-chat-hf"
                           tensor_parallel_size=tensor_parallel_size)

        def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, list]:
            # Generate texts from the prompts.
            # The output is a list of RequestOutput objects that contain the prompt,
            # generated text, and other information.
            outputs = self.llm.generate(batch["text"], sampling_params)
            prompt: list[str] = []
            generated_text: list[str] = []
            for output in outputs:
                prompt.append(output.prompt)
                generated_text.append(' '.join([o.text for o in output.outputs]))
            return {
                "prompt": prompt,
                "generated_text": generated_text,
            }

    lines = ["Hello, my name is", "The president of the United States is", "The capital of France is"]
    for column in (np.array(lines), np.array(lines, dtype=object)):  # Arrow strings / pandas objects
        result = LLMPredictor()({"text": column})
        # A fresh engine (seed 0) draws the same per-request seeds for the same list.
        want = LLM(model=tiny_model).generate(lines, sampling_params, use_tqdm=False)
        assert result == {"prompt": lines, "generated_text": [w.outputs[0].text for w in want]}

"""Conversations -> prompt text through a chat template, with the options of vLLM's `LLM.chat`."""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import TemplateError

CONTENT_FORMATS = ("auto", "string", "openai")


def render_conversations(
    tokenizer,
    messages: Sequence[dict] | Sequence[Sequence[dict]],
    *,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[str]:
    """One prompt text per conversation; every check runs before any template is rendered.

    As in vLLM, `chat_template_kwargs` are passed to the template last, so they override the
    named options. `chat_template_content_format="auto"` picks as vLLM does: "openai" (content as
    a list of text parts) when the template loops over a message's content, else "string".
    """
    conversations = as_conversations(messages)
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a Jinja template string or None, got {type(chat_template).__name__}")
    if chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {chat_template_content_format!r}"
        )
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TypeError("tools must be a list of dicts (OpenAI-style tool schemas) or None")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(chat_template_kwargs).__name__}")
    options = dict(
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
    )
    options.update(chat_template_kwargs or {})
    if "tokenize" in options:
        raise ValueError("chat_template_kwargs must not set 'tokenize': chat() renders text, then tokenizes it")
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise ValueError(
            "continue_final_message=True continues the last message, add_generation_prompt=True starts a new one: "
            "pass add_generation_prompt=False with continue_final_message=True"
        )
    fmt = chat_template_content_format
    if fmt == "auto":
        fmt = detect_content_format(_template_text(tokenizer, options["chat_template"], options["tools"]))
    normalised = [[_message(m, fmt, c, i) for i, m in enumerate(conv)] for c, conv in enumerate(conversations)]
    try:
        return [tokenizer.apply_chat_template(conv, tokenize=False, **options) for conv in normalised]
    except TemplateError as e:  # e.g. the template's own raise_exception on a bad conversation
        raise ValueError(f"the chat template rejected the conversation: {e}") from None


def as_conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them -> a list of conversations."""
    shape = "a non-empty list of {'role', 'content'} dicts, or a list of such lists"
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be {shape}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for c, conv in enumerate(conversations):
        if isinstance(conv, (str, bytes, dict)) or not isinstance(conv, Sequence) or not conv:
            raise ValueError(f"conversation {c} must be a non-empty list of message dicts; messages must be {shape}")
        for i, message in enumerate(conv):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"conversation {c}, message {i} must be a dict with a str 'role', got {message!r}")
    return [list(conv) for conv in conversations]


def _message(message: dict, fmt: str, c: int, i: int) -> dict:
    content = message.get("content")
    if content is None:
        return message  # e.g. an assistant turn that only holds tool_calls
    if isinstance(content, str):
        texts = [content]
    elif isinstance(content, Sequence):
        texts = [_text_part(part, c, i) for part in content]
    else:
        raise TypeError(f"conversation {c}, message {i}: content must be a str or a list of text parts")
    if fmt == "openai":
        content = [{"type": "text", "text": t} for t in texts]
    else:
        content = "\n".join(texts)  # vLLM's "string" format joins text parts with newlines
    return {**message, "content": content}


def _text_part(part, c: int, i: int) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(
        f"conversation {c}, message {i}: content part of type {kind!r} is not supported; only text parts "
        "({'type': 'text', 'text': ...}) are: nanoserve has no multimodal input"
    )


def _template_text(tokenizer, chat_template: str | None, tools) -> str | None:
    """The template apply_chat_template will render; None when there is none (it then raises)."""
    try:
        return tokenizer.get_chat_template(chat_template, tools=tools)
    except (ValueError, TypeError, AttributeError):
        return None


@lru_cache(maxsize=32)  # parsing a template costs milliseconds; run-batch renders one per line
def detect_content_format(template: str | None) -> str:
    """vLLM's "auto" content format: "openai" if the template iterates over some message's
    `content` (`{% for part in message['content'] %}`), as templates that expect a list of parts
    do; "string" otherwise, or when the template does not parse."""
    if template is None:
        return "string"
    try:
        ast = _parse(template)
    except TemplateError:
        return "string"
    loops = list(ast.find_all(nodes.For))
    message_names = {loop.target.name for loop in loops
                     if isinstance(loop.target, nodes.Name) and _reads(loop.iter, _aliases(ast, "messages"))}
    return "openai" if any(_reads(loop.iter, message_names, "content") for loop in loops) else "string"


def _parse(template: str) -> nodes.Template:
    try:  # the environment transformers renders with knows its extra tags ({% generation %})
        from transformers.utils.chat_template_utils import _compile_jinja_template
        environment = _compile_jinja_template(template).environment
    except ImportError:
        environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return environment.parse(template)


def _aliases(ast: nodes.Template, name: str) -> set[str]:
    """`name` and every variable set from it (`{% set msgs = messages[1:] %}`), transitively."""
    names, grew = {name}, True
    while grew:
        grew = False
        for assign in ast.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and assign.target.name not in names and _reads(assign.node, names):
                names.add(assign.target.name)
                grew = True
    return names


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (or its `key` item), possibly sliced, filtered or tested."""
    if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
        return _reads(node.node, names, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, names, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _reads(node.node, names)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _reads(node.node, names)
    return False

"""Chat templates: the server's own settings (`--chat-template`, `--chat-template-kwargs`),
checked once by the launcher so a bad one stops the start-up with its reason instead of
failing every chat request; what a template reads (its variables: the thinking switch,
the reasoning effort); and the messages as each family's template takes them (GPT-OSS's
`thinking`, Mistral's call ids, DeepSeek V3.1's arguments as text)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from ipc.config import json_object_flag
from tokenizer_proc.assistant_parser import SHORT_ID_CHARS, SHORT_ID_LENGTH
from tokenizer_proc.conversation import RESERVED_TEMPLATE_KWARGS


def is_inline(value: str) -> bool:
    """Whether --chat-template's value is the template itself (it holds Jinja syntax)
    rather than a file's path; looked at before any path test (a long template is no
    valid path)."""
    return "{{" in value or "{%" in value


def template_text(value: str) -> str:
    """--chat-template's Jinja text: the value itself if it is a template, else the file
    it names. Raises ValueError when it is neither, or does not parse."""
    import jinja2

    if is_inline(value):
        text = value
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja "
                             "template (no '{{' or '{%')")
        text = path.read_text(encoding="utf-8")
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: line {exc.lineno}: {exc.message}") from None
    return text


def _compile(text: str) -> None:
    """Parse a template as transformers will render it: its own environment (loop
    controls, the `generation` tag of assistant masks), where this transformers has it."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: Jinja's parse with loop controls
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        return
    _compile_jinja_template(text)


def default_template_kwargs(value: str) -> dict[str, Any]:
    """--chat-template-kwargs as a dict: a JSON object of template variables that requests
    may override, none of them one the server sets itself. Raises ValueError otherwise."""
    kwargs = json_object_flag("--chat-template-kwargs", value)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"--chat-template-kwargs may not set {reserved[0]!r}: the server "
                         "sets it")
    return kwargs


# The efforts a template's `reasoning_effort` variable takes (GPT-OSS's harmony).
TEMPLATE_EFFORTS = ("low", "medium", "high")


def thinking_switch(variables: frozenset[str]) -> str | None:
    """The template's variable that turns thinking on and off: enable_thinking (Qwen3's,
    GLM's, ...) or DeepSeek V3.1's `thinking` (one the caller sets, not the template's
    own, nor message.thinking)."""
    for name in ("enable_thinking", "thinking"):
        if name in variables:
            return name
    return None


@functools.lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads and does not set itself (Jinja's own analysis;
    a template Jinja cannot parse alone, e.g. with transformers' `generation` tag: the
    words it holds, a superset)."""
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset(re.findall(r"\w+", source))


# Mistral's templates refuse a call id that is not 9 letters and digits (kiln writes such
# ids for Mistral's calls; a client may send others: OpenAI's, Anthropic's).
_NINE_CHAR_IDS = re.compile(r"length\s*!=\s*9")


def _nine_char_id(call_id: str) -> str:
    """The id itself when it has Mistral's form (assistant_parser.short_call_id's), else
    one of that form drawn from it (the same for a call and the result that names it)."""
    if len(call_id) == SHORT_ID_LENGTH and call_id.isascii() and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode("utf-8")).digest()
    return "".join(SHORT_ID_CHARS[b % len(SHORT_ID_CHARS)] for b in digest[:SHORT_ID_LENGTH])


def _nine_char_ids(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("tool_calls"):
        calls = [{**c, "id": _nine_char_id(c["id"])} if isinstance(c.get("id"), str) else c
                 for c in message["tool_calls"]]
        message = {**message, "tool_calls": calls}
    if isinstance(message.get("tool_call_id"), str):
        message = {**message, "tool_call_id": _nine_char_id(message["tool_call_id"])}
    return message


def text_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each past call's arguments as JSON text (the OpenAI wire form)
    in place of a dict; the same list where no call has dict arguments."""
    def call_text(call: dict[str, Any]) -> dict[str, Any]:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, dict):
            return call
        return {**call, "function": {**function,
                                     "arguments": json.dumps(arguments, ensure_ascii=False)}}

    if not any(isinstance((c.get("function") or {}).get("arguments"), dict)
               for m in messages for c in m.get("tool_calls") or []):
        return messages
    return [{**m, "tool_calls": [call_text(c) for c in m["tool_calls"]]}
            if m.get("tool_calls") else m for m in messages]


# A template that reads an assistant message's reasoning as `thinking` (GPT-OSS's: the
# analysis before a tool call, the one reasoning it renders back), not `reasoning_content`.
_READS_THINKING = re.compile(r"\.thinking\b|['\"]thinking['\"] in \w")


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's reasoning as `thinking` too. Beside a tool call, GPT-OSS's
    template takes one analysis text, from the content or from `thinking`, and refuses a
    message with both (as kiln's own GPT-OSS output is: analysis, a commentary preamble,
    the call): the preamble then joins the reasoning there, no reasoning field left for
    transformers (which copies one into `thinking`) to bring back."""
    reasoning = message.get("reasoning_content") or message.get("thinking")
    if message.get("role") != "assistant" or not reasoning:
        return message
    content = message.get("content")
    if content and isinstance(content, str) and message.get("tool_calls"):
        kept = {k: v for k, v in message.items()
                if k not in ("reasoning_content", "reasoning", "thinking")}
        return {**kept, "content": "", "thinking": f"{reasoning}\n\n{content}"}
    return {**message, "thinking": reasoning}


def template_messages(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """The messages as this template (its source) can take them: reasoning as `thinking`
    too where it reads that (GPT-OSS), call ids of 9 letters and digits where it demands
    them (Mistral)."""
    if _READS_THINKING.search(source):
        messages = [_with_thinking(m) for m in messages]
    if _NINE_CHAR_IDS.search(source):
        messages = [_nine_char_ids(m) for m in messages]
    return messages

"""The server's own chat template settings (`--chat-template`, `--chat-template-kwargs`),
checked once by the launcher so a bad one stops the start-up with its reason instead of
failing every chat request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    if not value:
        return {}
    try:
        kwargs = json.loads(value)
    except ValueError:
        raise ValueError("--chat-template-kwargs must be a JSON object") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"--chat-template-kwargs may not set {reserved[0]!r}: the server "
                         "sets it")
    return kwargs

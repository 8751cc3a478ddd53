"""The server's own chat template settings (`--chat-template`, `--chat-template-kwargs`),
checked once by the launcher so a bad one stops the start-up with its reason instead of
failing every chat request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizer_proc.conversation import RESERVED_TEMPLATE_KWARGS


def template_text(value: str) -> str:
    """--chat-template's Jinja text: the file it names, else the value itself if it is a
    template. Raises ValueError when it is neither, or does not parse."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template "
                         "(no '{{' or '{%')")
    # The environment Hugging Face renders chat templates in (loop controls included).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: line {exc.lineno}: {exc.message}") from None
    return text


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

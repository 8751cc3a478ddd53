"""Grammars that force tool calls: the family's own call markup, the arguments held to each
tool's JSON schema, compiled by the structured-output engine (llguidance's Lark dialect).

- `required`: the output is one or more calls (one with `parallel_tool_calls` false);
- a named function: exactly one call of that function;
- `auto`: free text, but once the model writes the family's call marker, the call is
  finished under the grammar (the text before may not contain the marker; llguidance's
  StructTag pattern, with the marker excluded from the text instead of a lazy trigger, so
  the text cannot run past it). A family with no call template (GLM, Qwen3-Coder, ...)
  gets no grammar in auto: its calls are parsed as written.

A reasoning model may think first (`<think>...</think>`, harmony's analysis channel).
Markers that are special tokens of the tokenizer are written as `<token>` references,
others as literal text. JSON is written with ", " and ": " separators, as the chat
templates' `tojson` renders calls back into the prompt, and no other free whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

import regex

from tokenizer_proc.tool_syntax import (HARMONY, NEUTRAL_JSON, CallTemplate, ModelSyntax,
                                        ToolSyntax)

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_TEXT = "/(?s:.*)/"
# After a reasoning block, before the calls: the newlines models write there.
_GAP = "GAP: /[ \\n]{0,4}/"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class GrammarTool:
    """A function's name and the JSON schema of its arguments; strict: every keyword of
    the schema enforced (else the grammar leaves out those llguidance cannot enforce)."""

    name: str
    parameters: dict[str, Any]
    strict: bool = False


@dataclass(frozen=True)
class ToolGrammarPlan:
    """What the grammar forces: `mode` "required", "function" (one call of tools[0]) or
    "auto"; `parallel`: more than one call allowed; `reasoning_open`: the prompt opened a
    reasoning block, which the output must close first."""

    syntax: ModelSyntax
    tool_syntax: ToolSyntax
    tools: tuple[GrammarTool, ...]
    mode: str
    parallel: bool = True
    reasoning_open: bool = False
    reasoning_budget: int | None = None  # most tokens the reasoning may take (None: any)


class Lark:
    """Lark pieces for one tokenizer: literal text split around its special tokens."""

    def __init__(self, special_tokens: Iterable[str]) -> None:
        specials = sorted({t for t in special_tokens if t}, key=len, reverse=True)
        self._specials = set(specials)
        self._split = (regex.compile("(" + "|".join(regex.escape(t) for t in specials) + ")")
                       if specials else None)

    def literal(self, text: str) -> str:
        """A sequence matching exactly `text`; "{index}" stands for any call number."""
        parts = []
        for i, piece in enumerate(text.split("{index}")):
            if i:
                parts.append("/[0-9]{1,3}/")
            parts.extend(self._pieces(piece))
        return " ".join(parts)

    def _pieces(self, text: str) -> list[str]:
        chunks = self._split.split(text) if self._split else [text]
        return [f"<{c}>" if c in self._specials else json.dumps(c) for c in chunks if c]

    def is_special(self, text: str) -> bool:
        return text in self._specials

    def text_without(self, marker: str) -> str:
        """A terminal's body: any text not containing `marker` (any text at all when the
        marker is a special token, which text never holds)."""
        if self.is_special(marker):
            return _ANY_TEXT
        escaped = regex.escape(marker).replace("/", "\\/")
        return f"{_ANY_TEXT} & ~/(?s:.*){escaped}(?s:.*)/"


def tool_grammar(plan: ToolGrammarPlan, lark: Lark) -> str:
    """The Lark grammar of a plan."""
    if plan.tool_syntax is HARMONY:
        return _harmony_grammar(plan, lark)
    template = plan.tool_syntax.template
    assert template is not None, plan.tool_syntax.name
    rules = ["%llguidance {}", *_call_rules(plan, template, lark)]
    think = _think_rules(plan, lark)
    rules += think
    lead = ("think " if plan.reasoning_open else "think? ") if think else ""
    gap = "GAP " if think else ""
    if plan.mode != "auto":
        rules += [f"start: {lead}{gap}calls", _GAP]
    elif plan.tool_syntax.at_start:
        # Marker-less (Llama 3's bare JSON): text is anything not opening with "{".
        rules += [f"start: {lead}(TEXT | calls)?", "TEXT: /[^{](?s:.*)/"]
    else:
        rules += [f"start: {lead}TEXT calls?",
                  f"TEXT: {lark.text_without(plan.tool_syntax.start)}"]
    return "\n".join(rules) + "\n"


def _call_rules(plan: ToolGrammarPlan, template: CallTemplate, lark: Lark) -> list[str]:
    tools = plan.tools[:1] if plan.mode == "function" else plan.tools
    rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        after = lark.literal(template.after)
        # "{index}" stays: the literal accepts any call number there.
        before = template.before.replace("{name}", tool.name)
        rules.append(f"call_{i}: {lark.literal(before)} args_{i} {after}".rstrip())
        rules.append(f"args_{i}: %json {json.dumps(arguments_schema(tool))}")
    many = plan.parallel and plan.mode != "function" and not plan.tool_syntax.one_call
    between = lark.literal(template.between)
    repeat = f" ({between} call)*" if many and between else (" call*" if many else "")
    body = " ".join(p for p in (lark.literal(template.open), f"call{repeat}",
                                lark.literal(template.close)) if p)
    return rules + [f"calls: {body}"]


def _think_rules(plan: ToolGrammarPlan, lark: Lark) -> list[str]:
    markers = plan.syntax.reasoning
    if markers is None:
        return []
    opening = "" if plan.reasoning_open else lark.literal(markers.start) + " "
    return [f"think: {opening}think_text {lark.literal(markers.end)}",
            *_think_text(lark.text_without(markers.end), plan.reasoning_budget)]


def _think_text(body: str, budget: int | None) -> list[str]:
    """The reasoning's text: `body` (a terminal: llguidance intersects regexes in
    terminals only), ended by the grammar after `budget` tokens (the end marker is then
    all it allows)."""
    limit = f"[max_tokens={budget}]" if budget is not None else ""
    return [f"think_text{limit}: THINK_TEXT", f"THINK_TEXT: {body}"]


def reasoning_grammar(syntax: ModelSyntax, reasoning_open: bool, budget: int,
                      lark: Lark) -> str:
    """An answer that reasons first, in at most `budget` tokens (Anthropic's thinking
    budget), then says anything: the reasoning block is closed for the model once the
    budget is spent. For a model with reasoning markers or harmony's analysis channel."""
    if syntax.harmony:  # the analysis message, then the next one's header
        opening = lark.literal("<|channel|>analysis<|message|>") + " "
        end, closing = "<|end|>", "<|end|><|start|>assistant"
    else:
        markers = syntax.reasoning
        assert markers is not None
        opening = "" if reasoning_open else lark.literal(markers.start) + " "
        end = closing = markers.end
    return "\n".join(["%llguidance {}",
                      f"start: {opening}think_text {lark.literal(closing)} REST",
                      *_think_text(lark.text_without(end), budget),
                      f"REST: {_ANY_TEXT}"]) + "\n"


def _harmony_grammar(plan: ToolGrammarPlan, lark: Lark) -> str:
    """GPT-OSS: an optional analysis message, then the call (or, in auto, a final
    answer). The call's <|call|> and the answer's <|return|> are EOS tokens."""
    template = HARMONY.template
    assert template is not None
    tools = plan.tools[:1] if plan.mode == "function" else plan.tools
    rules = ["%llguidance {}",
             "analysis: " + lark.literal("<|channel|>analysis<|message|>")
             + " think_text " + lark.literal("<|end|><|start|>assistant"),
             *_think_text(lark.text_without("<|end|>"), plan.reasoning_budget),
             f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        before = template.before.replace("{name}", tool.name)
        rules.append(f"call_{i}: {lark.literal(before)} args_{i}")
        rules.append(f"args_{i}: %json {json.dumps(arguments_schema(tool))}")
    if plan.mode == "auto":
        rules += ["start: analysis? (call | final)",
                  "final: " + lark.literal("<|channel|>final<|message|>") + " FINAL",
                  f"FINAL: {_ANY_TEXT}"]
    else:
        rules.append("start: analysis? call")
    return "\n".join(rules) + "\n"


def arguments_schema(tool: GrammarTool) -> dict[str, Any]:
    """The JSON schema a tool's call arguments are written under, with kiln's options."""
    schema = dict(tool.parameters or _EMPTY_PARAMETERS)
    # A keyword llguidance cannot enforce fails a strict tool's request; a tool that is
    # not strict is held to the rest of its schema (lenient), as it would be to none at all
    # by OpenAI. The schema's own options (if any) win over ours.
    options = {**_JSON_OPTIONS, "lenient": not tool.strict}
    schema["x-guidance"] = {**options, **schema.get("x-guidance", {})}
    return schema


def forced_syntax(tool_syntax: ToolSyntax | None) -> ToolSyntax:
    """The syntax forced calls are written in: the family's own when it has a call
    template, else the neutral JSON list."""
    if tool_syntax is not None and tool_syntax.template is not None:
        return tool_syntax
    return NEUTRAL_JSON

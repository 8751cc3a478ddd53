"""What a chat turn's output is parsed for, and the grammar its tool calls are written under.

`TurnPlanner.plan` decides, per request, from the model's syntax and the conversation:
- no tools (or tool_choice "none"): reasoning is parsed out (unless inline), no grammar;
- "required" / a named function: the calls are forced by a grammar, in the family's own
  markup where it has a call template, else as a neutral JSON list, and parsed in it;
- "auto": the family's syntax is parsed; where it has a call template, a call the model
  starts is finished under the grammar (text before it is free). A model whose tool
  format is unknown cannot be parsed, so "auto" is refused there rather than ignored.
A reasoning budget (Anthropic's thinking.budget_tokens) makes the reasoning block part of
the grammar, closed for the model once the budget is spent: with tools, in their grammar;
without, in a grammar of its own (the reasoning first, then any text). A model with no
reasoning markers (nor harmony) writes no block: the budget asks nothing of it. Thinking
turned off where the template opened the block anyway (no enable_thinking variable) is a
budget of 0: the block is closed at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizer_proc.assistant_parser import ParseSpec
from tokenizer_proc.constraints import Constraint
from tokenizer_proc.conversation import Conversation
from tokenizer_proc.errors import RequestError
from tokenizer_proc.tool_grammar import (GrammarTool, Lark, ToolGrammarPlan, forced_syntax,
                                         reasoning_grammar, tool_grammar)
from tokenizer_proc.tool_syntax import HARMONY, ModelSyntax, ToolSyntax, opens_reasoning

_HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True)
class TurnPlan:
    parse: ParseSpec
    constraint: Constraint | None  # the tool-call grammar, as a Lark constraint
    keep_special_tokens: bool  # the markup holds special tokens the parser must see


class TurnPlanner:
    """Plans turns for one model: its syntax and its tokenizer's special tokens."""

    def __init__(self, syntax: ModelSyntax, special_tokens: frozenset[str]) -> None:
        self.syntax = syntax
        self._specials = special_tokens
        self._lark = Lark(special_tokens)

    def plan(self, conv: Conversation, prompt: str) -> TurnPlan:
        """The plan of one turn; `prompt` is the rendered template text."""
        inline = bool(conv.inline_reasoning)
        opened = opens_reasoning(prompt, self.syntax.reasoning)
        budget = self._budget(conv, opened)
        if not conv.calls_tools:
            return self._free(ParseSpec(self.syntax, None, (), inline, opened), conv, budget)
        mode = conv.tool_choice.mode
        tools = conv.forced_tools() if mode != "auto" else conv.tools
        syntax = forced_syntax(self.syntax.tools) if mode != "auto" else self._auto_syntax(conv)
        declared = tuple(t.template_dict() for t in conv.tools)
        parse = ParseSpec(self.syntax, syntax, declared, inline, opened)
        if syntax.template is None:  # auto, for a family without a call template
            return self._free(parse, conv, budget)
        grammar = tool_grammar(ToolGrammarPlan(
            self.syntax, syntax, tuple(GrammarTool(t.name, {} if t.loose else t.parameters or {}, t.strict)
                              for t in tools),
            mode, conv.parallel_tool_calls, opened, budget), self._lark)
        param = conv.tool_choice_param if mode != "auto" else conv.tools_param
        return self._plan(parse, Constraint("lark", grammar, param))

    def _free(self, parse: ParseSpec, conv: Conversation, budget: int | None) -> TurnPlan:
        """A turn whose calls (if any) are written freely: no grammar, or the reasoning
        budget's alone."""
        if budget is None:
            return self._plan(parse, None)
        grammar = reasoning_grammar(self.syntax, parse.reasoning_open, budget, self._lark)
        return self._plan(parse, Constraint("lark", grammar, conv.reasoning_budget_param))

    def _budget(self, conv: Conversation, opened: bool) -> int | None:
        """The reasoning budget the grammar holds the answer to (None: none to hold; 0:
        thinking turned off, the block the prompt opened anyway closed at once)."""
        if conv.reasoning_off and opened and not self.syntax.harmony:
            return 0
        if conv.reasoning_budget is None:
            return None
        if self.syntax.harmony or self.syntax.reasoning is not None:
            return conv.reasoning_budget
        return None  # a model that does not reason stays within any budget

    def _auto_syntax(self, conv: Conversation) -> ToolSyntax:
        if self.syntax.tools is None:
            raise RequestError(
                f"This model's tool-call format is unknown (no tool parser found in its chat "
                f"template or tokenizer config), so calls it makes cannot be parsed; use "
                f"'{conv.tool_choice_param}' 'required' or a named function (calls written "
                f"under a grammar), or start the server with --tool-parser.",
                param=conv.tool_choice_param, code="unsupported_value")
        return self.syntax.tools

    def _plan(self, parse: ParseSpec, constraint: Constraint | None) -> TurnPlan:
        return TurnPlan(parse, constraint, self._keeps_specials(parse))

    def _keeps_specials(self, parse: ParseSpec) -> bool:
        # Reasoning kept inline still shows (and counts, ReasoningCounter) by its markers.
        if not parse.active and self.syntax.reasoning is None:
            return False
        markers: list[str] = list(_HARMONY_MARKERS) if self.syntax.tools is HARMONY else []
        if parse.tool_syntax is not None:
            markers += [parse.tool_syntax.start, parse.tool_syntax.end]
        if self.syntax.reasoning is not None:
            markers += [self.syntax.reasoning.start, self.syntax.reasoning.end]
        return any(m in self._specials for m in markers if m)


def special_tokens(tokenizer: object) -> frozenset[str]:
    """The tokenizer's special tokens (the ones llguidance refers to as `<token>`)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(t.content for t in decoder.values() if getattr(t, "special", False))

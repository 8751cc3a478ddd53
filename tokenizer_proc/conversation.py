"""The one request shape the three chat-like APIs (OpenAI chat, Responses, Anthropic
Messages) are converted to before templating: messages as the chat template takes them
(transformers' convention: assistant `tool_calls` with dict arguments, `tool` messages),
function tools, the tool choice and the reasoning switch. Pure data and checks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenizer_proc.errors import RequestError
from tokenizer_proc.protocol import ChatCompletionRequest, ChatMessage, ChatTool

ToolMode = Literal["none", "auto", "required", "function"]
# OpenAI's rule for function names; it keeps them safe to write into grammars and markup.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call; `parameters` is its arguments' JSON schema. `strict`
    (OpenAI's): every keyword of the schema must be enforced, or the request is refused;
    otherwise the calls are held to the keywords the grammar can enforce (an MCP tool's
    `uniqueItems` or `not` then go unenforced rather than failing every request)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False
    # Not strict, and its schema does not compile (a regex llguidance cannot take, ...):
    # its calls are held to being a JSON object (the template still shows the schema).
    loose: bool = False

    def template_dict(self) -> dict[str, Any]:
        """The OpenAI shape chat templates read (`tools=[...]`)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode = "auto"
    name: str | None = None  # mode "function": the one function to call


@dataclass(frozen=True)
class Conversation:
    """A chat request, whichever API it came from. `params` names each part's field in
    that API's errors (Anthropic's `tool_choice` is OpenAI's too; its messages differ)."""

    messages: list[dict[str, Any]]
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    inline_reasoning: bool | None = None  # None: the server's default
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    messages_param: str = "messages"
    tools_param: str = "tools"
    tool_choice_param: str = "tool_choice"
    # The last message is an assistant turn the output continues (Anthropic's prefill):
    # rendered without the generation prompt, that turn left open after its text.
    continue_final: bool = False
    # Most tokens the answer's reasoning may take (Anthropic's thinking.budget_tokens):
    # a grammar closes the reasoning block once they are spent. None: no limit.
    reasoning_budget: int | None = None
    reasoning_budget_param: str = "thinking.budget_tokens"
    # Thinking turned off (Anthropic's thinking disabled): where the template opens the
    # reasoning block anyway (it has no enable_thinking), the grammar closes it at once.
    reasoning_off: bool = False
    # OpenAI's reasoning effort (none .. xhigh), as the template takes it (see
    # RequestPreparer._reasoning_kwargs). None: the model's default.
    reasoning_effort: str | None = None
    reasoning_effort_param: str = "reasoning_effort"
    # Thinking asked on or off (Anthropic's thinking type), through the template's switch
    # (enable_thinking, or DeepSeek's thinking). None: the template's default.
    thinking: bool | None = None

    @property
    def calls_tools(self) -> bool:
        """Whether tools reach the template and the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice.mode != "none"

    def checked(self) -> "Conversation":
        check_tools(self.tools, self.tools_param)
        check_choice(self.tool_choice, self.tools, self.tool_choice_param)
        return self

    def forced_tools(self) -> tuple[FunctionTool, ...]:
        """The tools a forced call may use: the named one, or all."""
        if self.tool_choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.tool_choice.name)
        return self.tools


# Template variables the front sets itself, and `chat_template`, which would replace the
# template (apply_chat_template takes it) past the --chat-template check.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "add_generation_prompt", "tokenize", "conversation", "documents",
    "tools_in_user_message", "continue_final_message", "return_dict", "chat_template"})


def check_tools(tools: tuple[FunctionTool, ...], param: str) -> None:
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"'{param}' takes at most {MAX_TOOLS} tools.", param=param)
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not _NAME.match(tool.name):
            raise RequestError(f"Invalid function name {tool.name[:80]!r}: 1 to 64 letters, "
                               "digits, '_', '.' or '-'.", param=f"{param}[{i}].name")
        if tool.name in seen:
            raise RequestError(f"Function {tool.name!r} is declared twice.",
                               param=f"{param}[{i}].name")
        seen.add(tool.name)


def check_choice(choice: ToolChoice, tools: tuple[FunctionTool, ...], param: str) -> None:
    if choice.mode in ("required", "function") and not tools:
        raise RequestError(f"'{param}' {choice.mode!r} needs tools.", param=param)
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise RequestError(f"'{param}' names function {choice.name!r}, which is not among "
                           "the tools.", param=param)


def check_template_kwargs(kwargs: dict[str, Any] | None, param: str) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {}))
    if reserved:
        raise RequestError(f"'{param}' may not set {reserved[0]!r}: the server sets it.",
                           param=param)
    return dict(kwargs or {})


def call_arguments(text: str, param: str) -> dict[str, Any]:
    """A history call's arguments (JSON text) as the dict templates render."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        raise RequestError(f"'{param}' must be JSON text of an object.", param=param) from None
    if not isinstance(value, dict):
        raise RequestError(f"'{param}' must be JSON text of an object.", param=param)
    return value


def template_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One call of an assistant message, as templates read it."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def name_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages get the name of the function whose call they answer, which some
    templates (harmony's) write and OpenAI's tool messages do not carry."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message:
            name = names.get(message.get("tool_call_id", ""))
            if name is not None:
                message["name"] = name
    return messages


# --- OpenAI chat ----------------------------------------------------------------------


def chat_conversation(body: ChatCompletionRequest, inline_default: bool) -> Conversation:
    """An OpenAI chat completions body as a conversation."""
    tools = tuple(_function_tool(t) for t in body.tools or [])
    inline = None if body.separate_reasoning is None else not body.separate_reasoning
    messages = [_chat_message(m, f"messages[{i}]") for i, m in enumerate(body.messages)]
    return Conversation(
        messages=name_tool_results(messages),
        tools=tools, tool_choice=_chat_choice(body, tools),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        inline_reasoning=inline_default if inline is None else inline,
        template_kwargs=check_template_kwargs(body.chat_template_kwargs,
                                              "chat_template_kwargs"),
        reasoning_effort=body.reasoning_effort).checked()


def _function_tool(tool: ChatTool) -> FunctionTool:
    f = tool.function
    return FunctionTool(f.name, f.description, f.parameters, strict=bool(f.strict))


def _chat_choice(body: ChatCompletionRequest, tools: tuple[FunctionTool, ...]) -> ToolChoice:
    choice = body.tool_choice
    if choice is None:  # OpenAI: "none" without tools, "auto" with them
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        return ToolChoice(choice)
    return ToolChoice("function", choice.function.name)


def _chat_message(message: ChatMessage, param: str) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.flat_content()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise RequestError("Only assistant messages carry 'tool_calls'.",
                               param=f"{param}.tool_calls")
        out["tool_calls"] = [
            template_call(c.id, c.function.name,
                          call_arguments(c.function.arguments,
                                         f"{param}.tool_calls[{j}].function.arguments"))
            for j, c in enumerate(message.tool_calls)]
    if message.role == "tool":
        if message.tool_call_id is None:
            raise RequestError("A tool message needs 'tool_call_id'.",
                               param=f"{param}.tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out

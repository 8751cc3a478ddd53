"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the body,
its conversion to a `Conversation`, and the message object and stream events, built from
the same parse events as chat.

Supported: `system` (text or text blocks), `messages` with text, `tool_use`,
`tool_result` and `thinking` blocks (consecutive messages of one role are one turn; a
final assistant message is continued: prefill), `tools` (custom tools with
`input_schema`), `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`),
`max_tokens` (0: the prompt is computed and cached, nothing generated), `stop_sequences`,
`temperature`, `top_p`, `top_k`, `thinking` (enabled/disabled: the template's switch,
enable_thinking or DeepSeek's thinking; `budget_tokens` held by a grammar that closes the
reasoning block once spent; disabled where the template opens the block anyway: closed at
once), `cache_control` (top level or per block: every prompt is cached anyway), `metadata`,
`stream`. Refused with a 400 in Anthropic's error format: image and document blocks,
server tools, `service_tier` other than auto, `container`, `mcp_servers`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ipc.messages.common import Usage
from tokenizer_proc.assistant_parser import (AssistantParser, ContentDelta, Event, ParseSpec,
                                             ReasoningDelta, ToolCallDelta, ToolCallStart)
from tokenizer_proc.conversation import (Conversation, FunctionTool, ToolChoice,
                                         name_tool_results, template_call)
from tokenizer_proc.errors import RequestError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools are refused
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # structured outputs: every schema keyword enforced


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class MessagesRequest(_Strict):
    model: str | None = None
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # Automatic prompt caching: every prompt's K/V is cached as it is computed here, so
    # the marker asks for nothing more (as the per-block ones do).
    cache_control: dict[str, Any] | None = None


class CountTokensRequest(_Strict):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


def check_unsupported(body: MessagesRequest) -> None:
    if body.service_tier not in (None, "auto", "standard_only"):
        raise RequestError("Parameter 'service_tier' is not supported by this server.",
                           param="service_tier", code="unsupported_parameter")
    if body.top_k is not None and body.top_k < 1:
        raise RequestError("'top_k' must be a positive integer.", param="top_k")


def messages_conversation(body: MessagesRequest | CountTokensRequest,
                          inline_default: bool) -> Conversation:
    messages = _system(body.system)
    for i, message in _turns(body.messages):
        messages += _messages(message, f"messages[{i}]")
    tools = tuple(_tool(t, i) for i, t in enumerate(body.tools or []))
    choice = body.tool_choice
    conversation = Conversation(
        messages=name_tool_results(messages), tools=tools, tool_choice=_choice(choice, tools),
        parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
        inline_reasoning=inline_default,
        thinking=None if body.thinking is None else body.thinking.type == "enabled",
        continue_final=bool(body.messages) and body.messages[-1].role == "assistant",
        reasoning_budget=_thinking_budget(body),
        reasoning_off=body.thinking is not None and body.thinking.type == "disabled")
    if conversation.continue_final:
        _check_prefill(conversation, body)
    return conversation.checked()


# Anthropic's floor for thinking.budget_tokens.
MIN_THINKING_BUDGET = 1024


def _thinking_budget(body: MessagesRequest | CountTokensRequest) -> int | None:
    """thinking.budget_tokens where thinking is enabled, checked as Anthropic checks it
    (at least 1,024, below max_tokens); the answer's reasoning is held to it."""
    thinking = body.thinking
    if thinking is None or thinking.type != "enabled":
        return None
    budget = thinking.budget_tokens
    if budget is None:
        raise RequestError("thinking.budget_tokens is required when thinking is enabled.",
                           param="thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise RequestError(f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET}.",
                           param="thinking.budget_tokens")
    if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
        raise RequestError("thinking.budget_tokens must be less than max_tokens.",
                           param="thinking.budget_tokens")
    return budget


def _check_prefill(conversation: Conversation, body: MessagesRequest | CountTokensRequest) -> None:
    """A final assistant message is text the answer continues from (Anthropic's
    prefill); what cannot follow on from text is refused, as Anthropic does."""
    param = f"messages[{len(body.messages) - 1}]"
    final = conversation.messages[-1]
    if final.get("tool_calls") or final.get("reasoning_content"):
        raise RequestError("A final assistant message is continued as text: it may hold only "
                           "text blocks.", param=f"{param}.content")
    if not final["content"]:
        raise RequestError("A final assistant message must not be empty.",
                           param=f"{param}.content")
    if conversation.tool_choice.mode in ("required", "function"):
        raise RequestError("A final assistant message (prefill) cannot be continued with a "
                           "forced tool_choice.", param="tool_choice")
    if body.thinking is not None and body.thinking.type == "enabled":
        raise RequestError("A final assistant message (prefill) cannot be continued with "
                           "thinking enabled.", param="thinking")


def _turns(messages: list[AnthropicMessage]) -> list[tuple[int, AnthropicMessage]]:
    """Consecutive messages of one role as one turn (Anthropic combines them; templates
    that want roles to alternate would refuse them apart), each with its first index."""
    turns: list[tuple[int, AnthropicMessage]] = []
    for i, message in enumerate(messages):
        if turns and turns[-1][1].role == message.role:
            first, before = turns[-1]
            turns[-1] = (first, AnthropicMessage(role=message.role, content=[
                *_blocks(before.content), *_blocks(message.content)]))
        else:
            turns.append((i, message))
    return turns


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    return [{"role": "system", "content": "\n".join(_text_block(b, f"system[{j}]")
                                                    for j, b in enumerate(system))}]


def _text_block(block: dict[str, Any], param: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise RequestError(f"Only text blocks are supported here; got {block.get('type')!r}.",
                           param=param)
    return block["text"]


def _messages(message: AnthropicMessage, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as template messages: a user's tool results become tool
    messages; an assistant's tool_use blocks its tool_calls, thinking its reasoning."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking = ""
    for j, block in enumerate(message.content):
        where = f"{param}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_result" and message.role == "user":
            result = {"role": "tool", "tool_call_id": _str(block, "tool_use_id", where),
                      "content": _result_text(block.get("content"), where)}
            if block.get("is_error"):  # for templates that mark failed calls
                result["is_error"] = True
            results.append(result)
        elif kind == "tool_use" and message.role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise RequestError("A tool_use block's 'input' must be an object.",
                                   param=f"{where}.input")
            calls.append(template_call(_str(block, "id", where), _str(block, "name", where),
                                       arguments))
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            thinking += block.get("thinking", "") if isinstance(block.get("thinking"), str) else ""
        else:
            raise RequestError(f"Content blocks of type {kind!r} are not supported in "
                               f"{message.role} messages.", param=f"{where}.type")
    out = list(results)
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = thinking
        out.append(turn)
    return out


def _str(block: dict[str, Any], name: str, param: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise RequestError(f"'{param}.{name}' must be a string.", param=f"{param}.{name}")
    return value


def _result_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text_block(b, f"{param}.content[{k}]") for k, b in enumerate(content))
    raise RequestError("A tool_result's 'content' must be text or text blocks.",
                       param=f"{param}.content")


def _tool(tool: AnthropicTool, i: int) -> FunctionTool:
    if tool.type not in (None, "custom"):
        raise RequestError(f"Server tools ({tool.type!r}) are not supported; only custom "
                           "tools are.", param=f"tools[{i}].type")
    return FunctionTool(tool.name, tool.description, tool.input_schema,
                        strict=bool(tool.strict))


def _choice(choice: AnthropicToolChoice | None, tools: tuple[FunctionTool, ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice.type == "tool":
        if choice.name is None:
            raise RequestError("tool_choice of type 'tool' needs a 'name'.",
                               param="tool_choice.name")
        return ToolChoice("function", choice.name)
    return ToolChoice({"any": "required"}.get(choice.type, choice.type))  # type: ignore[arg-type]


# --- output -------------------------------------------------------------------------


def stop_reason(finish_reason: str | None, stop_str: str | None, made_calls: bool) -> str:
    if finish_reason == "stop":
        if stop_str is not None:
            return "stop_sequence"
        return "tool_use" if made_calls else "end_turn"
    return "max_tokens"  # length, and a request aborted before it ended


@dataclass
class _Block:
    kind: str  # "thinking", "text" or "tool_use"
    data: dict[str, Any]
    text: str = ""


@dataclass
class MessageBuilder:
    """The message object and its stream events, from parse events: content blocks open
    as their first event comes and stop when the next opens or the message ends."""

    id: str
    model: str
    parse: ParseSpec
    blocks: list[_Block] = field(default_factory=list)
    _open: bool = False
    _parser: AssistantParser | None = None

    def __post_init__(self) -> None:
        if self.parse.active:
            self._parser = self.parse.parser()

    @property
    def made_calls(self) -> bool:
        return any(b.kind == "tool_use" for b in self.blocks)

    def opening(self, input_tokens: int) -> list[tuple[str, dict[str, Any]]]:
        start = self.message(None, None, Usage(prompt_tokens=input_tokens, completion_tokens=0))
        return [("message_start", {"type": "message_start", "message": start}),
                ("ping", {"type": "ping"})]

    def feed(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if self._parser is None:
            return self._apply([ContentDelta(text)] if text else [])
        return self._apply(self._parser.feed(text))

    def finish(self, finish_reason: str | None, stop_str: str | None,
               usage: Usage) -> list[tuple[str, dict[str, Any]]]:
        events = self._apply(self._parser.finish()) if self._parser else []
        events += self._close()
        reason = stop_reason(finish_reason, stop_str, self.made_calls)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason,
                                                    "stop_sequence": stop_str},
                 "usage": _usage(usage)}
        return events + [("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def message(self, reason: str | None, stop_str: str | None, usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [b.data for b in self.blocks], "stop_reason": reason,
                "stop_sequence": stop_str, "usage": _usage(usage)}

    def _apply(self, events: list[Event]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out += self._text("thinking", event.text)
            elif isinstance(event, ContentDelta):
                out += self._text("text", event.text)
            elif isinstance(event, ToolCallStart):
                out += self._close()
                out += self._start(_Block("tool_use", {"type": "tool_use", "id": _tool_id(),
                                                       "name": event.name, "input": {}}))
            elif isinstance(event, ToolCallDelta):
                block = self.blocks[-1]
                block.text += event.arguments
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": event.arguments}))
        return out

    def _text(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if not (self._open and self.blocks[-1].kind == kind):
            out += self._close()
            start = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            out += self._start(_Block(kind, start))
        block = self.blocks[-1]
        block.text += text
        block.data[kind] = block.text
        delta = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                 else {"type": "text_delta", "text": text})
        return out + [self._delta(delta)]

    def _start(self, block: _Block) -> list[tuple[str, dict[str, Any]]]:
        self.blocks.append(block)
        self._open = True
        return [("content_block_start", {"type": "content_block_start",
                                         "index": len(self.blocks) - 1,
                                         "content_block": json.loads(json.dumps(block.data))})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": len(self.blocks) - 1, "delta": delta})

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self._open:
            return []
        self._open = False
        block = self.blocks[-1]
        out = []
        if block.kind == "tool_use":
            block.data["input"] = _input(block.text)
        elif block.kind == "thinking":  # no signature: nothing here signs its reasoning
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        return out + [("content_block_stop", {"type": "content_block_stop",
                                              "index": len(self.blocks) - 1})]


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:  # cut short by max_tokens: what there was, unparsed
        return {"_partial_json": arguments}
    return value if isinstance(value, dict) else {"value": value}


def _usage(usage: Usage) -> dict[str, Any]:
    # Anthropic's input_tokens leaves out the cached part: a client adds the two (and the
    # tokens written to a cache, none here: every prompt's K/V is kept as it is computed).
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


def anthropic_sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

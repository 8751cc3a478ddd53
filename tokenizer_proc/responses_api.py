"""OpenAI's Responses API (`POST /v1/responses`): the body, its conversion to a
`Conversation`, the bounded store behind `previous_response_id`, and the response object
and stream events, built from the same parse events as chat.

Supported: `input` as text or items (messages with text parts, `function_call`,
`function_call_output`, `reasoning`), `instructions`, function tools, `tool_choice`,
`parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, `text.format`
(text, json_object, json_schema), `previous_response_id`, `store`, `metadata`, `stream`,
`reasoning.effort` (as the model's template takes it, see
RequestPreparer._reasoning_kwargs), `include` ["reasoning.encrypted_content"] (reasoning
items carry their text as an opaque token a stateless client sends back), and the cache
hints `prompt_cache_key` and `prompt_cache_retention` "in-memory" (every prompt's
prefix is cached here, whatever the key). Refused with a 400 naming them: other tool
types (web search, file search, ...), other item types, `background`, `truncation`
"auto", reasoning summaries ("concise", "detailed": no summarizer here), other
`include` values, `service_tier` other than auto or default.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ipc.messages.common import SamplingParams, Usage
from tokenizer_proc.assistant_parser import (AssistantParser, ContentDelta, Event, ParseSpec,
                                             ReasoningCounter, ReasoningDelta, ToolCallDelta,
                                             ToolCallStart)
from tokenizer_proc.conversation import (Conversation, FunctionTool, ToolChoice, call_arguments,
                                         check_template_kwargs, name_tool_results,
                                         template_call)
from tokenizer_proc.errors import RequestError
from tokenizer_proc.protocol import (CACHE_RETENTIONS, SERVICE_TIERS, VERBOSITIES,
                                     JsonSchemaFormat, ReasoningEffort, ResponseFormat)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ResponsesTool(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextSettings(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningSettings(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # deprecated name


# What `include` may ask for: reasoning items' text as an opaque token (for clients that
# keep their own history, store false: Codex's way).
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    text: TextSettings | None = None
    user: str | None = None
    reasoning: ReasoningSettings | None = None
    include: list[str] | None = None
    # Cache hints: every prompt's prefix is cached whatever they say (see the docstring).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Not supported: only their defaults are accepted (see `check_unsupported`).
    service_tier: str | None = None
    background: bool | None = None
    truncation: str | None = None
    # kiln's extras, as in chat: thinking inline, template variables.
    separate_reasoning: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def check_unsupported(body: ResponsesRequest) -> None:
    reasoning = body.reasoning or ReasoningSettings()
    for name, default in (("background", body.background in (None, False)),
                          ("truncation", body.truncation in (None, "disabled")),
                          ("service_tier", body.service_tier in SERVICE_TIERS),
                          ("prompt_cache_retention",
                           body.prompt_cache_retention in CACHE_RETENTIONS),
                          # No summarizer: "auto" is the most detailed summary available,
                          # none (the reasoning itself comes as reasoning_text content).
                          ("reasoning.summary", reasoning.summary in (None, "auto")),
                          ("reasoning.generate_summary",
                           reasoning.generate_summary in (None, "auto")),
                          # An open model has no verbosity control: only OpenAI's default.
                          ("text.verbosity", body.text is None
                           or body.text.verbosity in VERBOSITIES)):
        if not default:
            raise RequestError(f"Parameter '{name}' is not supported by this server; leave "
                               "it out or set it to its default.", param=name,
                               code="unsupported_parameter")
    for i, wanted in enumerate(body.include or []):
        if wanted != ENCRYPTED_REASONING:
            raise RequestError(f"'include' value {wanted!r} is not supported by this server; "
                               f"only {ENCRYPTED_REASONING!r} is.", param=f"include[{i}]",
                               code="unsupported_value")


def text_constraint_format(body: ResponsesRequest) -> ResponseFormat | None:
    """`text.format` as chat's `response_format` (the same constraint follows)."""
    fmt = body.text.format if body.text else None
    if fmt is None:
        return None
    schema = (JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
              if fmt.type == "json_schema" else None)
    return ResponseFormat(type=fmt.type, json_schema=schema)


# --- input --------------------------------------------------------------------------


def carried_messages(body: ResponsesRequest, conversation: Conversation) -> list[dict[str, Any]]:
    """What a response built from `conversation` hands a later one that names it as
    previous_response_id: every message but this request's `instructions` (OpenAI's
    rule: they are not carried over), system or developer messages sent as input kept."""
    return conversation.messages[1:] if body.instructions else conversation.messages


def responses_conversation(body: ResponsesRequest, history: list[dict[str, Any]],
                           inline_default: bool) -> Conversation:
    """The conversation of a body: `history` (a previous response's) + instructions +
    input items."""
    messages = [dict(m) for m in history]  # stored without its instructions (carried_messages)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    messages += input_messages(body.input)
    tools = tuple(_tool(t, i) for i, t in enumerate(body.tools or []))
    inline = None if body.separate_reasoning is None else not body.separate_reasoning
    return Conversation(
        messages=name_tool_results(messages), tools=tools,
        tool_choice=_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        inline_reasoning=inline_default if inline is None else inline,
        template_kwargs=check_template_kwargs(body.chat_template_kwargs,
                                              "chat_template_kwargs"),
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        reasoning_effort_param="reasoning.effort",
        messages_param="input").checked()


def _tool(tool: ResponsesTool, i: int) -> FunctionTool:
    if tool.type != "function":
        raise RequestError(f"Tools of type {tool.type!r} are not supported; only 'function' "
                           "tools are.", param=f"tools[{i}].type", code="unsupported_value")
    if tool.name is None:
        raise RequestError("A function tool needs a 'name'.", param=f"tools[{i}].name")
    # Responses' function tools are strict unless they say otherwise (OpenAI's default).
    return FunctionTool(tool.name, tool.description, tool.parameters,
                        strict=tool.strict is not False)


def _choice(choice: Any, tools: tuple[FunctionTool, ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        return ToolChoice(choice)  # type: ignore[arg-type]
    return ToolChoice("function", choice.name)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as template messages: consecutive function calls join one assistant
    message; a reasoning item goes with the assistant message after it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError("Each input item must be an object.", param=param)
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning += _reasoning_text(item, param)
            continue
        if kind == "message":
            message = _message(item, param)
        elif kind == "function_call":
            message = _function_call(item, param, messages)
            if message is None:
                continue
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": _text_field(item, "call_id", param),
                       "content": _output_text(item.get("output"), f"{param}.output")}
        else:
            raise RequestError(f"Input items of type {kind!r} are not supported.",
                               param=f"{param}.type", code="unsupported_value")
        if reasoning and message["role"] == "assistant":
            message["reasoning_content"], reasoning = reasoning, ""
        messages.append(message)
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError("A message's 'role' must be user, system, developer or assistant.",
                           param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise RequestError("A message's 'content' must be text or a list of text parts.",
                           param=f"{param}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f"Content parts of type {kind!r} are not supported; only text "
                               "parts are.", param=f"{param}.content[{j}]",
                               code="unsupported_value")
        texts.append(part["text"])
    return {"role": role, "content": "\n".join(texts)}


def _function_call(item: dict[str, Any], param: str,
                   messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A call item; None when it joined the assistant message just before it."""
    call = template_call(_text_field(item, "call_id", param), _text_field(item, "name", param),
                         call_arguments(_text_field(item, "arguments", param),
                                        f"{param}.arguments"))
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return None
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _text_field(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"'{param}.{name}' must be a string.", param=f"{param}.{name}")
    return value


def _output_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                       for p in value):
        return "\n".join(p["text"] for p in value)
    raise RequestError(f"'{param}' must be text or a list of text parts.", param=param)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its content and summary parts, else its sealed text
    (`encrypted_content`, which only this server makes)."""
    parts = (item.get("content") or []) + (item.get("summary") or [])
    text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
    sealed = item.get("encrypted_content")
    if text or sealed is None:
        return text
    try:
        return unseal_reasoning(sealed)
    except ValueError:
        raise RequestError("This reasoning item's 'encrypted_content' was not made by this "
                           "server.", param=f"{param}.encrypted_content") from None


_SEAL = "kiln-reasoning-1."


def seal_reasoning(text: str) -> str:
    """A reasoning text as `encrypted_content`: opaque to clients, which only send it back.
    Not a secret (the same text is the item's reasoning_text content), so not encrypted:
    only marked as this server's."""
    return _SEAL + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def unseal_reasoning(sealed: Any) -> str:
    if not isinstance(sealed, str) or not sealed.startswith(_SEAL):
        raise ValueError("not sealed here")
    try:
        return base64.b64decode(sealed[len(_SEAL):], altchars=b"-_",
                                validate=True).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        raise ValueError("not sealed here") from None


# --- the store ----------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    """What `previous_response_id` continues: the conversation up to and including the
    response's output, and the response object (for GET /v1/responses/{id})."""

    messages: list[dict[str, Any]]
    body: dict[str, Any]
    size: int


class ResponseStore:
    """The most recent stored responses, bounded in count and in JSON size (oldest out)."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 * 2**20) -> None:
        self._max_responses = max_responses
        self._max_chars = max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def put(self, rid: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(body))
        self.pop(rid)
        self._items[rid] = StoredResponse(messages, body, size)
        self._chars += size
        while len(self._items) > 1 and (len(self._items) > self._max_responses
                                        or self._chars > self._max_chars):
            _, old = self._items.popitem(last=False)
            self._chars -= old.size

    def get(self, rid: str, param: str = "previous_response_id") -> StoredResponse:
        stored = self._items.get(rid)
        if stored is None:
            if param == "previous_response_id":  # a bad request, as OpenAI answers it
                raise RequestError(f"Previous response with id {rid[:80]!r} not found.",
                                   param=param, code="previous_response_not_found")
            raise RequestError(f"Response with id {rid[:80]!r} not found.",
                               param=param, code="not_found", status=404)
        self._items.move_to_end(rid)
        return stored

    def pop(self, rid: str) -> StoredResponse | None:
        stored = self._items.pop(rid, None)
        if stored is not None:
            self._chars -= stored.size
        return stored

    def __len__(self) -> int:
        return len(self._items)


# --- output -------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item as it grows: its JSON and the text it accumulates."""

    kind: str  # "reasoning", "message" or "function_call"
    data: dict[str, Any]
    text: str = ""


@dataclass
class ResponseBuilder:
    """The response object and its stream events, from parse events.

    `echo` are the request settings the object repeats (model, instructions, tools...).
    Events carry increasing `sequence_number`s; items open as their first event comes
    and close (their `done` events) when the next one opens or the response ends."""

    id: str
    echo: dict[str, Any]
    parse: ParseSpec
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[_Item] = field(default_factory=list)
    _open: bool = False
    _sequence: int = 0
    _parser: AssistantParser | None = None
    # include ["reasoning.encrypted_content"]: reasoning items carry their sealed text.
    seal_reasoning: bool = False
    _counter: ReasoningCounter | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.parse.active:
            self._parser = self.parse.parser()
        self._counter = self.parse.counter()

    @property
    def reasoning_tokens(self) -> int:
        return self._counter.tokens if self._counter else 0

    def opening(self) -> list[dict[str, Any]]:
        body = self.response("in_progress", None, None)
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def feed(self, text: str, tokens: int = 0) -> list[dict[str, Any]]:
        """One output delta, the text of `tokens` output tokens."""
        if self._counter is not None:
            self._counter.feed(text, tokens)
        if self._parser is None:
            return self._apply([ContentDelta(text)] if text else [])
        return self._apply(self._parser.feed(text))

    def finish(self, reason: str | None, usage: Usage) -> list[dict[str, Any]]:
        events = self._apply(self._parser.finish()) if self._parser else []
        events += self._close()
        status = "completed" if reason == "stop" else "incomplete"
        body = self.response(status, reason, usage)
        name = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(name, response=body)]

    def fail(self, message: str) -> list[dict[str, Any]]:
        """A stream the engine ended with an error: the error event, then the response
        failed (OpenAI's pair), with what was made before it."""
        error = {"code": "server_error", "message": message}
        body = self.response("failed", None, None, error)
        return [self._event("error", **error, param=None),
                self._event("response.failed", response=body)]

    def response(self, status: str, reason: str | None, usage: Usage | None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = None if status != "incomplete" else {"reason": "max_output_tokens"}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "output": [item.data for item in self.items],
                "usage": _usage(usage, self.reasoning_tokens),
                **self.echo}

    def output_messages(self) -> list[dict[str, Any]]:
        """The output as template messages, for the store."""
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item.kind == "reasoning":
                message["reasoning_content"] = item.text
            elif item.kind == "message":
                message["content"] += item.text
            else:
                message.setdefault("tool_calls", []).append(template_call(
                    item.data["call_id"], item.data["name"],
                    _loads_object(item.data["arguments"])))
        return [message]

    # --- events ---

    def _apply(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out += self._text_delta("reasoning", event.text)
            elif isinstance(event, ContentDelta):
                out += self._text_delta("message", event.text)
            elif isinstance(event, ToolCallStart):
                out += self._close()
                out += self._add(_Item("function_call", {
                    "type": "function_call", "id": _item_id("fc"), "call_id": event.id,
                    "name": event.name, "arguments": "", "status": "in_progress"}))
            elif isinstance(event, ToolCallDelta):
                item = self.items[-1]
                item.data["arguments"] += event.arguments
                out.append(self._event("response.function_call_arguments.delta",
                                       **self._where(), delta=event.arguments))
        return out

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not (self._open and self.items[-1].kind == kind):
            out += self._close()
            out += self._add(_new_text_item(kind))
        item = self.items[-1]
        item.text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self._event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _add(self, item: _Item) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = True
        events = [self._event("response.output_item.added", output_index=len(self.items) - 1,
                              item=_copy(item.data))]
        if item.kind == "message":
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=_text_part("")))
        return events

    def _close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        item = self.items[-1]
        item.data["status"] = "completed"
        where = self._where()
        events = []
        if item.kind == "message":
            item.data["content"] = [_text_part(item.text)]
            events += [self._event("response.output_text.done", **where, content_index=0,
                                   text=item.text, logprobs=[]),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=_text_part(item.text))]
        elif item.kind == "reasoning":
            item.data["content"] = [{"type": "reasoning_text", "text": item.text}]
            if self.seal_reasoning:
                item.data["encrypted_content"] = seal_reasoning(item.text)
            events.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                      text=item.text))
        else:
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item.data["name"], arguments=item.data["arguments"]))
        return events + [self._event("response.output_item.done",
                                     output_index=where["output_index"], item=_copy(item.data))]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1].data["id"], "output_index": len(self.items) - 1}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _new_text_item(kind: str) -> _Item:
    if kind == "reasoning":
        return _Item("reasoning", {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                                   "content": [], "status": "in_progress"})
    return _Item("message", {"type": "message", "id": _item_id("msg"), "role": "assistant",
                             "status": "in_progress", "content": []})


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(data: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(data))


def _loads_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:  # a call cut short: its text is kept as the template's one field
        return {"arguments": text}
    return value if isinstance(value, dict) else {"value": value}


def _usage(usage: Usage | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}


def request_echo(body: ResponsesRequest, model: str, sampling: SamplingParams) -> dict[str, Any]:
    """The request settings a response object repeats; temperature and top_p as sampled
    (a field left out takes the server's default)."""
    choice = body.tool_choice
    reasoning = body.reasoning or ReasoningSettings()
    return {"model": model, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "tool_choice": (choice.model_dump() if isinstance(choice, BaseModel)
                            else choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text and body.text.format else {"type": "text"}),
                     "verbosity": "medium"},
            "truncation": "disabled", "store": body.store is not False,
            "metadata": body.metadata or {},
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary
                          or reasoning.generate_summary},
            "prompt_cache_key": body.prompt_cache_key, "service_tier": "default",
            "user": body.user}

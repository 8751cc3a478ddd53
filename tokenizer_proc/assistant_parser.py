"""The model's text as an assistant message: reasoning, content and tool calls, streamed.

Pure logic on text deltas (the detokenizer's output): `AssistantParser.feed` takes each
delta and returns the events it completes, `finish` the rest. The chat, Responses and
Messages formatters shape the same events, so the three APIs read one parse; a whole
(non-streamed) answer is the fold of the same events (`AssistantMessage`), so streamed and
whole answers agree.

Tool calls are found by the family's `ToolSyntax`: a call's id and name go out as soon as
its header has been read, then its JSON arguments in fragments as they come (the raw
text the model wrote, as OpenAI streams them). Families whose arguments are not JSON are
parsed whole by mlx-lm's parser when their region closes. Text that might still become a
marker (a `<tool_` at the end of a delta) is held back, so no markup reaches the content.
A region that parses as no call is returned as content, as the model wrote it: nothing
is dropped.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import regex

from tokenizer_proc.tool_syntax import ModelSyntax, ReasoningMarkers, ToolSyntax


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str  # a fragment of the arguments' JSON text


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallDelta | ToolCallEnd


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# Mistral's call ids: 9 letters and digits (its templates refuse any other).
SHORT_ID_CHARS = string.ascii_letters + string.digits
SHORT_ID_LENGTH = 9


def short_call_id() -> str:
    """A new call id in Mistral's form."""
    return "".join(secrets.choice(SHORT_ID_CHARS) for _ in range(SHORT_ID_LENGTH))


class Stage(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker` (held back: the
    next delta may complete the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class Trim:
    """A block's edges lose their whitespace: the leading at once, the trailing held back
    until more text follows (so "</think>\\n\\n" or the newline between two calls never
    shows as content)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def text(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out, self._held = self._held + body, text[len(body):]
        return out

    def boundary(self) -> None:
        """A block ends (a call starts, reasoning ends): held whitespace is dropped."""
        self._started = False
        self._held = ""


# --- reasoning ------------------------------------------------------------------------


class ReasoningSplitter:
    """`<think>...</think>` apart from what follows. The block may open the output, or
    the prompt may have opened it already (`inside`); only the first block is reasoning."""

    def __init__(self, markers: ReasoningMarkers, inside: bool) -> None:
        self._markers = markers
        self._state = "reasoning" if inside else "opening"
        self._buffer = ""
        self._trim = Trim()

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self._state == "opening":
            return self._opening()
        if self._state == "reasoning":
            return self._reasoning()
        return self._take_content()

    def finish(self) -> list[Event]:
        if self._state == "reasoning":
            return self._reasoned(self._take())
        return self._take_content()

    @property
    def inside(self) -> bool:
        """Whether the text so far ends inside the reasoning block."""
        return self._state == "reasoning"

    def _opening(self) -> list[Event]:
        head = self._buffer.lstrip()
        if head.startswith(self._markers.start):
            self._buffer = head[len(self._markers.start):]
            self._state = "reasoning"
            return self._reasoning()
        if self._markers.start.startswith(head):
            return []  # may still become the marker
        self._state = "content"
        return self._take_content()

    def _reasoning(self) -> list[Event]:
        end = self._buffer.find(self._markers.end)
        if end < 0:
            keep = held_prefix(self._buffer, self._markers.end)
            text = self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(text):]
            return self._reasoned(text)
        text, self._buffer = self._buffer[:end], self._buffer[end + len(self._markers.end):]
        self._state = "content"
        return self._reasoned(text) + self._take_content()

    def _reasoned(self, text: str) -> list[Event]:
        text = self._trim.text(text)
        return [ReasoningDelta(text)] if text else []

    def _take_content(self) -> list[Event]:
        text = self._take()
        return [ContentDelta(text)] if text else []

    def _take(self) -> str:
        text, self._buffer = self._buffer, ""
        return text


# --- tool calls -----------------------------------------------------------------------


class _JsonValue:
    """Finds where one JSON value ends in a stream of text (strings and nesting tracked),
    without parsing it. A value that is a JSON string (arguments some models quote) is
    kept whole and decoded at its end."""

    def __init__(self) -> None:
        self._started = False
        self._kind = ""  # "container", "string" or "scalar"
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.quoted = ""  # a string value, kept until it ends
        self.done = False

    def take(self, text: str) -> tuple[str, int]:
        """(the part of text that belongs to the value, chars consumed)."""
        start = 0
        for i, ch in enumerate(text):
            if not self._started:
                if ch.isspace():
                    start = i + 1
                    continue
                self._begin(ch)
                if self._kind != "scalar":
                    continue
            if self._step(ch):
                end = i if self._kind == "scalar" else i + 1
                self.done = True
                return text[start:end], end
        return text[start:], len(text)

    def _begin(self, ch: str) -> None:
        self._started = True
        if ch in "{[":
            self._kind, self._depth = "container", 1
        elif ch == '"':
            self._kind, self._in_string = "string", True
        else:
            self._kind = "scalar"

    def _step(self, ch: str) -> bool:
        """Advance by one char; True when the value has ended (a scalar: before ch)."""
        if self._kind == "scalar":
            return ch in ",}]" or ch.isspace()
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                return self._kind == "string"
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            return self._depth == 0
        return False

    @property
    def is_string(self) -> bool:
        return self._kind == "string"


@dataclass
class _Call:
    index: int
    value: _JsonValue = field(default_factory=_JsonValue)


class _Stepped:
    """A stage that buffers its text and consumes it in steps, each step emitting events
    and saying whether it moved (False: it waits for more text)."""

    _buffer: str

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        raise NotImplementedError


class ToolCallParser(_Stepped):
    """Content text in, content and tool-call events out, for one `ToolSyntax`.

    Modes: "text" (looking for the region's start marker), "maybe" (a marker-less
    syntax, at the output's start: is it a call?), "region" (a call header or the
    region's end expected), "args" (inside a call's JSON arguments), "trailer" (after a
    call: markup up to the next header or the end), "whole" (a region parsed whole
    when it closes), "plain" (no call can come any more).
    """

    def __init__(self, syntax: ToolSyntax, tools: list[dict[str, Any]] | None = None,
                 make_id: Callable[[], str] = new_call_id) -> None:
        self._syntax = syntax
        self._tools = tools
        self._make_id = make_id
        self._mode = "maybe" if syntax.at_start else "text"
        self._buffer = ""
        self._trim = Trim()
        self._call: _Call | None = None
        self._region_calls = 0
        self.calls = 0


    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._mode == "args" and self._call is not None:
            events.extend(self._end_call())
        elif self._mode == "whole" or (self._mode == "region" and self._region_calls == 0):
            # Cut short (max_tokens) or ended inside a region holding no call yet: a call
            # its parser can read, else what the model wrote, as it wrote it.
            events.extend(self._parse_whole(self._take(), closed=False))
        elif self._mode in ("text", "maybe", "plain"):
            events.extend(self._content(self._take()))
        self._buffer = ""
        return events

    # One step of the current mode; True when it made progress and may step again.
    def _step(self, events: list[Event]) -> bool:
        return getattr(self, f"_in_{self._mode}")(events)

    def _in_plain(self, events: list[Event]) -> bool:
        events.extend(self._content(self._take()))
        return False

    def _in_text(self, events: list[Event]) -> bool:
        start = self._syntax.start
        at = self._buffer.find(start)
        if at < 0:
            keep = held_prefix(self._buffer, start)
            text = self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(text):]
            events.extend(self._content(text))
            return False
        events.extend(self._content(self._buffer[:at]))
        self._buffer = self._buffer[at + len(start):]
        self._open_region()
        return True

    def _in_maybe(self, events: list[Event]) -> bool:
        head = self._buffer.lstrip()
        if not head:
            return False
        assert self._syntax.header is not None
        match = self._syntax.header.match(head, partial=True)
        if match is None:
            self._mode = "plain"
            return True
        if match.partial:
            return False
        self._buffer = head
        self._open_region()
        return True

    def _open_region(self) -> None:
        self._mode = "region" if self._syntax.header is not None else "whole"
        self._region_calls = 0
        self._trim.boundary()

    def _in_region(self, events: list[Event]) -> bool:
        header = self._syntax.header
        assert header is not None
        match = header.match(self._buffer, partial=True)
        if match is not None and not match.partial:
            self._buffer = self._buffer[match.end():]
            events.extend(self._start_call(match))
            return True
        if match is not None:
            return False
        closing = self._closing()
        if closing is not None:
            return closing
        if self._region_calls == 0:  # not a shape streamed here: parse it whole
            self._mode = "whole" if self._syntax.end or self._syntax.fallback else "plain"
            return True
        self._mode = "trailer"
        return True

    def _closing(self) -> bool | None:
        """The region's end marker at the buffer's start: True (closed), False (maybe,
        wait), None (not there)."""
        end = self._syntax.end
        head = self._buffer.lstrip()
        if not end or not head:
            return False if not head else None
        if head.startswith(end):
            self._buffer = head[len(end):]
            self._close_region()
            return True
        return False if end.startswith(head) else None

    def _close_region(self) -> None:
        self._mode = "text" if not self._syntax.at_start else "plain"
        self._trim.boundary()

    def _in_args(self, events: list[Event]) -> bool:
        call = self._call
        assert call is not None
        text, used = call.value.take(self._buffer)
        self._buffer = self._buffer[used:]
        if call.value.is_string:
            call.value.quoted += text
        elif text:
            events.append(ToolCallDelta(call.index, text))
        if not call.value.done:
            return False
        events.extend(self._end_call())
        self._mode = "trailer"
        return True

    def _in_trailer(self, events: list[Event]) -> bool:
        header = self._syntax.header
        assert header is not None
        end = self._syntax.end
        at_end = self._buffer.find(end) if end else -1
        match = header.search(self._buffer, partial=True)
        if match is not None and not match.partial and (at_end < 0 or match.start() <= at_end):
            self._buffer = self._buffer[match.start():]
            self._mode = "region"
            return True
        if at_end >= 0:
            self._buffer = self._buffer[at_end + len(end):]
            self._close_region()
            return True
        keep_from = len(self._buffer) - (held_prefix(self._buffer, end) if end else 0)
        if match is not None:
            keep_from = min(keep_from, match.start())
        self._buffer = self._buffer[keep_from:]  # markup between calls: dropped
        return False

    def _in_whole(self, events: list[Event]) -> bool:
        end = self._syntax.end
        at = self._buffer.find(end) if end else -1
        if at < 0:
            return False
        region, self._buffer = self._buffer[:at], self._buffer[at + len(end):]
        events.extend(self._parse_whole(region))
        self._close_region()
        return True

    def _start_call(self, match: regex.Match[str]) -> list[Event]:
        self._call = _Call(self.calls)
        self.calls += 1
        self._region_calls += 1
        self._mode = "args"
        self._trim.boundary()
        call_id = match.group("id") if "id" in match.groupdict() else None
        return [ToolCallStart(self._call.index, call_id or self._make_id(),
                              match.group("name").strip())]

    def _end_call(self) -> list[Event]:
        call = self._call
        assert call is not None
        self._call = None
        events: list[Event] = []
        if call.value.is_string:  # quoted arguments: the JSON text they quote
            try:
                events.append(ToolCallDelta(call.index, json.loads(call.value.quoted)))
            except (ValueError, TypeError):
                events.append(ToolCallDelta(call.index, call.value.quoted))
        return events + [ToolCallEnd(call.index)]

    def _parse_whole(self, region: str, closed: bool = True) -> list[Event]:
        """A region by the family's own parser (mlx-lm's); unparsable: content as written
        (its end marker only where the model wrote one: `closed`)."""
        parsed = _parse_region(self._syntax, region, self._tools) if region.strip() else None
        if parsed is None:
            return self._content(self._syntax.start + region + (self._syntax.end if closed else ""))
        events: list[Event] = []
        for name, arguments, call_id in parsed:
            index = self.calls
            self.calls += 1
            events += [ToolCallStart(index, call_id or self._make_id(), name),
                       ToolCallDelta(index, arguments), ToolCallEnd(index)]
        self._trim.boundary()
        return events

    def _content(self, text: str) -> list[Event]:
        text = self._trim.text(text)
        return [ContentDelta(text)] if text else []

    def _take(self) -> str:
        text, self._buffer = self._buffer, ""
        return text


def _parse_region(syntax: ToolSyntax, region: str,
                  tools: list[dict[str, Any]] | None) -> list[tuple[str, str, str | None]] | None:
    """(name, arguments JSON, id or None) of each call in a region, or None."""
    if syntax.fallback is None or not region.strip():
        return None
    try:
        parsed = syntax.fallback(region, tools)
    except Exception:  # noqa: BLE001 - mlx-lm's parsers raise what they meet: not a call
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                       ensure_ascii=False)
        out.append((call["name"], text, call.get("id")))
    return out


class ContentOnly:
    """Content that passes through with its edges trimmed (after reasoning)."""

    def __init__(self) -> None:
        self._trim = Trim()
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        text = self._trim.text(text)
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []


# --- harmony (GPT-OSS) ----------------------------------------------------------------

_H_MESSAGE = "<|message|>"
_H_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_H_CHANNEL = regex.compile(r"<\|channel\|>\s*([^\s<]+)")
_H_RECIPIENT = regex.compile(r"\bto=([^\s<]+)")


class HarmonyParser(_Stepped):
    """GPT-OSS's harmony messages: `<|channel|>analysis<|message|>...<|end|>` is
    reasoning, `final` (and commentary to no one) is content, a message `to=functions.X`
    is a call of X whose body is its JSON arguments. The text keeps the special tokens
    (the front asks the detokenizer for them); the stop tokens (<|call|>, <|return|>)
    never reach it. With `inline`, reasoning is content too."""

    def __init__(self, inline: bool = False, make_id: Callable[[], str] = new_call_id) -> None:
        self._inline = inline
        self._make_id = make_id
        self._buffer = ""
        self._in_body = False
        self._kind = ""  # "reasoning", "content" or "call"
        self._analysis = False  # the message is on the analysis channel (inline or not)
        self._trims = {"reasoning": Trim(), "content": Trim(), "call": Trim()}
        self._call = -1
        self.calls = 0


    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._in_body:
            events.extend(self._body_text(self._buffer))
            events.extend(self._end_message())
        elif "<|" not in self._buffer:  # text the model wrote outside any message
            events.extend(self._emit("content", self._buffer))
        self._buffer = ""
        return events

    def _step(self, events: list[Event]) -> bool:
        if not self._in_body:
            at = self._buffer.find(_H_MESSAGE)
            if at < 0:
                return False
            self._begin_message(self._buffer[:at], events)
            self._buffer = self._buffer[at + len(_H_MESSAGE):]
            return True
        ends = [(i, end) for end in _H_ENDS if (i := self._buffer.find(end)) >= 0]
        if not ends:
            keep = max(held_prefix(self._buffer, end) for end in _H_ENDS)
            text = self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(text):]
            events.extend(self._body_text(text))
            return False
        at, end = min(ends)
        events.extend(self._body_text(self._buffer[:at]))
        events.extend(self._end_message())
        # After <|start|> comes the next message's header ("assistant<|channel|>...").
        self._buffer = self._buffer[at + len(end):]
        return True

    @property
    def inside_reasoning(self) -> bool:
        """Whether the text so far ends inside an analysis message's body (not inline)."""
        return self._in_body and self._kind == "reasoning"

    @property
    def inside_analysis(self) -> bool:
        """Whether the text so far ends inside an analysis message's body (inline too)."""
        return self._in_body and self._analysis

    @property
    def in_header(self) -> bool:
        """Whether the text so far ends between messages or inside a header."""
        return not self._in_body

    def _begin_message(self, header: str, events: list[Event]) -> None:
        channel = _H_CHANNEL.search(header)
        recipient = _H_RECIPIENT.search(header)
        self._in_body = True
        self._analysis = (channel is not None and channel.group(1) == "analysis"
                          and (recipient is None or recipient.group(1) == "all"))
        if recipient is not None and recipient.group(1) != "all":
            self._kind = "call"
            self._call = self.calls
            self.calls += 1
            name = recipient.group(1).removeprefix("functions.")
            events.append(ToolCallStart(self._call, self._make_id(), name))
        elif channel is not None and channel.group(1) == "analysis" and not self._inline:
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _body_text(self, text: str) -> list[Event]:
        if self._kind == "call":
            text = self._trims["call"].text(text)
            return [ToolCallDelta(self._call, text)] if text else []
        return self._emit(self._kind, text)

    def _end_message(self) -> list[Event]:
        self._in_body = False
        self._trims[self._kind].boundary()
        return [ToolCallEnd(self._call)] if self._kind == "call" else []

    def _emit(self, kind: str, text: str) -> list[Event]:
        text = self._trims[kind].text(text)
        if not text:
            return []
        return [ReasoningDelta(text) if kind == "reasoning" else ContentDelta(text)]


# --- the whole ------------------------------------------------------------------------


@dataclass(frozen=True)
class ParseSpec:
    """What a request's output is parsed for (built by the preparer, one per request):
    the model's syntax, the tool syntax calls are parsed in (None: no tools), the declared tools (mlx-lm's parsers read their schemas), whether reasoning
    stays inline, and whether the prompt opened a reasoning block."""

    syntax: ModelSyntax
    tool_syntax: ToolSyntax | None = None
    tools: tuple[dict[str, Any], ...] = ()
    inline_reasoning: bool = False
    reasoning_open: bool = False

    @property
    def active(self) -> bool:
        """Whether the output needs parsing at all (else it is content, untouched)."""
        harmony = self.syntax.harmony
        return (self.tool_syntax is not None or harmony
                or (self.syntax.reasoning is not None and not self.inline_reasoning))

    def parser(self) -> "AssistantParser":
        return AssistantParser(self)

    def counter(self) -> "ReasoningCounter | None":
        """The output's reasoning-token counter; None for a model that does not reason."""
        if self.syntax.harmony or self.syntax.reasoning is not None:
            return ReasoningCounter(self)
        return None


class ReasoningCounter:
    """The output tokens of the deltas that were reasoning (began, ended or ran inside
    it): the usage's reasoning_tokens, alike streamed and whole. Reasoning kept inline
    counts too: OpenAI's count is of the tokens generated for reasoning, wherever their
    text goes. Its own parse of the reasoning, apart from the output's. Harmony: an
    analysis message's header counts with it, however the deltas cut it."""

    def __init__(self, spec: ParseSpec) -> None:
        self.tokens = 0
        self._harmony = HarmonyParser() if spec.syntax.harmony else None
        self._header = 0  # harmony: tokens of the message header being read
        markers = spec.syntax.reasoning
        self._splitter = (ReasoningSplitter(markers, spec.reasoning_open)
                          if markers is not None and self._harmony is None else None)

    def feed(self, text: str, tokens: int) -> None:
        before = self._inside()
        stage = self._harmony or self._splitter
        assert stage is not None
        events = stage.feed(text)
        if self._harmony is not None and not before:
            # A header is reasoning once it opens an analysis body: held until then.
            if self._harmony.in_header:
                self._header += tokens
                return
            tokens, self._header = tokens + (self._header if self._inside() else 0), 0
        if before or self._inside() or any(isinstance(e, ReasoningDelta) for e in events):
            self.tokens += tokens

    def _inside(self) -> bool:
        if self._harmony is not None:
            return self._harmony.inside_analysis
        return self._splitter is not None and self._splitter.inside


class AssistantParser:
    """Reasoning first, then tool calls in what remains: one parse of one output."""

    def __init__(self, spec: ParseSpec) -> None:
        self._reasoning: ReasoningSplitter | None = None
        self._content: Stage
        if spec.syntax.harmony:
            self._content = HarmonyParser(spec.inline_reasoning)
            return
        markers = spec.syntax.reasoning
        if markers is not None and not spec.inline_reasoning:
            self._reasoning = ReasoningSplitter(markers, spec.reasoning_open)
        if spec.tool_syntax is not None:
            self._content = ToolCallParser(
                spec.tool_syntax, list(spec.tools),
                short_call_id if spec.tool_syntax.short_ids else new_call_id)
        else:
            self._content = ContentOnly()

    @property
    def made_calls(self) -> bool:
        return getattr(self._content, "calls", 0) > 0

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside reasoning that is parsed apart."""
        if self._reasoning is not None:
            return self._reasoning.inside
        return isinstance(self._content, HarmonyParser) and self._content.inside_reasoning

    def feed(self, text: str) -> list[Event]:
        if self._reasoning is None:
            return self._content.feed(text)
        return self._route(self._reasoning.feed(text))

    def finish(self) -> list[Event]:
        events = self._route(self._reasoning.finish()) if self._reasoning else []
        return events + self._content.finish()

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.extend(self._content.feed(event.text))
            else:
                out.append(event)
        return out


@dataclass
class ToolCallText:
    id: str
    name: str
    arguments: str = ""


@dataclass
class AssistantMessage:
    """The fold of a parse's events: what a whole (non-streamed) answer holds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallText] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.reasoning += event.text
            elif isinstance(event, ContentDelta):
                self.content += event.text
            elif isinstance(event, ToolCallStart):
                self.tool_calls.append(ToolCallText(event.id, event.name))
            elif isinstance(event, ToolCallDelta):
                self.tool_calls[-1].arguments += event.arguments


def parse_whole(spec: ParseSpec, text: str) -> AssistantMessage:
    """A whole output, parsed as if it had been streamed in one delta."""
    message = AssistantMessage()
    if not spec.active:
        message.content = text
        return message
    parser = spec.parser()
    message.add(parser.feed(text))
    message.add(parser.finish())
    return message

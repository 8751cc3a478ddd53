"""Response bodies: whole responses and streamed chunks, for the OpenAI endpoints and the
native /generate.

Each formatter knows one endpoint's shapes; the HTTP layer drives them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ipc.messages.common import Usage
from ipc.messages.to_tokenizer import PromptTextLogprobs, TextLogprob, TextOutput
from tokenizer_proc.assistant_parser import (AssistantParser, ContentDelta, Event, ParseSpec,
                                             ReasoningCounter, ReasoningDelta, ToolCallDelta,
                                             ToolCallStart, parse_whole)
from tokenizer_proc.manager import Collected

DONE = "data: [DONE]\n\n"

# The engine's reasons that OpenAI's schemas lack (chat allows stop, length, tool_calls,
# content_filter, function_call; completions stop, length, content_filter), and typed
# SDKs reject an unknown one. An aborted request (/abort_request, shutdown) was cut short
# before it ended of itself, as when max_tokens cuts it, so it reports "length": the one
# allowed value that says "incomplete", where "stop" would pass a cut answer off as whole.
# (vLLM sends its own "abort".) The native API and the ZMQ client keep "abort".
_OPENAI_FINISH_REASONS = {"abort": "length"}


def openai_finish_reason(reason: str | None) -> str | None:
    """The finish_reason an OpenAI route shows for the engine's `reason`."""
    return _OPENAI_FINISH_REASONS.get(reason, reason) if reason is not None else None


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_dict(usage: Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; reasoning_tokens (chat): how many of the completion's tokens were
    reasoning (None: not counted, the field left out)."""
    out = {"prompt_tokens": usage.prompt_tokens,
           "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.total_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


@dataclass
class _Format:
    """What both endpoints share: the ids, timestamps and the usage convention."""

    id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        # With include_usage every chunk carries "usage": null except the last one.
        if self.include_usage:
            out["usage"] = None
        return out

    def _usage_envelope(self, obj: str, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(obj, []), "usage": usage_dict(usage)}


@dataclass
class CompletionFormat(_Format):
    """Shapes of /v1/completions (object "text_completion"); `echo` is the prompt text
    that comes before the completion (empty: no echo)."""

    echo: str = ""
    _offset: int = 0  # text_offset of the next token with logprobs, after the echo

    def opening(self, prompt: PromptTextLogprobs | None = None) -> list[dict[str, Any]]:
        """The echoed prompt, with its tokens' logprobs when they were asked for."""
        if not self.echo:
            return []
        choice = _text_choice(self.echo, None, _prompt_legacy(prompt, self.echo))
        return [self._envelope("text_completion", [choice])]

    def text_chunk(self, text: str, logprobs: list[TextLogprob] | None = None) -> dict[str, Any]:
        choice = _text_choice(text, None, self._logprobs(logprobs))
        return self._envelope("text_completion", [choice])

    def finish_chunk(self, reason: str | None) -> dict[str, Any]:
        return self._envelope("text_completion", [_text_choice("", reason)])

    def text_chunks(self, text: str, logprobs: list[TextLogprob] | None = None,
                    tokens: int = 0) -> list[dict[str, Any]]:
        """The chunks of one output delta (none for a delta of no text and no logprobs)."""
        return [self.text_chunk(text, logprobs)] if text or logprobs else []

    def finish_chunks(self, reason: str | None) -> list[dict[str, Any]]:
        return [self.finish_chunk(reason)]

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._usage_envelope("text_completion", usage)

    def response(self, result: Collected) -> dict[str, Any]:
        logprobs = self._logprobs(result.logprobs)
        prompt = _prompt_legacy(result.prompt_logprobs, self.echo) if self.echo else None
        if prompt is not None:
            logprobs = {key: prompt[key] + (logprobs or {}).get(key, []) for key in prompt}
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [_text_choice(self.echo + result.text, result.finish_reason,
                                         logprobs)],
                "usage": usage_dict(result.usage)}

    def _logprobs(self, logprobs: list[TextLogprob] | None) -> dict[str, Any] | None:
        """The legacy shape: parallel lists; each top_logprobs dict also holds the
        sampled token, as OpenAI's does."""
        if logprobs is None:
            return None
        offsets = []
        for lp in logprobs:
            offsets.append(len(self.echo) + self._offset)
            self._offset += len(lp.token)
        return {"tokens": [lp.token for lp in logprobs],
                "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [_top_dict(lp) for lp in logprobs],
                "text_offset": offsets}


def _prompt_legacy(prompt: PromptTextLogprobs | None, echo: str) -> dict[str, Any] | None:
    """The prompt's part of the legacy logprobs (echo): token 0 has no logprob and no
    top dict (null, as OpenAI's); offsets count the token texts from the echoed text's
    start. A first token the echo does not start with (a BOS the tokenizer added to the
    prompt as sent) is at offset 0 and takes no room, so the others index the echo."""
    if prompt is None:
        return None
    tokens = [prompt.first, *(lp.token for lp in prompt.rest)]
    at = 0 if echo.startswith(prompt.first) else -len(prompt.first)
    offsets = []
    for token in tokens:
        offsets.append(max(at, 0))
        at += len(token)
    return {"tokens": tokens,
            "token_logprobs": [None, *(_finite(lp.logprob) for lp in prompt.rest)],
            "top_logprobs": [None, *(_top_dict(lp) for lp in prompt.rest)],
            "text_offset": offsets}


def _top_dict(lp: TextLogprob) -> dict[str, float]:
    # The token itself is always in its dict, as in OpenAI's.
    return {**{t: _finite(v) for t, v in zip(lp.top_tokens, lp.top_logprobs)},
            lp.token: _finite(lp.logprob)}


@dataclass
class ChatFormat(_Format):
    """Shapes of /v1/chat/completions ("chat.completion", "chat.completion.chunk").

    With a parse spec (tools, a reasoning model), the text goes through the request's
    `AssistantParser`: reasoning comes as `reasoning_content`, calls as `tool_calls`
    (streamed: id and name first, then argument fragments) and a stop after a call is
    finish_reason "tool_calls". Each formatter (one per choice) parses its own output.
    """

    parse: ParseSpec | None = None
    _parser: AssistantParser | None = field(default=None, init=False, repr=False)
    _counter: ReasoningCounter | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.parse is not None and self.parse.active:
            self._parser = self.parse.parser()
        self._counter = self.parse.counter() if self.parse is not None else None

    def opening(self, prompt: PromptTextLogprobs | None = None) -> list[dict[str, Any]]:
        # OpenAI's first chunk announces the role with empty content.
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def text_chunk(self, text: str, logprobs: list[TextLogprob] | None = None) -> dict[str, Any]:
        return self._chunk({"content": text}, None, _chat_logprobs(logprobs))

    def text_chunks(self, text: str, logprobs: list[TextLogprob] | None = None,
                    tokens: int = 0) -> list[dict[str, Any]]:
        """The chunks of one output delta, the text of `tokens` output tokens (none for a
        delta of no text and no logprobs, whose tokens still count)."""
        if self._counter is not None:
            self._counter.feed(text, tokens)
        if self._parser is None:
            return [self.text_chunk(text, logprobs)] if text or logprobs else []
        chunks = [self._chunk(d, None) for d in chat_deltas(self._parser.feed(text))]
        if logprobs:  # the tokens' entries ride on the first chunk of their text
            if not chunks:
                chunks = [self._chunk({"content": ""}, None)]
            chunks[0]["choices"][0]["logprobs"] = _chat_logprobs(logprobs)
        return chunks

    def finish_chunk(self, reason: str | None) -> dict[str, Any]:
        return self._chunk({}, reason)

    def finish_chunks(self, reason: str | None) -> list[dict[str, Any]]:
        if self._parser is None:
            return [self.finish_chunk(reason)]
        chunks = [self._chunk(d, None) for d in chat_deltas(self._parser.finish())]
        return chunks + [self.finish_chunk(_tool_finish(reason, self._parser.made_calls))]

    @property
    def reasoning_tokens(self) -> int:
        """The streamed deltas' reasoning tokens so far (see ReasoningCounter)."""
        return self._counter.tokens if self._counter else 0

    def usage_chunk(self, usage: Usage, reasoning_tokens: int | None = None) -> dict[str, Any]:
        """reasoning_tokens: n choices' sum (default: this choice's)."""
        counted = self.reasoning_tokens if reasoning_tokens is None else reasoning_tokens
        return {**self._envelope("chat.completion.chunk", []),
                "usage": usage_dict(usage, counted)}

    def response(self, result: Collected) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text, "refusal": None}
        reason = result.finish_reason
        if self.parse is not None and self.parse.active:
            parsed = parse_whole(self.parse, result.text)
            message["content"] = parsed.content if parsed.content or not parsed.tool_calls else None
            if self.parse.syntax.reasoning is not None or self.parse.syntax.harmony:
                message["reasoning_content"] = parsed.reasoning or None
            if parsed.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.tool_calls]
            reason = _tool_finish(reason, bool(parsed.tool_calls))
        choice = {"index": 0, "message": message, "logprobs": _chat_logprobs(result.logprobs),
                  "finish_reason": openai_finish_reason(reason)}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": [choice],
                "usage": usage_dict(result.usage, self._whole_reasoning_tokens(result))}

    def _whole_reasoning_tokens(self, result: Collected) -> int:
        """A whole answer's reasoning tokens, from its deltas as they were streamed."""
        counter = self.parse.counter() if self.parse is not None else None
        if counter is None:
            return 0
        for text, tokens in result.pieces():
            counter.feed(text, tokens)
        return counter.tokens

    def _chunk(self, delta: dict[str, Any], reason: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                  "finish_reason": openai_finish_reason(reason)}
        return self._envelope("chat.completion.chunk", [choice])


ResponseFormat = CompletionFormat | ChatFormat


def _tool_finish(reason: str | None, made_calls: bool) -> str | None:
    # A turn that ended of itself after calling tools waits for their results.
    return "tool_calls" if made_calls and reason == "stop" else reason


def chat_deltas(events: list[Event]) -> list[dict[str, Any]]:
    """Chat chunk deltas of parse events, one each (a call's end has none)."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ReasoningDelta):
            deltas.append({"reasoning_content": event.text})
        elif isinstance(event, ContentDelta):
            deltas.append({"content": event.text})
        elif isinstance(event, ToolCallStart):
            deltas.append({"tool_calls": [{"index": event.index, "id": event.id,
                                           "type": "function",
                                           "function": {"name": event.name, "arguments": ""}}]})
        elif isinstance(event, ToolCallDelta):
            deltas.append({"tool_calls": [{"index": event.index,
                                           "function": {"arguments": event.arguments}}]})
    return deltas


def _text_choice(text: str, reason: str | None,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": logprobs,
            "finish_reason": openai_finish_reason(reason)}


def _chat_logprobs(logprobs: list[TextLogprob] | None) -> dict[str, Any] | None:
    """The chat shape: one entry per token, with its UTF-8 bytes and its top-k."""
    if logprobs is None:
        return None
    return {"content": [{**_chat_entry(lp.token, lp.logprob),
                         "top_logprobs": [_chat_entry(t, v) for t, v
                                          in zip(lp.top_tokens, lp.top_logprobs)]}
                        for lp in logprobs],
            "refusal": None}


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; a token the model rules out gets vLLM's stand-in.
    return max(logprob, -9999.0)


@dataclass
class NativeFormat:
    """Shapes of the native /generate: one object, whole or (streamed) one per output.

    With logprobs, meta_info carries SGLang's lists: `output_token_logprobs` (one
    [logprob, token id, text] per output token; text null unless text_in_logprobs),
    `output_top_logprobs` (per token, a list of such triples, most likely first) and,
    when logprob_start_len >= 0, `input_token_logprobs` / `input_top_logprobs` for the
    prompt from that position (prompt token 0 has logprob null and top list null).
    Streamed, each piece carries its own tokens' entries, the first the prompt's.
    """

    id: str
    logprobs: bool = False
    logprob_start_len: int = -1
    text_in_logprobs: bool = False
    index: int | None = None  # n > 1: the choice, shown in meta_info

    def response(self, result: Collected) -> dict[str, Any]:
        return self._shape(result.text, result.token_ids, result.finish_reason, result.usage,
                           result.logprobs, result.prompt_logprobs)

    def chunk(self, output: TextOutput, usage: Usage) -> dict[str, Any]:
        """A streamed piece: the output's new text and ids; usage counts tokens so far."""
        return self._shape(output.text, output.token_ids, output.finish_reason, usage,
                           output.logprobs, output.prompt_logprobs)

    def _shape(self, text: str, token_ids: list[int], finish_reason: str | None,
               usage: Usage, logprobs: list[TextLogprob] | None,
               prompt: PromptTextLogprobs | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": self.id, "finish_reason": finish_reason,
                                "prompt_tokens": usage.prompt_tokens,
                                "completion_tokens": usage.completion_tokens}
        if self.index is not None:
            meta["index"] = self.index
        if self.logprobs:
            meta.update(self._output_logprobs(logprobs or []))
        if self.logprob_start_len >= 0 and prompt is not None:
            meta.update(self._input_logprobs(prompt))
        return {"text": text, "output_ids": token_ids, "meta_info": meta}

    def _output_logprobs(self, logprobs: list[TextLogprob]) -> dict[str, Any]:
        return {"output_token_logprobs": [self._entry(lp.logprob, lp.token_id, lp.token)
                                          for lp in logprobs],
                "output_top_logprobs": [self._top(lp) for lp in logprobs]}

    def _input_logprobs(self, prompt: PromptTextLogprobs) -> dict[str, Any]:
        start = self.logprob_start_len
        first = [None, prompt.first_id, prompt.first if self.text_in_logprobs else None]
        entries = [first, *(self._entry(lp.logprob, lp.token_id, lp.token)
                            for lp in prompt.rest)]
        tops = [None, *(self._top(lp) for lp in prompt.rest)]
        return {"input_token_logprobs": entries[start:], "input_top_logprobs": tops[start:]}

    def _top(self, lp: TextLogprob) -> list[list[Any]]:
        return [self._entry(v, i, t) for v, i, t in zip(lp.top_logprobs, lp.top_ids,
                                                         lp.top_tokens)]

    def _entry(self, logprob: float, token_id: int, text: str) -> list[Any]:
        return [_finite(logprob), token_id, text if self.text_in_logprobs else None]


# --- n > 1: each choice is shaped as a one-choice body, then given its index -----------


def with_index(body: dict[str, Any], index: int) -> dict[str, Any]:
    """A one-choice body (response or chunk) relabelled as choice `index`."""
    return {**body, "choices": [{**c, "index": index} for c in body["choices"]]}


def merged_response(bodies: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    """n one-choice responses of one prompt as one response with n choices (their
    reasoning tokens summed, where they count them)."""
    choices = [with_index(b, i)["choices"][0] for i, b in enumerate(bodies)]
    details = [b["usage"].get("completion_tokens_details") for b in bodies]
    reasoning = (sum(d["reasoning_tokens"] for d in details) if all(details) else None)
    return {**bodies[0], "choices": choices, "usage": usage_dict(usage, reasoning)}


def share_prompt_logprobs(results: list[Collected]) -> list[Collected]:
    """Only choice 0 scores the prompt (prepare.fan_out): every choice shows its entries."""
    prompt = results[0].prompt_logprobs
    return [dataclasses.replace(r, prompt_logprobs=prompt) for r in results]


@dataclass(frozen=True)
class BestOf:
    """best_of > n: of the choices generated, the n with the highest log-probability
    per token (OpenAI's definition; vLLM ranks by the sum) are returned, earlier
    choices first on a tie. `show_logprobs`: the client asked for them (else they were
    computed only to rank)."""

    n: int
    show_logprobs: bool

    def pick(self, results: list[Collected]) -> list[Collected]:
        order = sorted(range(len(results)), key=lambda i: -results[i].mean_logprob)
        kept = [results[i] for i in order[:self.n]]
        if self.show_logprobs:
            return kept
        return [dataclasses.replace(r, logprobs=None) for r in kept]


def total_usage(usages: list[Usage]) -> Usage:
    """The usage of n choices of one prompt: the prompt counts once, completions add up."""
    return Usage(prompt_tokens=usages[0].prompt_tokens,
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=usages[0].cached_tokens)

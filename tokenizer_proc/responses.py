"""Response bodies: whole responses and streamed chunks, for the OpenAI endpoints and the
native /generate.

Each formatter knows one endpoint's shapes; the HTTP layer drives them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ipc.messages.common import Usage
from ipc.messages.to_tokenizer import TextOutput
from tokenizer_proc.manager import Collected

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


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


class CompletionFormat(_Format):
    """Shapes of /v1/completions (object "text_completion")."""

    def opening(self) -> list[dict[str, Any]]:
        return []

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._envelope("text_completion", [_text_choice(text, None)])

    def finish_chunk(self, reason: str | None) -> dict[str, Any]:
        return self._envelope("text_completion", [_text_choice("", reason)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._usage_envelope("text_completion", usage)

    def response(self, result: Collected) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [_text_choice(result.text, result.finish_reason)],
                "usage": usage_dict(result.usage)}


class ChatFormat(_Format):
    """Shapes of /v1/chat/completions ("chat.completion", "chat.completion.chunk")."""

    def opening(self) -> list[dict[str, Any]]:
        # OpenAI's first chunk announces the role with empty content.
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, None)

    def finish_chunk(self, reason: str | None) -> dict[str, Any]:
        return self._chunk({}, reason)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._usage_envelope("chat.completion.chunk", usage)

    def response(self, result: Collected) -> dict[str, Any]:
        message = {"role": "assistant", "content": result.text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": result.finish_reason}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": [choice], "usage": usage_dict(result.usage)}

    def _chunk(self, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self._envelope("chat.completion.chunk", [choice])


ResponseFormat = CompletionFormat | ChatFormat


def _text_choice(text: str, reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}


@dataclass
class NativeFormat:
    """Shapes of the native /generate: one object, whole or (streamed) one per output."""

    id: str

    def response(self, result: Collected) -> dict[str, Any]:
        return self._shape(result.text, result.token_ids, result.finish_reason, result.usage)

    def chunk(self, output: TextOutput, usage: Usage) -> dict[str, Any]:
        """A streamed piece: the output's new text and ids; usage counts tokens so far."""
        return self._shape(output.text, output.token_ids, output.finish_reason, usage)

    def _shape(self, text: str, token_ids: list[int], finish_reason: str | None,
               usage: Usage) -> dict[str, Any]:
        meta = {"id": self.id, "finish_reason": finish_reason,
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens}
        return {"text": text, "output_ids": token_ids, "meta_info": meta}

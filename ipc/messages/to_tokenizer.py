"""Text outputs the detokenizer sends back to the tokenizer (front) process."""

from __future__ import annotations

import msgspec

from ipc.messages.common import Message, Usage
from ipc.messages.to_detokenizer import StatsReply


class TextOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A text delta (never a broken UTF-8 character) and the token ids behind it."""

    rid: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None


class BatchText(Message, frozen=True):
    outputs: list[TextOutput]


TokenizerMessage = BatchText | StatsReply

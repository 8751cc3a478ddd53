"""Text outputs the detokenizer sends back to the tokenizer (front) process."""

from __future__ import annotations

import msgspec

from ipc.messages.common import Message, Usage
from ipc.messages.to_detokenizer import StatsReply


class TextLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A TokenLogprob with each token's text: the decode of that one id, special tokens
    kept (a token that is part of a UTF-8 character decodes to U+FFFD)."""

    token: str
    logprob: float
    top_tokens: list[str] = []
    top_logprobs: list[float] = []
    token_id: int = -1  # -1: not known (records built by hand)
    top_ids: list[int] = []


class PromptTextLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """The prompt's tokens with their logprobs: `first` (token 0, whose logprob does not
    exist: nothing precedes it), then one entry per later prompt token."""

    first: str
    first_id: int
    rest: list[TextLogprob]


class TextOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A text delta (never a broken UTF-8 character) and the token ids behind it."""

    rid: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    # One per token id, for requests that asked for logprobs; None otherwise.
    logprobs: list[TextLogprob] | None = None
    prompt_logprobs: PromptTextLogprobs | None = None  # first output only, when asked for
    cumulative_logprob: float | None = None  # final output only, with logprobs
    # The error is the engine's death (EngineDead), not a refusal of this request: an
    # HTTP response says 503 rather than 400. Set by the front itself, never sent.
    engine_dead: bool = False
    stop_str: str | None = None  # final output of a request a stop string ended: that string


class BatchText(Message, frozen=True):
    outputs: list[TextOutput]


class EngineDead(Message, frozen=True):
    """From the launcher: a child behind the front died, so nothing in flight will ever
    finish. The front fails every waiting request with `reason` and refuses new ones
    until the launcher stops it."""

    reason: str


TokenizerMessage = BatchText | StatsReply | EngineDead

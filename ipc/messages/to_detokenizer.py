"""Token outputs the scheduler sends for detokenization."""

from __future__ import annotations

import msgspec

from ipc.messages.common import Message, SchedulerStats, TokenLogprob, Usage


class PromptTokenLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """A request's prompt with the logprobs of its tokens 1.. (token 0 has no context)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]


class TokenOutput(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens of one request since its last output.

    `prompt_tail` (the last few prompt ids) and `skip_special_tokens` come with the first
    output of a request only: they set up its detokenizer state.
    """

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    prompt_tail: list[int] | None = None
    skip_special_tokens: bool = True
    # One per token id, for requests that asked for logprobs; None otherwise.
    logprobs: list[TokenLogprob] | None = None
    # The request's stop strings (first output only: the detokenizer holds back any tail
    # that may start one) and, on the final output of a request they ended, the one matched.
    stop: list[str] | None = None
    include_stop_str: bool = False
    stop_str: str | None = None
    # First output of a request that asked for prompt logprobs (and had its whole prompt
    # computed); None otherwise.
    prompt_logprobs: PromptTokenLogprobs | None = None
    # Final output of a request with logprobs: the sum over every token it sampled (the
    # stop token too), which best_of ranks by.
    cumulative_logprob: float | None = None


class BatchTokens(Message, frozen=True):
    outputs: list[TokenOutput]


class StatsReply(Message, frozen=True):
    """Passed through to the tokenizer process unchanged."""

    query_id: str
    stats: SchedulerStats


DetokenizerMessage = BatchTokens | StatsReply

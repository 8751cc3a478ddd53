"""Records between programmatic clients (`ipc.client`) and the tokenizer process's ZMQ front.

The client's DEALER socket talks to the front's ROUTER: every reply names the client's own
`request_id`, which the client uses to hand it to the right waiter. Request ids only need
to be unique per client.
"""

from __future__ import annotations

from typing import Any

from ipc.messages.common import Message, SchedulerStats, Usage
from ipc.messages.to_tokenizer import TextLogprob


class GenerateRequest(Message, frozen=True):
    """Text or token ids in (exactly one); the same sampling fields the HTTP API takes.

    top_k 0 or -1 means off, temperature 0 means greedy, seed None means unseeded;
    max_tokens None means 16, or fewer when the context has less room left. A sampling
    field left None takes the server's default, as on the HTTP routes (the model's
    generation_config.json value under --sampling-defaults model, else OpenAI's). The
    other sampling fields mean what the OpenAI routes' fields of the same names mean.
    """

    request_id: str
    prompt: str | None = None
    input_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_p: float | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    skip_special_tokens: bool = True
    api_key: str | None = None  # checked when the server has --api-key
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k log-probabilities per token (0..20); None: off
    # The same for every prompt token given the ones before it (0..20); None: off. The
    # prompt is then computed whole (no prefix-cache reuse), and max_tokens may be 0.
    prompt_logprobs: int | None = None
    n: int = 1  # outputs of the prompt (1..16), each replied with its `index`
    # Structured output, at most one: a JSON schema (object or JSON text), a regex, a GBNF
    # grammar (llama.cpp syntax) or a Lark grammar (llguidance's dialect).
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    lark: str | None = None


class AbortGenerate(Message, frozen=True):
    """Stop a request; its waiter then gets a final output with finish_reason "abort"."""

    request_id: str
    api_key: str | None = None


class StatsQuery(Message, frozen=True):
    """The scheduler's stats; with flush_cache, after dropping every unlocked cached prefix."""

    request_id: str
    flush_cache: bool = False
    api_key: str | None = None


class GenerateOutput(Message, frozen=True):
    """A streamed delta (stream=True) or the whole result (stream=False).

    The last message of each of a request's n outputs has finished=True; `usage` (its
    prompt and its own completion tokens) comes with it. A refused or failed request gets
    one message with finished=True and `error` set.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[TextLogprob] | None = None  # one per token id, when asked for
    index: int = 0  # which of the request's n outputs
    # One per prompt token, None for token 0 (nothing precedes it), when asked for: on
    # the whole result, or on the first streamed delta; with n > 1 on output 0's only.
    prompt_logprobs: list[TextLogprob | None] | None = None


class StatsResult(Message, frozen=True):
    """The scheduler's snapshot, or `error` when it did not answer in time."""

    request_id: str
    stats: SchedulerStats | None = None
    error: str | None = None


ClientToServer = GenerateRequest | AbortGenerate | StatsQuery
ServerToClient = GenerateOutput | StatsResult

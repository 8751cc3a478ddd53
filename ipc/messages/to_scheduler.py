"""Records received by the scheduler: requests from the tokenizer, results from the worker."""

from __future__ import annotations

from ipc.messages.common import Message, SamplingParams


class TokenizedRequest(Message, frozen=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: list[int]
    skip_special_tokens: bool = True


class AbortRequest(Message, frozen=True):
    rid: str


class GetStats(Message, frozen=True):
    query_id: str


class FlushCache(Message, frozen=True):
    """Drop every unlocked cached prefix; answered with a StatsReply of the same query_id."""

    query_id: str


class WorkerReady(Message, frozen=True):
    """The worker's handshake: the KV pool it allocated fixes the scheduler's capacity."""

    num_slots: int
    max_context_len: int


class StepResult(Message, frozen=True):
    """One sampled token for every request of step `step` that asked for one."""

    step: int
    rids: list[str]
    token_ids: list[int]


SchedulerMessage = (TokenizedRequest | AbortRequest | GetStats | FlushCache | WorkerReady
                    | StepResult)

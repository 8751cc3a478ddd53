"""Scheduler-side request state and the waiting queue."""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from ipc.messages.common import SamplingParams
from ipc.messages.to_scheduler import TokenizedRequest

# The detokenizer decodes the first outputs with this much prompt context (see TokenOutput).
PROMPT_TAIL = 4


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    skip_special_tokens: bool = True
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None
    num_computed: int = 0  # tokens whose K/V the worker has been told to write
    on_worker: bool = False
    announced: bool = False  # the detokenizer has seen this request's first output
    finish_reason: FinishReason | None = None

    @classmethod
    def from_message(cls, msg: TokenizedRequest) -> "Req":
        return cls(rid=msg.rid, input_ids=list(msg.input_ids), sampling=msg.sampling,
                   stop_token_ids=frozenset(msg.stop_token_ids),
                   skip_special_tokens=msg.skip_special_tokens)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.num_computed

    @property
    def max_kv_tokens(self) -> int:
        """K/V slots the request can ever hold: its last token's K/V is never computed."""
        return self.prompt_len + self.sampling.max_new_tokens - 1

    @property
    def future_kv_tokens(self) -> int:
        return self.max_kv_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class WaitingQueue:
    """First come, first served; removal by id for aborts."""

    def __init__(self) -> None:
        self._reqs: OrderedDict[str, Req] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def push(self, req: Req) -> None:
        self._reqs[req.rid] = req

    def peek(self) -> Req | None:
        return next(iter(self._reqs.values()), None)

    def pop(self) -> Req:
        return self._reqs.popitem(last=False)[1]

    def remove(self, rid: str) -> Req | None:
        return self._reqs.pop(rid, None)

"""Scheduler-side request state and the waiting queue."""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from ipc.messages.common import SamplingParams, TokenLogprob
from ipc.messages.to_scheduler import TokenizedRequest
from kiln_common.incremental_text import DetokenizerState, TokenizerLike
from kiln_common.stops import StopStringMatcher
from scheduler_proc.radix_cache import Node

# The detokenizer decodes the first outputs with this much prompt context (see TokenOutput).
PROMPT_TAIL = 4


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the worker could not serve it (Req.error says why)


@dataclass
class StopWatch:
    """A request's generated text, decoded as it grows, against its stop strings.

    The decode is the detokenizer's own incremental one (a bounded window of ids per
    step), so the scheduler stops at exactly the step whose text the detokenizer cuts.
    """

    decoder: DetokenizerState
    matcher: StopStringMatcher

    @classmethod
    def start(cls, tokenizer: TokenizerLike, req: "Req") -> "StopWatch":
        decoder = DetokenizerState.start(tokenizer, req.input_ids[-PROMPT_TAIL:],
                                         req.skip_special_tokens)
        return cls(decoder, StopStringMatcher(req.stop))

    def feed(self, token: int) -> str | None:
        """The stop string the text now contains, if any."""
        return self.matcher.feed(self.decoder.step([token]))


@dataclass
class DupRange:
    """Positions [start, end) of a request's own copies of tokens another request cached
    first: its row of the req-to-token table holds their slots, which it owns."""

    start: int
    end: int
    # The first of them still holding its window slots (those behind every window give
    # theirs back: Scheduler._trim_windows).
    windows_from: int


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    skip_special_tokens: bool = True
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None
    num_computed: int = 0  # tokens whose K/V the worker has been told to write
    # Tokens to compute before the next sample: the prompt, or prompt + outputs when a
    # preempted request resumes. Set at each admission.
    fill_len: int = 0
    # NOTE: slot ownership. The radix cache owns the slots of the first prefix_len tokens
    # (locked through last_node); the request owns [prefix_len, num_computed) plus
    # the positions of dups (its own copies of tokens another request cached first).
    prefix_len: int = 0
    last_node: Node | None = None
    dups: list[DupRange] = field(default_factory=list)
    # Windowed layers (WindowSlots): the first position its latest planned queries see
    # (what window eviction must leave alone), and how far its own positions behind
    # every window have given their window slots back.
    sees_from: int = 0
    window_from: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    admission: int = 0  # the serial of its latest admission, unique in the scheduler; 0: none
    # Scheduler steps planned when it last joined the queue (WaitingQueue.push), and
    # the step sampling its first token after its latest admission (decode first's rule:
    # Scheduler._decode_first).
    waiting_since: int = 0
    decoding_since: int = 0
    # Steps sent that sample this request and whose results are not in yet.
    samples_in_flight: int = 0
    on_worker: bool = False
    announced: bool = False  # the detokenizer has seen this request's first output
    finish_reason: FinishReason | None = None
    error: str | None = None  # with FinishReason.ERROR
    stop: list[str] = field(default_factory=list)  # stop strings
    include_stop_str: bool = False
    stop_watch: StopWatch | None = None  # set at arrival when there are stop strings
    stop_str: str | None = None  # the stop string that ended the request
    # Prompt logprobs received so far, of prompt tokens 1.. in order (when asked for).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # over every sampled token, when logprobs are on
    _prompt_ids: np.ndarray | None = field(default=None, repr=False)  # see all_ids

    @classmethod
    def from_message(cls, msg: TokenizedRequest) -> "Req":
        return cls(rid=msg.rid, input_ids=list(msg.input_ids), sampling=msg.sampling,
                   stop_token_ids=frozenset(msg.stop_token_ids),
                   skip_special_tokens=msg.skip_special_tokens, stop=list(msg.stop),
                   include_stop_str=msg.include_stop_str_in_output)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    def all_ids(self, end: int | None = None) -> np.ndarray:
        """Prompt then outputs (the first `end`), as the radix cache keys them.

        NOTE: within the prompt this is a view of an array made once, so planning a chunk
        or checking a prefix costs O(1), not O(context), per call.
        """
        end = self.prompt_len + len(self.output_ids) if end is None else end
        if end <= self.prompt_len:
            return self._prompt_array[:end]
        tail = np.asarray(self.output_ids[:end - self.prompt_len], dtype=np.int32)
        return np.concatenate([self._prompt_array, tail])

    @property
    def _prompt_array(self) -> np.ndarray:
        if self._prompt_ids is None:
            self._prompt_ids = np.asarray(self.input_ids, dtype=np.int32)
        return self._prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.fill_len

    @property
    def remaining_fill(self) -> int:
        return self.fill_len - self.num_computed

    @property
    def remaining_new(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    @property
    def owned_slots(self) -> int:
        return self.num_computed - self.prefix_len + sum(d.end - d.start for d in self.dups)

    @property
    def max_kv_tokens(self) -> int:
        """K/V slots the request can ever hold: its last token's K/V is never computed
        (with max_new_tokens 0 the whole prompt's is)."""
        return self.prompt_len + max(0, self.sampling.max_new_tokens - 1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and does not have them all yet: such a request
        computes its whole prompt (a cached prefix would leave positions unscored)."""
        return (self.sampling.prompt_logprobs >= 0
                and len(self.prompt_logprobs) < self.prompt_len - 1)

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Take the entries of prompt tokens start.. that extend what it has; a repeat
        (a step that was in flight across a preemption) adds nothing."""
        have = len(self.prompt_logprobs) + 1  # the next prompt token without one
        if start <= have < start + len(entries):
            self.prompt_logprobs.extend(entries[have - start:self.prompt_len - start])


class WaitingQueue:
    """First come, first served; removal by id for aborts."""

    def __init__(self) -> None:
        self._reqs: OrderedDict[str, Req] = OrderedDict()
        # (waiting_since, request) in the order pushed, which is the order of
        # waiting_since whatever the queue's order (a preempted request joins its head,
        # lpm re-sorts), as every push stamps the step it happens in: the oldest is the
        # first entry still queued, found in O(1) amortized. Entries of requests gone (or
        # queued again since) are dropped lazily.
        self._since: deque[tuple[int, Req]] = deque()

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def push(self, req: Req, step: int) -> None:
        """Queue req as of scheduler step `step` (its waiting_since)."""
        req.waiting_since = step
        self._reqs[req.rid] = req
        self._since.append((step, req))
        if len(self._since) > 2 * len(self._reqs) + 64:  # a long-queued head (lpm)
            self._since = deque(e for e in self._since if self._queued(*e))

    def push_front(self, req: Req, step: int) -> None:
        """A preempted request goes back to the head: it was admitted before the others."""
        self.push(req, step)
        self._reqs.move_to_end(req.rid, last=False)

    def oldest_since(self) -> int | None:
        """The earliest waiting_since of a queued request (None: the queue is empty)."""
        while self._since:
            since, req = self._since[0]
            if self._queued(since, req):
                return since
            self._since.popleft()
        return None

    def _queued(self, since: int, req: Req) -> bool:
        return self._reqs.get(req.rid) is req and req.waiting_since == since

    def reorder(self, key) -> None:  # noqa: ANN001 - a sort key over Req
        """Stable re-sort (the lpm policy orders by cached prefix length)."""
        self._reqs = OrderedDict((r.rid, r) for r in sorted(self._reqs.values(), key=key))

    def peek(self) -> Req | None:
        return next(iter(self._reqs.values()), None)

    def pop(self) -> Req:
        return self._reqs.popitem(last=False)[1]

    def remove(self, rid: str) -> Req | None:
        return self._reqs.pop(rid, None)

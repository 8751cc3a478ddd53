"""Request bookkeeping of the front process: ids, output routing, aborts, stats queries.

No sockets here: the engine is anything with `async send(message)`, and outputs come in
through `on_message`, so tests drive the manager with a fake engine. Every request's life
also passes through `metrics`, the front's Prometheus series.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from ipc.messages.common import SchedulerStats, Usage
from ipc.messages.to_scheduler import AbortRequest, FlushCache, GetStats, TokenizedRequest
from ipc.messages.to_tokenizer import (BatchText, EngineDead, PromptTextLogprobs, StatsReply,
                                       TextLogprob, TextOutput, TokenizerMessage)
from tokenizer_proc.errors import EngineUnavailable
from tokenizer_proc.metrics import ABORT, RequestMetrics

logger = logging.getLogger(__name__)


class EngineLink(Protocol):
    """Where requests go: the scheduler's socket in production, a fake in tests."""

    async def send(self, message: TokenizedRequest | AbortRequest | GetStats | FlushCache) -> None: ...


class StatsUnavailable(Exception):
    """The scheduler did not answer a stats query in time."""


def new_id(prefix: str, sep: str = "-") -> str:
    """A request id in the form its API's clients know: OpenAI's chat and completion ids
    join with "-" (chatcmpl-...), Responses' and Anthropic's with "_" (resp_..., msg_...)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def is_terminal(output: TextOutput) -> bool:
    return output.finished or output.error is not None


@dataclass
class Collected:
    """A whole generation, folded from its outputs."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    error: str | None = None
    logprobs: list[TextLogprob] | None = None  # one per token id, when asked for
    prompt_logprobs: PromptTextLogprobs | None = None  # when asked for
    cumulative_logprob: float | None = None  # of every sampled token, with logprobs
    engine_dead: bool = False  # the error is the engine's death (see TextOutput)
    stop_str: str | None = None  # the stop string that ended it, if one did
    # Each output's characters of `text` and tokens, in order: the stream's deltas, for
    # folds that attribute tokens to parts of the text (reasoning).
    piece_sizes: list[tuple[int, int]] = field(default_factory=list)

    def pieces(self) -> Iterator[tuple[str, int]]:
        """The stream's deltas again: each output's text and how many tokens it holds."""
        at = 0
        for chars, tokens in self.piece_sizes:
            yield self.text[at:at + chars], tokens
            at += chars

    @property
    def mean_logprob(self) -> float:
        """Log-probability per generated token (the stop token too): what best_of ranks
        by. Without logprobs or tokens it is -inf."""
        n = self.usage.completion_tokens
        if self.cumulative_logprob is None or n == 0:
            return float("-inf")
        return self.cumulative_logprob / n


class RequestStream:
    """The outputs of one submitted request, in order, up to its terminal output."""

    def __init__(self, manager: "TokenizerManager", request: TokenizedRequest,
                 queue: asyncio.Queue[TextOutput]) -> None:
        self.rid = request.rid
        self.prompt_tokens = len(request.input_ids)
        self.completion_tokens = 0
        self.done = False
        self._manager = manager
        self._queue = queue

    async def next(self) -> TextOutput:
        """The next output; after the terminal one, `done` is set and nothing more comes."""
        output = await self._queue.get()
        self.completion_tokens += len(output.token_ids)
        self.done = is_terminal(output)
        return output

    def usage(self, last: TextOutput) -> Usage:
        """The engine's usage from the terminal output, else what this stream counted."""
        return last.usage or Usage(prompt_tokens=self.prompt_tokens,
                                   completion_tokens=self.completion_tokens)

    async def collect(self, first: TextOutput | None = None) -> Collected:
        """Wait for the end and fold every output into one result."""
        outputs = [first] if first is not None else []
        while not (outputs and is_terminal(outputs[-1])):
            outputs.append(await self.next())
        return self._fold(outputs)

    def close(self) -> None:
        """Abort the request unless it already ended; safe to call any number of times.

        Synchronous on purpose: it runs in `finally` blocks of cancelled tasks, where an
        await would be cancelled again.
        """
        # NOTE: `done` stays False until the final "abort" output is read, so a reader
        # still relays that output; the manager ignores an abort of an ended request.
        if not self.done:
            self._manager.abort(self.rid)

    def _fold(self, outputs: list[TextOutput]) -> Collected:
        last = outputs[-1]
        return Collected(text="".join(o.text for o in outputs),
                         token_ids=[t for o in outputs for t in o.token_ids],
                         finish_reason=last.finish_reason, usage=self.usage(last),
                         error=last.error, logprobs=_joined_logprobs(outputs),
                         prompt_logprobs=next((o.prompt_logprobs for o in outputs
                                               if o.prompt_logprobs is not None), None),
                         cumulative_logprob=last.cumulative_logprob,
                         engine_dead=last.engine_dead, stop_str=last.stop_str,
                         piece_sizes=[(len(o.text), len(o.token_ids)) for o in outputs])


def _joined_logprobs(outputs: list[TextOutput]) -> list[TextLogprob] | None:
    """All outputs' logprobs in order; None when the request did not ask for them."""
    if all(o.logprobs is None for o in outputs):
        return None
    return [lp for o in outputs for lp in o.logprobs or []]


@dataclass
class TokenizerManager:
    """Tracks every request in flight and routes the engine's outputs to its waiter."""

    engine: EngineLink
    stats_timeout: float = 10.0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    _queues: dict[str, asyncio.Queue[TextOutput]] = field(default_factory=dict)
    _stats: dict[str, asyncio.Future[SchedulerStats]] = field(default_factory=dict)
    _background: set[asyncio.Task[None]] = field(default_factory=set)
    _groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # n-choice id -> choices
    # Why the engine is gone (EngineDead); from then on nothing is sent to it.
    engine_failure: str | None = None

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    def rids(self) -> list[str]:
        return list(self._queues)

    def is_in_flight(self, rid: str) -> bool:
        """Whether rid names a request (or an n-choice group) that has not ended."""
        return rid in self._queues or any(k in self._queues for k in self._groups.get(rid, ()))

    async def submit(self, request: TokenizedRequest) -> RequestStream:
        """Register the request (before sending: outputs may come back at once) and send it.
        Raises EngineUnavailable once the engine is gone."""
        if self.engine_failure is not None:
            raise EngineUnavailable(self.engine_failure)
        if request.rid in self._queues:
            raise ValueError(f"request id {request.rid} is already in flight")
        queue: asyncio.Queue[TextOutput] = asyncio.Queue()
        self._queues[request.rid] = queue
        self.metrics.submitted(request.rid, len(request.input_ids))
        try:
            await self.engine.send(request)
        except BaseException:
            del self._queues[request.rid]
            self.metrics.forget(request.rid)
            raise
        return RequestStream(self, request, queue)

    def on_message(self, message: TokenizerMessage) -> None:
        """Route what the detokenizer sent: text outputs to their streams, stats replies."""
        if isinstance(message, BatchText):
            for output in message.outputs:
                self._route(output)
        elif isinstance(message, StatsReply):
            self._answer_stats(message)
        elif isinstance(message, EngineDead):
            self.fail_all(message.reason)

    def _route(self, output: TextOutput) -> None:
        queue = self._queues.get(output.rid)
        if queue is None:
            # Normal after an abort: the engine may have been mid-step.
            logger.debug("dropped an output of unknown or finished request %s", output.rid)
            return
        if is_terminal(output):
            del self._queues[output.rid]
        self.metrics.output(output)
        queue.put_nowait(output)

    def abort(self, rid: str) -> bool:
        """Stop a request: the engine is told, its waiter gets a final 'abort' output.

        Returns False when the request had already ended.
        """
        if rid in self._groups:
            return any([self.abort(child) for child in self._groups.pop(rid)])
        queue = self._queues.pop(rid, None)
        if queue is None:
            return False
        logger.info("aborting request %s", rid)
        self.metrics.aborted(rid)
        queue.put_nowait(TextOutput(rid=rid, text="", token_ids=[], finished=True,
                                    finish_reason=ABORT))
        self._send_later(AbortRequest(rid=rid))
        return True

    def group(self, parent: str, children: list[str]) -> None:
        """Let abort(parent) stop the engine requests of an n-choice request."""
        # Drop groups whose choices have all ended: the map stays as small as what runs.
        for done in [p for p, kids in self._groups.items()
                     if not any(k in self._queues for k in kids)]:
            del self._groups[done]
        self._groups[parent] = tuple(children)

    def abort_all(self) -> list[str]:
        """Abort everything in flight (shutdown); returns the aborted ids."""
        rids = self.rids()
        for rid in rids:
            self.abort(rid)
        return rids

    def fail_all(self, reason: str) -> list[str]:
        """The engine is gone: every request in flight ends with `reason` as its error,
        every stats query fails, and later ones are refused at once. Returns the failed
        ids. Nothing is sent: the engine would never answer."""
        self.engine_failure = reason
        failed = self.rids()
        logger.error("%s; failing %d request(s) in flight", reason, len(failed))
        for rid in failed:
            self._route(TextOutput(rid=rid, text="", token_ids=[], finished=True,
                                   error=reason, engine_dead=True))
        self._groups.clear()
        for future in self._stats.values():
            if not future.done():
                future.set_exception(StatsUnavailable(reason))
        return failed

    async def flush(self) -> None:
        """Wait until every message queued by `abort` has been handed to the engine link."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to timeout seconds for all requests to end; True if they did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queues and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._queues

    async def query_stats(self, timeout: float | None = None,
                          flush_cache: bool = False) -> SchedulerStats:
        """Round trip a GetStats (or a FlushCache, answered with the stats after the
        flush) to the scheduler; raises StatsUnavailable on timeout, or at once when the
        engine is gone."""
        if self.engine_failure is not None:
            raise StatsUnavailable(self.engine_failure)
        query_id = uuid.uuid4().hex
        future: asyncio.Future[SchedulerStats] = asyncio.get_running_loop().create_future()
        self._stats[query_id] = future
        query = FlushCache(query_id=query_id) if flush_cache else GetStats(query_id=query_id)
        try:
            await self.engine.send(query)
            return await asyncio.wait_for(future, timeout or self.stats_timeout)
        except asyncio.TimeoutError:
            raise StatsUnavailable("the scheduler did not answer the stats query") from None
        finally:
            self._stats.pop(query_id, None)

    def _answer_stats(self, reply: StatsReply) -> None:
        # Any answer, whoever asked, refreshes the scheduler's series.
        self.metrics.set_scheduler_stats(reply.stats)
        future = self._stats.pop(reply.query_id, None)
        if future is not None and not future.done():
            future.set_result(reply.stats)

    def _send_later(self, message: AbortRequest) -> None:
        # A task, not an await: abort() runs in finally blocks of cancelled tasks.
        task = asyncio.get_running_loop().create_task(self.engine.send(message))
        self._background.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("could not send to the scheduler: %s", task.exception())

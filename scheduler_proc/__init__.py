"""Scheduler process: owns the queue, the KV slot allocator and the req-to-token table."""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass

from kiln_common.incremental_text import TokenizerLike
from ipc.channel import Receiver, Sender
from ipc.config import ServerConfig
from ipc.messages.to_detokenizer import BatchTokens, StatsReply, TokenOutput
from ipc.messages.to_scheduler import (AbortRequest, FlushCache, GetStats, SchedulerMessage,
                                       StepResult, TokenizedRequest, WorkerReady)
from ipc.messages.to_worker import SyncSteps
from ipc.process import setup_child
from scheduler_proc.scheduler import Scheduler, SchedulerLimits

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000


def _wait_for_worker(inbox: Receiver[SchedulerMessage],
                     early: list[SchedulerMessage]) -> WorkerReady:
    """Block until the worker's handshake; anything that arrives first is kept for later."""
    while True:
        message = inbox.recv()
        if isinstance(message, WorkerReady):
            return message
        if message is not None:
            early.append(message)


def limits_from(config: ServerConfig, ready: WorkerReady) -> SchedulerLimits:
    return SchedulerLimits(capacity=ready.num_slots, max_context=ready.max_context_len,
                           max_running=config.max_running_requests,
                           chunk_size=ready.chunk_size, chunk_align=ready.chunk_align,
                           prefix_align=ready.prefix_align,
                           max_prefill_tokens=config.max_prefill_tokens,
                           max_prefill_tokens_while_decoding=ready.decode_first_tokens,
                           decode_first_for_all=config.fixed_decode_first_budget,
                           radix_cache=not config.disable_radix_cache and ready.prefix_cache,
                           schedule_policy=config.schedule_policy,
                           state_snapshots=ready.state_snapshots,
                           snapshot_stride=config.snapshot_stride,
                           window_slots=ready.window_slots,
                           windows=tuple((kind, span) for kind, span in ready.windows),
                           bytes_per_slot=ready.bytes_per_slot,
                           window_bytes_per_slot=ready.window_bytes_per_slot,
                           prefill_parts=ready.prefill_parts)


@dataclass(frozen=True)
class InFlight:
    step: int
    sent_at: float


class SchedulerLoop:
    """The scheduler process's step loop.

    1. wait for news unless a step can be planned now, then drain every message;
    2. apply step results and requests (stop checks, admission input, aborts);
    3. keep `max_in_flight` steps at the worker: with overlap (2 or more) step N+1 is
       planned and sent before step N's result is processed, so this bookkeeping runs while
       the device computes; when nothing more can be planned, ask the worker to report what
       it holds;
    4. forward new tokens to the detokenizer.
    """

    def __init__(self, scheduler: Scheduler, inbox: Receiver[SchedulerMessage],
                 worker: Sender, detokenizer: Sender, max_in_flight: int = 2) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.worker = worker
        self.detokenizer = detokenizer
        self.max_in_flight = max_in_flight
        self.in_flight: deque[InFlight] = deque()
        self._synced = True  # the worker has been told to report every launched step
        # Planning found nothing to do; until a message changes the state it would again.
        self._idle = False

    def handle(self, message: SchedulerMessage, outputs: list[TokenOutput]) -> None:
        s = self.scheduler
        if isinstance(message, TokenizedRequest):
            outputs += s.add_request(message)
        elif isinstance(message, AbortRequest):
            outputs += s.abort(message.rid)
        elif isinstance(message, StepResult):
            outputs += s.apply_result(self._landed(message))
        elif isinstance(message, GetStats):
            self.detokenizer.send(StatsReply(query_id=message.query_id, stats=s.stats()))
        elif isinstance(message, FlushCache):
            logger.info("flushed %d cached slots", s.flush_cache())
            self.detokenizer.send(StatsReply(query_id=message.query_id, stats=s.stats()))
        elif isinstance(message, WorkerReady):
            logger.warning("ignoring a second worker handshake")

    def _landed(self, result: StepResult) -> StepResult:
        sent = self.in_flight.popleft() if self.in_flight else None
        if sent is None or sent.step != result.step:
            raise RuntimeError(f"result of step {result.step}, expected {sent}")
        logger.debug("step %d: %d tokens back after %.1f ms", result.step,
                     len(result.token_ids), (time.perf_counter() - sent.sent_at) * 1e3)
        return result

    def run_once(self) -> None:
        can_plan = (len(self.in_flight) < self.max_in_flight and self.scheduler.has_work
                    and not self._idle)
        first = self.inbox.recv(timeout_ms=0 if can_plan else _IDLE_POLL_MS)
        messages = ([first] if first is not None else []) + self.inbox.drain()
        self._idle = self._idle and not messages
        outputs: list[TokenOutput] = []
        for message in messages:
            self.handle(message, outputs)
        self._launch()
        if outputs:
            self.detokenizer.send(BatchTokens(outputs=outputs))

    def _launch(self) -> None:
        while len(self.in_flight) < self.max_in_flight:
            batch = self.scheduler.plan_step()
            if batch is None:
                self._idle = True
                break
            self.worker.send(batch)
            self.in_flight.append(InFlight(batch.step, time.perf_counter()))
            self._synced = self.max_in_flight == 1
            if logger.isEnabledFor(logging.DEBUG):
                # Each chunk as tokens@start: where chunks start says which attention
                # path the worker takes (bucket edges or not, PrefillBudget).
                logger.debug("step %d: %d prefill chunks (%d tokens%s), %d decodes%s",
                             batch.step, len(batch.prefill),
                             sum(len(c.token_ids) for c in batch.prefill),
                             "".join(f", {len(c.token_ids)}@{c.start}" for c in batch.prefill[:8]),
                             len(batch.decode_rids),
                             f", prefill parts {batch.parts_from}-{batch.parts_to} of "
                             f"{batch.parts}" if batch.parts > 1 else "")
        if self.in_flight and not self._synced and len(self.in_flight) < self.max_in_flight:
            # Nothing to chain behind the last step: the worker must not wait for one.
            self.worker.send(SyncSteps())
            self._synced = True


def _load_tokenizer(config: ServerConfig) -> TokenizerLike:
    from transformers import AutoTokenizer  # slow import: only once a request has stops

    logger.info("loading the tokenizer for stop strings")
    return AutoTokenizer.from_pretrained(config.model_path,
                                         trust_remote_code=config.trust_remote_code)


def run_scheduler(config: ServerConfig) -> None:
    reporter = setup_child(config, "scheduler")
    inbox: Receiver[SchedulerMessage] = Receiver(config.scheduler_endpoint, SchedulerMessage)
    worker = Sender(config.worker_endpoint)
    detokenizer = Sender(config.detokenizer_endpoint)
    reporter.progress("waiting for the worker's KV pool")
    early: list[SchedulerMessage] = []
    ready = _wait_for_worker(inbox, early)
    scheduler = Scheduler(limits_from(config, ready), functools.partial(_load_tokenizer, config))
    if not ready.overlap and config.steps_in_flight != 2:
        logger.warning("--steps-in-flight %d unused: overlap is off on this device (--overlap "
                       "auto); one step at a time", config.steps_in_flight)
    loop = SchedulerLoop(scheduler, inbox, worker, detokenizer,
                         max_in_flight=config.steps_in_flight if ready.overlap else 1)
    outputs: list[TokenOutput] = []
    for message in early:
        loop.handle(message, outputs)
    if outputs:
        detokenizer.send(BatchTokens(outputs=outputs))
    reporter.ready(f"capacity {ready.num_slots} slots, context {ready.max_context_len}")
    while True:
        loop.run_once()

"""Scheduler process: owns the queue, the KV slot allocator and the req-to-token table."""

from __future__ import annotations

import logging
import time

from ipc.channel import Receiver, Sender
from ipc.config import ServerConfig
from ipc.messages.to_detokenizer import BatchTokens, StatsReply, TokenOutput
from ipc.messages.to_scheduler import (AbortRequest, GetStats, SchedulerMessage, StepResult,
                                       TokenizedRequest, WorkerReady)
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
                           chunk_size=config.chunk_size,
                           max_prefill_tokens=config.max_prefill_tokens)


class SchedulerLoop:
    """Drain messages, plan a step if none is in flight, ship outputs; repeat."""

    def __init__(self, scheduler: Scheduler, inbox: Receiver[SchedulerMessage],
                 worker: Sender, detokenizer: Sender) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.worker = worker
        self.detokenizer = detokenizer
        self.in_flight: int | None = None  # step id sent to the worker, result pending
        self._sent_at = 0.0

    def handle(self, message: SchedulerMessage, outputs: list[TokenOutput]) -> None:
        s = self.scheduler
        if isinstance(message, TokenizedRequest):
            outputs += s.add_request(message)
        elif isinstance(message, AbortRequest):
            outputs += s.abort(message.rid)
        elif isinstance(message, StepResult):
            if message.step != self.in_flight:
                raise RuntimeError(f"result of step {message.step}, expected {self.in_flight}")
            self.in_flight = None
            logger.debug("step %d: %d tokens back after %.1f ms", message.step,
                         len(message.token_ids), (time.perf_counter() - self._sent_at) * 1e3)
            outputs += s.apply_result(message)
        elif isinstance(message, GetStats):
            self.detokenizer.send(StatsReply(query_id=message.query_id, stats=s.stats()))
        elif isinstance(message, WorkerReady):
            logger.warning("ignoring a second worker handshake")

    def run_once(self) -> None:
        # 1. Wait for news (a result, a request) unless a step can be planned right away;
        #    then drain whatever else has arrived.
        can_plan = self.in_flight is None and self.scheduler.has_work
        first = self.inbox.recv(timeout_ms=0 if can_plan else _IDLE_POLL_MS)
        messages = ([first] if first is not None else []) + self.inbox.drain()
        outputs: list[TokenOutput] = []
        for message in messages:
            self.handle(message, outputs)
        # 2. Plan and launch the next step once the previous one is back.
        if self.in_flight is None:
            batch = self.scheduler.plan_step()
            if batch is not None:
                self.worker.send(batch)
                self.in_flight = batch.step
                self._sent_at = time.perf_counter()
                logger.debug("step %d: %d prefill chunks (%d tokens), %d decodes", batch.step,
                             len(batch.prefill), sum(len(c.token_ids) for c in batch.prefill),
                             len(batch.decode_rids))
        # 3. Forward finished and streamed tokens.
        if outputs:
            self.detokenizer.send(BatchTokens(outputs=outputs))


def run_scheduler(config: ServerConfig) -> None:
    reporter = setup_child(config, "scheduler")
    inbox: Receiver[SchedulerMessage] = Receiver(config.scheduler_endpoint, SchedulerMessage)
    worker = Sender(config.worker_endpoint)
    detokenizer = Sender(config.detokenizer_endpoint)
    reporter.progress("waiting for the worker's KV pool")
    early: list[SchedulerMessage] = []
    ready = _wait_for_worker(inbox, early)
    loop = SchedulerLoop(Scheduler(limits_from(config, ready)), inbox, worker, detokenizer)
    outputs: list[TokenOutput] = []
    for message in early:
        loop.handle(message, outputs)
    if outputs:
        detokenizer.send(BatchTokens(outputs=outputs))
    reporter.ready(f"capacity {ready.num_slots} slots, context {ready.max_context_len}")
    while True:
        loop.run_once()

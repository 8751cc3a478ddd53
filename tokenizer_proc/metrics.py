"""Observability of the front process: Prometheus series and request/throughput logging.

Per-request timings (time to first token, inter-token latency, end to end) are measured
here, where outputs reach their clients; queue, KV and cache figures come from the
scheduler's `SchedulerStats`, refreshed whenever a stats reply passes through the manager.
Each `RequestMetrics` owns its own `CollectorRegistry`, so several apps can live in one
process (tests) without sharing series.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ipc.messages.common import SchedulerStats
from ipc.messages.to_tokenizer import TextOutput

logger = logging.getLogger(__name__)

ABORT = "abort"
# 1 ms (a fast decode step) to 60 s (a long generation); slower lands in +Inf.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                   10.0, 20.0, 30.0, 60.0)
# Inter-token gaps sit at 5-50 ms on a GPU: edges a few ms apart there, so a p99 read off
# the histogram (a decode step's against one carrying prefill) tells 30 ms from 45.
ITL_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025,
               0.03, 0.035, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)

Clock = Callable[[], float]


@dataclass
class _Timing:
    """One request's progress as seen by the front (monotonic seconds)."""

    start: float
    prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0


@dataclass
class ThroughputWindow:
    """Tokens counted since the last throughput log line."""

    since: float
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def line(self, now: float, running: int | None, waiting: int | None) -> str:
        """The info line for this window (None counts: the scheduler did not answer)."""
        span = max(now - self.since, 1e-9)
        return (f"throughput: running {_count(running)}, waiting {_count(waiting)}, "
                f"prompt {self.prompt_tokens / span:.1f} tok/s, "
                f"generation {self.generation_tokens / span:.1f} tok/s (last {span:.1f} s)")


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


class SchedulerCollector(Collector):
    """Series read from the scheduler's latest stats snapshot (all zero before the first)."""

    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield _gauge("kiln_num_requests_running", "Requests in the running batch.",
                     s.running_requests if s else 0)
        yield _gauge("kiln_num_requests_waiting", "Requests queued for admission.",
                     s.waiting_requests if s else 0)
        yield _gauge("kiln_kv_slots_used", "KV pool slots in use.", s.used_slots if s else 0)
        yield _gauge("kiln_kv_slots_capacity", "KV pool slots in all.",
                     s.capacity_slots if s else 0)
        yield _gauge("kiln_window_slots_used", "Slots of the windowed layers' own pool in "
                     "use (models with sliding-window or chunked layers).",
                     s.window_used_slots if s else 0)
        yield _gauge("kiln_window_slots_capacity", "Slots of the windowed layers' own pool.",
                     s.window_capacity_slots if s else 0)
        yield _gauge("kiln_kv_bytes_used", "Bytes of K/V held by positions in use (full "
                     "and windowed layers).", s.kv_bytes_used if s else 0)
        yield _gauge("kiln_cache_hit_rate", "Share of prompt tokens served from the prefix "
                     "cache instead of computed (since start).", cache_hit_rate(s))
        yield _gauge("kiln_state_snapshots_used", "Recurrent-state snapshots the prefix cache "
                     "holds (models with recurrent layers).", s.state_snapshots_used if s else 0)
        yield _gauge("kiln_state_snapshots_capacity", "Recurrent-state snapshots it may hold.",
                     s.state_snapshots if s else 0)
        # NOTE: getattr because SchedulerStats gained preemptions_total after this was written.
        yield CounterMetricFamily("kiln_preemptions", "Running requests sent back to the "
                                  "queue for lack of KV slots.",
                                  value=getattr(s, "preemptions_total", 0))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def cache_hit_rate(stats: SchedulerStats | None) -> float:
    """1 - computed / all prompt tokens; 0 before any prompt."""
    if stats is None or stats.prompt_tokens_total <= 0:
        return 0.0
    return 1.0 - stats.computed_prompt_tokens_total / stats.prompt_tokens_total


class RequestMetrics:
    """Watches each request from submission to its end and keeps the Prometheus series.

    The manager calls `submitted`, then `output` for every output it routes, and
    `aborted` when it ends a request itself; `forget` undoes a submission that failed.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._timings: dict[str, _Timing] = {}
        self.window = ThroughputWindow(since=clock())
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerCollector()
        self.registry.register(self.scheduler)
        self._define_series()

    def _define_series(self) -> None:
        reg = self.registry
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of requests that "
                                     "produced a first token.", registry=reg)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated.",
                                         registry=reg)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Submission to first "
                              "token.", buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("kiln_inter_token_latency_seconds", "Time between consecutive "
                             "generated tokens.", buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Submission to the last "
                             "output, for requests that finished (not aborted or failed).",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.finished = Counter("kiln_requests_finished", "Requests that ran to their end, by "
                                "finish reason.", ["finish_reason"], registry=reg)
        self.aborted_requests = Counter("kiln_requests_aborted", "Requests aborted (client "
                                        "gone, abort call, shutdown).", registry=reg)
        self.failed = Counter("kiln_requests_failed", "Requests the engine refused or "
                              "failed.", registry=reg)

    # --- the manager's hooks ----------------------------------------------------------

    def submitted(self, rid: str, prompt_tokens: int) -> None:
        self._timings[rid] = _Timing(start=self._clock(), prompt_tokens=prompt_tokens)

    def forget(self, rid: str) -> None:
        self._timings.pop(rid, None)

    def output(self, output: TextOutput) -> None:
        timing = self._timings.get(output.rid)
        if timing is None:
            return
        now = self._clock()
        if output.token_ids:
            self._tokens(timing, len(output.token_ids), now)
        if output.error is not None:
            self._end(output.rid, "error", now, failed=True)
        elif output.finished:
            self._end(output.rid, output.finish_reason or "stop", now)

    def aborted(self, rid: str) -> None:
        if rid in self._timings:
            self._end(rid, ABORT, self._clock())

    def set_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.scheduler.stats = stats

    # --- reading ------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The Prometheus text format of every series."""
        return generate_latest(self.registry)

    def had_traffic(self) -> bool:
        """Tokens since the last throughput line, or requests still in flight."""
        w = self.window
        return bool(w.prompt_tokens or w.generation_tokens or self._timings)

    def throughput_line(self, stats: SchedulerStats | None) -> str:
        """The periodic info line; starts a new window."""
        now = self._clock()
        line = self.window.line(now, stats.running_requests if stats else None,
                                stats.waiting_requests if stats else None)
        self.window = ThroughputWindow(since=now)
        return line

    # --- internals ----------------------------------------------------------------------

    def _tokens(self, timing: _Timing, count: int, now: float) -> None:
        if timing.first_token is None:
            # The prompt counts once it has been computed, i.e. at the first token.
            timing.first_token = now
            self.ttft.observe(now - timing.start)
            self._count_prompt(timing.prompt_tokens)
        elif timing.last_token is not None:
            # An output may carry several tokens; each gets an equal share of the gap.
            for _ in range(count):
                self.itl.observe((now - timing.last_token) / count)
        timing.last_token = now
        timing.completion_tokens += count
        self.generation_tokens.inc(count)
        self.window.generation_tokens += count

    def _count_prompt(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.window.prompt_tokens += tokens

    def _end(self, rid: str, reason: str, now: float, failed: bool = False) -> None:
        timing = self._timings.pop(rid)
        if failed:
            self.failed.inc()
        elif reason == ABORT:
            self.aborted_requests.inc()
        else:
            self.finished.labels(finish_reason=reason).inc()
            self.e2e.observe(now - timing.start)
        _log_finished(rid, timing, reason, now)


def _log_finished(rid: str, timing: _Timing, reason: str, now: float) -> None:
    if not logger.isEnabledFor(logging.DEBUG):
        return
    ttft = "-" if timing.first_token is None else f"{timing.first_token - timing.start:.3f} s"
    logger.debug("request %s ended: prompt %d, completion %d tokens, finish %s, ttft %s, "
                 "e2e %.3f s", rid, timing.prompt_tokens, timing.completion_tokens, reason,
                 ttft, now - timing.start)

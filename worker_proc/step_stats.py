"""Where the worker's wall time goes, step by step: the numbers that say whether the
device or the host holds the step back.

Phases of the worker's loop, as it spends them:
- idle:   blocked on the scheduler's next message (the plan round trip, or no work);
- build:  building a step's lazy graph on the host;
- start:  `mx.async_eval` of the step (on MLX's CUDA backend, launching its kernels), or
          with a launch thread (worker_proc.launcher) handing it over, whose launches
          the summary counts apart; a step with prefill chunks starts their forwards as
          it builds them, which counts here too (ForwardClock);
- wait:   blocked on a step's tokens (the device, or a launch thread, is behind the
          host), or, building a prefill step, on the forward before the one just started;
- report: turning tokens into a result message and sending it.

With two steps in flight a healthy loop waits (device-bound); a loop that idles or
builds most of the time is host- or scheduler-bound. The periodic summary is logged at
INFO, with the interval's slowest step (its time, phases and make-up: a first-sight
stall, a kernel compiled or a shape traced, shows in any log); the per-step record at
DEBUG.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

PHASES = ("idle", "build", "start", "wait", "report")


@dataclass
class StepStats:
    """Accumulates phase times and work done; `summary` closes an interval.

    The summary gives each phase's median per occurrence (the typical step) and its total
    per step (its share of the wall time: this also counts long tails, such as a launch
    that blocks, prefill forwards, or idle time between requests), and how busy the loop
    was (the share of the interval not idle).
    """

    interval_s: float = 10.0
    samples: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    # Running sums of samples (total() is read twice a step, see WorkerLoop).
    _totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    slowest: tuple[float, str] | None = None  # the interval's slowest step: seconds, what
    _since: float = field(default_factory=time.perf_counter)

    def add(self, phase: str, seconds: float) -> None:
        self.samples[phase].append(seconds)
        self._totals[phase] += seconds

    def total(self, phase: str) -> float:
        return self._totals[phase]

    def on_step(self, prefill_tokens: int, decode_tokens: int) -> None:
        self.steps += 1
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens

    def step_took(self, seconds: float, describe: Callable[[], str]) -> None:
        """A step's whole time in the loop; `describe` (called only for a new slowest)
        says what it was."""
        if self.slowest is None or seconds > self.slowest[0]:
            self.slowest = (seconds, describe())

    def summary(self, now: float | None = None) -> str | None:
        """The interval's line once interval_s has passed with steps in it (then a new
        interval starts); None before, or for an interval without steps."""
        now = time.perf_counter() if now is None else now
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return None
        line = self._line(elapsed) if self.steps else None
        self.samples = {p: [] for p in PHASES}
        self._totals = dict.fromkeys(PHASES, 0.0)
        self.steps = self.decode_tokens = self.prefill_tokens = 0
        self.slowest = None
        self._since = now
        return line

    def _line(self, elapsed: float) -> str:
        phases = ", ".join(f"{p} {statistics.median(self.samples[p]) * 1e3:.2f}"
                           f"/{self.total(p) / self.steps * 1e3:.2f}"
                           for p in PHASES if self.samples[p])
        busy = 1.0 - min(1.0, self.total("idle") / elapsed)
        slowest = (f"; slowest step {self.slowest[0] * 1e3:.1f} ms, {self.slowest[1]}"
                   if self.slowest else "")
        return (f"{self.steps / elapsed:.1f} steps/s, {self.decode_tokens / elapsed:.1f} decode tok/s, "
                f"{self.prefill_tokens / elapsed:.1f} prefill tok/s, busy {busy:.0%}; "
                f"ms, median/per step: {phases}{slowest}")


@dataclass
class ForwardClock:
    """What a step's build spent outside graph building: starting its prefill forwards
    (they are started as they are built) and waiting for the forward before each (see
    ModelRunner._launch_prefill), in seconds. Charged to start and wait, so the build
    phase is the host's graph building alone."""

    start: float = 0.0
    wait: float = 0.0

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - t0)

    def phases(self) -> dict[str, float]:
        return {p: s for p, s in (("start", self.start), ("wait", self.wait)) if s}


class Timer:
    """Charges the time between marks to phases."""

    def __init__(self, stats: StepStats) -> None:
        self.stats = stats
        self._last = time.perf_counter()

    def mark(self, phase: str, within: dict[str, float] | None = None) -> float:
        """Charge the time since the last mark to `phase`, less the parts of it `within`
        names for other phases (each charged to its own); returns `phase`'s share in
        seconds."""
        now = time.perf_counter()
        spent = now - self._last
        self._last = now
        for other, seconds in (within or {}).items():
            self.stats.add(other, seconds)
            spent -= seconds
        self.stats.add(phase, spent)
        return spent


@dataclass
class HostClock:
    """Wall and this thread's CPU time over a span of host work, less the pauses (waits
    for the device) it is told of."""

    wall: float = 0.0
    cpu: float = 0.0
    _since: tuple[float, float] | None = None

    @classmethod
    def start(cls) -> "HostClock":
        clock = cls()
        clock.resume()
        return clock

    def resume(self) -> None:
        self._since = (time.perf_counter(), time.thread_time())

    def pause(self) -> None:
        if self._since is not None:
            wall, cpu = self._since
            self.wall += time.perf_counter() - wall
            self.cpu += time.thread_time() - cpu
            self._since = None

    def spent(self) -> tuple[float, float]:
        """(wall, CPU) seconds so far; the clock stops."""
        self.pause()
        return self.wall, self.cpu


"""Where the worker's wall time goes, step by step: the numbers that say whether the
device or the host holds the step back.

Phases of the worker's loop, as it spends them:
- idle:   blocked on the scheduler's next message (the plan round trip, or no work);
- build:  building a step's lazy graph on the host (a step with prefill chunks also
          starts their forwards here);
- start:  `mx.async_eval` of the step (on MLX's CUDA backend, launching its kernels);
- wait:   blocked on a step's tokens (the device is behind the host);
- report: turning tokens into a result message and sending it.

With two steps in flight a healthy loop waits (device-bound); a loop that idles or
builds most of the time is host- or scheduler-bound. The periodic summary is logged at
INFO, the per-step record at DEBUG.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields

logger = logging.getLogger(__name__)

PHASES = ("idle", "build", "start", "wait", "report")


@dataclass
class PhaseTotals:
    idle: float = 0.0
    build: float = 0.0
    start: float = 0.0
    wait: float = 0.0
    report: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        setattr(self, phase, getattr(self, phase) + seconds)


@dataclass
class StepStats:
    """Accumulates phase times and work done; `summary` closes an interval."""

    interval_s: float = 10.0
    totals: PhaseTotals = field(default_factory=PhaseTotals)
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    _since: float = field(default_factory=time.perf_counter)

    def add(self, phase: str, seconds: float) -> None:
        self.totals.add(phase, seconds)

    def on_step(self, prefill_tokens: int, decode_tokens: int) -> None:
        self.steps += 1
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens

    def summary(self, now: float | None = None) -> str | None:
        """The interval's line once interval_s has passed with steps in it (then a new
        interval starts); None before, or for an interval without steps."""
        now = time.perf_counter() if now is None else now
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return None
        line = self._line(elapsed) if self.steps else None
        self.totals, self.steps, self.decode_tokens, self.prefill_tokens = PhaseTotals(), 0, 0, 0
        self._since = now
        return line

    def _line(self, elapsed: float) -> str:
        per_step = ", ".join(f"{f.name} {getattr(self.totals, f.name) / self.steps * 1e3:.2f}"
                             for f in fields(self.totals))
        return (f"{self.steps / elapsed:.1f} steps/s, {self.decode_tokens / elapsed:.1f} decode tok/s, "
                f"{self.prefill_tokens / elapsed:.1f} prefill tok/s; ms per step: {per_step}")


class Timer:
    """Charges the time between marks to phases."""

    def __init__(self, stats: StepStats) -> None:
        self.stats = stats
        self._last = time.perf_counter()

    def mark(self, phase: str) -> float:
        """Charge the time since the last mark to `phase`; returns it in seconds."""
        now = time.perf_counter()
        spent = now - self._last
        self._last = now
        self.stats.add(phase, spent)
        return spent

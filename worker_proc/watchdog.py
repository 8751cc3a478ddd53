"""The worker's step watchdog: a step stuck on the device (a kernel that never ends, a
wait that is never answered) ends the worker instead of leaving every request hanging.

It is faulthandler's timer, not a Python thread: the timer is a C thread that needs no
GIL, so it fires while the main thread is blocked inside MLX. On firing it writes every
thread's Python stack to stderr (the worker's log) and exits with status 1; the launcher
then takes the server down (a dead worker ends the server) for a supervisor to restart.
"""
from __future__ import annotations

import faulthandler
import sys
import time
from typing import Callable

# Arming starts a timer thread (faulthandler joins the previous one): the loop re-arms
# at most once a REARM_SHARE of the timeout (and a second), so a stuck step fires between
# 90% of the timeout and the whole of it after it began.
REARM_SHARE = 0.1
REARM_MAX_SECONDS = 1.0


def _arm_faulthandler(seconds: float) -> None:
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


class StepWatchdog:
    """Armed while the worker handles steps, disarmed while it waits for the scheduler.

    busy() at each step message: re-arms the timer (at most once a REARM_SHARE of the
    timeout); idle() once a wait for messages timed out (nothing to run): disarms it. A
    timeout of 0 never arms."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic,
                 arm: Callable[[float], None] = _arm_faulthandler,
                 disarm: Callable[[], None] = faulthandler.cancel_dump_traceback_later):
        self.seconds = seconds
        self._clock = clock
        self._arm = arm
        self._disarm = disarm
        self._armed_at: float | None = None
        self._rearm = min(REARM_MAX_SECONDS, seconds * REARM_SHARE)

    def busy(self) -> None:
        if self.seconds <= 0:
            return
        now = self._clock()
        if self._armed_at is None or now - self._armed_at >= self._rearm:
            self._arm(self.seconds)
            self._armed_at = now

    def idle(self) -> None:
        if self._armed_at is not None:
            self._disarm()
            self._armed_at = None

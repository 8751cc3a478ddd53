"""A thread of the worker's own that puts steps and prefill forwards on the device, so the
worker's thread builds the next step's graph while this one launches the last (CUDA's
default; `--experiments inline-launch`: the worker's thread launches, the A/B arm).

On MLX's CUDA backend `mx.async_eval` is host work: it walks the step's graph and records
each kernel into CUDA graphs, several milliseconds for an 8B model's step, while building
that graph in Python took a few more. The worker did both on one thread, so a step cost
the host their sum; with this thread the two overlap, and MLX's call leaves the GIL while
it launches.

Two threads on one MLX stream need care:
- The stream is made with `mx.new_thread_unsafe_stream` and is the worker thread's default
  from before the model loads, so every array and compiled trace is on it and either
  thread may evaluate it. Unsafe means one at a time: ModelRunner hands every launch
  here, and its own thread evaluates only once this one is idle (`quiesce`): before
  reading results from (or waiting on) arrays a later step may use, and before
  forgetting its requests.
- MLX marks arrays as it evaluates them (their status, events, inputs), so while a step is
  launching, the worker's thread only builds on its outputs and waits on what no later
  step takes as an input (the readback ring's copy, a prefill forward's probe), after
  that array's own launch has ended.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Sequence

import mlx.core as mx

logger = logging.getLogger(__name__)


class LaunchThread:
    """One thread that launches (`mx.async_eval`) what it is handed, in order, on a
    stream both threads may use; `stream` must be the caller's default before it builds
    anything this thread launches."""

    def __init__(self) -> None:
        self.stream = mx.new_thread_unsafe_stream(mx.default_device())
        self._jobs: queue.SimpleQueue[tuple[Future, list[mx.array], str] | None] = (
            queue.SimpleQueue())
        self._open: deque[Future] = deque()  # handed over, oldest first, not yet quiesced
        self.launches = 0
        self.seconds = 0.0  # spent in MLX's launches (observability)
        self._noted = (0, 0.0)  # launches and seconds at the last interval_note
        self._thread = threading.Thread(target=self._run, name="kiln-launch", daemon=True)
        self._thread.start()

    def launch(self, arrays: Sequence[mx.array], what: str = "") -> Future:
        """Hand arrays over to be launched; the future ends (with the seconds it took, or
        the launch's error) once they are on the device's queue. what: its name in the
        DEBUG log's line of each launch."""
        while self._open and self._open[0].done() and self._open[0].exception() is None:
            self._open.popleft()
        future: Future = Future()
        self._open.append(future)
        self._jobs.put((future, list(arrays), what))
        return future

    def check(self) -> None:
        """Raise the first error of the launches that have ended, oldest first (each
        error once): a step's report calls it once its own launch ended, so a prefill
        forward that failed to launch before it fails that step at the latest."""
        while self._open and self._open[0].done():
            exc = self._open.popleft().exception()
            if exc is not None:
                raise exc

    def quiesce(self, raise_errors: bool = True) -> None:
        """Wait until everything handed over is launched, so the caller may evaluate on
        the stream; raises the first launch error not yet raised here (unless told not)."""
        error: BaseException | None = None
        while self._open:
            exc = self._open.popleft().exception()  # waits
            error = error or exc
        if error is not None and raise_errors:
            raise error

    def interval_note(self) -> str:
        """Launches since the last note and their mean time (observability)."""
        n, seconds = self.launches - self._noted[0], self.seconds - self._noted[1]
        self._noted = (self.launches, self.seconds)
        return f"{n} launches, {seconds / max(n, 1) * 1e3:.2f} ms each"

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, arrays, what = job
            job = None
            began = time.perf_counter()
            try:
                mx.async_eval(*arrays)
            except BaseException as exc:  # noqa: BLE001 - the step's owner raises it
                future.set_exception(exc)
            else:
                spent = time.perf_counter() - began
                self.launches += 1
                self.seconds += spent
                future.set_result(spent)
                logger.debug("%s launched in %.2f ms", what or "arrays", spent * 1e3)
            # Holding the step's arrays until the next job would keep the next step's
            # pool writes from updating the layers they replace in place.
            arrays = None  # type: ignore[assignment]

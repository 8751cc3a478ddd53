"""A slow-to-make value made at most once, ahead of need where possible.

Both the tokenizer process and the worker need llguidance's tokenizer (about a second for
a 150k vocabulary); made on first use it stalls whatever asked for it (the event loop, a
batch step). Started at process start-up instead, it is usually ready by the time a
request needs it, and a request that comes sooner waits only for the rest.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundBuild(Generic[T]):
    """`make()`, run once: on a daemon thread after `start()`, or else by the first `get()`.

    A failure is kept and raised by every `get()`: what failed to build (a tokenizer
    llguidance does not support) fails the same way again, so retrying would only repeat
    the cost.
    """

    def __init__(self, make: Callable[[], T], name: str) -> None:
        self._make = make
        self._name = name
        self._lock = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._value: T | None = None
        self._error: Exception | None = None

    @property
    def started(self) -> bool:
        return self._claimed

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def start(self) -> None:
        """Build on a daemon thread (a build still running at exit must not hold it up)."""
        if self._claim():
            threading.Thread(target=self._build, name=self._name, daemon=True).start()

    def get(self) -> T:
        """The value: built here if nobody started it, else waited for."""
        if not self._done.is_set() and self._claim():  # once done, no lock: steps read it
            self._build()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def _claim(self) -> bool:
        with self._lock:
            first = not self._claimed
            self._claimed = True
        return first

    def _build(self) -> None:
        try:
            self._value = self._make()
        except Exception as exc:  # noqa: BLE001 - kept for get() to raise, on its thread
            logger.warning("could not build the %s", self._name, exc_info=True)
            self._error = exc
        finally:
            self._done.set()

"""What every child process does first: title, logging, signals, parent watch, ready report."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

from ipc.channel import Sender
from ipc.config import ServerConfig
from ipc.messages.to_launcher import ProcessProgress, ProcessReady

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

# How the launcher stops a child: the front drains its requests on it (a second one aborts
# the rest), the others exit (the signal's default action). Not SIGTERM: SIGINT and
# SIGTERM may reach the whole process group (Ctrl-C; `kill -- -PGID`; systemd's default
# KillMode), and a worker dying of it at once would cut the requests the front is still
# letting finish. Children ignore both; only the launcher decides how the server stops.
STOP_SIGNAL = signal.SIGUSR1


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {role:>11} %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def _watch_parent(parent_pid: int) -> None:
    # Portable fallback for PR_SET_PDEATHSIG (macOS has none): once the launcher is gone
    # we are re-parented, and nobody would ever stop us.
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True,
                     name="parent-watch").start()


def setup_child(config: ServerConfig, role: str) -> "StartupReporter":
    """Prepare a freshly spawned child; returns its channel for start-up reports."""
    try:
        import setproctitle

        setproctitle.setproctitle(config.process_title(role))
    except ImportError:  # optional nicety
        pass
    setup_logging(config.log_level, role)
    # See STOP_SIGNAL: the launcher alone decides how the server stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    return StartupReporter(config, role)


class StartupReporter:
    """Sends progress lines and the ready message to the launcher."""

    def __init__(self, config: ServerConfig, role: str) -> None:
        self._role = role
        self._sender = Sender(config.launcher_endpoint)

    def progress(self, text: str) -> None:
        self._sender.send(ProcessProgress(name=self._role, text=text))

    def ready(self, detail: str = "") -> None:
        self._sender.send(ProcessReady(name=self._role, detail=detail))
        self._sender.close(linger_ms=2000)

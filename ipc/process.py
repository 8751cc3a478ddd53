"""What every child process does: title, logging, signals, parent watch, start-up reports,
and the report of a failure."""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import logging
import os
import shutil
import signal
import sys
import threading
import time
from typing import Callable

from ipc.channel import Sender, send_last
from ipc.config import ServerConfig
from ipc.messages.to_launcher import ProcessFailed, ProcessProgress, ProcessReady

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# How long a failing child waits for its last report to reach the launcher.
_FAILURE_REPORT_MS = 1000
# The children the kernel kills the moment the launcher dies (Linux). The worker's main
# thread may sit in a long device call, which the watch thread (below) could not stop
# promptly; the others notice within a poll and remove the run directory first.
_KILLED_WITH_PARENT = frozenset({"worker"})

# How the launcher stops a child: the front drains its requests on it (a second one aborts
# the rest), the others exit (the signal's default action). Not SIGTERM: SIGINT and
# SIGTERM may reach the whole process group (Ctrl-C; `kill -- -PGID`; systemd's default
# KillMode), and a worker dying of it at once would cut the requests the front is still
# letting finish. Children ignore both; only the launcher decides how the server stops.
STOP_SIGNAL = signal.SIGUSR1

# On this signal any kiln process writes every thread's Python stack to its log (stderr)
# and goes on: where a slow start-up or a stuck step is, seen from outside (`kill -USR2`
# to the launcher's process group). faulthandler writes from the signal handler itself,
# so a main thread blocked in a device call still shows where it waits.
STACKS_SIGNAL = signal.SIGUSR2


def enable_stack_dumps() -> None:
    """Install STACKS_SIGNAL's handler (every thread's stack to stderr)."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (spawn's first child otherwise starts it)
    with STACKS_SIGNAL blocked, which its exec keeps and it never undoes: it shares the
    server's process group but installs no handler, so a group-wide stacks signal would
    kill it. (Blocked, not ignored: this works whatever handler the caller has.)"""
    from multiprocessing import resource_tracker

    signal.pthread_sigmask(signal.SIG_BLOCK, {STACKS_SIGNAL})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACKS_SIGNAL})


class ExitAtOnce(RuntimeError):
    """A failure after which the process's native state must not be torn down: it exits
    with code 1 without running destructors (a lost CUDA context makes MLX's stream
    destructors abort, and the launcher would hear "killed by SIGABRT" without the
    reason the process reported)."""


class CannotServe(Exception):
    """A refusal to serve (a model with layers the engine cannot run yet). Its message
    says it all: the launcher makes it its last line, and no traceback is printed."""


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        # Milliseconds: a step takes 5-50 ms, and bench/step_log.py times steps' tokens
        # from these stamps.
        format=f"%(asctime)s.%(msecs)03d {role:>11} %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


# At debug level each garbage collection that held a process this long is logged: a
# serving loop's step that stalls in one shows beside it (bench/step_log.py).
COLLECTION_LOGGED_MS = 1.0


def log_slow_collections(least_ms: float = COLLECTION_LOGGED_MS) -> Callable[[str, dict], None]:
    """Log (debug) every garbage collection of `least_ms` or more; returns the callback
    installed in gc.callbacks."""
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = (time.perf_counter() - started[0]) * 1e3
        if took >= least_ms:
            logger.debug("garbage collection of generation %d took %.2f ms (%d objects freed)",
                         info["generation"], took, info["collected"])

    gc.callbacks.append(watch)
    return watch


def _watch_parent(parent_pid: int, run_dir: str) -> None:
    # Once the launcher is gone we are re-parented, and nobody would ever stop us or
    # remove the run directory (its socket files) as the launcher does when it exits.
    # Also the portable fallback for PR_SET_PDEATHSIG (macOS has none).
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    os._exit(1)


def _die_with_parent(run_dir: str, at_once: bool) -> None:
    if at_once and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    threading.Thread(target=_watch_parent, args=(os.getppid(), run_dir), daemon=True,
                     name="parent-watch").start()


def setup_child(config: ServerConfig, role: str) -> "StartupReporter":
    """Prepare a freshly spawned child; returns its channel for start-up reports."""
    try:
        import setproctitle

        setproctitle.setproctitle(config.process_title(role))
    except ImportError:  # optional nicety
        pass
    setup_logging(config.log_level, role)
    if logger.isEnabledFor(logging.DEBUG):
        log_slow_collections()
    enable_stack_dumps()
    # See STOP_SIGNAL: the launcher alone decides how the server stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(config.run_dir, at_once=role in _KILLED_WITH_PARENT)
    return StartupReporter(config, role)


def run_child(role: str, entry: Callable[[ServerConfig], None], config: ServerConfig) -> None:
    """A child process's target: `entry(config)`; if it raises, the launcher is told why
    (ProcessFailed) before the process exits 1."""
    try:
        entry(config)
    except CannotServe as exc:
        _report(config, ProcessFailed(name=role, reason=str(exc), refusal=True))
        sys.exit(1)
    except Exception as exc:
        _report(config, ProcessFailed(name=role, reason=f"{type(exc).__name__}: {exc}"))
        if isinstance(exc, ExitAtOnce):
            logger.critical("exiting at once", exc_info=True)
            logging.shutdown()
            os._exit(1)
        raise  # multiprocessing prints the traceback and exits 1


def _report(config: ServerConfig, failure: ProcessFailed) -> None:
    try:
        send_last(config.launcher_endpoint, failure, _FAILURE_REPORT_MS)
    except Exception:  # noqa: BLE001 - the exit code still tells the launcher
        logger.exception("could not report the failure to the launcher")


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
        freeze_startup_objects()


def freeze_startup_objects() -> None:
    """Move everything start-up made (imported modules, the model's and tokenizer's
    objects: ~90k on the demo model) out of the garbage collector's reach. A full
    collection scans them all, 31-35 ms on the CPU machine, and runs whenever enough
    objects outlive their step, so it stalled a serving loop's step now and then (an
    inter-token latency outlier); frozen, collections scan what serving made alone."""
    gc.collect()
    gc.freeze()

"""Start the kiln server: an OpenAI-compatible HTTP API and a ZMQ endpoint over MLX.

    python launch.py --model <local dir | Hugging Face id | demo>

The launcher builds one frozen config, starts the four processes (worker, scheduler,
detokenizer, tokenizer), waits for each to report ready, and then only supervises: if any
child dies it has the front fail every request in flight with an error, stops the rest
and exits non-zero; on SIGINT/SIGTERM it lets in-flight requests finish (up to
--shutdown-timeout), stops everything and exits 0. A start-up that fails ends with the
reason as the launcher's last line ("cannot serve <model>: ...").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ipc.channel import Receiver, Sender
from ipc.config import PROJECT_NAME, ServerConfig, cli_fields, default_run_root
from ipc.messages.to_launcher import (LauncherMessage, ProcessFailed, ProcessProgress,
                                      ProcessReady)
from ipc.messages.to_tokenizer import EngineDead
from ipc.process import (STOP_SIGNAL, enable_stack_dumps, run_child, setup_logging,
                         start_resource_tracker)
from tokenizer_proc.remote_code import UntrustedModelError, check_remote_code

logger = logging.getLogger("launcher")

# Seconds between the stop signal and SIGKILL for a child that will not stop.
_KILL_GRACE = 2.0
# Seconds the front gets, once told the engine is gone, to send the errors it answered
# every request with and exit; those answers are already made, only bytes remain to go.
_FRONT_FLUSH_S = 5.0
# A start-up line after this many seconds without a child's report (and again each as
# long): a first start may compile kernels for minutes, and silence reads as a hang.
_STILL_STARTING_S = 60.0
# How long a child that exited with an error may take to be heard saying why (it waited
# for its ProcessFailed to be delivered before exiting, so this is only the read).
_FAILURE_REPORT_S = 0.5
# Read when --api-key is empty.
API_KEY_ENV = "KILN_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in cli_fields():
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=help_text,
                                choices=f.metadata.get("choices"))
    return parser


def resolve_model(name: str) -> str:
    """A local directory for the model: the demo generator, a path, or a hub download."""
    from worker_proc.demo_model import ensure_demo_model, is_demo_model

    if is_demo_model(name):
        return str(ensure_demo_model(name))
    if Path(name).is_dir():
        return str(Path(name).resolve())
    from mlx_lm.utils import _download  # the same resolution mlx_lm.load does

    try:
        return str(_download(name))
    except Exception as exc:  # noqa: BLE001 - any hub failure means the same to the user
        raise SystemExit(f"could not find model {name!r} locally or fetch it from the "
                         f"Hugging Face Hub: {exc}") from exc


def check_adapters(path: str) -> None:
    """--adapter-path names a local directory of mlx_lm.lora's output (what
    mlx_lm.load(adapter_path=...) reads), or the server does not start."""
    missing = [name for name in ("adapter_config.json", "adapters.safetensors")
               if not (Path(path) / name).is_file()]
    if missing:
        raise SystemExit(f"error: --adapter-path {path}: no {' or '.join(missing)} there "
                         "(a directory mlx_lm.lora wrote, as mlx_lm.load reads it)")


def make_run_dir() -> str:
    path = tempfile.mkdtemp(prefix=f"{PROJECT_NAME}-", dir=default_run_root())
    os.chmod(path, 0o700)
    return path


def config_from_args(argv: list[str] | None = None) -> ServerConfig:
    args = vars(build_parser().parse_args(argv))
    try:
        base = ServerConfig(**args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    setup_logging(base.log_level, "launcher")
    logger.info("resolving model %s", base.model)
    model_path = resolve_model(base.model)
    try:
        check_remote_code(model_path, base.trust_remote_code)
    except UntrustedModelError as exc:
        raise SystemExit(f"error: {exc}") from None
    if base.adapter_path:
        check_adapters(base.adapter_path)
    # Here, not at the top: every child (spawned) imports this module again, and these
    # pull in the front's request models.
    from tokenizer_proc.chat_template import default_template_kwargs, template_text
    from tokenizer_proc.prepare import generation_overrides

    try:
        template = template_text(base.chat_template) if base.chat_template else ""
        default_template_kwargs(base.chat_template_kwargs)
        generation_overrides(base.override_generation_config)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    # The environment keeps the key out of `ps` output, where the flag would show it.
    api_key = base.api_key or os.environ.get(API_KEY_ENV, "")
    return dataclasses.replace(base, model_path=model_path, run_dir=make_run_dir(),
                               api_key=api_key, chat_template_text=template)


def _child_targets() -> dict[str, Callable[[ServerConfig], None]]:
    from detokenizer_proc import run_detokenizer
    from scheduler_proc import run_scheduler
    from tokenizer_proc import run_tokenizer
    from worker_proc import run_worker

    # Start order: the worker loads the model, which takes longest.
    return {"worker": run_worker, "scheduler": run_scheduler,
            "detokenizer": run_detokenizer, "tokenizer": run_tokenizer}


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def kernel_compiles_since(started: float) -> str:
    """What a timed-out start-up's last line adds when MLX compiled CUDA kernels meanwhile
    (into the directory the worker keeps them in: worker_proc.kernel_cache), else ""."""
    from worker_proc.demo_model import default_cache_root
    from worker_proc.kernel_cache import compiled_since

    made = compiled_since(os.environ, default_cache_root(), started)
    if not made:
        return ""
    return (f" (MLX compiled {made} CUDA kernel modules meanwhile, a first start's cost: they "
            "are kept, so the next start resumes from them; --ready-timeout gives a first "
            "start longer)")


class Supervisor:
    """Owns the child processes from start to teardown."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ctx = mp.get_context("spawn")
        self.children: dict[str, mp.process.BaseProcess] = {}
        self.stop_requested = False
        self.failure: str | None = None  # why start-up failed: the launcher's last line

    def start(self) -> None:
        start_resource_tracker()  # before the children, which would start it unprotected
        for name, target in _child_targets().items():
            proc = self.ctx.Process(target=run_child, args=(name, target, self.config),
                                    name=name, daemon=False)
            proc.start()
            self.children[name] = proc

    def dead_child(self) -> str | None:
        for name, proc in self.children.items():
            if proc.exitcode is not None:
                return name
        return None

    def wait_ready(self, inbox: Receiver[LauncherMessage]) -> bool:
        """True once every child reported ready; False on a failure (then `failure` says
        why), a signal or the timeout."""
        pending = set(self.children)
        started = time.time()
        deadline = time.monotonic() + self.config.ready_timeout
        heard = told = time.monotonic()  # the last report; the last line of ours since
        while pending:
            if self.stop_requested:
                return False
            if time.monotonic() - max(heard, told) >= _STILL_STARTING_S:
                told = time.monotonic()
                logger.info("still starting: waiting for %s, %.0f s since the last report "
                            "(SIGUSR2 to a kiln process writes its threads' stacks to this log)",
                            ", ".join(sorted(pending)), told - heard)
            dead = self.dead_child()
            if dead:
                self.failure = self._startup_failure(dead, self.failure_report(dead, inbox))
                return False
            if time.monotonic() > deadline:
                self.failure = (f"start-up timed out after {self.config.ready_timeout:.0f}s "
                                f"waiting for {', '.join(sorted(pending))}"
                                + kernel_compiles_since(started))
                return False
            message = inbox.recv(timeout_ms=200)
            if message is not None:
                heard = time.monotonic()
            if isinstance(message, ProcessFailed):  # its process is exiting
                self.failure = self._startup_failure(message.name, message)
                return False
            if isinstance(message, ProcessProgress):
                logger.info("%s: %s", message.name, message.text)
            elif isinstance(message, ProcessReady):
                pending.discard(message.name)
                logger.info("%s ready%s", message.name, f" ({message.detail})" if message.detail else "")
        return True

    def failure_report(self, name: str, inbox: Receiver[LauncherMessage]) -> ProcessFailed | None:
        """What a dead child said of its failure; only one that exited with an error code
        (not killed by a signal) may have said anything."""
        if (self.children[name].exitcode or 0) <= 0:
            return None
        deadline = time.monotonic() + _FAILURE_REPORT_S
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            message = inbox.recv(timeout_ms=left_ms)
            if isinstance(message, ProcessFailed) and message.name == name:
                return message
        return None

    def _startup_failure(self, name: str, report: ProcessFailed | None) -> str:
        if report is None:
            return f"{name} died during start-up ({describe_exit(self.children[name].exitcode)})"
        if report.refusal:
            return f"cannot serve {self.config.model}: {report.reason}"
        return f"{name} failed during start-up: {report.reason}"

    def death(self, name: str) -> str:
        return f"{name} died ({describe_exit(self.children[name].exitcode)})"

    def death_in_words(self, name: str, inbox: Receiver[LauncherMessage]) -> str:
        """How a child died while serving, with its own words when it had any (for the
        log: an exception's text is not for clients)."""
        report = self.failure_report(name, inbox)
        return f"{self.death(name)}: {report.reason}" if report else self.death(name)

    def supervise(self) -> str | None:
        """Block until a child dies (its name) or a stop signal arrives (None)."""
        sentinels = {p.sentinel: name for name, p in self.children.items()}
        while not self.stop_requested:
            ready = mp.connection.wait(list(sentinels), timeout=0.5)
            if ready:
                name = sentinels[ready[0]]
                # The sentinel can fire a moment before the child is reapable.
                self.children[name].join(1.0)
                return name
        return None

    def drain_front(self, timeout: float | None = None) -> None:
        """Graceful part of a stop: the front stops accepting and lets requests finish."""
        front = self.children["tokenizer"]
        if front.exitcode is None:
            os.kill(front.pid, STOP_SIGNAL)
            front.join(self.config.shutdown_timeout + 5 if timeout is None else timeout)

    def fail_front(self, reason: str) -> None:
        """The engine is gone: the front answers every waiting request with `reason` as
        an error (and refuses new ones), then it is stopped once those answers are out."""
        if self.children["tokenizer"].exitcode is not None:
            return
        sender = Sender(self.config.tokenizer_endpoint)
        sender.send(EngineDead(reason=reason))
        sender.close(linger_ms=1000)  # delivered by ZMQ's I/O thread; we go on at once
        self.drain_front(_FRONT_FLUSH_S)

    def stop_all(self) -> None:
        alive = [p for p in self.children.values() if p.exitcode is None]
        for p in alive:
            os.kill(p.pid, STOP_SIGNAL)
        deadline = time.monotonic() + _KILL_GRACE
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.exitcode is None:
                logger.warning("%s did not stop; killing it", p.name)
                p.kill()
                p.join(1.0)


def _install_signal_handlers(supervisor: Supervisor) -> None:
    def on_signal(signum: int, _frame: object) -> None:
        if supervisor.stop_requested:  # a second Ctrl-C: stop waiting for requests
            raise KeyboardInterrupt
        logger.info("%s received: finishing in-flight requests, then stopping",
                    signal.Signals(signum).name)
        supervisor.stop_requested = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def serve(config: ServerConfig) -> int:
    """Run the server until a signal (returns 0) or a child's death (returns 1)."""
    supervisor = Supervisor(config)
    _install_signal_handlers(supervisor)
    inbox: Receiver[LauncherMessage] = Receiver(config.launcher_endpoint, LauncherMessage)
    try:
        supervisor.start()
        if not supervisor.wait_ready(inbox):
            return _abandon_start(supervisor)
        logger.info("serving %s: HTTP http://%s:%d/v1  ZMQ %s", config.model_name, config.host,
                    config.port, config.client_endpoint)
        dead = supervisor.supervise()
        if dead is not None:
            logger.error("%s; stopping the server", supervisor.death_in_words(dead, inbox))
            supervisor.fail_front(f"The engine stopped: its {supervisor.death(dead)}. The "
                                  "server is shutting down.")
            supervisor.stop_all()
            return 1
        supervisor.drain_front()
        supervisor.stop_all()
        logger.info("stopped")
        return 0
    except KeyboardInterrupt:
        supervisor.stop_all()
        return 0
    finally:
        inbox.close()
        shutil.rmtree(config.run_dir, ignore_errors=True)


def _abandon_start(supervisor: Supervisor) -> int:
    """Stop a start-up that cannot complete; the reason is the launcher's last line."""
    # A front already up may hold health probes waiting on a scheduler that will never
    # answer; told first, it ends them at once instead of outliving the kill grace.
    supervisor.fail_front(supervisor.failure or "The server stopped during start-up.")
    supervisor.stop_all()
    if supervisor.failure:
        logger.error("%s", supervisor.failure)
    return 0 if supervisor.stop_requested and not supervisor.dead_child() else 1


def main(argv: list[str] | None = None) -> int:
    # Inherited by the children: transformers' "PyTorch was not found" advice is noise here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    enable_stack_dumps()  # here, not in config_from_args: tests call that in their process
    config = config_from_args(argv)
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())

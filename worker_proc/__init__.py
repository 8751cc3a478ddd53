"""Worker process: loads the model with mlx-lm, owns the KV pool, runs the step plans."""

from __future__ import annotations

import logging
import time
from collections import deque

from ipc.channel import Receiver, Sender
from ipc.config import ServerConfig
from ipc.messages.to_scheduler import WorkerReady
from ipc.messages.to_worker import ForwardBatch, Shutdown, SyncSteps, WorkerMessage
from ipc.process import StartupReporter, setup_child

logger = logging.getLogger(__name__)


def _model_context_len(model: object) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def build_runner(config: ServerConfig, reporter: StartupReporter | None = None):
    """Load the model and size the pool; returns the runner (split out for tests)."""
    import mlx_lm

    from worker_proc.attention import check_layer_kinds
    from worker_proc.kv_pool import KVPool
    from worker_proc.memory import pool_slots, probe_attention_specs
    from worker_proc.runner import ModelRunner, warm_up

    say = reporter.progress if reporter else logger.info
    t0 = time.monotonic()
    say(f"loading model from {config.model_path}")
    model, _ = mlx_lm.load(config.model_path, trust_remote_code=config.trust_remote_code,
                           tokenizer_config={"trust_remote_code": config.trust_remote_code})
    check_layer_kinds(model)
    specs = probe_attention_specs(model)
    say(f"model loaded in {time.monotonic() - t0:.1f}s")
    context = _model_context_len(model) or 4096
    slots = pool_slots(config, KVPool.bytes_per_slot(specs), context)
    pool = KVPool(specs, slots)
    say(f"KV pool: {slots} slots, {pool.nbytes / 2**20:.1f} MiB")
    runner = ModelRunner(model, pool, config.max_running_requests, min(context, slots))
    t0 = time.monotonic()
    steps = warm_up(runner, config.max_running_requests)
    say(f"warmed up ({steps} steps, {time.monotonic() - t0:.1f}s)")
    return runner


class WorkerLoop:
    """Runs step plans with at most two steps in flight.

    With overlap, step N+1's graph (fed by step N's still-lazy tokens) is launched before
    the worker blocks on step N's tokens, so the device always has the next step queued
    while the worker and the scheduler do their host work. A SyncSteps message (the
    scheduler has nothing to chain) makes it report what it holds.
    """

    def __init__(self, runner, results: Sender, overlap: bool) -> None:  # noqa: ANN001
        self.runner = runner
        self.results = results
        self.depth = 2 if overlap else 1
        self.in_flight: deque = deque()
        self.most_in_flight = 0  # observability: 2 shows steps really overlapped

    def handle(self, message: WorkerMessage) -> bool:
        """Process one message; False once the worker should stop."""
        if isinstance(message, ForwardBatch):
            self.in_flight.append(self.runner.launch(message))
            self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
            while len(self.in_flight) >= self.depth:
                self._report_oldest()
        elif isinstance(message, SyncSteps):
            while self.in_flight:
                self._report_oldest()
        elif isinstance(message, Shutdown):
            logger.info("shutting down: %s", message.reason)
            return False
        return True

    def _report_oldest(self) -> None:
        self.results.send(self.runner.finish(self.in_flight.popleft()))


def run_worker(config: ServerConfig) -> None:
    reporter = setup_child(config, "worker")
    runner = build_runner(config, reporter)
    plans: Receiver[WorkerMessage] = Receiver(config.worker_endpoint, WorkerMessage)
    results = Sender(config.scheduler_endpoint)
    results.send(WorkerReady(num_slots=runner.pool.num_slots, max_context_len=runner.max_context))
    reporter.ready(f"{runner.pool.num_slots} KV slots")
    loop = WorkerLoop(runner, results, overlap=not config.disable_overlap)
    while loop.handle(plans.recv()):
        pass

"""Worker process: loads the model with mlx-lm, owns the KV pool, runs the step plans."""

from __future__ import annotations

import logging
import time

from ipc.channel import Receiver, Sender
from ipc.config import ServerConfig
from ipc.messages.to_scheduler import WorkerReady
from ipc.messages.to_worker import ForwardBatch, Shutdown, WorkerMessage
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
    from worker_proc.runner import ModelRunner

    say = reporter.progress if reporter else logger.info
    t0 = time.monotonic()
    say(f"loading model from {config.model_path}")
    model, _ = mlx_lm.load(config.model_path)
    check_layer_kinds(model)
    specs = probe_attention_specs(model)
    say(f"model loaded in {time.monotonic() - t0:.1f}s")
    context = _model_context_len(model) or 4096
    slots = pool_slots(config, KVPool.bytes_per_slot(specs), context)
    pool = KVPool(specs, slots)
    say(f"KV pool: {slots} slots, {pool.nbytes / 2**20:.1f} MiB")
    return ModelRunner(model, pool, config.max_running_requests, min(context, slots))


def run_worker(config: ServerConfig) -> None:
    reporter = setup_child(config, "worker")
    runner = build_runner(config, reporter)
    plans: Receiver[WorkerMessage] = Receiver(config.worker_endpoint, WorkerMessage)
    results = Sender(config.scheduler_endpoint)
    results.send(WorkerReady(num_slots=runner.pool.num_slots, max_context_len=runner.max_context))
    reporter.ready(f"{runner.pool.num_slots} KV slots")
    while True:
        message = plans.recv()
        if isinstance(message, ForwardBatch):
            results.send(runner.run(message))
        elif isinstance(message, Shutdown):
            logger.info("shutting down: %s", message.reason)
            return

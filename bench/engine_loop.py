"""kiln's scheduler and model runner driven in one process, without sockets, for benchmarks.

    from bench.engine_loop import EngineLoop, EngineSizes, load_model
    model, _ = load_model("demo-tiny")
    loop = EngineLoop(model, EngineSizes(capacity=8192, max_running=16, max_context=2048))
    loop.submit("r0", [5, 6, 7], max_tokens=32)
    loop.run_until_idle(max_steps=1000)

Plain stepping is `Scheduler.plan_step` -> `ModelRunner.run` (launch, then finish) ->
`Scheduler.apply_result`, one step at a time, so each step can be timed. With
`run_until_idle(..., overlap=True)` the server's own step loops (`SchedulerLoop`,
`WorkerLoop`) run over in-memory queues instead, two steps in flight as in the server.
Requests are greedy and carry no EOS ids, so each one runs to exactly `max_tokens`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipc.messages.common import SamplingParams
from ipc.messages.to_detokenizer import BatchTokens, TokenOutput
from ipc.messages.to_scheduler import StepResult, TokenizedRequest
from ipc.messages.to_worker import ForwardBatch
from scheduler_proc.scheduler import Scheduler, SchedulerLimits
from worker_proc.kv_pool import KVPool
from worker_proc.memory import probe_attention_specs
from worker_proc.runner import ModelRunner


def resolve_model_dir(name: str) -> Path:
    """A demo preset name (built on first use) or a local model directory."""
    from worker_proc.demo_model import ensure_demo_model, is_demo_model

    if is_demo_model(name):
        return ensure_demo_model(name)
    path = Path(name)
    if not path.is_dir():
        raise SystemExit(f"{name!r} is neither a demo preset nor a model directory")
    return path.resolve()


def load_model(name: str) -> tuple[Any, Path]:
    """mlx-lm's model for a demo name or directory, and the directory it came from."""
    import mlx_lm

    path = resolve_model_dir(name)
    model, _ = mlx_lm.load(str(path))
    return model, path


@dataclass(frozen=True)
class EngineSizes:
    capacity: int  # KV slots in the pool
    max_running: int
    max_context: int
    chunk_size: int = 2048
    max_prefill_tokens: int = 8192


@dataclass
class StepClock:
    """Wall time of completed steps, split by whether a step computed any prompt tokens."""

    prefill_s: float = 0.0  # steps holding a prefill chunk (decode rows may ride along)
    decode_s: float = 0.0  # decode-only steps
    decode_steps: int = 0

    def add(self, batch: ForwardBatch, seconds: float) -> None:
        if batch.prefill:
            self.prefill_s += seconds
        else:
            self.decode_s += seconds
            self.decode_steps += 1


@dataclass
class RequestOutput:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class EngineLoop:
    """A `Scheduler` feeding a `ModelRunner` step by step, collecting every request's tokens."""

    def __init__(self, model: Any, sizes: EngineSizes) -> None:
        self.pool = KVPool(probe_attention_specs(model), sizes.capacity)
        self.runner = ModelRunner(model, self.pool, sizes.max_running, sizes.max_context)
        self.scheduler = Scheduler(SchedulerLimits(
            sizes.capacity, sizes.max_context, sizes.max_running,
            min(sizes.chunk_size, sizes.max_prefill_tokens), sizes.max_prefill_tokens))
        self.outputs: dict[str, RequestOutput] = {}
        self.steps = 0
        self.clock = StepClock()

    def submit(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        """Queue a greedy request with no stop ids: it ends after exactly max_tokens."""
        msg = TokenizedRequest(rid=rid, input_ids=prompt, stop_token_ids=[],
                               sampling=SamplingParams(temperature=0.0, max_new_tokens=max_tokens))
        self.outputs[rid] = RequestOutput()
        self._collect(self.scheduler.add_request(msg))

    def abort(self, rid: str) -> None:
        """End a request now; the worker forgets it with the next plan."""
        self._collect(self.scheduler.abort(rid))

    def plan(self) -> ForwardBatch | None:
        return self.scheduler.plan_step()

    def execute(self, batch: ForwardBatch) -> StepResult:
        """Run one planned step on the runner to completion and apply its tokens."""
        start = time.perf_counter()
        result = self.runner.run(batch)
        self._collect(self.scheduler.apply_result(result))
        self.clock.add(batch, time.perf_counter() - start)
        self.steps += 1
        return result

    def step(self) -> bool:
        batch = self.plan()
        if batch is None:
            return False
        self.execute(batch)
        return True

    def run_until_idle(self, max_steps: int, overlap: bool = False) -> int:
        """Step until no work is left; returns the steps taken. Raises past max_steps."""
        if overlap:
            return self._run_overlapped(max_steps)
        start = self.steps
        while self.step():
            if self.steps - start >= max_steps:
                raise RuntimeError(f"engine still busy after {max_steps} steps")
        return self.steps - start

    def _run_overlapped(self, max_steps: int) -> int:
        """The server's loops, sockets replaced by queues: the scheduler plans step N+1
        before it applies step N's result, the worker launches N+1 before it waits on N."""
        from scheduler_proc import SchedulerLoop
        from worker_proc import WorkerLoop

        inbox, to_worker, to_detokenizer = _Queue(), _Queue(), _Queue()
        scheduler = SchedulerLoop(self.scheduler, inbox, to_worker, to_detokenizer,
                                  max_in_flight=2)
        # As the server does: on CUDA the next step starts before the worker waits.
        worker = WorkerLoop(self.runner, inbox, overlap=True, start_ahead=self.runner.pool.in_place)
        start = self.steps
        while self.scheduler.has_work or scheduler.in_flight or inbox.items:
            scheduler.run_once()
            for message in to_worker.drain():
                self.steps += isinstance(message, ForwardBatch)
                worker.handle(message)
            for batch in to_detokenizer.drain():
                if isinstance(batch, BatchTokens):
                    self._collect(batch.outputs)
            if self.steps - start > max_steps:
                raise RuntimeError(f"engine still busy after {max_steps} steps")
        return self.steps - start

    def errors(self) -> list[str]:
        return [f"{rid}: {o.error}" for rid, o in self.outputs.items() if o.error]

    def _collect(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            record = self.outputs[out.rid]
            record.token_ids += out.token_ids
            if out.finished:
                record.finish_reason, record.error = out.finish_reason, out.error


class _Queue:
    """A socket's stand-in for the in-process loops: send, recv (never blocks), drain."""

    def __init__(self) -> None:
        self.items: deque[Any] = deque()

    def send(self, message: Any) -> None:
        self.items.append(message)

    def recv(self, timeout_ms: int | None = None) -> Any:
        return self.items.popleft() if self.items else None

    def drain(self) -> list[Any]:
        out = list(self.items)
        self.items.clear()
        return out

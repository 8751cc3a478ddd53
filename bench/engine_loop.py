"""kiln's scheduler and model runner driven in one process, without sockets, for benchmarks.

    from bench.engine_loop import EngineLoop, load_model
    model, _ = load_model("demo-tiny")
    loop = EngineLoop(model, EngineSizes(capacity=8192, max_running=16, max_context=2048))
    loop.submit("r0", [5, 6, 7], max_tokens=32)
    loop.run_until_idle(max_steps=1000)

The step is the served engine's: `Scheduler.plan_step` -> `ModelRunner.run` (launch, then
finish) -> `Scheduler.apply_result`. Requests are greedy and carry no EOS ids, so each one
runs to exactly `max_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipc.messages.common import SamplingParams
from ipc.messages.to_detokenizer import TokenOutput
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
        result = self.runner.run(batch)
        self.steps += 1
        self._collect(self.scheduler.apply_result(result))
        return result

    def step(self) -> bool:
        batch = self.plan()
        if batch is None:
            return False
        self.execute(batch)
        return True

    def run_until_idle(self, max_steps: int) -> int:
        """Step until no work is left; returns the steps taken. Raises past max_steps."""
        start = self.steps
        while self.step():
            if self.steps - start >= max_steps:
                raise RuntimeError(f"engine still busy after {max_steps} steps")
        return self.steps - start

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs.values())

    def errors(self) -> list[str]:
        return [f"{rid}: {o.error}" for rid, o in self.outputs.items() if o.error]

    def _collect(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            record = self.outputs[out.rid]
            record.token_ids += out.token_ids
            if out.finished:
                record.finish_reason, record.error = out.finish_reason, out.error

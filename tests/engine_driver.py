"""Scheduler and worker wired together in one process, without sockets, for tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ipc.messages.common import SamplingParams
from ipc.messages.to_detokenizer import TokenOutput
from ipc.messages.to_scheduler import TokenizedRequest
from scheduler_proc.scheduler import Scheduler, SchedulerLimits
from worker_proc.kv_pool import KVPool
from worker_proc.memory import probe_attention_specs
from worker_proc.runner import ModelRunner


@dataclass
class Finished:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class InProcessEngine:
    def __init__(self, model: Any, capacity: int = 8192, max_running: int = 16,
                 chunk_size: int = 256, max_prefill_tokens: int = 1024, max_context: int = 4096) -> None:
        self.pool = KVPool(probe_attention_specs(model), capacity)
        self.runner = ModelRunner(model, self.pool, max_running, max_context)
        self.scheduler = Scheduler(SchedulerLimits(capacity, max_context, max_running, chunk_size,
                                                   max_prefill_tokens))
        self.results: dict[str, Finished] = {}
        self.steps = 0

    def submit(self, rid: str, prompt: list[int], max_tokens: int, eos: list[int],
               **sampling: Any) -> None:
        msg = TokenizedRequest(rid=rid, input_ids=prompt, stop_token_ids=eos,
                               sampling=SamplingParams(max_new_tokens=max_tokens,
                                                       **{"temperature": 0.0, **sampling}))
        self.results[rid] = Finished()
        self._collect(self.scheduler.add_request(msg))

    def step(self) -> bool:
        batch = self.scheduler.plan_step()
        if batch is None:
            return False
        self.steps += 1
        self._collect(self.scheduler.apply_result(self.runner.run(batch)))
        return True

    def run_until_idle(self, max_steps: int = 100_000) -> dict[str, Finished]:
        for _ in range(max_steps):
            if not self.step():
                break
        return self.results

    def _collect(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            r = self.results[out.rid]
            r.token_ids += out.token_ids
            if out.finished:
                r.finish_reason, r.error = out.finish_reason, out.error

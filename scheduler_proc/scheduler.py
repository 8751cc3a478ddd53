"""The scheduler's decisions: admission, batching, chunked prefill, stop checks.

Pure logic on plain data: the process loop in `scheduler_proc.__init__` feeds it messages
and ships what it returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ipc.messages.common import SchedulerStats, Usage
from ipc.messages.to_detokenizer import TokenOutput
from ipc.messages.to_scheduler import StepResult, TokenizedRequest
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from scheduler_proc.allocator import ReqToTokenTable, SlotAllocator
from scheduler_proc.request import PROMPT_TAIL, FinishReason, Req, WaitingQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    capacity: int  # KV slots in the worker's pool
    max_context: int  # longest sequence (prompt + output) the worker can hold
    max_running: int
    chunk_size: int
    max_prefill_tokens: int


class PrefillBudget:
    """Prompt tokens one step may still compute, cut into chunks of at most `chunk`."""

    def __init__(self, tokens: int, chunk: int) -> None:
        self.left = tokens
        self.chunk = chunk

    def take(self, wanted: int) -> int:
        n = min(wanted, self.chunk, self.left)
        self.left -= n
        return n

    @property
    def exhausted(self) -> bool:
        return self.left <= 0


class KVReservation:
    """Admission control: a request is admitted only when every slot it could ever need
    is free beyond what the running requests may still claim, so decode never runs dry."""

    def __init__(self, free_slots: int, running: list[Req]) -> None:
        self.available = free_slots - sum(r.future_kv_tokens for r in running)

    def try_reserve(self, req: Req) -> bool:
        if req.future_kv_tokens > self.available:
            return False
        self.available -= req.future_kv_tokens
        return True


@dataclass
class Counters:
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0


class Scheduler:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.allocator = SlotAllocator(limits.capacity)
        self.table = ReqToTokenTable(limits.max_running, limits.max_context)
        self.waiting = WaitingQueue()
        self.running: dict[str, Req] = {}  # admission order
        self.counters = Counters()
        self._released: list[str] = []
        self._step = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- requests in, aborts ---------------------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> list[TokenOutput]:
        """Queue a request, or answer at once with an error if it can never run."""
        req = Req.from_message(msg)
        if req.rid in self.running or req.rid in self.waiting:
            return [_error(req.rid, f"duplicate request id {req.rid}")]
        problem = self._never_fits(req)
        if problem:
            return [_error(req.rid, problem)]
        self.counters.prompt_tokens += req.prompt_len
        self.waiting.push(req)
        return []

    def _never_fits(self, req: Req) -> str | None:
        if not req.input_ids:
            return "the prompt is empty"
        if req.sampling.max_new_tokens < 1:
            return "max_new_tokens must be >= 1"
        need = req.max_kv_tokens
        if need > self.limits.max_context:
            return (f"prompt ({req.prompt_len} tokens) + max_tokens ({req.sampling.max_new_tokens}) "
                    f"exceeds the context length the server holds ({self.limits.max_context})")
        if need > self.limits.capacity:
            return (f"the request needs {need} KV slots but the server has only "
                    f"{self.limits.capacity}; lower max_tokens or raise --max-total-tokens")
        return None

    def abort(self, rid: str) -> list[TokenOutput]:
        req = self.waiting.remove(rid) or self.running.get(rid)
        if req is None:
            return []  # already finished: its last output is on its way
        self.counters.aborted += 1
        self._finish(req, FinishReason.ABORT)
        return [self._output(req, [])]

    # -- planning a step -------------------------------------------------------------------

    def plan_step(self) -> ForwardBatch | None:
        """The next step: decode every running request, then spend the prefill budget on
        unfinished prompts (oldest first), admitting waiting requests while they fit."""
        new_reqs: list[NewRequest] = []
        decode_rids, decode_slots = self._plan_decode()
        budget = PrefillBudget(self.limits.max_prefill_tokens, self.limits.chunk_size)
        prefill = [self._plan_chunk(r, budget, new_reqs)
                   for r in list(self.running.values()) if r.prefilling and not budget.exhausted]
        prefill += self._admit(budget, new_reqs)
        prefill = [c for c in prefill if c is not None]
        if not (prefill or decode_rids):
            return None
        self._step += 1
        released, self._released = self._released, []
        return ForwardBatch(step=self._step, new_requests=new_reqs, prefill=prefill,
                            decode_rids=decode_rids, decode_slots=decode_slots, released=released)

    def _plan_decode(self) -> tuple[list[str], list[int]]:
        decoding = [r for r in self.running.values() if not r.prefilling]
        if not decoding:
            return [], []
        slots = self.allocator.alloc(len(decoding))
        if slots is None:  # NOTE: admission reserves every future slot, so this is a bug
            raise RuntimeError("KV slots ran out for decode despite admission control")
        for req, slot in zip(decoding, slots):
            self.table.assign(req.row, req.num_computed, slot[None])
            req.num_computed += 1
        return [r.rid for r in decoding], slots.tolist()

    def _admit(self, budget: PrefillBudget, new_reqs: list[NewRequest]) -> list[PrefillChunk | None]:
        chunks: list[PrefillChunk | None] = []
        reservation = KVReservation(self.allocator.num_free, list(self.running.values()))
        while (self.waiting and not budget.exhausted
               and len(self.running) < self.limits.max_running):
            req = self.waiting.peek()
            if not reservation.try_reserve(req):
                break  # FCFS: later requests do not overtake the head of the queue
            self.waiting.pop()
            req.row = self.table.alloc_row()
            self.running[req.rid] = req
            chunks.append(self._plan_chunk(req, budget, new_reqs))
        return chunks

    def _plan_chunk(self, req: Req, budget: PrefillBudget,
                    new_reqs: list[NewRequest]) -> PrefillChunk | None:
        n = budget.take(req.remaining_prompt)
        if n == 0:
            return None
        start = req.num_computed
        slots = self.allocator.alloc(n)
        if slots is None:
            raise RuntimeError("KV slots ran out for prefill despite admission control")
        self.table.assign(req.row, start, slots)
        req.num_computed += n
        self.counters.computed_prompt_tokens += n
        if not req.on_worker:
            req.on_worker = True
            new_reqs.append(NewRequest(rid=req.rid, sampling=req.sampling))
        return PrefillChunk(rid=req.rid, start=start, token_ids=req.input_ids[start:start + n],
                            slot_ids=slots.tolist(), sample=not req.prefilling)

    # -- results ---------------------------------------------------------------------------

    def apply_result(self, result: StepResult) -> list[TokenOutput]:
        outputs = []
        for rid, token in zip(result.rids, result.token_ids):
            req = self.running.get(rid)
            if req is not None:  # None: aborted while the step ran; the token is dropped
                outputs.append(self._append_token(req, token))
        return outputs

    def _append_token(self, req: Req, token: int) -> TokenOutput:
        self.counters.generated_tokens += 1
        if token in req.stop_token_ids:
            self._finish(req, FinishReason.STOP)
            return self._output(req, [], stop_token=True)
        req.output_ids.append(token)
        n_out = len(req.output_ids)
        if n_out >= req.sampling.max_new_tokens or req.prompt_len + n_out >= self.limits.max_context:
            self._finish(req, FinishReason.LENGTH)
        return self._output(req, [token])

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        if req.row is not None:
            self.allocator.free(self.table.slots(req.row, req.num_computed).copy())
            self.table.free_row(req.row)
            req.row = None
        self.running.pop(req.rid, None)
        if req.on_worker:
            self._released.append(req.rid)
        if reason is not FinishReason.ABORT:
            self.counters.finished += 1

    def _output(self, req: Req, token_ids: list[int], stop_token: bool = False) -> TokenOutput:
        first = not req.announced
        req.announced = True
        usage = None
        if req.finished:
            usage = Usage(prompt_tokens=req.prompt_len,
                          completion_tokens=len(req.output_ids) + int(stop_token))
        return TokenOutput(
            rid=req.rid, token_ids=token_ids, finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None, usage=usage,
            prompt_tail=req.input_ids[-PROMPT_TAIL:] if first else None,
            skip_special_tokens=req.skip_special_tokens)

    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(
            capacity_slots=self.allocator.capacity, used_slots=self.allocator.num_used,
            free_slots=self.allocator.num_free, running_requests=len(self.running),
            waiting_requests=len(self.waiting), prompt_tokens_total=c.prompt_tokens,
            computed_prompt_tokens_total=c.computed_prompt_tokens,
            generated_tokens_total=c.generated_tokens, finished_requests_total=c.finished,
            aborted_requests_total=c.aborted)


def _error(rid: str, message: str) -> TokenOutput:
    logger.info("rejected %s: %s", rid, message)
    return TokenOutput(rid=rid, token_ids=[], finished=True, finish_reason="error", error=message)

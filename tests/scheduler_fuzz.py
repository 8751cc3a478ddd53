"""Schedule fuzzing: the real `Scheduler` and `SchedulerLoop` against a fake worker that
records what every KV slot, window slot and recurrent-state snapshot holds, and checks
every read.

The fake model is a function of the tokens so far: the K/V of position i is the hash
(`Truth.key`) of tokens 0..i, a recurrent state after n tokens is the key of those n, and
the next token is drawn from that key (`model_token`). So a slot read is right exactly
when it holds the key of the reader's own prefix, and every request's outputs are known
in advance, whatever the batching, chunking, prefix hits, preemption, steps in flight,
aborts, refusals and whole-step failures a schedule throws at the scheduler.

`draw_schedule(seed, mode)` draws one schedule (prompts sharing heads, engine limits, how
often things go wrong); `run_schedule` drives it and raises `ScheduleBug` on the first
broken check. Replay one: `python -m tests.scheduler_fuzz SEED MODE` (from the repo root).
"""

from __future__ import annotations

import enum
import logging
import random
import sys
from collections import Counter, deque
from dataclasses import dataclass, field, fields

from ipc.messages.common import SamplingParams, Usage
from ipc.messages.to_detokenizer import BatchTokens, TokenOutput
from ipc.messages.to_scheduler import (AbortRequest, FlushCache, RequestError, SchedulerMessage,
                                       StepResult, TokenizedRequest)
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from kiln_common.windows import WindowRule
from scheduler_proc import SchedulerLoop
from scheduler_proc.radix_cache import SnapshotCache
from scheduler_proc.request import Req
from scheduler_proc.scheduler import Scheduler, SchedulerLimits

EOS = 1
VOCAB = 40
FIRST_TOKEN = 5  # prompts and the model's tokens are FIRST_TOKEN..VOCAB-1, or EOS
EOS_ODDS = 61  # the model ends a sequence with EOS about once in this many tokens
_MASK = (1 << 64) - 1
_FNV_PRIME = 0x100000001B3
_FNV_OFFSET = 0xCBF29CE484222325
MAX_TICKS = 20_000  # driver ticks before a schedule counts as stuck


class ScheduleBug(AssertionError):
    """A check of the fuzz harness failed: the scheduler did something wrong."""


# -- the fake model ---------------------------------------------------------------------------

def extend_key(key: int, token: int) -> int:
    """The key of a sequence one token longer (FNV-1a over token ids)."""
    return ((key ^ (token + 1)) * _FNV_PRIME) & _MASK


def model_token(key: int) -> int:
    """The fake model's greedy next token after the sequence with this key."""
    x = (key >> 32) * 2654435761 & 0xFFFFFFFF
    return EOS if x % EOS_ODDS == 0 else FIRST_TOKEN + x % (VOCAB - FIRST_TOKEN)


@dataclass(frozen=True)
class Expected:
    tokens: list[int]
    reason: str  # "stop" or "length"


class Truth:
    """A prompt and the fake model's greedy continuation of it, extended on demand."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt_len = len(prompt)
        self.seq = list(prompt)
        self.keys = [_FNV_OFFSET]  # keys[n]: the key of the first n tokens
        for token in prompt:
            self.keys.append(extend_key(self.keys[-1], token))

    def _extend_to(self, n: int) -> None:
        while len(self.seq) < n:
            token = model_token(self.keys[-1])
            self.seq.append(token)
            self.keys.append(extend_key(self.keys[-1], token))

    def key(self, n: int) -> int:
        """The key of the first n tokens: the K/V of position n - 1, the state after n."""
        if n >= len(self.keys):
            self._extend_to(n)
        return self.keys[n]

    def tokens(self, start: int, end: int) -> list[int]:
        self._extend_to(end)
        return self.seq[start:end]

    def expected(self, max_new: int) -> Expected:
        """What a request for this prompt must return: tokens up to EOS or max_new."""
        out = self.tokens(self.prompt_len, self.prompt_len + max_new)
        if EOS in out:
            return Expected(out[:out.index(EOS)], "stop")
        return Expected(out, "length")


# -- drawing a schedule -----------------------------------------------------------------------

class Mode(enum.Enum):
    PLAIN = "plain"  # one slot space, radix cache
    WINDOWS = "windows"  # windowed layers in a window slot space of their own
    SNAPSHOTS = "snapshots"  # recurrent layers: hits only where a state snapshot is kept
    NO_CACHE = "no-cache"  # --disable-radix-cache (or a worker that cannot share)


@dataclass(frozen=True)
class RequestPlan:
    prompt: list[int]
    max_new: int
    refused: bool  # the worker refuses it (a RequestError at its admission)

    @property
    def kv_need(self) -> int:
        return len(self.prompt) + self.max_new


@dataclass(frozen=True)
class Schedule:
    seed: int
    mode: Mode
    requests: list[RequestPlan]
    limits: SchedulerLimits
    max_in_flight: int
    step_failure_rate: float  # chance a step fails as a whole at the worker
    reuse_rate: float  # chance a request takes the id of one the client saw end

    @property
    def window_rule(self) -> WindowRule | None:
        return WindowRule(self.limits.windows) if self.limits.windows else None

    def describe(self) -> str:
        lim = self.limits
        return (f"{len(self.requests)} requests (prompts {[len(r.prompt) for r in self.requests]}, "
                f"max_new {[r.max_new for r in self.requests]}), capacity {lim.capacity}, "
                f"chunk {lim.chunk_size}/{lim.max_prefill_tokens} align {lim.chunk_align}, "
                f"spread {lim.prefill_parts}, "
                f"running {lim.max_running}, windows {lim.windows} in {lim.window_slots}, "
                f"snapshots {lim.state_snapshots}, in flight {self.max_in_flight}, "
                f"failures {self.step_failure_rate}, reuse {self.reuse_rate}")


def draw_schedule(seed: int, mode: Mode) -> Schedule:
    rng = random.Random(f"{mode.value}/{seed}")
    requests = _draw_requests(rng)
    return Schedule(seed=seed, mode=mode, requests=requests,
                    limits=_draw_limits(rng, mode, requests),
                    max_in_flight=rng.choice([1, 2, 2, 3]),
                    step_failure_rate=rng.choice([0.0, 0.0, 0.0, 0.02]),
                    reuse_rate=rng.choice([0.0, 0.5, 1.0]))


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


def _draw_prompt(rng: random.Random, earlier: list[list[int]]) -> list[int]:
    """A fresh prompt, or one sharing a head with an earlier one (the cache's hits): the
    same, a prefix of it, it extended, its head, or a next turn (it, the model's answer
    to it, more), which hits K/V that decode steps wrote."""
    if not earlier or rng.random() >= 0.6:
        return _fresh(rng, rng.choice([1, 5, 20, 50, 90]))
    base = rng.choice(earlier)
    fresh = _fresh(rng, rng.randrange(1, 60))
    kind = rng.choice(["same", "prefix", "extend", "share", "turn"])
    if kind == "turn":
        answer = Truth(base).tokens(len(base), len(base) + rng.choice([1, 5, 20]))
        return base + answer + fresh
    if kind == "same":
        return list(base)
    if kind == "prefix" and len(base) > 1:
        return base[:rng.randrange(1, len(base))]
    if kind == "extend":
        return base + fresh
    return base[:rng.choice([1, 8, 20, 40])] + fresh


def _draw_requests(rng: random.Random) -> list[RequestPlan]:
    prompts: list[list[int]] = []
    for _ in range(rng.randrange(3, 12)):
        prompts.append(_draw_prompt(rng, prompts))
    return [RequestPlan(p, rng.choice([0, 1, 3, 10, 30]) if rng.random() < 0.2
                        else rng.choice([5, 20, 40, 80]), refused=rng.random() < 0.05)
            for p in prompts]


def _draw_limits(rng: random.Random, mode: Mode, requests: list[RequestPlan]) -> SchedulerLimits:
    chunk = rng.choice([8, 16, 32])
    need = max(r.kv_need for r in requests)
    # Mostly a pool that fits the longest request with little to spare: preemption.
    capacity = (need + rng.randrange(0, max(1, need // 3)) if rng.random() < 0.8
                else sum(r.kv_need for r in requests) + 200)
    windows: tuple[tuple[str, int], ...] = ()
    window_slots = 0
    if mode is Mode.WINDOWS:
        windows = rng.choice([(("sliding", 8),), (("chunked", 16),),
                              (("sliding", 12), ("chunked", 8))])
        least = WindowRule(windows).most_held(need, need, chunk)
        # Often the least the longest request needs: the window space runs short while
        # the full one may not (test_scheduler_fuzz's window_shortage meets that surely).
        window_slots = rng.choice([least, least, least + 10, capacity // 2 + least, capacity])
    return SchedulerLimits(
        capacity=capacity, max_context=1024, max_running=rng.choice([1, 2, 4, 16]),
        chunk_size=chunk, max_prefill_tokens=rng.choice([chunk, 2 * chunk, 4 * chunk]),
        radix_cache=mode is not Mode.NO_CACHE, schedule_policy=rng.choice(["fcfs", "lpm"]),
        state_snapshots=rng.choice([1, 2, 4, 16]) if mode is Mode.SNAPSHOTS else 0,
        snapshot_stride=rng.choice([0, 0, 16]), window_slots=window_slots, windows=windows,
        max_prefill_tokens_while_decoding=rng.choice([None, 4, chunk]),
        chunk_align=rng.choice([1, 1, 8]),
        prefill_parts=1 if mode is Mode.SNAPSHOTS else rng.choice([1, 1, 2, 3]),
        decode_first_for_all=rng.choice([False, True]))


# -- the client: requests in, outputs checked -------------------------------------------------

@dataclass
class Instance:
    """One request as the client sent it (a reused id names several, one after another)."""

    rid: str
    nth: int  # 1 for the first request under its id, 2 for the next that reuses it...
    plan: RequestPlan
    truth: Truth
    aborted: bool = False
    # On the worker when the scheduler learnt of a whole-step failure: it ends with it.
    failed_with_worker: bool = False
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    reason: str | None = None
    usage: Usage | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.rid if self.nth == 1 else f"{self.rid} (request {self.nth} under this id)"


class Client:
    """Sends requests and aborts, and routes each output to the instance it belongs to:
    the oldest one of its id that has not finished (a reused id's outputs come after the
    ended one's last)."""

    def __init__(self) -> None:
        self.instances: list[Instance] = []
        self.current: dict[str, Instance] = {}  # the latest instance sent under each id
        self._open: dict[str, deque[Instance]] = {}

    def request(self, rid: str, plan: RequestPlan) -> TokenizedRequest:
        nth = sum(inst.rid == rid for inst in self.instances) + 1
        inst = Instance(rid, nth, plan, Truth(plan.prompt))
        self.instances.append(inst)
        self.current[rid] = inst
        self._open.setdefault(rid, deque()).append(inst)
        return TokenizedRequest(rid=rid, input_ids=plan.prompt, stop_token_ids=[EOS],
                                sampling=SamplingParams(temperature=0.0,
                                                        max_new_tokens=plan.max_new))

    def reusable_ids(self) -> list[str]:
        """Ids whose latest request the client saw end or has aborted (a client may send
        a new request under such an id at once; the scheduler takes the abort first)."""
        return [rid for rid, inst in self.current.items() if inst.finished or inst.aborted]

    def receive(self, output: TokenOutput) -> None:
        waiting = self._open.get(output.rid)
        if not waiting:
            raise ScheduleBug(f"output {output.token_ids} for {output.rid}, which has no "
                              f"unfinished request")
        inst = waiting[0]
        inst.tokens += output.token_ids
        if output.finished:
            waiting.popleft()
            inst.finished, inst.reason = True, output.finish_reason
            inst.usage, inst.error = output.usage, output.error


def check_outcome(inst: Instance) -> None:
    """A request's end: its tokens, finish reason and usage are the fake model's."""
    if not inst.finished:
        raise ScheduleBug(f"{inst.name} never finished")
    want = inst.truth.expected(inst.plan.max_new)
    if inst.tokens != want.tokens[:len(inst.tokens)]:
        raise ScheduleBug(f"{inst.name} returned {inst.tokens} ({inst.reason}), the model "
                          f"gives {want.tokens} ({want.reason})")
    if inst.reason == "abort" and inst.aborted:
        return  # cut short where the abort found it
    if inst.reason == "error":
        if inst.error == "refused" and inst.plan.refused:
            return
        # A failure, once the scheduler learns of it, ends the requests it had sent to
        # the worker; those admitted but not sent yet are queued again.
        if str(inst.error).startswith("internal error") and inst.failed_with_worker:
            return
        raise ScheduleBug(f"{inst.name} ended with an error: {inst.error}")
    if inst.tokens != want.tokens or inst.reason != want.reason:
        raise ScheduleBug(f"{inst.name} returned {inst.tokens} ({inst.reason}), the model "
                          f"gives {want.tokens} ({want.reason})")
    usage = inst.usage
    if usage is None:
        raise ScheduleBug(f"{inst.name} finished without usage")
    if not 0 <= usage.cached_tokens <= len(inst.plan.prompt):
        raise ScheduleBug(f"{inst.name} cached_tokens {usage.cached_tokens}")
    if usage.completion_tokens != len(want.tokens) + (want.reason == "stop"):
        raise ScheduleBug(f"{inst.name} completion_tokens {usage.completion_tokens}")


# -- the fake worker --------------------------------------------------------------------------

@dataclass
class WorkerRequest:
    """What the fake worker holds for one request, like the runner's table rows."""

    truth: Truth
    row: list[int]  # full slot of each position
    window_row: list[int]  # window slot of each position (0: none)
    start_snapshot: int
    length: int = 0  # positions computed
    state: object = None  # the recurrent state: the key of what it was fed
    started: bool = False  # its first chunk ran
    last: int | None = None  # its last sampled token (what its next decode feeds)


@dataclass(frozen=True)
class SnapshotState:
    state: object
    length: int


@dataclass
class Sampled:
    rid: str
    token: int


class FakeWorker:
    """Runs steps on slots of keys: every write records the key of the writer's prefix,
    every read checks it (see the module doc)."""

    def __init__(self, rule: WindowRule | None, recurrent: bool) -> None:
        self.rule = rule
        self.recurrent = recurrent
        self.full: dict[int, int] = {}  # slot -> key of what its K/V were computed from
        self.window: dict[int, int] = {}
        self.snapshots: dict[int, SnapshotState] = {}
        self.requests: dict[str, WorkerRequest] = {}
        # Steps failed as a whole: a step planned before the scheduler learnt of the
        # last one is not run (ForwardBatch.epoch).
        self.failures = 0
        # A spread prefill's chunks (ForwardBatch.parts): their K/V count as written, and
        # their prompts' tokens as sampled, with the last part only (the real worker
        # writes a share of the layers a step: a read before the last part is wrong).
        self.spread: list[PrefillChunk] | None = None

    def fail(self, batch: ForwardBatch, admitted: dict[str, Instance]) -> None:
        """The step fails as a whole after taking its releases and new requests: forget
        every request (what the pool holds stays, untrusted)."""
        self._release(batch)
        for new in batch.new_requests:
            self._admit(batch.step, new, admitted[new.rid])
        self.failures += 1
        self.requests.clear()
        self.spread = None

    def stale(self, batch: ForwardBatch) -> bool:
        """Planned before the scheduler learnt of the last failure: not run."""
        return batch.epoch < self.failures

    def run(self, batch: ForwardBatch, admitted: dict[str, Instance]) -> StepResult:
        """One step; `admitted`: the client's instance of each new request's id."""
        self._release(batch)
        errors = [self._admit(batch.step, new, admitted[new.rid]) for new in batch.new_requests]
        rows = [self._prefill(batch.step, chunk) for chunk in self._spread_chunks(batch)]
        rows += [self._decode(batch, i) for i in range(len(batch.decode_rids))]
        sampled = [row for row in rows if row is not None]
        return StepResult(step=batch.step, rids=[s.rid for s in sampled],
                          token_ids=[s.token for s in sampled],
                          errors=[e for e in errors if e is not None])

    def _spread_chunks(self, batch: ForwardBatch) -> list[PrefillChunk]:
        """The chunks whose K/V this step completes: its own, or with a spread's last part
        the spread's (none in its other parts)."""
        if batch.parts == 1:
            return list(batch.prefill)
        where = f"step {batch.step} (parts {batch.parts_from}..{batch.parts_to} of {batch.parts})"
        if batch.parts_from == 0:
            if self.spread is not None:
                raise ScheduleBug(f"{where}: a spread starts before the last one ended")
            self.spread = list(batch.prefill)
        elif batch.prefill:
            raise ScheduleBug(f"{where}: a spread's later part carries new chunks")
        elif self.spread is None:
            raise ScheduleBug(f"{where}: continues no spread")
        if batch.parts_to < batch.parts:
            return []
        chunks, self.spread = self.spread, None
        return chunks

    def _release(self, batch: ForwardBatch) -> None:
        if self.spread is not None and {c.rid for c in self.spread} & set(batch.released):
            raise ScheduleBug(f"step {batch.step}: releases a request of the spread in flight")
        for i, rid in enumerate(batch.released):
            req = self.requests.pop(rid, None)
            if req is not None and batch.released_snapshots and batch.released_snapshots[i]:
                self.snapshots[batch.released_snapshots[i]] = SnapshotState(req.state, req.length)

    def _admit(self, step: int, new: NewRequest, inst: Instance) -> RequestError | None:
        if new.rid in self.requests:
            raise ScheduleBug(f"step {step}: {new.rid} admitted while the worker holds it")
        if new.prefix_slot_ids and self.recurrent and not new.state_snapshot:
            raise ScheduleBug(f"step {step}: {new.rid} hits a prefix without a state snapshot")
        prefix = list(new.prefix_slot_ids)
        windows = list(new.prefix_window_slot_ids)
        self.requests[new.rid] = WorkerRequest(
            truth=inst.truth, row=prefix,
            window_row=windows + [0] * (len(prefix) - len(windows)),
            start_snapshot=new.state_snapshot, length=len(prefix),
            state=None if prefix else inst.truth.key(0))
        return RequestError(new.rid, "refused") if inst.plan.refused else None

    def _held(self, step: int, rid: str) -> WorkerRequest:
        req = self.requests.get(rid)
        if req is None:
            raise ScheduleBug(f"step {step}: {rid} is not on the worker")
        return req

    def _prefill(self, step: int, chunk: PrefillChunk) -> Sampled | None:
        req = self._held(step, chunk.rid)
        truth, n = req.truth, len(chunk.token_ids)
        where = f"step {step}: {chunk.rid} chunk at {chunk.start}"
        if chunk.start != req.length:
            raise ScheduleBug(f"{where}: the worker has computed {req.length} positions")
        if list(chunk.token_ids) != truth.tokens(chunk.start, chunk.start + n):
            raise ScheduleBug(f"{where}: tokens {chunk.token_ids} are not the sequence's")
        if len(chunk.slot_ids) != n or (self.rule is not None and len(chunk.window_slot_ids) != n):
            raise ScheduleBug(f"{where}: {len(chunk.slot_ids)} slots, "
                              f"{len(chunk.window_slot_ids)} window slots for {n} tokens")
        self._check_state(where, req, chunk.start)
        self._write(req, chunk.start, chunk.slot_ids, chunk.window_slot_ids)
        self._check_reads(where, req, chunk.start)
        if self.recurrent:
            req.state = truth.key(req.length)
            if chunk.snapshot_id:
                self.snapshots[chunk.snapshot_id] = SnapshotState(req.state, req.length)
        if not chunk.sample:
            return None
        req.last = model_token(truth.key(req.length))
        return Sampled(chunk.rid, req.last)

    def _check_state(self, where: str, req: WorkerRequest, start: int) -> None:
        """The recurrent state a chunk starts from: its snapshot's for the first chunk of
        a prefix hit, else what the previous chunks left."""
        if not self.recurrent:
            return
        want = req.truth.key(start)
        if not req.started and req.start_snapshot:
            kept = self.snapshots.get(req.start_snapshot)
            if kept != SnapshotState(want, start):
                raise ScheduleBug(f"{where}: snapshot {req.start_snapshot} holds {kept}, "
                                  f"not the state after {start} tokens")
            req.state = kept.state
        req.started = True
        if req.state != want:
            raise ScheduleBug(f"{where}: the recurrent state is not the one after {start} tokens")

    def _write(self, req: WorkerRequest, start: int, slots: list[int],
               window_slots: list[int]) -> None:
        """The K/V of positions start.. (computed from the request's own tokens)."""
        for j, slot in enumerate(slots):
            self.full[slot] = req.truth.key(start + j + 1)
        req.row[start:] = list(slots)
        if self.rule is not None:
            for j, slot in enumerate(window_slots):
                self.window[slot] = req.truth.key(start + j + 1)
            req.window_row[start:] = list(window_slots)
        req.length = start + len(slots)

    def _check_reads(self, where: str, req: WorkerRequest, first_query: int) -> None:
        """Every position the queries from first_query on read holds the K/V of the
        request's own prefix: all of them in the full space, those inside the first
        query's window in the window space."""
        truth = req.truth
        for pos in range(req.length):
            if self.full.get(req.row[pos]) != truth.key(pos + 1):
                raise ScheduleBug(f"{where}: full slot {req.row[pos]} of position {pos} holds "
                                  f"other K/V (context {req.length})")
        if self.rule is None:
            return
        for pos in range(int(self.rule.first_needed(first_query)), req.length):
            slot = req.window_row[pos]
            if slot == 0 or self.window.get(slot) != truth.key(pos + 1):
                raise ScheduleBug(f"{where}: window slot {slot} of position {pos} is missing "
                                  f"or holds other K/V (query {first_query})")

    def _decode(self, batch: ForwardBatch, i: int) -> Sampled:
        """Feed the request's last sample at its next position (the worker's own token:
        a scheduler that believes another has the wrong K/V keyed in its cache)."""
        rid = batch.decode_rids[i]
        req = self._held(batch.step, rid)
        if req.last is None:
            raise ScheduleBug(f"step {batch.step}: {rid} decodes before it sampled a token")
        pos, truth = req.length, req.truth
        where = f"step {batch.step}: {rid} decode at {pos}"
        self._check_state(where, req, pos)
        # NOTE: the last sample is always the truth's next token: every read it came
        # from was checked, and the fake samples greedily.
        self._write(req, pos, [batch.decode_slots[i]], batch.decode_window_slots[i:i + 1])
        self._check_reads(where, req, pos)
        if self.recurrent:
            req.state = truth.key(pos + 1)
        req.last = model_token(truth.key(pos + 1))
        return Sampled(rid, req.last)


# -- the scheduler's state, checked after every plan and every turn ---------------------------

def _free_slots(s: Scheduler) -> list[int]:
    # NOTE: the allocator's free stack, read directly: its count alone cannot show a slot
    # freed twice or lost.
    return s.allocator._free[:s.allocator._top].tolist()


def _owned_slots(s: Scheduler, req: Req) -> list[int]:
    """The slots a running request holds itself: past its cached prefix, and its copies
    of positions another request cached first."""
    row = s.table.slots(req.row, req.num_computed)
    owned = row[req.prefix_len:req.num_computed].tolist()
    for dup in req.dups:
        owned += row[dup.start:dup.end].tolist()
    return owned


def check_partition(s: Scheduler) -> None:
    """Every slot is free, cached or owned by one running request (or one a spread prefill
    in flight holds after it ended), exactly once; window slots belong to one position
    each; lock counts match what is protected; snapshot ids are unique and none is lost."""
    free, cached = _free_slots(s), s.cache.all_slots().tolist()
    held = [req for req, _, _ in s._spread.held] if s._spread is not None else []
    owned = [slot for req in [*s.running.values(), *held] for slot in _owned_slots(s, req)]
    every = free + cached + owned
    if sorted(every) != list(range(1, s.allocator.capacity + 1)):
        twice = [slot for slot, n in Counter(every).items() if n > 1][:10]
        lost = sorted(set(range(1, s.allocator.capacity + 1)) - set(every))[:10]
        raise ScheduleBug(f"slots not partitioned: twice {twice}, lost {lost} (free "
                          f"{len(free)}, cached {len(cached)}, owned {len(owned)})")
    if s.windows is not None and not s.windows.consistent():
        raise ScheduleBug("a window slot is held by two positions, or lost")
    nodes = s.cache.nodes()
    if any(node.lock_ref < 0 for node in nodes):
        raise ScheduleBug("a cache node is unlocked more often than locked")
    protected = sum(len(node.key) for node in nodes if node.lock_ref > 0)
    if protected != s.cache.protected_size:
        raise ScheduleBug(f"protected_size {s.cache.protected_size}, locked nodes hold {protected}")
    if isinstance(s.cache, SnapshotCache):
        ids = [node.snapshot for node in nodes if node.snapshot]
        lost = s.limits.state_snapshots - s.cache.free_snapshots - len(ids)
        if len(ids) != len(set(ids)) or lost:
            raise ScheduleBug(f"snapshot ids {sorted(ids)} with {s.cache.free_snapshots} free")


def check_no_stall(s: Scheduler, batch: ForwardBatch, preempted: bool) -> None:
    """A step leaves out every decoding request only to wait for a finishing request's
    slots, or after a preemption: a shortage nothing finishing relieves is not waited out
    (decode would stall for as long as a prompt prefills beside it)."""
    if batch.decode_rids or preempted:
        return
    # Prompts this step ends were not decoding when it was planned, nor finishing.
    ended_prompts = {c.rid for c in batch.prefill if c.sample}
    finishing = {r.rid for r in s._finishing()} - ended_prompts
    # A spread prefill's requests decode only after its last part, which samples the
    # first tokens of those whose prompts it ends.
    spread = set(s._spread.admitted_as) if s._spread is not None else set()
    spread |= set(s._sampled_for.get(batch.step, ())) - set(batch.decode_rids)
    left_out = [r.rid for r in s.running.values() if not r.prefilling and r.rid not in spread
                and r.rid not in ended_prompts and r.rid not in finishing]
    if left_out and not finishing:
        raise ScheduleBug(f"step {batch.step} decodes none of {left_out} with nothing finishing "
                          f"and no preemption (full slots free {s.allocator.num_free}, window "
                          f"free {s.windows.num_free if s.windows is not None else '-'})")


def check_idle(s: Scheduler) -> None:
    """Nothing runs: every slot is free or cached, and flushing the cache frees them all."""
    capacity = s.allocator.capacity
    if not s.slots_consistent() or s.allocator.num_free + s.cache.total_size != capacity:
        raise ScheduleBug("idle, yet some slots are neither free nor cached")
    s.flush_cache()
    if s.allocator.num_free != capacity:
        raise ScheduleBug(f"the flushed cache keeps {capacity - s.allocator.num_free} slots")
    if s.windows is not None and s.windows.num_free != s.windows.capacity:
        raise ScheduleBug("window slots leak")


# -- the pipes between the loop, the worker and the client ------------------------------------

class Inbox:
    """The scheduler's inbox (a Receiver): messages in the order sent."""

    def __init__(self) -> None:
        self.items: deque[SchedulerMessage] = deque()

    def send(self, message: SchedulerMessage) -> None:
        self.items.append(message)

    def recv(self, timeout_ms: int | None = None) -> SchedulerMessage | None:
        return self.items.popleft() if self.items else None

    def drain(self) -> list[SchedulerMessage]:
        out = list(self.items)
        self.items.clear()
        return out


class Outbox:
    """The detokenizer's end: every TokenOutput, in order."""

    def __init__(self) -> None:
        self.outputs: list[TokenOutput] = []

    def send(self, message: object) -> None:
        if isinstance(message, BatchTokens):
            self.outputs += message.outputs

    def take(self) -> list[TokenOutput]:
        out, self.outputs = self.outputs, []
        return out


@dataclass(frozen=True)
class Sent:
    """A step as the loop sent it, with the client's instance of each id it names (the
    loop plans only after taking every message sent before, so `Client.current` then
    is what the scheduler knows)."""

    batch: ForwardBatch
    instances: dict[str, Instance]
    learnt: int = 0  # whole-step failures the scheduler had learnt of when it planned it

    @property
    def sampled(self) -> set[str]:
        return {c.rid for c in self.batch.prefill if c.sample} | set(self.batch.decode_rids)


class WorkerLink:
    """The loop's worker Sender: checks each step as it is planned (the loop sends it at
    once) and queues it for the fake worker."""

    def __init__(self, scheduler: Scheduler, client: Client) -> None:
        self.scheduler = scheduler
        self.client = client
        self.queue: deque[Sent] = deque()
        self.by_step: dict[int, Sent] = {}
        self._preemptions = 0
        self.learnt = 0  # whole-step failures the scheduler has learnt of
        # The client's instance of each admission the steps sent (rid, Req.admission).
        self.admitted: dict[tuple[str, int], Instance] = {}

    def turn_starts(self) -> None:
        """Preemptions happen only while planning: count them from here."""
        self._preemptions = self.scheduler.counters.preemptions

    def send(self, message: object) -> None:
        if not isinstance(message, ForwardBatch):
            return  # SyncSteps: the fake worker reports every step it ran anyway
        s = self.scheduler
        check_no_stall(s, message, preempted=s.counters.preemptions > self._preemptions)
        self._preemptions = s.counters.preemptions
        check_partition(s)
        names = ({n.rid for n in message.new_requests} | {c.rid for c in message.prefill}
                 | set(message.decode_rids))
        sent = Sent(message, {rid: self.client.current[rid] for rid in names}, self.learnt)
        for new in message.new_requests:
            self.admitted[new.rid, s.running[new.rid].admission] = sent.instances[new.rid]
        self.queue.append(sent)
        self.by_step[message.step] = sent


# -- driving a schedule -----------------------------------------------------------------------

@dataclass
class Coverage:
    """What a schedule exercised (so a test can tell the draw still reaches it)."""

    preemptions: int = 0
    cache_hit_tokens: int = 0
    step_failures: int = 0
    aborts: int = 0
    reused_ids: int = 0
    reused_in_flight: int = 0  # reused while a step sampling the ended request was out
    spread_parts: int = 0  # later parts of spread prefills run (beside decode rows or not)

    def add(self, other: Coverage) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class FuzzRun:
    """One schedule: at each tick the client sends a request or an abort, the worker
    runs what it was sent and reports (or fails a step), or the loop takes a turn, in
    an order drawn from the seed."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.rng = random.Random(f"{schedule.mode.value}/{schedule.seed}/run")
        self.scheduler = Scheduler(schedule.limits)
        self.client = Client()
        self.inbox, self.outbox = Inbox(), Outbox()
        self.link = WorkerLink(self.scheduler, self.client)
        self.loop = SchedulerLoop(self.scheduler, self.inbox, self.link, self.outbox,
                                  max_in_flight=schedule.max_in_flight)
        self.worker = FakeWorker(schedule.window_rule, recurrent=schedule.mode is Mode.SNAPSHOTS)
        fail_everything = self.scheduler._fail_everything

        def learn_of_failure(reason: str) -> list[TokenOutput]:
            """The requests a failure may end: those on the worker when it is learnt."""
            self.link.learnt += 1
            for req in self.scheduler.running.values():
                if req.on_worker:
                    self.link.admitted[req.rid, req.admission].failed_with_worker = True
            return fail_everything(reason)

        self.scheduler._fail_everything = learn_of_failure  # type: ignore[method-assign]
        self.results: deque[StepResult] = deque()  # the worker's, not yet delivered
        self.owed: deque[int] = deque()  # steps the worker received, not yet reported
        self.pending = deque(schedule.requests)
        self.coverage = Coverage()

    def run(self) -> Coverage:
        for _ in range(MAX_TICKS):
            self._tick()
            for output in self.outbox.take():
                self.client.receive(output)
            if self._done():
                self._check_end()
                return self.coverage
        raise ScheduleBug(f"no progress after {MAX_TICKS} ticks: running "
                          f"{list(self.scheduler.running)}, waiting {len(self.scheduler.waiting)}")

    def _done(self) -> bool:
        return not (self.pending or self.scheduler.has_work or self.loop.in_flight
                    or self.link.queue or self.results or self.inbox.items)

    def _tick(self) -> None:
        a = self.rng.random()
        if self.pending and a < 0.15:
            self._submit(self.pending.popleft())
        elif a < 0.2 and self.client.current and self.rng.random() < 0.3:
            self._abort(self.rng.choice(list(self.client.current)))
        elif a < 0.6:
            self._worker_turn()
        else:
            self.link.turn_starts()
            self.loop.run_once()
            check_partition(self.scheduler)

    def _submit(self, plan: RequestPlan, rid: str | None = None) -> None:
        """Send a request: under a new id, or (reuse_rate) one the client saw end."""
        reusable = self.client.reusable_ids()
        if rid is None and reusable and self.rng.random() < self.schedule.reuse_rate:
            rid = self.rng.choice(reusable)
        if rid in self.client.current:
            self.coverage.reused_ids += 1
            self.coverage.reused_in_flight += self._sampled_in_flight(self.client.current[rid])
        self.inbox.send(self.client.request(rid or f"r{len(self.client.instances)}", plan))

    def _sampled_in_flight(self, inst: Instance) -> bool:
        """Whether a step the scheduler has not had the result of yet samples inst."""
        landed = {m.step for m in self.inbox.items if isinstance(m, StepResult)}
        for out in self.loop.in_flight:
            sent = self.link.by_step[out.step]
            if (out.step not in landed and inst.rid in sent.sampled
                    and sent.instances[inst.rid] is inst):
                return True
        return False

    def _abort(self, rid: str) -> None:
        """Abort the id's latest request; maybe send the next one under it at once (a
        client retrying with its own rid), while steps sampling the old one are out."""
        self.client.current[rid].aborted = True
        self.coverage.aborts += 1
        self.inbox.send(AbortRequest(rid=rid))
        if self.pending and self.rng.random() < self.schedule.reuse_rate:
            self._submit(self.pending.popleft(), rid)

    def _worker_turn(self) -> None:
        """The worker runs every step it was sent, then maybe reports the oldest."""
        while self.link.queue:
            self._run_step(self.link.queue.popleft())
        if self.rng.random() < 0.02:
            self.inbox.send(FlushCache(query_id="fuzz"))
        if self.results and self.rng.random() < 0.8:
            result = self.results.popleft()
            if self.owed and self.owed[0] == result.step:
                self.owed.popleft()
            self.inbox.send(result)

    def _run_step(self, sent: Sent) -> None:
        self.owed.append(sent.batch.step)
        self.coverage.spread_parts += sent.batch.parts_from > 0
        if self.worker.stale(sent.batch):
            if sent.learnt >= self.worker.failures:
                raise ScheduleBug(f"step {sent.batch.step} (epoch {sent.batch.epoch}) was "
                                  f"planned knowing all {self.worker.failures} failures, "
                                  "yet the worker would not run it")
            self._report_owed_failed("its requests were ended by an earlier failed step")
            return
        admitted = {n.rid: sent.instances[n.rid] for n in sent.batch.new_requests}
        if self.rng.random() < self.schedule.step_failure_rate:
            self.coverage.step_failures += 1
            self.worker.fail(sent.batch, admitted)
            self._report_owed_failed("injected failure")
        else:
            self.results.append(self.worker.run(sent.batch, admitted))

    def _report_owed_failed(self, reason: str) -> None:
        """Like the worker's _report_failed: every step not reported yet, failed (its
        computed but unsent results are dropped)."""
        kept = [r for r in self.results if r.failed is not None]
        self.results = deque(kept)
        while self.owed:
            self.results.append(StepResult(step=self.owed.popleft(), rids=[], token_ids=[],
                                           failed=reason, epoch=self.worker.failures))

    def _check_end(self) -> None:
        for inst in self.client.instances:
            check_outcome(inst)
        check_idle(self.scheduler)
        self.coverage.preemptions = self.scheduler.counters.preemptions
        self.coverage.cache_hit_tokens = self.scheduler.counters.cache_hit_tokens


def run_schedule(schedule: Schedule) -> Coverage:
    """Drive one schedule to its end; raises ScheduleBug (or what the scheduler raised)."""
    return FuzzRun(schedule).run()


def replay_hint(seed: int, mode: Mode) -> str:
    return f"python -m tests.scheduler_fuzz {seed} {mode.value}"


def main(argv: list[str]) -> None:
    """Replay one schedule, with the scheduler's log, to the first failed check."""
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    seed, mode = int(argv[0]), Mode(argv[1])
    schedule = draw_schedule(seed, mode)
    print(f"{mode.value} seed {seed}: {schedule.describe()}")
    print(run_schedule(schedule))


if __name__ == "__main__":
    main(sys.argv[1:])

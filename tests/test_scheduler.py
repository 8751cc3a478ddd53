"""The scheduler's managers on plain data: allocator, table, queue, budgets, step plans."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ipc.messages.common import SamplingParams
from ipc.messages.to_scheduler import StepResult, TokenizedRequest
from scheduler_proc.allocator import ReqToTokenTable, SlotAllocator
from scheduler_proc.request import Req, WaitingQueue
from scheduler_proc.scheduler import (BURST_STEPS, DecodeRatio, KVReservation, PrefillBudget,
                                      Scheduler, SchedulerLimits)


def _req(rid: str, prompt: int, max_new: int, eos: tuple[int, ...] = (0,),
         first: int | None = None) -> TokenizedRequest:
    """A prompt of consecutive ids; distinct rids get disjoint prompts unless `first` is given."""
    start = first if first is not None else 10 + 1000 * (sum(map(ord, rid)) % 50)
    return TokenizedRequest(rid=rid, input_ids=list(range(start, start + prompt)),
                            stop_token_ids=list(eos),
                            sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new))


def assert_idle_invariant(s: Scheduler) -> None:
    """Idle: every slot is free or cached; flushing the cache frees them all."""
    assert not s.running and s.slots_consistent()
    assert s.allocator.num_free + s.cache.total_size == s.allocator.capacity
    s.flush_cache()
    assert s.allocator.num_free == s.allocator.capacity and s.cache.total_size == 0
    # The windowed layers' slots went back with the positions that held them.
    assert s.windows is None or s.windows.num_free == s.windows.capacity


def _sched(capacity=1000, max_context=512, max_running=8, chunk=64, budget=128,
           while_decoding=None, for_all=False) -> Scheduler:
    return Scheduler(SchedulerLimits(capacity, max_context, max_running, chunk, budget,
                                     max_prefill_tokens_while_decoding=while_decoding,
                                     decode_first_for_all=for_all))


def _answer(batch, token: int = 7) -> StepResult:
    rids = [c.rid for c in batch.prefill if c.sample] + list(batch.decode_rids)
    return StepResult(step=batch.step, rids=rids, token_ids=[token] * len(rids))


# -- allocator and table -------------------------------------------------------------------

def test_allocator_never_hands_out_slot_zero_or_a_slot_twice():
    alloc = SlotAllocator(10)
    a = alloc.alloc(4)
    b = alloc.alloc(6)
    assert alloc.alloc(1) is None and alloc.num_free == 0
    assert sorted(np.concatenate([a, b]).tolist()) == list(range(1, 11))
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.num_used == 6
    assert sorted(alloc.alloc(4).tolist()) == sorted(a.tolist())


def test_allocator_refuses_partial_allocations_and_double_frees():
    alloc = SlotAllocator(3)
    assert alloc.alloc(4) is None and alloc.num_free == 3
    with pytest.raises(RuntimeError):
        alloc.free(np.array([1], dtype=np.int32))


def test_req_to_token_table_rows():
    table = ReqToTokenTable(rows=2, max_context=8)
    r0, r1 = table.alloc_row(), table.alloc_row()
    assert {r0, r1} == {0, 1}
    assert table.alloc_row() is None
    table.assign(r0, 0, np.array([5, 6, 7]))
    table.assign(r0, 3, np.array([9]))
    assert table.slots(r0, 4).tolist() == [5, 6, 7, 9]
    table.free_row(r0)
    assert table.num_free_rows == 1 and table.slots(r0, 4).tolist() == [0, 0, 0, 0]


def test_waiting_queue_is_fifo_with_removal():
    q = WaitingQueue()
    for rid in "abc":
        q.push(Req.from_message(_req(rid, 3, 2)), step=0)
    assert q.remove("b").rid == "b" and q.remove("zz") is None
    assert [q.pop().rid, q.pop().rid] == ["a", "c"] and len(q) == 0


def test_prefill_budget_chunks():
    budget = PrefillBudget(tokens=100, chunk=64)
    assert [budget.take(0, 200), budget.take(64, 200), budget.take(0, 5)] == [64, 36, 0]
    assert budget.exhausted
    # A prompt is started only with a head of at least half the longest chunk given (a
    # shorter one would be a forward of its own for few tokens); whole prompts fit in
    # whatever is left.
    budget = PrefillBudget(tokens=100, chunk=100)
    assert [budget.take(30, 70), budget.take(0, 5), budget.take(0, 200)] == [70, 5, 0]
    assert budget.exhausted and budget.take(0, 1) == 0  # FCFS: later prompts wait too
    budget = PrefillBudget(tokens=100, chunk=100)
    assert [budget.take(60, 40), budget.take(0, 200)] == [40, 60]
    assert PrefillBudget(100, 64).take(0, 200) == 64  # a budget that gave nothing: its whole


def test_beside_decoding_a_prompts_tail_is_not_joined_by_a_short_head_of_the_next():
    """Unaligned chunks (Gemma 3's on CUDA, every model's on the CPU) beside a decoding
    stream: a long prompt's 50-token tail leaves 14 of the step's 64, which would start the
    next long prompt as a forward of its own (under half the tail); that prompt starts the
    next step, in whole chunks. A head of half the tail or more still joins it."""
    s = _sched(capacity=4000, max_context=1024, chunk=64, budget=256, while_decoding=64,
               for_all=True)
    s.add_request(_req("w", 4, 100))
    s.apply_result(_answer(s.plan_step()))
    s.add_request(_req("a", 114, 3))  # 64 + 50
    s.add_request(_req("b", 300, 3))
    steps = []
    for _ in range(8):
        batch = s.plan_step()
        assert batch.decode_rids[:1] == ["w"]
        steps.append([(c.rid, c.start, len(c.token_ids)) for c in batch.prefill])
        s.apply_result(_answer(batch))
    assert steps[:3] == [[("a", 0, 64)], [("a", 64, 50)], [("b", 0, 64)]]
    assert [n for step in steps[2:] for rid, _, n in step] == [64, 64, 64, 64, 44]  # b alone
    s = _sched(capacity=4000, max_context=1024, chunk=64, budget=256, while_decoding=64,
               for_all=True)
    s.add_request(_req("w", 4, 100))
    s.apply_result(_answer(s.plan_step()))
    s.add_request(_req("a", 104, 3))  # a 40-token tail leaves 24: b starts beside it
    s.add_request(_req("b", 300, 3))
    s.apply_result(_answer(s.plan_step()))
    assert _prefilled(s.plan_step()) == {"a": 40, "b": 24}


def test_an_aligned_budget_ends_unfinished_chunks_on_its_edges():
    budget = PrefillBudget(tokens=100, chunk=64, align=16)
    assert budget.take(0, 200) == 64
    assert budget.take(64, 200) == 32  # to 96, not 100: the prompt goes on from an edge
    assert budget.take(0, 3) == 3  # a prompt's last chunk ends where it ends
    assert budget.take(0, 200) == 0 and budget.exhausted  # 1 token's scraps: next step
    assert PrefillBudget(100, 64, 16).take(40, 200) == 56  # a prefix hit's chunk to the edge
    # A budget that gave nothing yet gives what it has, aligned or not: no starvation.
    assert PrefillBudget(10, 64, 16).take(5, 200) == 10
    # Edges a chunk cannot end on: ignored.
    assert PrefillBudget(100, 60, 16).take(0, 200) == 60


def test_while_decoding_long_prompts_are_chunked_on_the_bucket_edges():
    """A burst of long prompts of odd lengths beside decoding streams: every chunk that
    does not finish its prompt ends on a multiple of the alignment, so no prompt's chunks
    start off the edges, and no step starts a long prompt with another's scraps."""
    s = Scheduler(SchedulerLimits(4000, 512, 8, 64, 256, max_prefill_tokens_while_decoding=32,
                                  decode_first_for_all=True, chunk_align=32))
    for rid in "wx":
        s.add_request(_req(rid, 4, 200))
    s.apply_result(_answer(s.plan_step()))
    for rid, n in (("a", 70), ("b", 41), ("c", 100)):
        s.add_request(_req(rid, n, 3))
    chunks: list = []
    for _ in range(40):
        batch = s.plan_step()
        chunks.append([(c.rid, c.start, len(c.token_ids), c.sample) for c in batch.prefill])
        s.apply_result(_answer(batch))
    flat = [c for step in chunks for c in step]
    assert all((start + n) % 32 == 0 for _, start, n, sample in flat if not sample)
    assert {rid: sum(n for r, _, n, _ in flat if r == rid) for rid in "abc"} == {
        "a": 70, "b": 41, "c": 100}
    assert chunks[2] == [("a", 64, 6, True)]  # a's last 6 tokens; b waits, not 26 of b
    assert all(len(step) <= 1 for step in chunks)


def test_a_prefix_hit_is_cut_back_to_an_edge_when_much_of_the_prompt_is_left():
    """Where the worker wants chunks on edges, a cached prefix ending off one is reused
    only up to the edge before it when half an edge or more is still to compute (its
    chunks then start on edges); a hit that leaves less is reused whole."""
    s = Scheduler(SchedulerLimits(4000, 512, 8, 64, 256, chunk_align=32))
    s.add_request(_req("a", 100, 1, first=10))
    while s.running or s.waiting:
        s.apply_result(_answer(s.plan_step()))

    def sharing(rid: str, shared: int) -> TokenizedRequest:
        ids = list(range(10, 10 + shared)) + list(range(5000, 5100 - shared))
        return TokenizedRequest(rid=rid, input_ids=ids, stop_token_ids=[0],
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=1))

    for rid, shared, reused in (("b", 40, 32), ("c", 90, 90), ("d", 64, 64)):
        s.add_request(sharing(rid, shared))
        batch = s.plan_step()
        assert [(c.rid, c.start) for c in batch.prefill] == [(rid, reused)]
        assert s.running[rid].cached_tokens == reused
        s.apply_result(_answer(batch))
        while s.running:
            s.apply_result(_answer(s.plan_step()))
    assert_idle_invariant(s)


def test_kv_reservation_counts_expected_decode_of_running_requests():
    ratio = DecodeRatio()
    running = Req.from_message(_req("r", 10, 21))
    running.fill_len = running.num_computed = 10  # prompt done, 21 tokens to go
    res = KVReservation([running], ratio)
    assert res.claimed == math.ceil(ratio.value * 20)
    new = Req.from_message(_req("a", 30, 11))
    new.fill_len = 30
    need = res.need(new, cached=10)  # 20 uncached prompt tokens + expected decode
    assert need == 20 + math.ceil(ratio.value * 10)
    assert res.fits(res.claimed + need, need) and not res.fits(res.claimed + need - 1, need)
    ratio.on_preempt()
    assert ratio.value == 1.0 and KVReservation([running], ratio).claimed == 20


# -- step plans -----------------------------------------------------------------------------

def test_long_prompt_is_chunked_and_decode_shares_steps():
    s = _sched(chunk=64, budget=64)
    s.add_request(_req("short", 10, 5))
    b1 = s.plan_step()
    assert [(c.rid, c.start, len(c.token_ids), c.sample) for c in b1.prefill] == [("short", 0, 10, True)]
    s.apply_result(_answer(b1))
    s.add_request(_req("long", 150, 5))
    b2 = s.plan_step()
    assert b2.decode_rids == ["short"]
    assert [(c.rid, c.start, len(c.token_ids), c.sample) for c in b2.prefill] == [("long", 0, 64, False)]
    s.apply_result(_answer(b2))
    b3 = s.plan_step()
    assert [(c.start, len(c.token_ids), c.sample) for c in b3.prefill] == [(64, 64, False)]
    s.apply_result(_answer(b3))
    b4 = s.plan_step()
    assert [(c.start, len(c.token_ids), c.sample) for c in b4.prefill] == [(128, 22, True)]
    assert b4.new_requests == [] and "short" in b4.decode_rids


def _prefilled(batch) -> dict[str, int]:
    """Prompt tokens the step computes, by request."""
    return {c.rid: len(c.token_ids) for c in batch.prefill}


def test_a_step_that_decodes_computes_only_the_decoding_budget_of_prompts():
    """Decode first: while "short" decodes, the long prompts share the smaller budget,
    oldest first, so each of its tokens waits for 64 prompt tokens, not 256; once nothing
    decodes, a step takes the full budget again. (Two prompts waiting for one stream would
    double its budget: fixed here.)"""
    s = _sched(chunk=128, budget=256, while_decoding=64, for_all=True)
    s.add_request(_req("short", 10, 3))
    s.add_request(_req("b", 300, 5))
    s.add_request(_req("c", 300, 5))
    b1 = s.plan_step()  # nothing decodes yet
    assert _prefilled(b1) == {"short": 10, "b": 128, "c": 118}
    s.apply_result(_answer(b1))
    b2 = s.plan_step()
    assert b2.decode_rids == ["short"] and _prefilled(b2) == {"b": 64}
    s.apply_result(_answer(b2))
    b3 = s.plan_step()  # short's last token: b's chunk is cut where the budget ends
    assert b3.decode_rids == ["short"] and _prefilled(b3) == {"b": 64}
    s.apply_result(_answer(b3))
    assert "short" not in s.running
    b4 = s.plan_step()
    assert b4.decode_rids == [] and _prefilled(b4) == {"b": 44, "c": 128}


def test_a_long_prompt_advances_every_step_however_long_others_decode():
    """No starvation: a prompt arriving beside a stream of decode steps gets the budget
    (here 7 tokens) every step and samples its first token after ceil(100 / 7) steps."""
    s = _sched(chunk=64, budget=256, while_decoding=7, for_all=True)
    for rid in "wxyz":
        s.add_request(_req(rid, 4, 200))
    s.apply_result(_answer(s.plan_step()))
    s.add_request(_req("long", 100, 3))
    chunks = []
    while not chunks or not chunks[-1].sample:
        batch = s.plan_step()
        assert batch.decode_rids == list("wxyz")
        chunks += batch.prefill
        s.apply_result(_answer(batch))
    assert [len(c.token_ids) for c in chunks] == [7] * 14 + [2]
    assert [c.start for c in chunks] == list(range(0, 100, 7))


@pytest.mark.parametrize("for_all", [False, True])
def test_a_burst_at_a_nearly_idle_server_is_prefilled_in_few_steps(for_all):
    """A wave of prompts whose first two arrive alone: once the first decodes, the second
    (mid-prompt) and ten more wait, the second there before the first decoded, so nothing
    decoding predates the backlog and the next step computes a whole step's budget, the
    oldest prompt first, not 16 tokens. Held to decode first's budget for every stream, the
    wave trickles in 16 tokens a step."""
    s = _sched(chunk=64, budget=256, max_running=16, while_decoding=16, for_all=for_all)
    s.add_request(_req("first", 20, 50))
    s.add_request(_req("r0", 300, 50))  # a long prompt arriving with it
    s.apply_result(_answer(s.plan_step()))  # first's prompt and r0's first 64 tokens
    for i in range(1, 11):
        s.add_request(_req(f"r{i}", 20, 50))
    b = s.plan_step()
    assert b.decode_rids == ["first"]
    if for_all:
        assert _prefilled(b) == {"r0": 16}
    else:
        # (r10's 12 tokens left of 20 would be a head under half the longest chunk: waits)
        assert _prefilled(b) == {"r0": 64, **{f"r{i}": 20 for i in range(1, 10)}}


def _decode_for(s: Scheduler, steps: int) -> None:
    for _ in range(steps):
        s.apply_result(_answer(s.plan_step()))


def test_streams_decoding_before_a_burst_keep_decode_firsts_budget_until_they_end():
    """Two streams have decoded for BURST_STEPS steps when a burst of prompts arrives:
    every step while they decode computes at most the decoding budget (16 tokens), though
    the burst's first requests decode too and many more wait. Once the two end, what
    decodes is the burst's own, so its rest is prefilled at a whole step's budget."""
    s = _sched(capacity=4000, chunk=64, budget=256, max_running=16, while_decoding=16)
    for rid in "wx":
        s.add_request(_req(rid, 4, BURST_STEPS + 6))
    _decode_for(s, BURST_STEPS + 1)
    for i in range(10):
        s.add_request(_req(f"b{i}", 40, 50))
    budgets = []
    while s.waiting or any(r.prefilling for r in s.running.values()):
        b = s.plan_step()
        protected = {"w", "x"} & set(b.decode_rids)
        budgets.append((bool(protected), sum(_prefilled(b).values())))
        s.apply_result(_answer(b))
    assert budgets[0] == (True, 16) and all(n <= 16 for p, n in budgets if p)
    assert any(not p for p, _ in budgets)  # w and x ended before the burst was prefilled
    assert all(n > 16 for p, n in budgets[:-1] if not p) and budgets[-1][0] is False


def test_a_stream_just_ahead_of_a_burst_is_part_of_it():
    """A request that started decoding a step before a burst arrived (its requests reach
    the scheduler one after another) does not hold the burst to the decode-first budget;
    one that has decoded BURST_STEPS steps does."""
    for head_start, protected in ((1, False), (BURST_STEPS + 1, True)):
        s = _sched(capacity=4000, chunk=64, budget=256, max_running=16, while_decoding=16)
        s.add_request(_req("w", 4, 50))
        _decode_for(s, head_start)
        for i in range(10):
            s.add_request(_req(f"b{i}", 40, 50))
        prefilled = sum(_prefilled(s.plan_step()).values())
        assert prefilled == 16 if protected else prefilled == 240  # six 40-token prompts


def test_a_stream_preempted_and_resumed_stays_protected():
    """A stream decoding before a long prompt arrived, preempted and resumed, is still
    one the decode-first budget protects: its steps carry 16 prompt tokens again."""
    s = _sched(capacity=4000, chunk=64, budget=256, while_decoding=16)
    s.add_request(_req("a", 4, 100))
    _decode_for(s, BURST_STEPS + 1)
    s.add_request(_req("long", 400, 3))
    _decode_for(s, 2)
    s._preempt(s.running["a"])
    resumed = []
    while len(resumed) < 3:
        b = s.plan_step()
        if "a" in b.decode_rids:
            resumed.append(sum(_prefilled(b).values()))
        s.apply_result(_answer(b))
    assert resumed == [16, 16, 16]


def test_a_preempted_request_waits_from_its_preemption():
    """A request preempted goes back to the queue as of that step: streams that decoded
    long enough before it (though after its first arrival) keep decode first's budget."""
    s = _sched(capacity=4000, chunk=64, budget=256, while_decoding=16)
    s.add_request(_req("a", 4, 50))
    s.apply_result(_answer(s.plan_step()))
    s.add_request(_req("b", 4, 50))
    _decode_for(s, BURST_STEPS + 1)
    s._preempt(s.running["a"])
    assert s.waiting.oldest_since() == s._step == s.waiting.peek().waiting_since
    assert s.running["b"].decoding_since + BURST_STEPS <= s.waiting.oldest_since()
    assert s._decode_first(["b"])
    s.waiting.remove("a")
    assert s.waiting.oldest_since() is None


def test_the_decoding_budget_never_raises_a_steps_budget_and_reaches_the_scheduler():
    from ipc.config import ServerConfig
    from ipc.messages.to_scheduler import WorkerReady
    from scheduler_proc import limits_from

    limits = SchedulerLimits(1000, 512, 8, 64, 128, max_prefill_tokens_while_decoding=1000)
    assert limits.prefill_tokens(True) == limits.prefill_tokens(False) == 128
    assert SchedulerLimits(1000, 512, 8, 64, 128).prefill_tokens(True) == 128
    ready = WorkerReady(num_slots=1000, max_context_len=512, overlap=False,
                        decode_first_tokens=300)
    assert limits_from(ServerConfig(), ready).prefill_tokens(True) == 300
    assert limits_from(ServerConfig(), ready).prefill_tokens(False) == 8192
    assert not limits_from(ServerConfig(), ready).decode_first_for_all
    assert limits_from(ServerConfig(fixed_decode_first_budget=True), ready).decode_first_for_all
    assert limits_from(ServerConfig(), ready).chunk_align == 1
    aligned = WorkerReady(num_slots=1000, max_context_len=512, overlap=False, chunk_align=512)
    assert limits_from(ServerConfig(), aligned).chunk_align == 512


def test_decode_firsts_defaults_resolve_by_device_and_model():
    """Spread over four steps at 128 tokens a step on CUDA (where measured), whole at 512
    elsewhere, beside mixed-forward, or where the model's forwards cannot be spread; a
    flag given wins."""
    from ipc.config import ServerConfig

    auto = ServerConfig()
    assert auto.spread_parts(on_cuda=True, most=48) == 8
    assert auto.decode_first_tokens(4) == 128
    assert auto.spread_parts(on_cuda=False, most=48) == 1 == auto.spread_parts(True, most=1)
    assert auto.decode_first_tokens(1) == 512
    assert auto.spread_parts(True, 2) == 2  # at most a block a part
    assert ServerConfig(experiments="mixed-forward").spread_parts(True, 48) == 1
    given = ServerConfig(prefill_spread=8, max_prefill_tokens_while_decoding=128)
    assert given.spread_parts(False, 48) == 8 and given.decode_first_tokens(8) == 128
    assert ServerConfig(prefill_spread=1).spread_parts(True, 48) == 1
    for bad in ({"max_prefill_tokens_while_decoding": -1}, {"prefill_spread": -1},
                {"max_prefill_tokens": 0}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


def test_slot_ids_are_consistent_between_plan_and_table():
    s = _sched()
    s.add_request(_req("a", 5, 3))
    b = s.plan_step()
    row = s.running["a"].row
    assert s.table.slots(row, 5).tolist() == b.prefill[0].slot_ids
    s.apply_result(_answer(b))
    b2 = s.plan_step()
    assert s.table.slots(row, 6).tolist()[-1] == b2.decode_slots[0]


def test_stop_token_and_max_tokens_finish_and_free_everything():
    s = _sched()
    s.add_request(_req("eos", 4, 10, eos=(3,)))
    s.add_request(_req("len", 4, 2))
    b = s.plan_step()
    out = s.apply_result(StepResult(step=b.step, rids=["eos", "len"], token_ids=[3, 8]))
    eos = next(o for o in out if o.rid == "eos")
    assert eos.finished and eos.finish_reason == "stop" and eos.token_ids == []
    assert eos.usage.completion_tokens == 1 and eos.prompt_tail == _req("eos", 4, 1).input_ids
    b2 = s.plan_step()
    assert b2.released == ["eos"] and b2.decode_rids == ["len"]
    out2 = s.apply_result(StepResult(step=b2.step, rids=["len"], token_ids=[9]))
    assert out2[0].finish_reason == "length" and out2[0].usage.completion_tokens == 2
    assert out2[0].prompt_tail is None
    assert not s.has_work
    assert_idle_invariant(s)


def test_no_decode_is_planned_past_a_last_token_already_in_flight():
    """With two steps in flight, a request whose max_tokens ends with a planned step gets
    no further decode: that row's token would only be discarded."""
    s = _sched()
    s.add_request(_req("two", 4, 2))
    s.add_request(_req("long", 4, 50))
    b1 = s.plan_step()  # the prefill samples both first tokens
    b2 = s.plan_step()  # planned before b1's result: samples "two"'s last
    assert b2.decode_rids == ["two", "long"]
    b3 = s.plan_step()
    assert b3.decode_rids == ["long"]
    s.apply_result(_answer(b1))
    out = s.apply_result(_answer(b2))
    assert [(o.rid, o.finish_reason) for o in out if o.finished] == [("two", "length")]
    assert "two" not in s.running and s.slots_consistent()
    s.abort("long")
    s.apply_result(_answer(b3))
    assert_idle_invariant(s)


def test_requests_finishing_in_flight_are_waited_for_not_preempted():
    """Nothing else can run until the slots of requests whose last tokens are in flight
    come back: planning waits (None) instead of preempting anyone."""
    s = _sched(capacity=16, max_running=4)
    s.add_request(_req("a", 4, 2))
    s.add_request(_req("b", 4, 2))
    b1, b2 = s.plan_step(), s.plan_step()
    assert b2.decode_rids == ["a", "b"]  # both last tokens in flight; 6 slots free
    s.add_request(_req("c", 6, 2))  # admission wants 6 + 1 beyond a's and b's expected 2
    assert s.plan_step() is None and s.counters.preemptions == 0
    s.apply_result(_answer(b1))
    s.apply_result(_answer(b2))
    b3 = s.plan_step()
    assert [c.rid for c in b3.prefill] == ["c"] and s.counters.preemptions == 0


def test_decode_short_of_slots_waits_for_a_finishing_request_instead_of_preempting_it():
    """b needs a decode slot, none is free, and the newest request, a, has its last token
    in flight: preempting a would throw that token away and prefill a again. The plan
    waits for the step's result instead (a's slots come back), then decodes b."""
    s = _sched(capacity=35, max_running=4)
    s.ratio.value = DecodeRatio.FLOOR  # an optimistic admission lets a in beside b
    s.add_request(_req("b", 30, 6))
    s.add_request(_req("a", 4, 1))
    b1 = s.plan_step()
    b2 = s.plan_step()
    assert [c.rid for c in b2.prefill] == ["a"] and b2.decode_rids == ["b"]
    assert s.allocator.num_free == 0
    assert s.plan_step() is None and s.counters.preemptions == 0
    s.apply_result(_answer(b1))
    out = s.apply_result(_answer(b2))
    a_out = [o for o in out if o.rid == "a"]
    assert a_out and a_out[-1].finish_reason is not None and a_out[-1].token_ids == [7]
    b3 = s.plan_step()
    assert b3.decode_rids == ["b"] and s.counters.preemptions == 0


def test_decode_short_of_slots_preempts_the_newest_request_that_is_not_finishing():
    """When the finishing requests' slots would not cover the shortfall, the victim is
    the newest request still generating, never one whose last token is in flight."""
    s = _sched(capacity=32, max_running=4)
    s.ratio.value = DecodeRatio.FLOOR
    s.add_request(_req("c", 10, 4))
    s.add_request(_req("b", 10, 4))
    s.add_request(_req("a", 1, 1))
    s.plan_step()
    b2 = s.plan_step()
    assert [c.rid for c in b2.prefill] == ["a"] and b2.decode_rids == ["c", "b"]
    # The pool runs dry (slots taken here stand for other requests' use): c and b need
    # two, a's last token is in flight but it holds one slot only.
    s.allocator.alloc(s.allocator.num_free)
    b3 = s.plan_step()
    assert s.counters.preemptions == 1 and "b" in s.waiting and "a" in s.running
    assert b3.decode_rids == ["c"]


def test_scheduler_loop_waits_for_news_when_nothing_can_be_planned():
    """With a step in flight that samples every running request's last token, there is
    nothing to plan until a message comes: the loop blocks on its inbox, never spins."""
    from scheduler_proc import _IDLE_POLL_MS, SchedulerLoop
    from tests.engine_driver import Pipe

    class Inbox(Pipe):
        timeouts: list[int | None] = []

        def recv(self, timeout_ms=None):
            self.timeouts.append(timeout_ms)
            return super().recv(timeout_ms)

    s, inbox, worker = _sched(), Inbox(), Pipe()
    loop = SchedulerLoop(s, inbox, worker, Pipe(), max_in_flight=2)
    inbox.send(_req("a", 4, 2))
    loop.run_once()
    b1, b2 = worker.drain()  # the prefill, and the decode of "a"'s last token
    inbox.send(_answer(b1))
    loop.run_once()
    assert len(loop.in_flight) == 1 and worker.drain()[-1].__class__.__name__ == "SyncSteps"
    inbox.timeouts.clear()
    loop.run_once()
    assert inbox.timeouts == [_IDLE_POLL_MS] and not worker.items
    inbox.send(_answer(b2))
    loop.run_once()
    assert not s.running and not loop.in_flight


def test_abort_while_waiting_and_while_running_frees_slots():
    s = _sched(max_running=1)
    s.add_request(_req("a", 8, 50))
    s.add_request(_req("b", 8, 50))
    b = s.plan_step()
    assert [c.rid for c in b.prefill] == ["a"]
    assert s.abort("b")[0].finish_reason == "abort"
    s.apply_result(_answer(b))
    assert s.abort("a")[0].finished
    assert s.apply_result(StepResult(step=99, rids=["a"], token_ids=[1])) == []
    assert_idle_invariant(s)
    assert s.stats().aborted_requests_total == 2 and s.stats().running_requests == 0
    assert s.plan_step() is None


def test_a_reused_id_never_takes_what_a_step_in_flight_computed_for_the_ended_request():
    """A client may choose its request ids (native /generate `rid`) and reuse one right
    after an abort, while a step that decodes the old request is still in flight: that
    step's token belongs to no running request (it was appended to the new one, whose
    recorded tokens then differed from the worker's, so the prefix cache keyed K/V by a
    token the model never saw)."""
    s = _sched()
    s.add_request(_req("x", 10, 50))
    s.apply_result(_answer(s.plan_step(), 111))  # the old request's first token
    in_flight = s.plan_step()  # decodes the old request
    assert in_flight.decode_rids == ["x"]
    s.abort("x")
    s.add_request(_req("x", 5, 50, first=500))
    new = s.plan_step()  # the new request's prompt, sampling its first token
    assert [n.rid for n in new.new_requests] == ["x"]
    assert s.apply_result(_answer(in_flight, 999)) == []  # stale: nobody's
    out = s.apply_result(_answer(new, 222))
    assert [(o.rid, o.token_ids) for o in out] == [("x", [222])]
    assert s.running["x"].output_ids == [222] and s.running["x"].samples_in_flight == 0
    s.abort("x")
    assert_idle_invariant(s)


def test_a_failed_step_requeues_admitted_requests_the_worker_never_saw():
    """A step failing as a whole ends the requests sent to the worker; one admitted whose
    first chunk waited for budget (never sent) goes back to the queue and runs later."""
    s = Scheduler(SchedulerLimits(capacity=1000, max_context=512, max_running=8,
                                  chunk_size=128, max_prefill_tokens=100, chunk_align=16))
    s.add_request(_req("a", 90, 5))
    s.add_request(_req("b", 200, 5))
    first = s.plan_step()
    assert [c.rid for c in first.prefill] == ["a"] and not s.running["b"].on_worker
    out = s.apply_result(StepResult(step=first.step, rids=[], token_ids=[], failed="boom",
                                    epoch=1))
    assert [(o.rid, o.finish_reason) for o in out] == [("a", "error")]
    assert not s.running and len(s.waiting) == 1 and s.waiting.peek().rid == "b"
    again = s.plan_step()
    assert [(c.rid, c.start) for c in again.prefill] == [("b", 0)]
    assert [n.rid for n in again.new_requests] == ["b"]


def test_the_context_limit_counts_prompt_and_max_tokens_alike_at_admission_and_finish():
    """A request admitted runs to its max_tokens: admission refuses prompt + max_tokens
    past the context (it let one more in, which then ended a token short, "length")."""
    s = _sched(capacity=100, max_context=16)
    assert s.add_request(_req("over", 10, 7))[0].finish_reason == "error"
    assert s.add_request(_req("fits", 10, 6)) == []
    got = []
    while s.has_work:
        for out in s.apply_result(_answer(s.plan_step(), 7)):
            got += out.token_ids
            finish = out.finish_reason
    assert len(got) == 6 and finish == "length"


def test_requests_that_can_never_fit_are_rejected():
    s = _sched(capacity=100, max_context=80)
    (ctx,) = s.add_request(_req("ctx", 70, 20))
    assert ctx.finish_reason == "error" and "context length" in ctx.error
    s2 = _sched(capacity=50, max_context=512)
    (kv,) = s2.add_request(_req("kv", 40, 20))
    assert "KV slots" in kv.error and not s2.has_work


def test_max_running_requests_caps_the_batch():
    s = _sched(max_running=2)
    for rid in "abc":
        s.add_request(_req(rid, 4, 5))
    b = s.plan_step()
    assert [c.rid for c in b.prefill] == ["a", "b"] and len(s.waiting) == 1


def test_stats_counters():
    s = _sched()
    s.add_request(_req("a", 6, 2))
    b = s.plan_step()
    s.apply_result(_answer(b))
    st = s.stats()
    assert (st.prompt_tokens_total, st.computed_prompt_tokens_total, st.generated_tokens_total) == (6, 6, 1)
    assert st.used_slots == 6 and st.used_slots + st.free_slots == st.capacity_slots


def test_decode_plans_do_not_grow_with_context():
    """Per-step traffic to the worker is O(batch): a decode entry is one slot id."""
    from ipc.codec import encode

    sizes = []
    for prompt in (10, 1000):
        s = _sched(capacity=5000, max_context=2048, chunk=2048, budget=2048)
        s.add_request(_req("a", prompt, 50))
        s.apply_result(_answer(s.plan_step()))
        decode = s.plan_step()
        assert not decode.prefill
        sizes.append(len(encode(decode)))
    assert abs(sizes[0] - sizes[1]) <= 2  # only the slot id's varint width may differ


# -- prefill spread over steps -------------------------------------------------------------

def _sampled(s: Scheduler, batch, token: int = 7) -> StepResult:
    """The worker's answer: a token for each request the step samples (with a spread,
    not every chunk ending a prompt: those sample with its last part)."""
    rids = s._sampled_for[batch.step]
    return StepResult(step=batch.step, rids=rids, token_ids=[token] * len(rids))


def _step(s: Scheduler) -> None:
    batch = s.plan_step()
    s.apply_result(_sampled(s, batch))


def _spreading(parts: int = 3, capacity: int = 1000, decode_tokens: int = 50) -> Scheduler:
    """A scheduler whose steps that decode spread their prefill over `parts` steps (every
    decoding stream held to decode first); "d" (a 10-token prompt, `decode_tokens` to
    generate) decodes from its second step on."""
    s = Scheduler(SchedulerLimits(capacity, 512, 8, 64, 128, max_prefill_tokens_while_decoding=32,
                                  prefill_parts=parts, decode_first_for_all=True))
    s.add_request(_req("d", 10, decode_tokens))
    _step(s)
    return s


def test_a_spread_prefill_runs_its_parts_in_the_next_steps_beside_decode():
    s = _spreading()
    s.add_request(_req("p", 40, 5))
    first = s.plan_step()
    # Three times the decode-first budget: the 40-token prompt whole, its first part.
    assert (first.parts, first.parts_from, first.parts_to) == (3, 0, 1)
    assert s.running["p"].decoding_since == first.step + 2  # sampled with the last part
    assert _prefilled(first) == {"p": 40} and first.decode_rids == ["d"]
    s.apply_result(_sampled(s, first))
    second, third = s.plan_step(), None
    assert (second.parts_from, second.parts_to, second.prefill) == (1, 2, [])
    assert second.decode_rids == ["d"]  # p does not decode before its prompt's token
    s.apply_result(_sampled(s, second))
    third = s.plan_step()
    assert (third.parts_from, third.parts_to) == (2, 3) and third.decode_rids == ["d"]
    # The last part samples p's first token; p decodes from the next step.
    assert s._sampled_for[third.step] == ["p", "d"]
    s.apply_result(StepResult(step=third.step, rids=["p", "d"], token_ids=[7, 7]))
    fourth = s.plan_step()
    assert fourth.parts == 1 and sorted(fourth.decode_rids) == ["d", "p"]


def test_an_unaligned_spread_runs_a_prompts_pieces_alone():
    """A spread of an unaligned model (Gemma 3 on CUDA): a piece of a prompt (its tail, or
    a head that leaves it unfinished) is the spread's only chunk, so no other prompt's
    head joins a tail (the pair would be two forwards, each started in parts); whole
    prompts (fresh, or what a prefix hit leaves) still go together, and without a spread
    a tail shares its step."""
    lone = PrefillBudget(96, 128, lone_pieces=True)
    assert [lone.take(96, 4), lone.take(0, 200)] == [4, 0] and lone.exhausted
    fresh = PrefillBudget(96, 128, lone_pieces=True)
    assert [fresh.take(0, 30), fresh.take(0, 30), fresh.take(0, 50)] == [30, 30, 0]
    hits = PrefillBudget(96, 128, lone_pieces=True)  # whole rests after prefix hits
    assert [hits.take(40, 20, admitting=True), hits.take(40, 20, admitting=True),
            hits.take(0, 10), hits.take(40, 60, admitting=True)] == [20, 20, 10, 0]
    shared = PrefillBudget(96, 128)
    assert [shared.take(96, 4), shared.take(0, 200)] == [4, 92]
    aligned = PrefillBudget(96, 64, 16, lone_pieces=True)  # pads tails instead
    assert [aligned.take(96, 4), aligned.take(0, 200)] == [4, 64]
    s = _spreading()  # chunks of 64, spreads of 96 tokens
    s.add_request(_req("a", 100, 5))
    s.add_request(_req("b", 100, 5))
    plans = []
    for _ in range(4):  # each spread's first step, then its two later parts
        first = s.plan_step()
        plans.append(_prefilled(first))
        s.apply_result(_sampled(s, first))
        _step(s)
        _step(s)
    assert plans == [{"a": 64}, {"a": 36}, {"b": 64}, {"b": 36}]


def test_a_spread_prompt_is_shared_only_with_its_last_part():
    s = _spreading()
    s.add_request(_req("p", 40, 5))
    _step(s)
    assert s.cache.match_len(s.running["p"].all_ids(40)) == 0
    _step(s)
    s.plan_step()  # the last part
    assert s.cache.match_len(s.running["p"].all_ids(40)) == 40


def test_with_nothing_decoding_a_spread_runs_its_remaining_parts_in_one_step():
    s = _spreading(parts=4, decode_tokens=2)
    s.add_request(_req("p", 40, 5))
    first = s.plan_step()  # d's last token: it finishes with this step's result
    assert first.parts == 4 and first.decode_rids == ["d"]
    s.apply_result(_sampled(s, first))
    rest = s.plan_step()
    assert (rest.parts_from, rest.parts_to, rest.decode_rids) == (1, 4, [])


def test_an_abort_mid_spread_ends_the_request_but_holds_its_slots_to_the_last_part():
    s = _spreading()
    s.add_request(_req("p", 40, 5))
    _step(s)
    free = s.allocator.num_free
    out = s.abort("p")
    assert out[0].finished and out[0].finish_reason == "abort" and "p" not in s.running
    assert s.allocator.num_free == free and s.slots_consistent()
    assert s.add_request(_req("p", 20, 5)) == []  # the id may be reused at once
    second = s.plan_step()
    assert second.parts_from == 1 and not second.released and not second.new_requests
    last = s.plan_step()
    assert last.parts_to == 3 and s._sampled_for[last.step] == ["d"]
    after = s.plan_step()  # the old p released before the new one is sent
    assert after.released == ["p"] and [n.rid for n in after.new_requests] == ["p"]
    assert s.slots_consistent()


def test_a_request_the_worker_refused_mid_spread_fails_and_gives_back_after_it():
    s = _spreading()
    s.add_request(_req("p", 40, 5))
    first = s.plan_step()
    second = s.plan_step()  # planned before the first's result comes (overlap)
    from ipc.messages.to_scheduler import RequestError
    out = s.apply_result(StepResult(step=first.step, rids=["d"], token_ids=[7],
                                    errors=[RequestError("p", "refused")]))
    assert any(o.rid == "p" and o.error for o in out) and "p" not in s.running
    assert not second.released
    last = s.plan_step()
    assert last.parts_to == 3 and not last.released
    assert s.plan_step().released == ["p"]
    assert s.slots_consistent()


def test_preemption_passes_over_a_spreads_requests():
    s = _spreading(parts=8, capacity=55, decode_tokens=10)
    s.add_request(_req("p", 40, 1))
    _step(s)  # p (the newest) spreads; d decodes beside it
    while s.counters.preemptions == 0:
        assert s._spread is not None
        batch = s.plan_step()
    # The pool ran short mid-spread: d was preempted; p's spread ran on, to its end at
    # once with nothing decoding, sampling p's token.
    assert "p" in s.running and "d" in s.waiting and not batch.decode_rids
    assert batch.parts_to == 8 and s._sampled_for[batch.step] == ["p"]
    assert s.slots_consistent()


def test_a_failed_step_drops_the_spread_and_ends_its_requests():
    s = _spreading()
    s.add_request(_req("p", 40, 5))
    first = s.plan_step()
    s.abort("d")
    out = s.apply_result(StepResult(step=first.step, rids=[], token_ids=[], failed="boom",
                                    epoch=1))
    assert [o.rid for o in out] == ["p"] and s._spread is None
    assert_idle_invariant(s)


def test_a_prompt_sharing_a_spread_prompts_head_waits_for_it_and_hits():
    """Two prompts sharing a 300-token head arrive beside a decoding request: the first
    spreads; the second waits for its prompt (shared with the last part) and hits it."""
    s = Scheduler(SchedulerLimits(4000, 2048, 8, 512, 2048, max_prefill_tokens_while_decoding=400,
                                  prefill_parts=3))
    s.add_request(_req("d", 10, 50))
    _step(s)
    head = list(range(100, 400))
    for rid, tail in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        s.add_request(TokenizedRequest(rid=rid, input_ids=head + tail, stop_token_ids=[0],
                                       sampling=SamplingParams(temperature=0.0, max_new_tokens=5)))
    for _ in range(12):
        _step(s)
    assert s.counters.cache_hit_tokens == 300
    assert s.counters.computed_prompt_tokens == 10 + 303 + 3


def test_a_spread_cuts_prefix_hits_back_to_a_buckets_edge_not_its_own():
    """Chunks ending on 2,048 edges (a spread of 4 over 512 buckets) keep prefix hits on
    the 512 edges: a 1,900-token shared head hits 1,536 tokens, not 0."""
    s = Scheduler(SchedulerLimits(20000, 8192, 8, 4096, 8192, chunk_align=2048,
                                  prefix_align=512, prefill_parts=4))
    system = list(range(100, 2000))
    for rid, tail in (("turn1", [1] * 300), ("turn2", [2] * 1100)):
        s.add_request(TokenizedRequest(rid=rid, input_ids=system + tail, stop_token_ids=[0],
                                       sampling=SamplingParams(temperature=0.0, max_new_tokens=1)))
        while s.has_work:
            _step(s)
    assert s.counters.cache_hit_tokens == 1536

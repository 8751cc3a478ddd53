"""The scheduler and the worker's model runner on a tiny float32 model, against mlx-lm."""

from __future__ import annotations

import dataclasses

import numpy as np

import pytest

from tests.engine_driver import (InProcessEngine, StandInInPlaceKernels, StandInKernel,
                                 assert_greedy)
from tests.test_scheduler import assert_idle_invariant
from ipc.messages.to_worker import ForwardBatch
import worker_proc.runner as runner_module
import worker_proc.warm_up as warm_up_module
from worker_proc.warm_up import trace_decode_shapes, warm_up
from worker_proc.step_inputs import compiled_batch_size


def _eos(tokenizer) -> list[int]:
    return sorted(tokenizer.eos_token_ids)


def _prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Ids above the 5 special tokens, so no prompt contains an EOS.
    return [rng.integers(5, vocab, size=lengths[i % len(lengths)]).tolist() for i in range(n)]


@dataclasses.dataclass
class _Pending:
    """A started step, as _StubRunner hands it to the worker loop."""

    step: int
    needs_sampling: bool = False


class _StubRunner:
    """What WorkerLoop calls of a ModelRunner, doing nothing: a test overrides the calls
    it watches or slows."""

    mixed_forwards = 0

    def __init__(self) -> None:
        from worker_proc.step_stats import ForwardClock

        self.clock = ForwardClock()  # no prefill forwards started in build

    def build(self, batch):
        return _Pending(batch.step)

    def start_head(self):
        pass

    def start(self, pending):
        pass

    def finish(self, pending):
        from ipc.messages.to_scheduler import StepResult

        return StepResult(step=pending.step, rids=[], token_ids=[])


class _DroppedResults:
    def send(self, result):
        pass


@pytest.mark.parametrize(("overlap", "depth"), [(True, 2), ("ahead", 2), ("ahead", 3), (False, 1)])
def test_batched_chunked_greedy_matches_mlx_lm(tiny_model, oracle, overlap, depth):
    model, tokenizer = tiny_model
    lengths = [1, 7, 64, 300, 600, 33, 128, 257]
    prompts = _prompts(8, lengths, model.args.vocab_size)
    max_tokens = [40, 1, 25, 60, 10, 33, 5, 48]
    engine = InProcessEngine(model, chunk_size=128, max_prefill_tokens=256, overlap=overlap,
                             steps_in_flight=depth)
    deepest = 0
    send = engine.to_worker.send

    def counting_send(message):  # noqa: ANN001, ANN202
        nonlocal deepest
        deepest = max(deepest, len(engine.loop.in_flight) + isinstance(message, ForwardBatch))
        send(message)

    engine.to_worker.send = counting_send
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.submit(f"r{i}", p, m, _eos(tokenizer))
    results = engine.run_until_idle()
    assert deepest == depth
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert results[f"r{i}"].token_ids == oracle(p, m), f"request r{i} (prompt {len(p)})"
    assert (engine.worker.steps_built_ahead > 0) == bool(overlap)
    assert_idle_invariant(engine.scheduler)


def test_requests_join_a_running_batch(tiny_model, oracle):
    model, tokenizer = tiny_model
    prompts = _prompts(6, [20, 90, 5], model.args.vocab_size, seed=1)
    engine = InProcessEngine(model, chunk_size=32, max_prefill_tokens=64)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 30, _eos(tokenizer))
        for _ in range(3):  # the others are mid-decode or mid-prefill when the next arrives
            engine.step()
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == oracle(p, 30)


@pytest.mark.parametrize("overlap", [True, False])
def test_seeded_sampling_is_independent_of_batch_mates(tiny_model, overlap):
    model, tokenizer = tiny_model
    prompt = _prompts(1, [12], model.args.vocab_size, seed=2)[0]
    others = _prompts(5, [3, 40, 17], model.args.vocab_size, seed=3)
    sampling = dict(temperature=0.9, top_p=0.9, top_k=50, seed=1234)

    alone = InProcessEngine(model)
    alone.submit("x", prompt, 30, [], **sampling)
    crowded = InProcessEngine(model, overlap=overlap)
    for i, p in enumerate(others):
        crowded.submit(f"o{i}", p, 20 + i, [], temperature=1.0)
    crowded.step()
    crowded.submit("x", prompt, 30, [], **sampling)
    a = alone.run_until_idle()["x"].token_ids
    b = crowded.run_until_idle()["x"].token_ids
    assert a == b and len(a) == 30
    other_seed = InProcessEngine(model)
    other_seed.submit("x", prompt, 30, [], **{**sampling, "seed": 99})
    assert other_seed.run_until_idle()["x"].token_ids != a


def test_request_that_can_never_fit_is_rejected(tiny_model):
    model, _ = tiny_model
    engine = InProcessEngine(model, capacity=100)
    engine.submit("big", list(range(5, 95)), 20, [])
    assert engine.results["big"].finish_reason == "error"
    assert "KV slots" in engine.results["big"].error


def test_waiting_request_runs_when_slots_free_up(tiny_model, oracle):
    model, tokenizer = tiny_model
    prompts = _prompts(3, [40], model.args.vocab_size, seed=4)
    engine = InProcessEngine(model, capacity=100)  # room for one request at a time
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 50, _eos(tokenizer))
    engine.step()
    assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == 2
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == oracle(p, 50)


def test_steps_update_the_pool_in_place(tiny_model):
    """Several forwards in one step must not copy the pool (a copy per forward once made a
    500k-slot pool 36x slower); peak memory shows it."""
    import mlx.core as mx

    model, _ = tiny_model
    engine = InProcessEngine(model, capacity=300_000)
    prompts = _prompts(8, [30, 50], model.args.vocab_size, seed=5)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 4, [])
    engine.step()
    mx.clear_cache()
    mx.reset_peak_memory()
    for i, p in enumerate(prompts):
        engine.submit(f"s{i}", p, 4, [])
    for _ in range(5):  # 8 prefill forwards and a decode batch, then overlapped decodes
        engine.step()
    assert engine.worker.steps_built_ahead > 0
    extra = mx.get_peak_memory() - mx.get_active_memory()
    assert extra < engine.pool.nbytes / 8, (extra, engine.pool.nbytes)


def test_warm_up_leaves_the_runner_clean(tiny_model, oracle):
    """Warm-up runs a lone prompt, prompts in two chunks and every decode batch size on
    throwaway requests and forgets them; the engine then serves exactly as before."""

    model, tokenizer = tiny_model
    engine = InProcessEngine(model, capacity=2000, max_running=16)
    # a lone prompt and its release, two chunks, then sizes 1, 2, 4, 8, 16
    assert warm_up(engine.runner, max_batch=16) == 2 + 2 + 2 * 5
    assert engine.runner.requests == {}
    prompt = _prompts(1, [30], model.args.vocab_size, seed=9)[0]
    engine.submit("r", prompt, 20, _eos(tokenizer))
    assert engine.run_until_idle()["r"].token_ids == oracle(prompt, 20)


def test_warm_up_runs_each_padded_tail_width_once(tiny_model, oracle):
    """Where lone chunks are padded to a multiple of a tail size (the CUDA path's
    pad_tails), warm-up runs a lone prompt in chunks of every such width up to the one
    it is given (the worker's: decode first's piece), as far as the context holds them,
    so a served tail meets no new width; then the engine serves exactly as before."""
    model, tokenizer = tiny_model
    engine = InProcessEngine(model, capacity=2000, max_running=4, chunk_size=64,
                             max_context=128, backend=StandInKernel(), pad_tails=16)
    assert engine.runner.tail_multiple == 16
    widths: list[int] = []
    padded_width = engine.runner._padded_width

    def recorded(group):  # noqa: ANN001, ANN202
        width = padded_width(group)
        widths.append(width or len(group[0].token_ids))
        return width

    engine.runner._padded_width = recorded
    # The lone prompt (16 tokens: its 16), then 16, 32, 48 (ending at 96; 64 more would
    # pass the context of 128), two-chunk prompts, then sizes 1, 2, 4.
    assert warm_up(engine.runner, max_batch=4, long_chunk=64, tail_top=64) == 2 + 4 + 2 + 2 * 3
    assert widths[:4] == [16, 16, 32, 48]
    assert engine.runner.requests == {}
    prompt = _prompts(1, [70], model.args.vocab_size, seed=9)[0]
    engine.submit("r", prompt, 20, _eos(tokenizer))
    assert engine.run_until_idle()["r"].token_ids == oracle(prompt, 20)
    assert widths[-1] == 16  # its 6-token tail after 64, padded


def test_memory_probes_measure_forwards_and_leave_the_runner_clean(tiny_model, oracle):
    """The start-up probes of a prefill forward's memory (run on CUDA, where they bound
    the forwards) report the bytes a token their step held, a lone prompt's and several
    prompts' in one forward, forget their requests, and the engine then serves exactly as
    before."""
    from worker_proc.warm_up import probe_prefill_bytes

    model, tokenizer = tiny_model
    engine = InProcessEngine(model, capacity=2000, max_running=16)
    hidden = model.args.hidden_size * 4  # float32: at least one hidden state a token
    assert probe_prefill_bytes(engine.runner, 0, [40]) > hidden
    assert probe_prefill_bytes(engine.runner, 2, [20] * 4) > hidden
    assert engine.runner.requests == {}
    prompt = _prompts(1, [30], model.args.vocab_size, seed=9)[0]
    engine.submit("r", prompt, 20, _eos(tokenizer))
    assert engine.run_until_idle()["r"].token_ids == oracle(prompt, 20)


@pytest.mark.parametrize("family, options", [
    ("llama", {}), ("llama", {"capacity": 300, "max_context": 300}),
    ("llama_sliding", {"window_slots": 300}), ("jamba", {})])
def test_prefill_forwards_fit_the_room_the_probes_measure(monkeypatch, family, options):
    """fit_prefill_forwards (CUDA's start-up) on any pool: a small one, a windowed space
    smaller than the full one (the probes stay inside it), a model whose prompts never
    share a forward. Plenty of room leaves the cap at PREFILL_FORWARD_TOKENS; none cuts
    it to the floor, and the runner keeps the measured figures for its launches."""
    from tests import families

    import worker_proc
    from worker_proc import memory

    engine = InProcessEngine(families.build(family), **{"capacity": 2000, **options})
    runner = engine.runner
    said = []
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 40)
    worker_proc.fit_prefill_forwards(runner, 10, 1 << 28, 256, said.append)
    measured = runner.prefill_memory
    assert all(runner.forward_cap(w) == runner_module.PREFILL_FORWARD_TOKENS
               for w in (1, 64, 200, 511, 4096))
    assert measured.lone > 0 and runner.requests == {}
    assert "prefill forwards of up to 2048 tokens" in said[0]
    if runner.shares_prefill:  # the wider where two such prompts fit the (300-slot) space
        wide = [] if {"capacity", "window_slots"} & set(options) else [511]
        assert [w for w, _ in measured.shared] == [worker_proc.SHARED_PROBE_WIDTH, *wide]
        measured_bytes = [b for _, b in measured.shared]
        assert all(b > 0 for b in measured_bytes) and measured_bytes == sorted(measured_bytes)
    else:
        assert measured.shared == ()
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 0)
    worker_proc.fit_prefill_forwards(runner, 20, 1 << 28, 256, said.append)
    assert all(runner.forward_cap(w) == memory.LEAST_FORWARD_TOKENS for w in (1, 511, 4096))
    assert runner.prefill_memory.room == 0


def test_shared_forwards_take_more_tokens_where_their_prompts_are_narrower(tiny_model):
    """A token's measured bytes by forward width: on the line between two probed widths,
    the narrowest's below them, the costlier of the widest's and a lone prompt's past
    them; the cap of a forward follows its width, and a new measure replaces the caps."""
    from worker_proc.runner import PrefillMemory

    mib = 1 << 20
    memory = PrefillMemory(room=4000 * mib, lone=3 * mib, shared=((64, 4 * mib), (511, 8 * mib)))
    assert memory.token_bytes(False, 100) == 3 * mib
    assert memory.token_bytes(True, 10) == memory.token_bytes(True, 64) == 4 * mib
    assert memory.token_bytes(True, 511) == 8 * mib
    assert 4 * mib < memory.token_bytes(True, 200) < memory.token_bytes(True, 300) < 8 * mib
    assert memory.token_bytes(True, 4096) == 8 * mib
    assert PrefillMemory(room=0, lone=9 * mib, shared=((64, mib),)).token_bytes(True, 100) == 9 * mib
    assert PrefillMemory(room=0, lone=9 * mib).token_bytes(True, 100) == 9 * mib

    runner = InProcessEngine(tiny_model[0], capacity=200).runner
    runner.set_prefill_memory(memory)
    # two forwards of 2,000 MiB: 500 tokens at 4 MiB, 250 at 8 (multiples of 64, never
    # below memory.LEAST_FORWARD_TOKENS)
    assert runner.forward_cap(64) == 448 and runner.forward_cap(600) == 256
    assert runner.forward_cap(64) > runner.forward_cap(300) >= runner.forward_cap(600)
    runner.set_prefill_memory(PrefillMemory(room=1 << 40, lone=mib))
    assert runner.forward_cap(64) == runner_module.PREFILL_FORWARD_TOKENS


def test_a_forward_past_the_room_waits_for_the_one_before(tiny_model, oracle, monkeypatch):
    """Where two forwards' measured bytes pass the room, the step's next forward is
    launched only once the one before it is done (a wait, then its start), not beside it;
    the tokens are mlx-lm's either way."""
    from worker_proc.runner import PrefillMemory

    model, tokenizer = tiny_model
    engine = InProcessEngine(model, chunk_size=64, max_prefill_tokens=512)
    assert engine.runner.prefill_memory is None  # measured on CUDA only
    runner = engine.runner
    runner.prefill_forward_tokens = 30  # several forwards a step
    phases = []
    timing = runner_module.ForwardClock.timing
    monkeypatch.setattr(runner_module.ForwardClock, "timing",
                        lambda clock, phase: (phases.append(phase), timing(clock, phase))[1])
    for seed, room, waits_first in ((6, 1 << 40, False), (7, 1, True)):
        # new prompts each round: none a prefix hit, so the step has several forwards
        prompts = _prompts(6, [9, 11, 12, 10, 8, 13], model.args.vocab_size, seed=seed)
        runner.set_prefill_memory(PrefillMemory(room=room, lone=1.0, shared=((1, 1.0),)))
        phases.clear()
        for i, p in enumerate(prompts):
            engine.submit(f"r{room}-{i}", p, 6, _eos(tokenizer))
        results = engine.run_until_idle()
        for i, p in enumerate(prompts):
            assert results[f"r{room}-{i}"].token_ids == oracle(p, 6)
        starts = [k for k, phase in enumerate(phases) if phase == "start"]
        assert len(starts) >= 2
        assert (phases[starts[1] - 1] == "wait") == waits_first, phases


def test_rows_by_length_groups_a_decode_batch_by_context_length():
    from worker_proc.step_inputs import rows_by_length

    groups = rows_by_length(np.array([5, 3, 5, 9, 3]))
    assert [g.tolist() for g in groups] == [[1, 4], [0, 2], [3]]
    assert [g.tolist() for g in rows_by_length(np.array([7]))] == [[0]]


def test_group_by_length_bounds_padding():
    from worker_proc.step_inputs import group_by_length

    assert group_by_length([130, 120, 150, 110, 2000, 30, 31]) == [[4], [2, 0, 1, 3], [6, 5]]
    assert group_by_length([]) == []
    for sizes in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [64] * 9, [500, 1, 1, 1]):
        for group in group_by_length(sizes):
            real = sum(sizes[i] for i in group)
            assert len(group) * max(sizes[i] for i in group) <= 1.25 * real
    # A forward's tokens are capped too: 64 prompts of 130 tokens in forwards of <= 2048.
    groups = group_by_length([130] * 64, max_tokens=2048)
    assert [len(g) for g in groups] == [15, 15, 15, 15, 4]
    assert group_by_length([3000, 100, 100], max_tokens=2048) == [[0], [1, 2]]
    # a cap by the group's longest chunk: narrow chunks share more
    by_width = group_by_length([100] * 8 + [50] * 8, max_tokens=lambda w: 400 if w > 60 else 800)
    assert [len(g) for g in by_width] == [4, 4, 8]


@pytest.mark.parametrize("forward_tokens", [None, 30])
def test_prompts_prefilled_together_match_mlx_lm(tiny_model, oracle, monkeypatch, forward_tokens):
    """Several prompts (some after a cached prefix) in one padded forward, same tokens; with
    a small cap on a forward's tokens, in several forwards of a step (each launched while
    the one before it may still run)."""
    from worker_proc.runner import ModelRunner

    if forward_tokens is not None:
        monkeypatch.setattr(runner_module, "PREFILL_FORWARD_TOKENS", forward_tokens)
    shared = []
    original = ModelRunner._prefill_many
    monkeypatch.setattr(ModelRunner, "_prefill_many",
                        lambda self, chunks, *width: (shared.append(len(chunks))
                                                    or original(self, chunks, *width)))
    model, tokenizer = tiny_model
    prefix = _prompts(1, [40], model.args.vocab_size, seed=5)[0]
    tails = _prompts(6, [9, 11, 12, 10, 8, 13], model.args.vocab_size, seed=6)
    engine = InProcessEngine(model, chunk_size=64, max_prefill_tokens=512)
    engine.submit("first", prefix + tails[0], 4, _eos(tokenizer))
    engine.run_until_idle()  # the prefix is cached from here on
    prompts = [prefix + t for t in tails[1:]] + _prompts(3, [12, 10, 11], model.args.vocab_size, seed=7)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 12, _eos(tokenizer))
    results = engine.run_until_idle()
    assert max(shared) >= 4 if forward_tokens is None else max(shared) == 2
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == oracle(p, 12), f"r{i}"


@pytest.mark.parametrize("backend", [None, StandInKernel()], ids=["plain", "cuda-path"])
def test_compiled_prefill_replays_recurring_shapes_with_mlx_lm_tokens(tiny_model, oracle, backend):
    """Prefill forwards of a shape met before run through an mx.compile trace (exact
    shapes, nothing padded): fresh chunks, chunks continuing their prompt or a cached
    prefix, several prompts in one forward; greedy tokens stay mlx-lm's, on the plain
    path and on the CUDA path's (unfused prefill attention, steps launched ahead) stood
    in for. (The in-place stand-ins write through the array objects a trace replaces: the
    CUDA kernels' in-place writes are tested on the GPU, below.)"""
    model, tokenizer = tiny_model
    engine = InProcessEngine(model, chunk_size=32, max_prefill_tokens=96, compile_prefill=True,
                             backend=backend, overlap="ahead" if backend else True)
    forwards = engine.runner.prefill_forwards
    assert forwards.compiles
    vocab = model.args.vocab_size
    prefix = _prompts(1, [64], vocab, seed=31)[0]
    # Prompts of 96 tokens: chunks of 32 at starts 0, 32, 64 recur from the second on;
    # then prompts sharing a cached 64-token prefix, whose 32-token tails continue it.
    prompts = {f"r{i}": p for i, p in enumerate(
        _prompts(3, [96], vocab, seed=32) + [prefix + t for t in _prompts(4, [32, 32, 21, 32], vocab, seed=33)])}
    for rid, p in prompts.items():
        engine.submit(rid, p, 6, _eos(tokenizer))
        engine.run_until_idle()  # one at a time: each chunk its own forward
    for wave in range(2):  # three 32-token prompts at once: a forward of three rows, twice
        batch = {f"w{wave}-{i}": p for i, p in enumerate(_prompts(3, [32], vocab, seed=40 + wave))}
        for rid, p in batch.items():
            engine.submit(rid, p, 6, _eos(tokenizer))
        engine.run_until_idle()
        prompts.update(batch)
    assert forwards.traces >= 3 and forwards.replays > forwards.traces
    for rid, p in prompts.items():
        assert engine.results[rid].token_ids == oracle(p, 6), rid


def test_decode_inputs_gather_last_tokens_from_any_steps():
    import mlx.core as mx

    from ipc.messages.common import SamplingParams
    from worker_proc.request_state import RequestState
    from worker_proc.step_inputs import gather_last_tokens

    step_a, step_b = mx.array([10, 11, 12], dtype=mx.int32), mx.array([20, 21], dtype=mx.int32)

    def state(tokens, row):
        return RequestState(rid=f"r{row}", row=0, sampling=SamplingParams(), seed=0,
                            last_tokens=tokens, last_row=row)

    staged: list[int] = []

    def stage(*parts):
        # Every index the gathers take comes through one call (the runner's HostStaging).
        staged.append(len(parts))
        return [mx.array(p) for p in parts]

    same = [state(step_a, 0), state(step_a, 1), state(step_a, 2)]
    assert gather_last_tokens(same, stage) is step_a  # the steady case: no op at all
    assert staged == []
    assert gather_last_tokens([state(step_a, 2), state(step_a, 0)], stage).tolist() == [12, 10]
    mixed = [state(step_b, 1), state(step_a, 2), state(step_b, 0), state(step_a, 0)]
    assert gather_last_tokens(mixed, stage).tolist() == [21, 12, 20, 10]
    assert staged == [1, 3]  # one call a gather: its source's rows; two sources' and the order


def test_overlap_computes_no_row_past_a_length_bound_requests_last_token(tiny_model):
    """Two steps in flight: the scheduler plans the step after a request's max_tokens-th
    token before it sees that token, and leaves the request out of it (no discarded row)."""
    model, _ = tiny_model
    engine = InProcessEngine(model)
    limits = (3, 6, 9)
    for i, p in enumerate(_prompts(3, [20, 9], model.args.vocab_size, seed=6)):
        engine.submit(f"r{i}", p, limits[i], [])
    results = engine.run_until_idle()
    assert [len(results[f"r{i}"].token_ids) for i in range(3)] == list(limits)
    assert engine.worker.stats.decode_tokens == sum(n - 1 for n in limits)
    assert_idle_invariant(engine.scheduler)


def test_step_stats_account_the_loop_and_summarise_by_interval(tiny_model):
    import time

    from worker_proc.step_stats import ForwardClock, StepStats, Timer

    model, tokenizer = tiny_model
    engine = InProcessEngine(model, overlap=False)  # overlap adds discarded steps
    stats = engine.worker.stats
    for i, p in enumerate(_prompts(3, [20, 9], model.args.vocab_size, seed=5)):
        engine.submit(f"r{i}", p, 6, [])
    engine.run_until_idle()
    # 3 prompts of 20/9/20 tokens, then every request's 5 more tokens one step each.
    assert stats.prefill_tokens == 49 and stats.decode_tokens == 15
    assert stats.steps >= 6 and stats.total("build") > 0 and stats.total("start") > 0

    # A prefill step's build started its forwards and waited for earlier ones: those
    # parts count as start and wait, the rest as build.
    split = StepStats()
    timer = Timer(split)
    time.sleep(0.02)
    build = timer.mark("build", ForwardClock(start=0.005, wait=0.01).phases())
    assert split.samples["start"] == [0.005] and split.samples["wait"] == [0.01]
    assert split.samples["build"] == [build] and 0.004 < build < 0.5

    clock = StepStats(interval_s=10.0, _since=100.0)
    assert clock.summary(now=105.0) is None  # the interval is not over
    clock.on_step(prefill_tokens=100, decode_tokens=4)
    for seconds in (0.5, 0.1, 0.2):
        clock.add("wait", seconds)
    clock.add("idle", 2.5)
    line = clock.summary(now=110.0)
    assert line is not None and "0.4 decode tok/s" in line and "busy 75%" in line
    assert "wait 200.00/800.00" in line  # the median, then the total over the one step
    assert clock.steps == 0 and clock.summary(now=125.0) is None  # a new, empty interval


def test_memory_note_reports_the_peak_since_the_last_note():
    """The worker's summary ends with MLX's memory: a transient peak (what a pool write
    that copied instead of updating in place leaves) shows once, then the next note
    starts from the memory held."""
    import re

    import mlx.core as mx

    from worker_proc import memory_note

    memory_note()
    held = mx.arange(16 << 20, dtype=mx.float32)  # 64 MiB kept
    mx.eval(held)
    # A 512 MiB transient (zeros would be a broadcast view that CUDA reduces unallocated).
    mx.eval(mx.arange(128 << 20, dtype=mx.float32).sum())
    mx.synchronize()  # on CUDA a kernel's inputs are let go of after it completes
    gib = [float(x) for x in re.findall(r"[\d.]+", memory_note())]
    active, peak = gib[0], gib[1]
    assert peak - active >= 0.45
    later = [float(x) for x in re.findall(r"[\d.]+", memory_note())]
    assert later[1] - later[0] < 0.1


def test_start_ahead_reports_a_step_between_the_two_halves_of_the_next():
    """On the start-ahead path (pools written in place) the device always has work queued
    when the worker blocks, and step N's result leaves before the second half of N+1 is
    launched (so the scheduler plans N+2 meanwhile); never more than two steps in flight,
    steps with prefill too."""
    from ipc.messages.to_scheduler import StepResult
    from ipc.messages.to_worker import ForwardBatch, PrefillChunk, SyncSteps
    from worker_proc import WorkerLoop

    calls: list[tuple] = []

    class Runner(_StubRunner):
        def build(self, batch):
            calls.append(("build", batch.step))
            return super().build(batch)

        def start_head(self):
            step = max(c[1] for c in calls if c[0] == "build")  # the step just built
            calls.append(("start half", step))

        def start(self, pending):
            calls.append(("start", pending.step))

        def finish(self, pending):
            calls.append(("finish", pending.step))
            return super().finish(pending)

    sent: list[StepResult] = []

    class Results:
        send = sent.append

    loop = WorkerLoop(Runner(), Results(), overlap=True, start_ahead=True)
    for step in (1, 2, 3):
        loop.handle(ForwardBatch(step=step, decode_rids=["a"], decode_slots=[step]))
        assert len(loop.in_flight) == 1
    loop.handle(ForwardBatch(step=4, decode_rids=["a"], decode_slots=[4],
                             prefill=[PrefillChunk(rid="b", start=0, token_ids=[1], sample=True,
                                                   slot_ids=[9])]))
    loop.handle(SyncSteps())
    assert calls == [("build", 1), ("start half", 1), ("start", 1),
                     ("build", 2), ("start half", 2), ("finish", 1), ("start", 2),
                     ("build", 3), ("start half", 3), ("finish", 2), ("start", 3),
                     ("build", 4), ("start half", 4), ("finish", 3), ("start", 4),
                     ("finish", 4)]
    assert [r.step for r in sent] == [1, 2, 3, 4]


def test_the_launch_line_tells_the_hosts_cpu_time_from_its_waits(caplog):
    """At debug level the start-ahead launch line gives the step's host work (build and
    both launch halves, not the wait for the step before) in wall time and in the worker
    thread's CPU time: a sleep in the launch counts in the first alone, the report's wait
    in neither."""
    import logging
    import re
    import time as time_module

    from ipc.messages.to_worker import ForwardBatch
    from worker_proc import WorkerLoop

    class Runner(_StubRunner):
        def build(self, batch):
            spun = time_module.thread_time()
            while time_module.thread_time() - spun < 0.02:  # 20 ms computing
                pass
            return super().build(batch)

        def start_head(self):
            time_module.sleep(0.06)  # blocked in a call

        def finish(self, pending):
            time_module.sleep(0.2)  # the device's time: waited for, not host work
            return super().finish(pending)

    loop = WorkerLoop(Runner(), _DroppedResults(), overlap=True, start_ahead=True)
    with caplog.at_level(logging.DEBUG, logger="worker_proc"):
        loop.handle(ForwardBatch(step=1, decode_rids=["a"], decode_slots=[1]))
        loop.handle(ForwardBatch(step=2, decode_rids=["a"], decode_slots=[2]))
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("step 2 launched in"))
    wall, cpu = (float(x) for x in re.search(
        r"built and launched in ([\d.]+) ms, ([\d.]+) ms of it on the CPU", line).groups())
    assert 80 <= wall < 200, line  # 20 + 60 ms, not the 200 ms wait
    assert 20 <= cpu <= wall - 50, line


def test_the_summary_names_the_intervals_slowest_step(monkeypatch):
    """The worker's 10 s summary ends with the interval's slowest step: its time, phases
    and what it carried, so a stall shows in any server log."""
    import time as time_module

    import worker_proc
    from ipc.messages.to_worker import ForwardBatch, PrefillChunk

    class Runner(_StubRunner):
        def build(self, batch):
            if batch.prefill:
                time_module.sleep(0.05)  # the stall
            return super().build(batch)

    loop = worker_proc.WorkerLoop(Runner(), _DroppedResults(), overlap=False)
    chunk = PrefillChunk(rid="b", start=0, token_ids=[1] * 7, sample=True, slot_ids=list(range(7)))
    loop.handle(ForwardBatch(step=1, decode_rids=["a"], decode_slots=[1]))
    loop.handle(ForwardBatch(step=2, decode_rids=["a"], decode_slots=[2], prefill=[chunk]))
    loop.handle(ForwardBatch(step=3, decode_rids=["a"], decode_slots=[3]))
    line = loop.stats.summary(now=time_module.perf_counter() + 60)
    assert "slowest step" in line and "step 2 (build" in line
    assert "1 prefill chunks (7 tokens, longest 7), 1 decode rows" in line
    assert float(line.split("slowest step ")[1].split(" ms")[0]) >= 50
    assert loop.stats.slowest is None  # a new interval


def test_compiled_decode_matches_mlx_lm(tiny_model, oracle):
    """Compiled decode (the CUDA default): decode forwards replayed from mx.compile traces
    (one per batch size and table-width bucket, across the 128 bucket) give mlx-lm's
    greedy tokens, on the kernel path stood in for on the CPU."""
    model, tokenizer = tiny_model
    with pytest.raises(ValueError, match="compiled decode"):
        InProcessEngine(model, compile_decode=True)  # the CPU has no paged-attention path
    prompts = _prompts(5, [100, 7, 30], model.args.vocab_size, seed=13)
    engine = InProcessEngine(model, compile_decode=True, overlap="ahead", backend=StandInKernel())
    assert_greedy(engine, prompts, 40, _eos(tokenizer), oracle)
    engine.submit("alone", prompts[1], 12, _eos(tokenizer))  # a batch of one (RoPE offsets [1])
    assert engine.run_until_idle()["alone"].token_ids == oracle(prompts[1], 12)
    # A fresh server's warm-up traces every batch bucket it meets with 12 rows: 1, 2, 4,
    # 8 and 16 (run with 12 rows); then it serves as before.
    engine = InProcessEngine(model, compile_decode=True, overlap="ahead", backend=StandInKernel())
    assert warm_up(engine.runner, max_batch=12) == 2 + 2 + 2 * 5
    engine.submit("after", prompts[2], 12, _eos(tokenizer))
    assert engine.run_until_idle()["after"].token_ids == oracle(prompts[2], 12)


@pytest.mark.parametrize("in_attention", [True, False])
def test_in_place_pool_decode_stores_through_attention(tiny_model, oracle, monkeypatch,
                                                       in_attention):
    """On the in-place pool's path, decode K/V are stored by the attention call (one
    kernel on CUDA, stood in for here) or by a separate write: mlx-lm's greedy tokens
    either way, steps launched ahead; a model whose attention skips that call is refused
    rather than left without its K/V."""
    import mlx.core as mx

    import worker_proc.attention as attention

    model, tokenizer = tiny_model
    prompts = _prompts(4, [60, 9, 33], model.args.vocab_size, seed=17)
    engine = InProcessEngine(model, overlap="ahead",
                             backend=StandInInPlaceKernels(write_in_attention=in_attention))
    assert engine.pool.in_place
    assert_greedy(engine, prompts, 25, _eos(tokenizer), oracle)
    if in_attention:
        caches = attention.build_layer_caches(engine.pool, attention.ForwardLayout.decode(
            np.array([[1, 2]], dtype=np.int32), np.array([2])))
        spec = engine.pool.specs[0]
        new = mx.zeros((1, spec.n_kv_heads, 1, spec.head_dim))
        caches[0].update_and_fetch(new, new)  # and no attention call after it
        with pytest.raises(attention.UnsupportedModelError, match="layer 0"):
            attention.check_written(caches)


def test_compiled_decode_traced_at_start_up_serves_without_tracing(tiny_model, oracle,
                                                                   monkeypatch):
    """After the warm-up and the start-up traces (every batch bucket at every slot-table
    width up to the longest context), serving traces nothing, also as contexts cross
    width buckets; tokens stay mlx-lm's."""
    model, tokenizer = tiny_model
    engine = InProcessEngine(model, compile_decode=True, overlap="ahead", max_context=600,
                             backend=StandInKernel())
    runner = engine.runner
    warm_up(runner, max_batch=6)
    assert trace_decode_shapes(runner, max_batch=6) == 4 * 3  # buckets 1, 2, 4, 8; widths 256-1024
    monkeypatch.setattr(warm_up_module, "TRACED_AHEAD_MAX_WIDTH", 512)
    assert trace_decode_shapes(runner, max_batch=6) == 4 * 2  # a bound on start-up time
    traces = runner.decode_traces
    prompts = _prompts(5, [200, 7, 120], model.args.vocab_size, seed=21)
    assert_greedy(engine, prompts, 70, _eos(tokenizer), oracle)  # r0 crosses 256, r2 128 and 256
    assert runner.decode_traces == traces


def test_compiled_batch_buckets():
    sizes = [1, 2, 3, 5, 8, 9, 16, 17, 100, 128]
    assert [compiled_batch_size(n) for n in sizes] == [1, 2, 4, 8, 8, 16, 16, 24, 104, 128]


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    """On the CUDA backend: the demo model (head size 32, which the decode kernel and the
    in-place pool writes serve; demo-tiny's 16 takes the fallback), and its oracle."""
    from worker_proc.paged_attention import kernel_available

    if not kernel_available():
        pytest.skip("the CUDA decode kernel needs MLX's CUDA backend")
    import os
    from pathlib import Path

    import mlx_lm

    from tests.oracle import mlx_lm_greedy
    from worker_proc.demo_model import ensure_demo_model

    root = os.environ.get("KILN_TEST_CACHE") or tmp_path_factory.mktemp("kiln-cache")
    model, tokenizer = mlx_lm.load(str(ensure_demo_model("demo", cache_root=Path(root))))
    return model, tokenizer, lambda p, n: mlx_lm_greedy(model, tokenizer, p, n)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_in_place_pool_steps_launched_ahead_match_mlx_lm_without_copies(kernel_model,
                                                                       compile_decode):
    """Pipelined as the CUDA worker runs them (step N+1 launched before N is waited for,
    prefill steps too), pool writes land in place: peak memory stays far below the pool's
    size (a write that copied would add a layer each, the whole pool at a step's scale),
    and greedy tokens are mlx-lm's. Compiled decode comes with compiled prefill, as served
    (the second 9-token prompt's forward replays the first's trace)."""
    import mlx.core as mx

    model, tokenizer, oracle = kernel_model
    engine = InProcessEngine(model, capacity=200_000, compile_decode=compile_decode,
                             compile_prefill=compile_decode, overlap="ahead")
    assert engine.pool.in_place
    pool_bytes = engine.pool.nbytes
    prompts = _prompts(6, [40, 9, 25, 130], model.args.vocab_size, seed=5)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for i, p in enumerate(prompts[:3]):
        engine.submit(f"r{i}", p, 30, _eos(tokenizer))
    for _ in range(4):
        engine.step()
    for i, p in enumerate(prompts[3:], start=3):  # they join the running batch
        engine.submit(f"r{i}", p, 20, _eos(tokenizer))
    results = engine.run_until_idle()
    assert engine.worker.steps_built_ahead > 0
    assert engine.runner.prefill_forwards.replays > 0 or not compile_decode
    over = mx.get_peak_memory() - before
    # A copying write adds at least a layer (the demo model's 2 make each 390 MiB); the
    # steps' own buffers measured 104 MiB on the H200 (session 19).
    layer_bytes = pool_bytes // len(engine.pool.layers)
    assert over < layer_bytes // 2, f"peak {over / 2**20:.0f} MiB over a {pool_bytes / 2**20:.0f} MiB pool"
    for i, p in enumerate(prompts):
        want = oracle(p, 30 if i < 3 else 20)
        assert results[f"r{i}"].token_ids == want, f"r{i}: {results[f'r{i}'].token_ids} != {want}"


def test_prefill_without_a_known_output_head_takes_every_positions_logits(tiny_model, oracle):
    """A model whose call is not backbone-then-head (no split_model) is prefilled through
    its own call, every position's logits computed: the same tokens."""
    from worker_proc.runner import split_model

    model, tokenizer = tiny_model
    assert split_model(model) is not None  # the demo model is mlx-lm's llama
    engine = InProcessEngine(model)
    engine.runner.prefill_forwards.split = None
    prompts = _prompts(3, [40, 9, 25], model.args.vocab_size, seed=41)
    assert_greedy(engine, prompts, 10, _eos(tokenizer), oracle)


def test_overlap_auto_is_on_with_a_gpu_only_and_the_flags_force_it():
    from ipc.config import ServerConfig
    from worker_proc import overlap_enabled

    auto = ServerConfig()
    assert overlap_enabled(auto, on_gpu=True) and not overlap_enabled(auto, on_gpu=False)
    assert overlap_enabled(ServerConfig(overlap="on"), on_gpu=False)
    for off in (ServerConfig(overlap="off"), ServerConfig(disable_overlap=True)):
        assert not overlap_enabled(off, on_gpu=True)
    with pytest.raises(ValueError, match="contradicts"):
        ServerConfig(disable_overlap=True, overlap="on")
    # A deeper pipeline without one is refused, not ignored; so is a depth out of range.
    for flags in ({"overlap": "off"}, {"disable_overlap": True}):
        with pytest.raises(ValueError, match="with overlap only"):
            ServerConfig(steps_in_flight=3, **flags)
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        ServerConfig(steps_in_flight=5)
    assert ServerConfig(steps_in_flight=3, overlap="on").steps_in_flight == 3


def test_prefill_chunk_is_the_flag_or_longer_where_long_prefill_is_fused():
    import mlx.core as mx

    from ipc.config import ServerConfig
    from worker_proc import prefill_chunking
    from worker_proc.decode_backend import GatherDecode, KernelDecode
    from worker_proc.kv_pool import AttentionLayerSpec, StateLayerSpec

    auto = ServerConfig()
    llama = [AttentionLayerSpec(8, 128, 128, mx.bfloat16)] * 2

    def chunking(backend, specs=llama):  # noqa: ANN001, ANN202
        return prefill_chunking(auto, backend, specs)

    assert chunking(GatherDecode()).size == 2048  # mlx-lm's prefill step
    assert chunking(KernelDecode()).size == 4096  # cuDNN, bucketed
    assert chunking(KernelDecode(bucketed_prefill=False)).size == 2048
    # Heads cuDNN does not take keep mlx-lm's chunk, unaligned, whether the paged prefill
    # kernel serves them (Gemma's 256: its 4,096-token chunks ran an H100 out of memory)
    # or MLX's matmul fallback does (MLA's latent, or --experiments unpaged-prefill).
    gemma = [AttentionLayerSpec(8, 256, 256, mx.bfloat16)]
    unpaged = KernelDecode(paged_prefill=False)
    latent = [AttentionLayerSpec(1, 576, 0, mx.bfloat16)]
    for backend, specs in ((KernelDecode(), gemma), (unpaged, gemma), (KernelDecode(), latent)):
        wide = chunking(backend, llama + specs)
        assert (wide.size, wide.align, wide.tail_bucket) == (2048, 1, 0)
    state = [StateLayerSpec(((4, 64),), (mx.float32,))]  # recurrent layers change nothing
    assert chunking(KernelDecode(), llama + state).size == 4096
    assert chunking(KernelDecode(), gemma + state).size == 2048
    # Chunks end on the bucket's edges exactly where long chunks are bucketed.
    assert chunking(KernelDecode()).align == 512
    assert chunking(GatherDecode()).align == 1
    assert chunking(KernelDecode(bucketed_prefill=False)).align == 1
    assert chunking(KernelDecode(align_chunks=False)).align == 1  # the A/B arm
    # Last chunks padded to the bucket exactly where chunks are aligned to it.
    assert chunking(KernelDecode()).tail_bucket == 512
    assert chunking(KernelDecode(align_chunks=False)).tail_bucket == 0
    assert chunking(GatherDecode()).tail_bucket == 0
    # A smaller decode-first budget, a power of two from 128, sets the bucket and so the
    # edges, the tails and the walk (prefill_bucket_for); others keep 512.
    from worker_proc.prefill_attention import prefill_bucket_for
    assert [prefill_bucket_for(n) for n in (64, 128, 256, 384, 512, 1024)] == [
        512, 128, 256, 512, 512, 512]
    small = prefill_chunking(ServerConfig(max_prefill_tokens_while_decoding=256),
                             KernelDecode(prefill_bucket=256), llama)
    assert (small.align, small.tail_bucket, small.warm_walk) == (256, 256, 256)
    # The warm-up walks decode first's chunks where they are bucketed, aligned or not.
    unaligned = KernelDecode(align_chunks=False)
    assert chunking(KernelDecode()).warm_walk == chunking(unaligned).warm_walk == 512
    assert chunking(GatherDecode()).warm_walk == chunking(KernelDecode(), llama + gemma).warm_walk == 0
    # No chunk is longer than `size`: one budget for every step walks chunks of 4,096; a
    # prefill spread over steps walks its longer decode-first chunks.
    one_budget = prefill_chunking(ServerConfig(max_prefill_tokens_while_decoding=8192),
                                  KernelDecode(), llama)
    assert one_budget.warm_walk == one_budget.size == 4096
    # Spread over 4 steps, decode first's chunks are 4 times longer: the edges, the tails'
    # padding and the walk with them; where they do not divide the chunk, nothing changes.
    spread = chunking(KernelDecode()).spread(4)
    assert (spread.align, spread.tail_bucket, spread.warm_walk, spread.size) == (2048, 2048, 2048, 4096)
    plain = chunking(KernelDecode())
    assert plain.spread(3) == dataclasses.replace(plain, parts=3)
    assert plain.spread(1) == plain
    assert chunking(GatherDecode()).spread(4) == dataclasses.replace(chunking(GatherDecode()), parts=4)
    assert small.spread(4).warm_walk == small.spread(4).align == 1024
    # The defaults' spread (CUDA's: 8 parts, 128 tokens a step, the 128 bucket).
    config = ServerConfig()
    parts = config.spread_parts(on_cuda=True, most=48)
    cuda = prefill_chunking(config, KernelDecode(prefill_bucket=128), llama, parts=parts)
    assert (cuda.decode_first, cuda.parts, cuda.align, cuda.warm_walk) == (128, 8, 1024, 1024)
    assert (plain.decode_first, plain.parts) == (512, 1)
    # Prefix hits stay on the buckets' edges; the chunks from each to the spread's next
    # edge are walked.
    assert (spread.hit_align, spread.walk_offsets()) == (512, (512, 1024, 1536))
    assert chunking(KernelDecode()).walk_offsets() == ()
    assert ServerConfig(chunked_prefill_size=512).chunk_size(True) == 512
    assert ServerConfig(max_prefill_tokens=1024).chunk_size(True) == 1024  # within a step's budget
    with pytest.raises(ValueError, match="chunked-prefill-size"):
        ServerConfig(chunked_prefill_size=-1)


def test_experiments_are_named_and_become_the_kernel_backends_options(monkeypatch):
    from ipc.config import ServerConfig
    from worker_proc import decode_backend
    from worker_proc.decode_backend import GatherDecode, KernelDecode, choose_decode_backend
    from worker_proc.kv_pool import AttentionLayerSpec

    import mlx.core as mx

    specs = [AttentionLayerSpec(8, 128, 128, mx.bfloat16)]
    config = ServerConfig(experiments=" rope-in-kernel ")
    monkeypatch.setattr(decode_backend, "kernel_available", lambda: False)  # as on the CPU
    monkeypatch.setattr(decode_backend, "tensor_cores_available", lambda: False)  # (below)
    assert choose_decode_backend(specs) == GatherDecode()  # plain MLX
    with pytest.raises(ValueError, match="need the CUDA kernel"):  # no silent no-op elsewhere
        choose_decode_backend(specs, config.experiment_set)
    monkeypatch.setattr(decode_backend, "kernel_available", lambda: True)
    assert choose_decode_backend(specs) == KernelDecode()
    assert choose_decode_backend(specs, config.experiment_set) == KernelDecode(rope_in_kernel=True)
    # Lone chunks padded to recurring widths on the kernel path only (the CPU computes
    # every padded row), unless asked not to.
    assert choose_decode_backend(specs).pad_tails and not GatherDecode().pad_tails
    assert not choose_decode_backend(specs, frozenset({"unpadded-tails"})).pad_tails
    assert choose_decode_backend([AttentionLayerSpec(8, 80, 80, mx.bfloat16)]) == GatherDecode()
    # A block holds one KV head's queries in shared memory: multi-query models with many
    # query heads a KV head (Falcon-7B: 71 of 64 wide) take the gather path instead.
    from worker_proc.decode_backend import kernel_fits, kernel_misfit
    assert kernel_fits([AttentionLayerSpec(8, 128, 128, mx.bfloat16, query_heads=64)])
    assert not kernel_fits([AttentionLayerSpec(2, 256, 256, mx.bfloat16, query_heads=32)])
    # ... and start-up says why (the worker's "decode attention" line on CUDA).
    assert kernel_misfit([AttentionLayerSpec(8, 128, 128, mx.bfloat16, query_heads=32),
                          AttentionLayerSpec(1, 64, 64, mx.bfloat16, query_heads=71)]) == (
        "attention layer 1: 71 query heads a KV head of 64 (more than a thread block's "
        "shared memory holds)")
    assert "keys 80 and values 80 wide" in kernel_misfit([AttentionLayerSpec(8, 80, 80, mx.bfloat16)])
    with pytest.raises(ValueError, match="unknown"):
        ServerConfig(experiments="rope-in-kernel,warp-drive")
    with pytest.raises(ValueError, match="fast decode blocks"):
        ServerConfig(experiments="rope-in-kernel", fast_decode_blocks="off")
    from worker_proc import paged_attention

    register = ServerConfig(experiments="register-kv", fast_decode_blocks="off")  # kernel-level only
    backend = choose_decode_backend(specs, register.experiment_set)
    assert backend == KernelDecode(stages=0)
    assert paged_attention.staged_tiles(128, 2, 4, backend.stages) == 0
    # The default stages K/V through shared memory, as many tiles as fit beside the rest
    # of a block's 48 KiB: Llama-3-8B's heads 8, Llama-3-70B's (8 queries a KV head) 6,
    # Gemma 3's 256-wide float32 ones 4 (32 lanes a token: tiles of 4 tokens); none where
    # two do not fit.
    tiles = paged_attention.staged_tiles
    assert [tiles(128, 2, 4), tiles(128, 2, 8), tiles(256, 4, 2)] == [8, 6, 4]
    assert tiles(128, 2, 16) == 2 and tiles(256, 2, 8) == 2 and tiles(128, 4, 32) == 0
    unfused = choose_decode_backend(specs, ServerConfig(experiments="unfused-prefill").experiment_set)
    assert KernelDecode().bucketed_prefill and unfused == KernelDecode(bucketed_prefill=False)
    masked = choose_decode_backend(specs, ServerConfig(experiments="unfused-masked-prefill").experiment_set)
    assert KernelDecode().bucketed_masked and masked == KernelDecode(bucketed_masked=False)
    unaligned = choose_decode_backend(specs, ServerConfig(experiments="unaligned-chunks").experiment_set)
    assert KernelDecode().align_chunks and unaligned == KernelDecode(align_chunks=False)
    # The tensor-core kernel: the default where the device has them (sm_80+) and every
    # layer's heads are 128 wide or less; Gemma's 256 keep the CUDA-core one unless asked.
    assert choose_decode_backend(specs).mma is None  # a device without tensor cores
    monkeypatch.setattr(decode_backend, "tensor_cores_available", lambda: True)
    from worker_proc.paged_attention import MMA_WIDE_TILES, MmaConfig

    assert choose_decode_backend(specs) == KernelDecode(mma=MmaConfig())
    assert choose_decode_backend(specs).name == "CUDA kernel (tensor cores)"
    gemma = specs + [AttentionLayerSpec(8, 256, 256, mx.bfloat16, query_heads=16)]
    assert choose_decode_backend(gemma).mma is None
    assert choose_decode_backend(gemma, frozenset({"mma-attention"})).mma == MmaConfig()
    assert choose_decode_backend(gemma, frozenset({"mma-wide-tiles"})).mma == MMA_WIDE_TILES
    off = ServerConfig(experiments="cuda-core-attention").experiment_set
    assert choose_decode_backend(specs, off) == KernelDecode()
    # register-kv is the CUDA-core kernel's option: it takes that kernel, never silently none.
    assert choose_decode_backend(specs, register.experiment_set) == KernelDecode(stages=0)
    # ... as block-tiles is (the staged tiles copied by the whole block, not a warp's each).
    block = ServerConfig(experiments="block-tiles").experiment_set
    assert choose_decode_backend(specs, block) == KernelDecode(warp_tiles=False)
    assert choose_decode_backend(gemma).warp_tiles
    with pytest.raises(ValueError, match="choose one"):
        choose_decode_backend(specs, frozenset({"mma-wide-tiles", "register-kv"}))
    with pytest.raises(ValueError, match="choose one"):  # at the command line already
        ServerConfig(experiments="mma-attention,cuda-core-attention")
    # Latent (MLA) layers' decode through the latent kernel unless gathered-latent asks for
    # the model's own code over gathered K/V (the A/B arm).
    from worker_proc.paged_attention import LatentConfig

    assert KernelDecode().attends_latent and KernelDecode().latent == LatentConfig()
    gathered = choose_decode_backend(specs, ServerConfig(experiments="gathered-latent").experiment_set)
    assert gathered.latent is None and not gathered.attends_latent
    # ... and own-score layers' prefill attention through the backend's unless asked.
    assert KernelDecode().own_prefill
    fused_own = choose_decode_backend(specs, ServerConfig(experiments="fused-own-prefill").experiment_set)
    assert not fused_own.own_prefill and fused_own.latent == LatentConfig()
    # ... and a decode step's q/k norms and RoPE in one kernel unless asked (unfused-qk-norm;
    # the plain-MLX backend has no such kernel: its caller runs the ops).
    unfused_norm = choose_decode_backend(specs, ServerConfig(experiments="unfused-qk-norm").experiment_set)
    assert KernelDecode().qk_norm_kernel and not unfused_norm.qk_norm_kernel
    from worker_proc.paged_attention import RopeSpec

    rope = RopeSpec(128, False, 10000.0, 1.0)
    qkv, scale = mx.zeros((1, 1, 4 * 128)), mx.ones((3, 128))
    for backend in (unfused_norm, GatherDecode()):
        assert backend.norm_rope_qk(qkv, 3, mx.array([4]), scale, 1e-6, rope) is None
    # RoPE alone (no q/k norms: llama) the same unless asked (unfused-qk-rope).
    unfused_rope = choose_decode_backend(specs, ServerConfig(experiments="unfused-qk-rope").experiment_set)
    assert KernelDecode().qk_rope_kernel and not unfused_rope.qk_rope_kernel
    assert unfused_rope.norm_rope_qk(qkv, 3, mx.array([4]), None, 0.0, rope) is None
    # ... and Gemma's sandwich norms and adds in one kernel a pair unless asked
    # (unfused-residual-norm).
    unfused_residual = choose_decode_backend(specs, ServerConfig(experiments="unfused-residual-norm").experiment_set)
    assert KernelDecode().residual_norm_kernel and not unfused_residual.residual_norm_kernel
    x = mx.zeros((1, 1, 64))
    for backend in (unfused_residual, GatherDecode()):
        assert backend.residual_norm(x, x, mx.ones((64,)), 1e-6) is None
    # Start-up says how latent layers decode (the device has tensor cores here).
    from worker_proc.layer_kinds import LayerKind

    mla = [AttentionLayerSpec(1, 512, 64, mx.bfloat16, LayerKind(own_attention=True, latent=True))]
    assert KernelDecode().latent_path(specs) is None
    assert KernelDecode().latent_path(mla) == "the latent kernel (tensor cores)"
    assert "plain MLX" in KernelDecode().latent_path([AttentionLayerSpec(
        1, 512, 64, mx.float32, LayerKind(own_attention=True, latent=True))])
    assert "own code" in gathered.latent_path(mla) and "own code" in GatherDecode().latent_path(mla)
    q = mx.zeros((1, 2, 3, 128), dtype=mx.bfloat16)
    assert fused_own.own_prefill_attention(q, q, q, 0.1, None, None) is None
    assert KernelDecode().own_prefill_attention(q, q, q, 0.1, None, None).shape == q.shape
    assert not GatherDecode().attends_latent


def test_chunks_at_different_starts_through_bucketed_masked_attention_match_mlx_lm(
        tiny_model, oracle, monkeypatch):
    """CUDA's default masked prefill on the CPU stand-in: one forward of chunks of
    requests at different starts (a mask per row), and a lone causal chunk under a
    bucket long, go padded through the fused call; greedy tokens stay mlx-lm's."""
    from worker_proc import decode_backend

    model, tokenizer = tiny_model
    calls = []
    masked = decode_backend.bucketed_masked_attention

    def spy(q, k, v, scale, mask, sinks=None):  # noqa: ANN001, ANN202
        calls.append(q.shape[0])
        return masked(q, k, v, scale, mask, sinks)

    monkeypatch.setattr(decode_backend, "bucketed_masked_attention", spy)
    biases = []
    make_bias = decode_backend.masked_bias
    monkeypatch.setattr(decode_backend, "masked_bias",
                        lambda mask, dtype, bucket: biases.append(mask.shape)
                        or make_bias(mask, dtype, bucket))
    # Chunks of 300: the first prompt's first chunk runs alone, then its later chunks
    # share forwards with the others' first ones (rows at different starts).
    prompts = _prompts(3, [900, 600, 350], model.args.vocab_size, seed=23)
    engine = InProcessEngine(model, chunk_size=300, max_prefill_tokens=900, max_context=2048,
                             backend=StandInKernel())
    eos = _eos(tokenizer)
    engine.submit("r0", prompts[0], 10, eos)
    engine.step()
    for i, p in enumerate(prompts[1:], 1):
        engine.submit(f"r{i}", p, 10, eos)
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == oracle(p, 10), f"r{i}"
    assert any(b > 1 for b in calls) and 1 in calls
    # One bias a forward, shared by its layers.
    assert len(calls) == len(biases) * model.args.num_hidden_layers


def test_prefill_attention_buckets_masks_of_bounded_bias_only(monkeypatch):
    """A masked (or unaligned causal) forward whose bias would pass the cap keeps the
    unfused path, as before masks were bucketed."""
    import mlx.core as mx

    from worker_proc import decode_backend, prefill_attention

    taken = []
    monkeypatch.setattr(decode_backend, "bucketed_masked_attention",
                        lambda *args: taken.append("masked") or args[0])
    monkeypatch.setattr(decode_backend, "unfused_prefill_attention",
                        lambda *args: taken.append("unfused") or args[0])
    q = mx.zeros((1, 4, 300, 16))
    kv = mx.zeros((1, 2, 1300, 16))
    for cap in (1 << 30, 300 * 1536):  # the bias: 512 x 1536 x 2 bytes
        monkeypatch.setattr(prefill_attention, "MASKED_BIAS_MAX_BYTES", cap)
        StandInKernel().prefill_attention(q, kv, kv, 0.25, "causal", None)
    assert taken == ["masked", "unfused"]


def test_long_chunks_through_bucketed_fused_attention_match_mlx_lm(tiny_model, oracle, monkeypatch):
    """The CUDA backend's prefill attention in a served model: chunks of 512+ tokens at a
    bucket-aligned start go padded through the fused call (the rest of 256+ tokens
    with a causal mask, bucketed_masked_attention; shorter ones unfused), beside
    requests decoding; greedy tokens stay mlx-lm's. The warm-up builds a long prompt's
    first shapes."""
    from worker_proc import decode_backend
    model, tokenizer = tiny_model
    padded, fused_keys = [], []
    bucketed = decode_backend.bucketed_fused_attention

    def spy(q, k, v, scale, pad, sinks=None):  # noqa: ANN001, ANN202
        padded.append(pad)
        fused_keys.append(k.shape[2] + pad)
        return bucketed(q, k, v, scale, pad, sinks)

    monkeypatch.setattr(decode_backend, "bucketed_fused_attention", spy)
    # 1,300 in chunks of 768: 768 fresh (padded by 256), 532 after 768 (not a bucket
    # multiple: masked); 1,100: 768, then 332 (under a bucket: masked); 40: unfused.
    prompts = _prompts(3, [1300, 1100, 40], model.args.vocab_size, seed=21)
    engine = InProcessEngine(model, chunk_size=768, max_prefill_tokens=1536, max_context=2048,
                             backend=StandInKernel())
    assert_greedy(engine, prompts, 12, _eos(tokenizer), oracle)
    assert padded and set(padded) == {256}
    # A fresh server with this backend warms up a lone prompt of two long chunks too (its
    # fused shapes built before a user's long prompt meets them), then serves as before.
    padded.clear()
    engine = InProcessEngine(model, chunk_size=512, max_context=2048, backend=StandInKernel())
    assert warm_up(engine.runner, max_batch=4, long_chunk=512) == 2 + 3 + 2 + 2 * 3
    assert padded == [0] * 2 * model.args.num_hidden_layers  # both chunks, every layer
    assert engine.runner.requests == {}
    engine.submit("after", prompts[1], 12, _eos(tokenizer))
    assert engine.run_until_idle()["after"].token_ids == oracle(prompts[1], 12)
    padded.clear()  # a context that holds one long chunk: that one alone
    short = InProcessEngine(model, chunk_size=512, max_context=768, backend=StandInKernel())
    assert warm_up(short.runner, max_batch=4, long_chunk=512) == 2 + 2 + 2 + 2 * 3
    assert padded == [0] * model.args.num_hidden_layers
    # Decode first's chunks walked over every key length of the context: 4 of 512.
    fused_keys.clear()
    walked = InProcessEngine(model, chunk_size=1024, max_context=2048, backend=StandInKernel())
    assert warm_up(walked.runner, max_batch=4, long_chunk=1024, walk_chunk=512) == (
        2 + 3 + 5 + 2 + 2 * 3)
    layers = model.args.num_hidden_layers
    assert fused_keys == [1024] * layers + [2048] * layers + [
        n for n in (512, 1024, 1536, 2048) for _ in range(layers)]
    walked.submit("after", prompts[1], 12, _eos(tokenizer))
    assert walked.run_until_idle()["after"].token_ids == oracle(prompts[1], 12)
    # Traced prefill: walked twice, and the two-chunk prompts run twice (a release
    # between), so each of those shapes is traced at start-up.
    traced = InProcessEngine(model, chunk_size=1024, max_context=2048, backend=StandInKernel(),
                             compile_prefill=True)
    assert warm_up(traced.runner, max_batch=4, long_chunk=1024, walk_chunk=512) == (
        2 + 3 + 2 * 5 + 2 + 1 + 2 + 2 * 3)
    assert traced.runner.prefill_forwards.traces >= 4
    traced.submit("after", prompts[0], 12, _eos(tokenizer))
    assert traced.run_until_idle()["after"].token_ids == oracle(prompts[0], 12)

def test_a_long_prompts_last_chunk_runs_padded_to_a_bucket_with_mlx_lm_tokens(
        tiny_model, oracle, monkeypatch):
    """Where chunks end on a bucket's edges, a prompt's last chunk shorter than a bucket
    runs right-padded to a whole one (the padding written to slot 0, its queries
    dropped): greedy tokens stay mlx-lm's, beside requests decoding and with a prefix
    hit. On the CUDA stand-in the padded tail is the warm causal shape: 512 queries over
    its start plus 512 keys, through the fused call unpadded."""
    from worker_proc import decode_backend

    model, tokenizer = tiny_model
    widths = []
    many = runner_module.ModelRunner._prefill_many

    def spy(self, chunks, width=0):  # noqa: ANN001, ANN202
        widths.append((len(chunks), width))
        return many(self, chunks, width)

    monkeypatch.setattr(runner_module.ModelRunner, "_prefill_many", spy)
    # 70: 64, then 6 padded to 32; 100: 64, then 36 (not under a bucket); 45: one chunk.
    prompts = _prompts(3, [70, 100, 45], model.args.vocab_size, seed=5)
    engine = InProcessEngine(model, chunk_size=64, max_prefill_tokens=64, chunk_align=32,
                             tail_bucket=32)
    assert_greedy(engine, prompts, 10, _eos(tokenizer), oracle)
    assert (1, 32) in widths and all(w in (0, 32) for _, w in widths)
    # A prefix hit of 64 (a bucket edge): the new 20 tokens run padded too.
    widths.clear()
    shared = prompts[1][:64] + prompts[2][:20]
    engine.submit("hit", shared, 10, _eos(tokenizer))
    assert engine.run_until_idle()["hit"].token_ids == oracle(shared, 10)
    assert widths == [(1, 32)]
    # Off (tail_bucket 0, as for models with recurrent or windowed layers): never padded.
    widths.clear()
    assert_greedy(InProcessEngine(model, chunk_size=64, max_prefill_tokens=64, chunk_align=32),
                  prompts[:1], 4, _eos(tokenizer), oracle)
    assert all(w == 0 for _, w in widths)
    # The CUDA stand-in: 700 = 512, then 188 padded to 512 (the walk's shape: no padding).
    padded = []
    bucketed = decode_backend.bucketed_fused_attention

    def fused_spy(q, k, v, scale, pad, sinks=None):  # noqa: ANN001, ANN202
        padded.append((q.shape[2], k.shape[2], pad))
        return bucketed(q, k, v, scale, pad, sinks)

    monkeypatch.setattr(decode_backend, "bucketed_fused_attention", fused_spy)
    long_prompt = _prompts(1, [700], model.args.vocab_size, seed=6)
    engine = InProcessEngine(model, chunk_size=512, max_prefill_tokens=512, max_context=2048,
                             chunk_align=512, tail_bucket=512, backend=StandInKernel())
    assert_greedy(engine, long_prompt, 8, _eos(tokenizer), oracle)
    assert set(padded) == {(512, 512, 0), (512, 1024, 0)}
    # Traced prefill: the padded tail replays the trace the warm-up's walk made of its
    # prompt's earlier chunk shape; serving the prompt traces nothing new.
    traced = InProcessEngine(model, chunk_size=512, max_prefill_tokens=512, max_context=2048,
                             chunk_align=512, tail_bucket=512, backend=StandInKernel(),
                             compile_prefill=True)
    warm_up(traced.runner, max_batch=4, long_chunk=512, walk_chunk=512)
    forwards = traced.runner.prefill_forwards
    traces, replays = forwards.traces, forwards.replays
    assert_greedy(traced, long_prompt, 8, _eos(tokenizer), oracle)
    assert forwards.traces == traces and forwards.replays == replays + 2


def test_a_smaller_bucket_keeps_decode_firsts_chunks_on_its_edges(tiny_model, oracle,
                                                                   monkeypatch):
    """A decode-first budget of 256 with the bucket at 256 (prefill_bucket_for): a long
    prompt arriving beside a decoding request is prefilled in 256-token chunks on the
    256 edges, each through the fused causal call at a 256-query shape, its tail padded
    to one, none through a mask; greedy tokens stay mlx-lm's (the CUDA stand-in)."""
    from worker_proc import decode_backend

    model, tokenizer = tiny_model
    fused, masked = [], []
    bucketed, bucketed_masked = (decode_backend.bucketed_fused_attention,
                                 decode_backend.bucketed_masked_attention)

    def fused_spy(q, k, v, scale, pad, sinks=None):  # noqa: ANN001, ANN202
        fused.append((q.shape[2], k.shape[2], pad))
        return bucketed(q, k, v, scale, pad, sinks)

    def masked_spy(q, k, v, scale, bias, sinks=None):  # noqa: ANN001, ANN202
        masked.append(q.shape[2])
        return bucketed_masked(q, k, v, scale, bias, sinks)

    monkeypatch.setattr(decode_backend, "bucketed_fused_attention", fused_spy)
    monkeypatch.setattr(decode_backend, "bucketed_masked_attention", masked_spy)
    engine = InProcessEngine(model, chunk_size=512, max_prefill_tokens=512, max_context=2048,
                             max_prefill_tokens_while_decoding=256, chunk_align=256,
                             tail_bucket=256, backend=StandInKernel(prefill_bucket=256),
                             decode_first_for_all=True)
    short, long_prompt = _prompts(2, [20, 700], model.args.vocab_size, seed=8)
    engine.submit("short", short, 40, _eos(tokenizer))
    for _ in range(3):  # the short one decodes before the long one arrives
        engine.step()
    engine.submit("long", long_prompt, 8, _eos(tokenizer))
    results = engine.run_until_idle()
    assert results["short"].token_ids == oracle(short, 40)
    assert results["long"].token_ids == oracle(long_prompt, 8)
    # 700 = 256 + 256 + 188, the tail padded: 256 queries over 256, 512 and 768 keys.
    assert set(fused) == {(256, 256, 0), (256, 512, 0), (256, 768, 0)} and not masked


def test_a_burst_of_short_prompts_never_reaches_cudnn(tiny_model, oracle, monkeypatch):
    """Several fresh prompts shorter than FUSED_PREFILL_BUCKET in one forward (a burst's)
    take the unfused attention even where a smaller decode-first bucket pads a lone
    prompt of that length through the fused call (cuDNN builds a graph for each count of
    prompts); greedy tokens stay mlx-lm's (the CUDA stand-in)."""
    from worker_proc import decode_backend

    model, tokenizer = tiny_model
    fused = []
    bucketed, bucketed_masked = (decode_backend.bucketed_fused_attention,
                                 decode_backend.bucketed_masked_attention)
    monkeypatch.setattr(decode_backend, "bucketed_fused_attention",
                        lambda q, *a, **k: (fused.append(q.shape[:3]), bucketed(q, *a, **k))[1])
    monkeypatch.setattr(decode_backend, "bucketed_masked_attention",
                        lambda q, *a, **k: (fused.append(q.shape[:3]),
                                            bucketed_masked(q, *a, **k))[1])
    engine = InProcessEngine(model, chunk_size=512, max_prefill_tokens=2048,
                             backend=StandInKernel(prefill_bucket=128))
    prompts = _prompts(5, [130, 140, 150, 135, 145], model.args.vocab_size, seed=12)
    for i, p in enumerate(prompts):
        engine.submit(f"b{i}", p, 6, _eos(tokenizer))
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"b{i}"].token_ids == oracle(p, 6)
    assert fused == []
    lone = _prompts(1, [200], model.args.vocab_size, seed=13)[0]
    engine.submit("lone", lone, 6, _eos(tokenizer))
    assert engine.run_until_idle()["lone"].token_ids == oracle(lone, 6)
    assert fused and all(shape[0] == 1 for shape in fused)  # alone: padded to 256, fused


def test_a_forwards_layers_share_one_causal_mask(tiny_model, oracle, monkeypatch):
    """The unfused prefill path's causal mask is built once a forward (in the graph, not
    from host data), however many layers attend through it."""
    from worker_proc import decode_backend

    model, tokenizer = tiny_model
    assert len(model.layers) > 1
    made = []
    real = decode_backend.causal_mask
    monkeypatch.setattr(decode_backend, "causal_mask",
                        lambda n_new, n_keys: made.append((n_new, n_keys)) or real(n_new, n_keys))
    engine = InProcessEngine(model, backend=StandInKernel())
    assert_greedy(engine, _prompts(1, [40], model.args.vocab_size, seed=9), 4, _eos(tokenizer),
                  oracle)
    assert made == [(40, 40)]


def test_host_staging_reuses_its_buffers_and_keeps_the_last_steps_inputs():
    """Compiled decode's host-written inputs: no allocation a step once its buffers are
    made, every part read back with its shape, and a buffer rewritten only `depth`
    steps later (the steps still in flight read their own)."""
    import mlx.core as mx

    from worker_proc.staging import MIN_ELEMENTS, HostStaging

    staging = HostStaging(depth=3)
    staged = []
    for step in range(8):
        parts = (np.full(5, step, dtype=np.int32), np.arange(6, dtype=np.int32).reshape(2, 3) + step)
        staged.append((parts, staging.stage(*parts)))
        for want, got in staged[-3:]:  # this step's and the two before it
            assert all(g.shape == w.shape and g.tolist() == w.tolist() for w, g in zip(want, got))
    assert staging.grown == 3
    big = np.arange(MIN_ELEMENTS + 1, dtype=np.int32)
    assert staging.stage(big)[0].tolist() == big.tolist() and staging.grown == 4
    assert mx.array_equal(staging.stage(big[:3], big[3:5])[1], mx.array([3, 4])).item()


def test_host_staging_checks_the_devices_reads_once_a_process(monkeypatch):
    """Each check reads a result back, a wait for every step in flight: a buffer that
    grows mid-serving (a longer context's table) must not check again, nor grow again
    for a part a little larger (GROWTH)."""
    from worker_proc import staging

    checks = []
    monkeypatch.setattr(staging, "_reads_host_writes", None)
    monkeypatch.setattr(staging, "_device_reads",
                        lambda array, view, first: checks.append(first) or True)
    rings = [staging.HostStaging(depth=2), staging.HostStaging(depth=2)]
    for size in (10, staging.MIN_ELEMENTS + 1, staging.MIN_ELEMENTS + 2):
        for ring in rings:
            for _ in range(2):  # each buffer of the ring
                part = np.arange(size, dtype=np.int32)
                assert ring.stage(part)[0].tolist() == part.tolist()
    assert checks == [7, 11]
    assert [ring.grown for ring in rings] == [4, 4]  # made, then grown once, per buffer


def test_host_staging_falls_back_to_new_arrays_where_the_device_misses_host_writes(monkeypatch):
    from worker_proc import staging

    monkeypatch.setattr(staging, "_reads_host_writes", None)
    monkeypatch.setattr(staging, "_device_reads", lambda array, view, first: False)
    ring = staging.HostStaging()
    part = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert ring.stage(part)[0].tolist() == part.tolist()
    assert ring.stage(part + 1)[0].tolist() == (part + 1).tolist() and ring.grown == 1


def test_build_runner_reads_the_context_as_the_front_does(tiny_model_dir, tmp_path) -> None:
    """The worker's context limit is config.json's, text_config's where mlx-lm's args nest
    it (Qwen3.5), or --context-length, as the tokenizer process validates against."""
    import json
    import shutil

    from ipc.config import ServerConfig
    from worker_proc import build_runner

    assert build_runner(ServerConfig(model_path=str(tiny_model_dir), max_running_requests=2,
                                     context_length=300)).max_context == 300
    nested = tmp_path / "nested"
    shutil.copytree(tiny_model_dir, nested)
    config = json.loads((nested / "config.json").read_text())
    # Where mlx-lm's args do not see it (as Qwen3.5's, under text_config).
    config["text_config"] = {"max_position_embeddings": 1000}
    del config["max_position_embeddings"]
    (nested / "config.json").write_text(json.dumps(config))
    assert build_runner(ServerConfig(model_path=str(nested),
                                     max_running_requests=2)).max_context == 1000


def test_prefill_padding_flag_reaches_the_runner(tiny_model_dir) -> None:
    from ipc.config import ServerConfig
    from worker_proc import build_runner
    from worker_proc.runner import CPU_PREFILL_PADDING

    def runner(padding: str):
        return build_runner(ServerConfig(model_path=str(tiny_model_dir), max_running_requests=2,
                                         prefill_padding=padding))

    assert runner("auto").prefill_padding == CPU_PREFILL_PADDING  # this CPU's default
    assert runner("0.5").prefill_padding == 0.5
    for bad in ("-1", "many", "nan"):
        with pytest.raises(ValueError, match="--prefill-padding"):
            ServerConfig(model_path=str(tiny_model_dir), prefill_padding=bad)


def test_prefill_experiments_are_refused_for_the_device_not_the_model(tiny_model_dir,
                                                                     tmp_path) -> None:
    """Only rope-in-kernel runs inside the llama/qwen2 fast decode blocks; the prefill
    experiments take any model (here Gemma 3's), and on the CPU are refused as needing the
    CUDA kernel."""
    from ipc.config import ServerConfig
    from tests.families import write_model_dir
    from worker_proc import build_runner
    from worker_proc.layer_kinds import UnsupportedModelError

    gemma = write_model_dir("gemma3_text", tiny_model_dir, tmp_path / "gemma")
    for name in ("unfused-masked-prefill", "mixed-forward"):
        with pytest.raises(ValueError, match="need the CUDA kernel"):
            build_runner(ServerConfig(model_path=str(gemma), experiments=name))
    with pytest.raises(UnsupportedModelError, match="no llama or qwen2 block"):
        build_runner(ServerConfig(model_path=str(gemma), experiments="rope-in-kernel"))
    # Gemma 3's own fast blocks do not carry the kernel's RoPE either.
    with pytest.raises(UnsupportedModelError, match="no llama or qwen2 block"):
        build_runner(ServerConfig(model_path=str(gemma), experiments="rope-in-kernel",
                                  fast_decode_blocks="on"))


def test_expert_kernel_experiments_are_refused_for_models_they_do_not_take(tiny_model_dir,
                                                                          tmp_path) -> None:
    """quantized-rows-kernel needs 4-bit quantized Linear layers, bf16-expert-rows bf16
    GPT-OSS or Qwen3-MoE experts and bf16-rows-kernel bf16 Linear layers: a float32 model
    has none, and is told so; the counts find them once the model has them."""
    import mlx.core as mx
    import mlx.nn as nn

    from ipc.config import ServerConfig
    from tests.families import write_model_dir
    from worker_proc import build_runner
    from worker_proc.layer_kinds import UnsupportedModelError

    oss = write_model_dir("gpt_oss", tiny_model_dir, tmp_path / "gpt_oss")
    with pytest.raises(UnsupportedModelError, match="no 4-bit quantized Linear layer"):
        build_runner(ServerConfig(model_path=str(oss), experiments="quantized-rows-kernel"))
    with pytest.raises(UnsupportedModelError, match="no bfloat16 GPT-OSS or Qwen3-MoE"):
        build_runner(ServerConfig(model_path=str(oss), experiments="bf16-expert-rows"))
    with pytest.raises(UnsupportedModelError, match="no bfloat16 Linear layer"):
        build_runner(ServerConfig(model_path=str(oss), experiments="bf16-rows-kernel"))
    from tests.families import build
    from worker_proc.expert_rows import bf16_expert_layers, kernel_rows_layers

    model = build("gpt_oss")
    assert bf16_expert_layers(model) == 0 and kernel_rows_layers(model) == 0
    model.set_dtype(mx.bfloat16)
    assert bf16_expert_layers(model) == len(model.layers)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4")
    assert kernel_rows_layers(model) > 0 and bf16_expert_layers(model) == 0


def test_compile_prefill_is_refused_on_the_cpu(tiny_model_dir) -> None:
    from ipc.config import ServerConfig
    from worker_proc import build_runner
    from worker_proc.layer_kinds import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="--compile-prefill"):
        build_runner(ServerConfig(model_path=str(tiny_model_dir), compile_prefill=True))

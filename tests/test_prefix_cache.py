"""Radix prefix cache, memory pressure and preemption: the scheduler and the worker on a
tiny float32 model, exact against mlx-lm's greedy output, slot accounting checked after
every scenario."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_proc.scheduler import Scheduler
from tests.engine_driver import InProcessEngine


def check_slots(s: Scheduler) -> None:
    """Every slot is exactly one of: free, cached, held by one running request."""
    free = s.allocator._free[:s.allocator.num_free].tolist()
    cached = s.cache.all_slots().tolist()
    held = []
    for r in s.running.values():
        held += s.table.slots(r.row, r.num_computed)[r.prefix_len:].tolist()
        for d in r.dups:
            held += s.table.slots(r.row, d.end)[d.start:].tolist()
    everything = free + cached + held
    assert len(everything) == len(set(everything)) == s.allocator.capacity, "slot leak or overlap"
    assert s.slots_consistent()


def check_idle(s: Scheduler) -> None:
    assert not s.running and not s.waiting
    check_slots(s)
    assert s.allocator.num_free + s.cache.total_size == s.allocator.capacity
    s.flush_cache()
    assert s.allocator.num_free == s.allocator.capacity


def _rand(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(5, vocab, size=n).tolist()


@pytest.fixture(scope="module")
def vocab(tiny_model) -> int:
    return tiny_model[0].args.vocab_size


def test_outputs_are_identical_with_and_without_the_cache(tiny_model, oracle, vocab):
    model, _ = tiny_model
    rng = np.random.default_rng(20)
    system = _rand(rng, 150, vocab)
    prompts = [system + _rand(rng, n, vocab) for n in (5, 40, 1, 90)] + [_rand(rng, 60, vocab)]
    prompts += [prompts[1] + _rand(rng, 30, vocab)]
    runs = {}
    for cache in (True, False):
        engine = InProcessEngine(model, chunk_size=64, max_prefill_tokens=128, radix_cache=cache)
        for i, p in enumerate(prompts):
            engine.submit(f"r{i}", p, 24, [])
            engine.step()
        runs[cache] = {k: v.token_ids for k, v in engine.run_until_idle().items()}
        check_idle(engine.scheduler)
        if cache:
            assert engine.scheduler.counters.cache_hit_tokens > 0
    assert runs[True] == runs[False]
    for i, p in enumerate(prompts):
        assert runs[True][f"r{i}"] == oracle(p, 24)


@pytest.mark.parametrize("concurrent", [True, False])
def test_32_requests_sharing_a_1000_token_prefix_compute_it_once(tiny_model, oracle, vocab,
                                                                 concurrent):
    model, _ = tiny_model
    rng = np.random.default_rng(21)
    prefix = _rand(rng, 1000, vocab)
    suffix = 12
    prompts = [prefix + _rand(rng, suffix, vocab) for _ in range(32)]
    engine = InProcessEngine(model, capacity=6000, max_running=32, chunk_size=512,
                             max_prefill_tokens=1024)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 6, [])
        if not concurrent:
            engine.run_until_idle()
    results = engine.run_until_idle()
    counters = engine.scheduler.counters
    assert counters.prompt_tokens == 32 * 1012
    # The prefix once, then each request's own suffix (the first request computes both).
    assert counters.computed_prompt_tokens == 1000 + 32 * suffix
    for i in (0, 7, 31):
        assert results[f"r{i}"].token_ids == oracle(prompts[i], 6)
    check_idle(engine.scheduler)


def test_second_chat_turn_reads_the_first_turn_from_the_cache(tiny_model, oracle, vocab):
    model, _ = tiny_model
    rng = np.random.default_rng(22)
    turn1 = _rand(rng, 80, vocab)
    engine = InProcessEngine(model)
    engine.submit("t1", turn1, 20, [])
    out1 = engine.run_until_idle()["t1"].token_ids
    turn2 = turn1 + out1 + _rand(rng, 15, vocab)
    before = engine.scheduler.counters.computed_prompt_tokens
    engine.submit("t2", turn2, 20, [])
    assert engine.run_until_idle()["t2"].token_ids == oracle(turn2, 20)
    # Everything of turn 1 hits but, without overlap, its last generated token, whose K/V
    # was never computed; with overlap the step planned after turn 1's last one computed it.
    assert engine.scheduler.running == {} and engine.scheduler.waiting.peek() is None
    computed = engine.scheduler.counters.computed_prompt_tokens - before
    assert computed in (15, 15 + 1)
    check_idle(engine.scheduler)


def test_chunked_prefill_after_a_cached_prefix(tiny_model, oracle, vocab):
    model, _ = tiny_model
    rng = np.random.default_rng(23)
    prefix = _rand(rng, 300, vocab)
    long_prompt = prefix + _rand(rng, 700, vocab)
    engine = InProcessEngine(model, chunk_size=128, max_prefill_tokens=128)
    engine.submit("p", prefix + [7], 3, [])
    engine.run_until_idle()
    engine.submit("long", long_prompt, 10, [])
    steps_before = engine.steps
    assert engine.run_until_idle()["long"].token_ids == oracle(long_prompt, 10)
    assert engine.steps - steps_before >= 700 // 128  # chunked after the 300 cached tokens
    check_idle(engine.scheduler)


@pytest.mark.parametrize("overlap", [True, "ahead", False])
def test_capacity_far_below_the_working_set_preempts_and_stays_exact(tiny_model, oracle, vocab,
                                                                     overlap):
    model, _ = tiny_model
    rng = np.random.default_rng(24)
    # 32 requests of 200 + 60 tokens: 8,320 slots against a pool of 1,500. About 7 run at
    # once; 8 preemptions in each overlap mode, whose resumed prompts hit the cache.
    prompts = [_rand(rng, 200, vocab) for _ in range(32)]
    engine = InProcessEngine(model, capacity=1500, max_running=48, chunk_size=256,
                             max_prefill_tokens=512, overlap=overlap)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 60, [])
    for _ in range(100_000):
        if not engine.step():
            break
        check_slots(engine.scheduler)
    results = engine.results
    assert engine.scheduler.counters.preemptions > 0
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].finish_reason == "length"
        assert results[f"r{i}"].token_ids == oracle(p, 60), f"r{i}"
    check_idle(engine.scheduler)


def test_seeded_sampling_survives_preemption(tiny_model, vocab):
    model, _ = tiny_model
    rng = np.random.default_rng(25)
    prompts = [_rand(rng, 120, vocab) for _ in range(8)]
    sampling = dict(temperature=1.0, top_k=20, seed=5)
    alone = InProcessEngine(model)
    alone.submit("x", prompts[0], 60, [], **sampling)
    expected = alone.run_until_idle()["x"].token_ids
    tight = InProcessEngine(model, capacity=500, max_running=8)
    tight.submit("x", prompts[0], 60, [], **sampling)
    for i, p in enumerate(prompts[1:]):
        tight.submit(f"o{i}", p, 60, [])
    assert tight.run_until_idle()["x"].token_ids == expected
    assert tight.scheduler.counters.preemptions > 0
    check_idle(tight.scheduler)


def test_aborts_during_prefill_chunks_and_decode_leak_nothing(tiny_model, vocab):
    model, _ = tiny_model
    rng = np.random.default_rng(26)
    shared = _rand(rng, 200, vocab)
    engine = InProcessEngine(model, chunk_size=64, max_prefill_tokens=64)
    engine.submit("prefilling", shared + _rand(rng, 300, vocab), 50, [])
    engine.submit("decoding", _rand(rng, 10, vocab), 50, [])
    engine.submit("waiting", shared + _rand(rng, 20, vocab), 50, [])
    engine.step()
    engine.step()
    assert engine.scheduler.running["prefilling"].prefilling
    engine.abort("prefilling")
    check_slots(engine.scheduler)
    for _ in range(4):
        engine.step()
    assert not engine.scheduler.running["decoding"].prefilling
    engine.abort("decoding")
    check_slots(engine.scheduler)
    results = engine.run_until_idle()
    assert results["prefilling"].finish_reason == results["decoding"].finish_reason == "abort"
    assert results["waiting"].finish_reason == "length"
    assert engine.scheduler.counters.aborted == 2
    check_idle(engine.scheduler)


def test_lpm_policy_admits_the_longest_cached_prefix_first(tiny_model, vocab):
    model, _ = tiny_model
    rng = np.random.default_rng(27)
    shared = _rand(rng, 100, vocab)
    engine = InProcessEngine(model, schedule_policy="lpm", max_running=1)
    engine.submit("seed", shared + [9], 2, [])
    engine.run_until_idle()
    engine.submit("cold", _rand(rng, 50, vocab), 2, [])
    engine.submit("warm", shared + [11, 12], 2, [])
    engine.step()
    assert list(engine.scheduler.running) == ["warm"]
    engine.run_until_idle()
    check_idle(engine.scheduler)

"""Windowed layers' own slot space: positions behind every window give their slots back,
prefix hits are cut back to where every windowed layer still holds what it sees, and the
greedy tokens stay mlx-lm's."""

from __future__ import annotations

import numpy as np
import pytest

from ipc.config import ServerConfig
from kiln_common.windows import CHUNKED, SLIDING, WindowRule
from scheduler_proc.window_slots import WindowSlots
from tests.engine_driver import InProcessEngine
from tests.families import VOCAB, WINDOW, build
from tests.test_families import (SMALL_SERVER, assert_served_as_mlx_lm, mlx_lm_tokens,
                                 model_dir_and_prompts)
from tests.test_scheduler import assert_idle_invariant
from worker_proc import memory
from worker_proc.kv_pool import KVPool
from worker_proc.memory import probe_attention_specs


def _slots(rule: WindowRule, present: list[bool]) -> WindowSlots:
    """A window space where positions 0.. (full slots 1..) have window slots as given."""
    windows = WindowSlots(64, 64, rule, chunk_size=16)
    full = np.arange(1, len(present) + 1, dtype=np.int32)
    windows.attach(full)
    windows.drop(full[~np.array(present)])
    return windows


def test_a_match_is_cut_back_to_the_last_position_whose_window_is_whole():
    rule = WindowRule(((SLIDING, 4),))  # a query sees itself and the 3 positions before it
    full = np.arange(1, 13, dtype=np.int32)
    assert _slots(rule, [True] * 12).usable(full) == 12
    # Positions 0-5 gave theirs back: a hit at L needs L-3 .. L-1.
    assert _slots(rule, [False] * 6 + [True] * 6).usable(full) == 12
    assert _slots(rule, [False] * 6 + [True] * 6).usable(full[:8]) == 0  # 5 is gone
    # A tail kept inside a dropped stretch (a cached prompt end at 5) serves a hit there.
    kept = [False, False, True, True, True, False, False, False, False, False, True, True]
    assert _slots(rule, kept).usable(full) == 5
    # A chunked layer needs nothing at its chunk's start.
    chunked = WindowRule(((CHUNKED, 4),))
    assert _slots(chunked, [False] * 8 + [True] * 2 + [False] * 2).usable(full[:11]) == 10
    assert _slots(chunked, [False] * 12).usable(full[:11]) == 8
    assert _slots(chunked, [False] * 12).usable(full) == 12


def test_two_kinds_keep_what_the_wider_one_sees():
    rule = WindowRule(((SLIDING, 8), (SLIDING, 3)))
    assert rule.reach == 7 and int(rule.first_needed(20)) == 13
    assert rule.most_held(tokens=10_000, fill=5_000, chunk=16) == 7 + 16 + 1


def test_the_windowed_layers_pool_is_sized_apart():
    """gemma3 with a window: its sliding layers' arrays have the window space's rows."""
    specs = probe_attention_specs(build("gemma3_text"))
    pool = KVPool(specs, 300, window_slots=100)
    rows = sorted({a.shape[0] for a in pool.layers})
    assert rows == [101, 301]
    full, window = pool.slot_bytes
    assert full + window == KVPool.bytes_per_slot(specs) and window > 0
    assert pool.window_kinds == [(SLIDING, WINDOW)]


def test_the_budget_gives_windowed_layers_their_ratio(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1_000_000)
    cfg = ServerConfig(model="m", mem_fraction=1.0, max_running_requests=1000)
    # 100 bytes a position in full layers, 500 in windowed ones (five of six layers).
    full, window = memory.pool_spaces(cfg, 600, 500, max_context=100)
    assert (full, window) == (1_000_000 // 350, 1_000_000 // 350 // 2)
    assert full * 100 + window * 500 <= 1_000_000
    # Without the split the same bytes held 1,666 positions.
    off = ServerConfig(model="m", mem_fraction=1.0, max_running_requests=1000, window_ratio=0.0)
    assert memory.pool_spaces(off, 600, 500, max_context=100) == (1_000_000 // 600, 0)


def _run_tracking_windows(engine: InProcessEngine) -> int:
    """Run to idle; the most window slots in use after any step."""
    most = 0
    while engine.step():
        most = max(most, engine.scheduler.windows.num_used)
    return most


@pytest.mark.parametrize("name", ["gemma3_text", "llama4_text"])
def test_positions_behind_the_window_give_their_slots_back(name):
    model = build(name)
    rng = np.random.default_rng(7)
    prompt = rng.integers(5, VOCAB, size=120).tolist()
    # Without a prefix cache to keep them, positions behind the window go at once.
    engine = InProcessEngine(model, chunk_size=16, max_prefill_tokens=16, window_slots=200,
                             radix_cache=False)
    engine.submit("r", prompt, 60, [])
    most = _run_tracking_windows(engine)
    assert engine.results["r"].token_ids == mlx_lm_tokens(model, prompt, 60)
    # Held at once: the window and a chunk (the last one, in the cache's place), never
    # the request's 180 positions.
    assert most <= WINDOW + 2 * 16
    assert_idle_invariant(engine.scheduler)


def test_cached_prefixes_keep_their_windows_while_room_allows():
    """The next turn (prompt + answer + more) hits where the last request ended; prompts
    sharing the head of a cached prompt hit there, also of a long chunked one; once
    running requests need the window slots, a head whose windows were taken is computed
    again. Every answer is mlx-lm's."""
    model = build("gemma3_text")
    rng = np.random.default_rng(8)
    engine = InProcessEngine(model, chunk_size=64, max_prefill_tokens=64, window_slots=400)
    counters = engine.scheduler.counters

    def run(rid: str, prompt: list[int], n: int = 20) -> tuple[list[int], int]:
        before = counters.cache_hit_tokens
        engine.submit(rid, prompt, n, [])
        engine.run_until_idle()
        tokens = engine.results[rid].token_ids
        assert tokens == mlx_lm_tokens(model, prompt, n), rid
        return tokens, counters.cache_hit_tokens - before

    first = rng.integers(5, VOCAB, size=50).tolist()
    answer, _ = run("turn1", first)
    turn2 = first + answer + rng.integers(5, VOCAB, size=10).tolist()
    _, hit = run("turn2", turn2)
    assert hit == len(first) + len(answer) - 1  # the last answer token's K/V was never computed
    short = first[:30] + rng.integers(5, VOCAB, size=12).tolist()
    _, hit = run("short", short)
    assert hit == 30  # one chunk: every position still had its window slot
    long = rng.integers(5, VOCAB, size=200).tolist()
    run("long", long)
    head = long[:40] + rng.integers(5, VOCAB, size=12).tolist()
    _, hit = run("head", head)
    assert hit == 40  # its chunks kept their windows in the cache
    # A request that needs most of the window space takes the cached windows.
    run("big", rng.integers(5, VOCAB, size=500).tolist(), n=50)
    _, hit = run("head again", long[:40] + rng.integers(5, VOCAB, size=12).tolist())
    assert hit == 0
    assert_idle_invariant(engine.scheduler)


def test_a_small_window_space_takes_cached_windows_and_stays_exact(monkeypatch):
    """A window space that holds about two requests' windows: admission waits, cached
    prefixes lose their window slots to running requests, and every answer is mlx-lm's.
    (Preemption with a window space: test_families' assert_exact_under_preemption.)"""
    model = build("gpt_oss")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(5, VOCAB, size=n).tolist() for n in (90, 60, 33, 70)]
    engine = InProcessEngine(model, capacity=260, chunk_size=16, max_prefill_tokens=32,
                             window_slots=2 * (WINDOW + 16) + 8)
    taken = []
    evict = engine.scheduler._evict_windows
    monkeypatch.setattr(engine.scheduler, "_evict_windows", lambda n: taken.append(evict(n)) or taken[-1])
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 40, [])
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(model, p, 40), i
    assert sum(taken) > 0
    assert_idle_invariant(engine.scheduler)


def test_a_sliding_model_served_reports_both_spaces(tiny_model_dir, tmp_path):
    """Served: the windowed layers' space and the bytes per position of each space show in
    /get_server_info and /metrics, and concurrent requests equal mlx-lm's."""
    import httpx

    from tests.server import Server

    model_dir, model, prompts = model_dir_and_prompts("gemma3_text", tiny_model_dir,
                                                      tmp_path / "gemma3", 10, (3, 40, 150, 17))
    srv = Server(model_dir, *SMALL_SERVER, log_path=tmp_path / "log").wait_ready()
    try:
        assert_served_as_mlx_lm(srv, model, prompts, 16)
        stats = srv.stats()
        assert stats["capacity_slots"] == 4000 and stats["window_capacity_slots"] == 2000
        assert 0 < stats["window_kv_bytes_per_slot"] and 0 < stats["kv_bytes_per_slot"]
        assert stats["kv_bytes_used"] == (stats["used_slots"] * stats["kv_bytes_per_slot"]
                                          + stats["window_used_slots"]
                                          * stats["window_kv_bytes_per_slot"])
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "kiln_window_slots_capacity 2000.0" in metrics
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_a_prompt_whose_cached_copy_lost_its_windows_is_cached_again_in_its_place():
    """A prompt cached in a small window space loses its windows to the next prompt, so
    a request repeating it recomputes it. Its fresh copy replaces the cached one (which
    nobody reads) instead of sitting beside it: in a pool too small for two copies the
    repeat used to be preempted and recomputed for ever (schedule_soak seed 42017)."""
    model = build("gpt_oss")
    prompt = np.random.default_rng(10).integers(5, VOCAB, size=200).tolist()
    engine = InProcessEngine(model, capacity=300, chunk_size=64, max_prefill_tokens=64,
                             window_slots=100)
    engine.submit("first", prompt, 1, [])
    engine.run_until_idle()
    engine.submit("other", np.random.default_rng(11).integers(5, VOCAB, size=60).tolist(), 1, [])
    engine.run_until_idle()
    hit_before = engine.scheduler.counters.cache_hit_tokens
    engine.submit("again", prompt, 20, [])
    results = engine.run_until_idle(max_steps=200)
    assert results["again"].token_ids == mlx_lm_tokens(model, prompt, 20)
    assert engine.scheduler.counters.cache_hit_tokens - hit_before < 100  # it recomputed
    assert engine.scheduler.counters.preemptions == 0
    assert_idle_invariant(engine.scheduler)

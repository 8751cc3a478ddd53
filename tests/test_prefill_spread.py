"""Prefill forwards spread over steps (--prefill-spread): a share of the model's blocks a
step, beside the decode rows. Exact against mlx-lm whatever ends a request mid-spread
(an abort, a refusal, a failed step), with prompt logprobs, and with the id reused."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from scheduler_proc.scheduler import BURST_STEPS
from tests.engine_driver import InProcessEngine
from tests.families import build
from tests.oracle import mlx_lm_tokens
from tests.test_families import run_recording_parts
from tests.test_prompt_logprobs import _check_prompt
from tests.test_scheduler import assert_idle_invariant
from tests.test_worker import _prompts
from worker_proc.attention import ForwardLayout, build_layer_caches
from worker_proc.kv_pool import KVPool
from worker_proc.memory import probe_attention_specs
from worker_proc.prefill_parts import part_bounds, run_blocks
from worker_proc.runner import split_model


def test_part_bounds_cover_every_block_once():
    for blocks in (1, 2, 4, 32, 61):
        for parts in range(1, min(blocks, 8) + 1):
            edges = [part_bounds(blocks, parts, j) for j in range(parts + 1)]
            assert edges[0] == 0 and edges[-1] == blocks
            assert all(a < b for a, b in zip(edges, edges[1:]))  # no part empty


@pytest.mark.parametrize("cuts", [(0, 1, 4), (0, 1, 3, 4), (0, 1, 2, 3, 4)])
def test_blocks_run_in_parts_give_the_whole_forwards_logits(cuts):
    """The backbone run part by part over a fresh pool each time: the same logits as one
    forward, to the bit (the same ops on the same inputs)."""
    model = build("llama")
    split = split_model(model)
    tokens = mx.array([list(range(5, 45))])

    def logits(edges: tuple[int, ...]) -> mx.array:
        pool = KVPool(probe_attention_specs(model), 256)
        layout = ForwardLayout.single(np.arange(1, 41), 0, 40)
        caches = build_layer_caches(pool, layout)
        hidden = None
        for a, b in zip(edges, edges[1:]):
            hidden = run_blocks(split.backbone, tokens, caches, hidden, a, b)
            mx.eval(hidden)
        return split.head(hidden[:, -1])

    assert mx.array_equal(logits(cuts), logits((0, 4))).item()
    assert len(split.backbone.layers) == 4 and all(
        type(b).__name__ != "_Carried" for b in split.backbone.layers)  # put back


def _spreading_engine(model: Any, parts: int = 2, **kwargs: Any) -> InProcessEngine:
    """An engine whose prompts arriving beside a decoding one spread over `parts` steps
    (the demo model has 2 blocks)."""
    engine = InProcessEngine(model, chunk_size=32, max_prefill_tokens_while_decoding=32,
                             prefill_parts=parts, **kwargs)
    assert engine.scheduler.limits.prefill_parts == parts
    return engine


def _decoding(engine: InProcessEngine, prompt: list[int]) -> None:
    """A stream decoding long enough before the next prompts arrive that decode first
    holds them to its budget (a stream just ahead of them would count as their burst's)."""
    engine.submit("bg", prompt, 40, [])
    for _ in range(BURST_STEPS + 3):
        engine.step()


@pytest.mark.parametrize("overlap", [False, True, "ahead"])
def test_an_abort_mid_spread_and_its_id_reused_leave_the_rest_exact(tiny_model, oracle, overlap):
    model, _ = tiny_model
    prompts = _prompts(4, [20, 50, 60, 30], model.args.vocab_size, seed=70)
    engine = _spreading_engine(model, overlap=overlap)
    _decoding(engine, prompts[0])
    engine.submit("x", prompts[1], 10, [])
    engine.submit("y", prompts[2], 10, [])
    engine.step()  # x's and y's chunks spread: part 1 of 2 planned
    assert engine.scheduler._spread is not None
    engine.abort("x")
    assert engine.results["x"].finish_reason == "abort"
    engine.submit("x", prompts[3], 10, [])  # the id again, while the old x's slots are held
    results = engine.run_until_idle()
    assert results["x"].token_ids == oracle(prompts[3], 10)
    assert results["y"].token_ids == oracle(prompts[2], 10)
    assert results["bg"].token_ids == oracle(prompts[0], 40)
    assert_idle_invariant(engine.scheduler)


def test_a_refused_request_in_a_spread_ends_alone(tiny_model, oracle):
    model, _ = tiny_model
    prompts = _prompts(3, [20, 50, 60], model.args.vocab_size, seed=71)
    engine = _spreading_engine(model)
    _decoding(engine, prompts[0])
    engine.submit("bad", prompts[1], 10, [], temperature=1.0, top_k=2 ** 40)
    engine.submit("ok", prompts[2], 10, [])
    assert (2, 1, 2) in run_recording_parts(engine)
    results = engine.results
    assert results["bad"].finish_reason == "error" and "cannot serve" in results["bad"].error
    assert results["ok"].token_ids == oracle(prompts[2], 10)
    assert results["bg"].token_ids == oracle(prompts[0], 40)
    assert_idle_invariant(engine.scheduler)


def test_prompt_logprobs_in_a_spread_are_mlx_lms(tiny_model, oracle):
    """A request scoring its prompt runs its chunks whole in the spread's first step, its
    token sampled with the last part; its neighbours' chunks spread."""
    model, _ = tiny_model
    prompts = _prompts(3, [20, 28, 30], model.args.vocab_size, seed=72)
    engine = _spreading_engine(model)
    _decoding(engine, prompts[0])
    engine.submit("scored", prompts[1], 5, [], logprobs=2, prompt_logprobs=2)
    engine.submit("plain", prompts[2], 5, [])
    assert (2, 1, 2) in run_recording_parts(engine)
    _check_prompt(model, prompts[1], engine.results["scored"].prompt_logprobs, 2)
    assert engine.results["scored"].token_ids == oracle(prompts[1], 5)
    assert engine.results["plain"].token_ids == oracle(prompts[2], 5)


@pytest.mark.parametrize("overlap", [False, "ahead"])
def test_a_step_failing_mid_spread_ends_its_requests_and_serving_goes_on(tiny_model, oracle,
                                                                        monkeypatch, overlap):
    model, _ = tiny_model
    prompts = _prompts(3, [20, 50, 40], model.args.vocab_size, seed=73)
    engine = _spreading_engine(model, overlap=overlap)
    _decoding(engine, prompts[0])
    spread_step = engine.runner._spread_step
    calls = {"n": 0}

    def failing(batch, *args):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if batch.parts_from == 1:
            raise RuntimeError("part lost")
        return spread_step(batch, *args)

    monkeypatch.setattr(engine.runner, "_spread_step", failing)
    engine.submit("x", prompts[1], 10, [])
    results = engine.run_until_idle()
    assert results["x"].finish_reason == "error" and "part lost" in results["x"].error
    assert engine.runner._spread is None and engine.scheduler._spread is None
    assert_idle_invariant(engine.scheduler)
    monkeypatch.setattr(engine.runner, "_spread_step", spread_step)
    _decoding(engine, prompts[0])
    engine.submit("after", prompts[2], 10, [])
    results = engine.run_until_idle()
    assert results["after"].token_ids == oracle(prompts[2], 10)
    assert results["bg"].token_ids == oracle(prompts[0], 40)


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "gpt_oss"])
def test_a_spread_on_the_kernel_path_equals_mlx_lm(name):
    """The CUDA path's attention (stood in on the CPU), its in-place pool written by parts:
    full attention; sliding windows (in their own slot space) beside full layers; sinks."""
    from tests.engine_driver import StandInInPlaceKernels

    model = build(name, head_dim=64)
    prompts = _prompts(4, [30, 70, 45, 90], 512, seed=74)
    engine = _spreading_engine(model, parts=3, backend=StandInInPlaceKernels(),
                               overlap="ahead")
    _decoding(engine, prompts[0])
    for i, p in enumerate(prompts[1:]):
        engine.submit(f"r{i}", p, 12, [])
    parts = run_recording_parts(engine)
    assert (3, 2, 3) in parts
    assert engine.results["bg"].token_ids == mlx_lm_tokens(model, prompts[0], 40)
    for i, p in enumerate(prompts[1:]):
        assert engine.results[f"r{i}"].token_ids == mlx_lm_tokens(model, p, 12), i


def test_a_server_spreads_prefill_as_asked_and_stays_exact(tiny_model_dir, tmp_path):
    """--prefill-spread through every process: the scheduler learns the worker's parts
    (6 asked, the llama family's 4 blocks: one a step), spreads the prompts that arrive
    while others decode (its debug log names each step's parts), and concurrent requests
    get mlx-lm's tokens."""
    from tests.server import Server
    from tests.test_families import SMALL_SERVER, assert_served_as_mlx_lm, model_dir_and_prompts

    model_dir, model, prompts = model_dir_and_prompts("llama", tiny_model_dir, tmp_path / "m",
                                                      600, (3, 40, 150, 17, 90))
    srv = Server(model_dir, *SMALL_SERVER, "--prefill-spread", "6", "--log-level", "debug",
                 "--max-prefill-tokens-while-decoding", "16", "--fixed-decode-first-budget",
                 log_path=tmp_path / "log").wait_ready()
    try:
        assert srv.stats()["prefill_parts"] == 4 and srv.stats()["decode_first_tokens"] == 16
        assert_served_as_mlx_lm(srv, model, prompts, 12)
        assert srv.stats()["slots_consistent"]
        log = srv.log_path.read_text()
        assert "prefill parts 0-1 of 4" in log and "prefill parts 3-4 of 4" in log
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_a_spreads_parts_run_only_their_blocks(monkeypatch):
    """In each step of a spread, the prefill forwards run the part's blocks alone (of the
    llama family's 4 over 3 parts: block 0, then 1 and 2, then 3)."""
    model = build("llama")
    blocks = split_model(model).backbone.layers
    index = {id(b): i for i, b in enumerate(blocks)}
    ran: list = []
    call = type(blocks[0]).__call__

    def counting(self, x, *args, **kwargs):  # noqa: ANN001, ANN202
        if x.shape[1] > 1:  # a prefill forward's (decode rows run one position)
            ran.append(index[id(self)])
        return call(self, x, *args, **kwargs)

    monkeypatch.setattr(type(blocks[0]), "__call__", counting)
    prompts = _prompts(3, [20, 45, 60], 512, seed=75)
    engine = _spreading_engine(model, parts=3)
    _decoding(engine, prompts[0])
    engine.submit("x", prompts[1], 6, [])
    engine.submit("y", prompts[2], 6, [])
    handle, per_step = engine.worker.handle, []

    def recording(message):  # noqa: ANN001, ANN202
        ran.clear()
        out = handle(message)
        if getattr(message, "parts", 1) > 1:
            per_step.append((message.parts_from, message.parts_to, sorted(set(ran))))
        return out

    engine.worker.handle = recording
    engine.run_until_idle()
    assert (0, 1, [0]) in per_step and (1, 2, [1, 2]) in per_step and (2, 3, [3]) in per_step
    assert all(blocks_run == list(range(*{0: (0, 1), 1: (1, 3), 2: (3, 4)}[start]))
               for start, _, blocks_run in per_step)
    assert engine.results["x"].token_ids == mlx_lm_tokens(model, prompts[1], 6)


def test_a_spread_whose_requests_all_end_still_runs_its_parts_and_gives_back(tiny_model):
    """Every request of a spread aborted, nothing else running: its remaining parts still
    run (it holds their slots), and then every slot is free."""
    model, _ = tiny_model
    prompts = _prompts(2, [20, 60], model.args.vocab_size, seed=76)
    engine = _spreading_engine(model, overlap=False)
    _decoding(engine, prompts[0])
    engine.submit("x", prompts[1], 10, [])
    engine.step()
    assert engine.scheduler._spread is not None
    engine.abort("x")
    engine.abort("bg")
    assert engine.scheduler.has_work  # its loop keeps planning, not waiting for news
    engine.run_until_idle()
    assert engine.scheduler._spread is None and engine.runner._spread is None
    assert_idle_invariant(engine.scheduler)


def test_a_spread_planned_before_a_failure_was_known_is_not_started(tiny_model, oracle):
    """With three steps in flight, a step fails, the worker resets, and the scheduler,
    not knowing yet, plans a spread: the worker does not run that step (its epoch is
    behind: ForwardBatch.epoch), the failure ends its requests on both sides, and the
    next spread runs exactly."""
    from ipc.messages.to_worker import SyncSteps
    from tests.engine_driver import Pipe

    model, _ = tiny_model
    prompts = _prompts(5, [20, 30, 40, 20, 30], model.args.vocab_size, seed=77)
    engine = _spreading_engine(model, overlap=True, steps_in_flight=3, decode_first_for_all=True)
    s, runner = engine.scheduler, engine.runner
    held = Pipe()
    engine.worker.results = held  # results reach the scheduler when released below

    def plan_and_run():  # noqa: ANN202
        batch = s.plan_step()
        engine.worker.handle(batch)
        engine.worker.handle(SyncSteps())
        return batch

    def deliver() -> None:
        for result in held.drain():
            s.apply_result(result)

    engine.submit("bg", prompts[0], 3, [])
    while True:  # until bg's last token is the next step's
        bg = s.running.get("bg")
        if bg is not None and not bg.prefilling and len(bg.output_ids) + bg.samples_in_flight == 2:
            break
        plan_and_run()
        deliver()
    failing_step, build = s._step + 1, runner.build

    def failing(batch):  # noqa: ANN001, ANN202
        if batch.step == failing_step:
            raise RuntimeError("device error")
        return build(batch)

    runner.build = failing
    plan_and_run()  # bg's last token: the step fails, the worker resets
    engine.submit("b", prompts[1], 8, [])
    plan_and_run()  # b, planned before the failure is known
    engine.submit("c", prompts[2], 8, [])
    spread = plan_and_run()  # c spread beside b decoding, as the scheduler believes
    assert spread.parts == 2 and runner._spread is None and runner.requests == {}
    deliver()  # the failure ends bg, b and c
    assert s._spread is None
    runner.build = build
    engine.worker.results = engine.to_scheduler
    engine.loop.in_flight.clear()
    _decoding(engine, prompts[3])
    engine.submit("e", prompts[4], 5, [])
    results = engine.run_until_idle()
    assert results["e"].token_ids == oracle(prompts[4], 5) and results["e"].error is None


def test_the_spread_flag_is_checked_at_start_up():
    from ipc.config import ServerConfig

    with pytest.raises(ValueError, match="--prefill-spread must be >= 0"):
        ServerConfig(prefill_spread=-1)
    with pytest.raises(ValueError, match="mixed-forward and --prefill-spread"):
        ServerConfig(prefill_spread=2, experiments="mixed-forward")
    assert ServerConfig(prefill_spread=4).prefill_spread == 4


@pytest.mark.parametrize("overlap", [False, "ahead"])
def test_hits_on_bucket_edges_and_padded_chunks_to_a_spreads_edge_are_exact(tiny_model, oracle,
                                                                            overlap):
    """A spread's chunks end on 64-token edges (4 buckets of 16) while prefix hits stay on
    the 16-token ones: a prompt sharing 40 tokens with a cached one hits 32 and runs its
    chunk from there to the 64 edge (its last chunks padded to the next edge, as the CUDA
    server does); every request's tokens are mlx-lm's."""
    model, _ = tiny_model
    prompts = _prompts(4, [20, 90, 150, 60], model.args.vocab_size, seed=78)
    prompts[2][:40] = prompts[1][:40]
    prompts[3][:40] = prompts[1][:40]
    engine = InProcessEngine(model, chunk_size=64, chunk_align=64, prefix_align=16,
                             tail_bucket=64, max_prefill_tokens_while_decoding=32,
                             prefill_parts=2, overlap=overlap, decode_first_for_all=True)
    padded = []  # the widths of the spread's forwards
    parted = engine.runner._parted

    def recording(chunks, width, stage):  # noqa: ANN001, ANN202
        padded.append(width)
        return parted(chunks, width, stage)

    engine.runner._parted = recording
    _decoding(engine, prompts[0])
    engine.submit("first", prompts[1], 6, [])
    engine.run_until_idle()
    engine.submit("bg2", prompts[0], 60, [])  # decoding again beside the hits
    for _ in range(3):
        engine.step()
    engine.submit("long", prompts[2], 6, [])
    for _ in range(12):
        engine.step()
    engine.submit("short", prompts[3], 6, [])  # alone: its last chunk in a forward of its own
    results = engine.run_until_idle()
    assert engine.scheduler.counters.cache_hit_tokens >= 2 * 32
    assert 32 in padded  # a spread's last chunk from a hit at 32 to the 64 edge
    for rid, p, n in (("first", prompts[1], 6), ("long", prompts[2], 6), ("short", prompts[3], 6),
                      ("bg", prompts[0], 40), ("bg2", prompts[0], 60)):
        assert results[rid].token_ids == oracle(p, n), rid
    assert_idle_invariant(engine.scheduler)


def test_an_aborted_spread_requests_windows_are_not_evicted_before_its_last_part():
    """Gemma 3 (windows of 16 in their own slot space, tight): x, a cached prompt plus 20
    tokens, spreads over 4 steps beside 4 decoding streams and is aborted after its first
    part. While the window space runs short, eviction must spare the window slots x's
    later parts read (else the decoders take them, x's later layers read their K/V, and
    the prompt cached with x's last part is wrong); the same prompt later gets mlx-lm's
    tokens from that cache."""
    model = build("gemma3_text")
    rng = np.random.default_rng(1)
    a = rng.integers(5, 512, size=200).tolist()
    x = a + rng.integers(5, 512, size=20).tolist()
    engine = InProcessEngine(model, chunk_size=256, max_prefill_tokens_while_decoding=32,
                             prefill_parts=4, overlap=False, capacity=2048, window_slots=336,
                             decode_first_for_all=True)
    s = engine.scheduler
    for rid, prompt in (("a", a), ("f", rng.integers(5, 512, size=62).tolist())):
        engine.submit(rid, prompt, 1, [])
        engine.run_until_idle()
    for i in range(4):
        engine.submit(f"bg{i}", rng.integers(5, 512, size=12).tolist(), 60, [])
    engine.step()
    engine.submit("x", x, 5, [])
    engine.step()
    req = s.running["x"]
    assert s._spread is not None and s._spread.has(req)
    reads = s.table.slots(req.row, req.num_computed)[req.sees_from:req.prefix_len].copy()
    engine.abort("x")
    evict, lost = s._evict_windows, []

    def watching(n):  # noqa: ANN001, ANN202
        before = s.windows.of(reads) > 0
        freed = evict(n)
        lost.append(int((before & (s.windows.of(reads) == 0)).sum()))
        return freed

    s._evict_windows = watching
    while s._spread is not None:
        engine.step()
    s._evict_windows = evict
    assert lost and not any(lost)  # eviction ran mid-spread, and spared x's windows
    engine.run_until_idle()
    hits = s.counters.cache_hit_tokens
    engine.submit("z", x, 5, [])
    results = engine.run_until_idle()
    assert s.counters.cache_hit_tokens - hits > 200  # z read x's cached prompt
    assert results["z"].token_ids == mlx_lm_tokens(model, x, 5)


def test_a_spreads_warm_up_builds_the_shapes_its_prefix_hits_meet(tiny_model, oracle, monkeypatch):
    """Spread over 2 steps with 512-token buckets on the CUDA stand-in: chunks end on the
    1,024 edges and prefix hits on the 512 ones. The warm-up walks the chunk from each
    hit to the next edge as a hit itself (slots the walk wrote read as its prefix) and no
    chunk ending off an edge, which no served prompt runs; afterwards a prompt hitting a
    cached one at 512 beside a decoding stream meets no fused attention shape the warm-up
    did not build (a new cuDNN graph mid-serving, 60-180 ms on the H100), and its tokens
    are mlx-lm's."""
    from tests.engine_driver import StandInKernel
    from worker_proc import decode_backend
    from worker_proc.warm_up import warm_up

    model, tokenizer = tiny_model
    shapes: list[tuple[str, int, int]] = []
    fused, masked = decode_backend.bucketed_fused_attention, decode_backend.bucketed_masked_attention

    def fused_spy(q, k, v, scale, pad, sinks=None):  # noqa: ANN001, ANN202
        shapes.append(("fused", q.shape[2] + pad, k.shape[2] + pad))
        return fused(q, k, v, scale, pad, sinks)

    def masked_spy(q, k, v, scale, bias, sinks=None):  # noqa: ANN001, ANN202
        shapes.append(("masked", q.shape[2], k.shape[2]))
        return masked(q, k, v, scale, bias, sinks)

    monkeypatch.setattr(decode_backend, "bucketed_fused_attention", fused_spy)
    monkeypatch.setattr(decode_backend, "bucketed_masked_attention", masked_spy)
    engine = InProcessEngine(model, chunk_size=2048, max_context=2048, chunk_align=1024,
                             prefix_align=512, tail_bucket=1024,
                             max_prefill_tokens_while_decoding=512, prefill_parts=2,
                             backend=StandInKernel())
    warm_up(engine.runner, max_batch=4, long_chunk=2048, walk_chunk=1024, walk_offsets=(512,),
            walk_edge=1024)
    warmed = set(shapes)
    # The walk's two chunks, the hits at 512 and 1,536 to the next edges; no 512-query
    # chunk ending on 512 or 1,536 (the walk's old way, chunks from the edges to the hits).
    assert {("fused", 1024, 1024), ("fused", 1024, 2048), ("fused", 512, 1024),
            ("fused", 512, 2048)} <= warmed
    assert not {("fused", 512, 512), ("fused", 512, 1536)} & warmed
    assert not any(kind == "masked" for kind, _, _ in warmed)
    assert engine.runner.requests == {}
    # The hit's prompt runs to the 1,024 edge, then its last 976 tokens padded to the next.
    prompts = _prompts(3, [40, 1100, 2000], model.args.vocab_size, seed=91)
    prompts[2][:700] = prompts[1][:700]  # cached to 512 (a bucket's edge), not 1,024
    engine.submit("cached", prompts[1], 4, [])
    engine.run_until_idle()
    shapes.clear()
    _decoding(engine, prompts[0])
    engine.submit("hit", prompts[2], 6, [])
    results = engine.run_until_idle()
    assert engine.scheduler.counters.cache_hit_tokens == 512
    assert shapes.count(("fused", 512, 1024)) == model.args.num_hidden_layers
    assert set(shapes) <= warmed, set(shapes) - warmed
    assert results["hit"].token_ids == oracle(prompts[2], 6)
    assert results["bg"].token_ids == oracle(prompts[0], 40)


def test_the_hits_walked_are_a_padded_last_chunk_and_decode_firsts_unfinished_one(
        tiny_model, monkeypatch):
    """Where decode first's chunk (2,048) is longer than the spread's edge (1,024), a hit
    at 512 meets two first chunks: to 1,024 (a last chunk padded there) and to 2,048 (an
    unfinished one, cut back to the last edge it reaches); where the keys walked are
    fewer than one chunk (none walked), no hit is walked either."""
    from tests.engine_driver import StandInKernel
    from worker_proc import warm_up as warm
    from worker_proc.warm_up import _hit_chunks

    assert _hit_chunks(2048, 1024, (512,), 1024) == [(512, 1024), (1536, 2048)]
    assert _hit_chunks(4096, 2048, (512,), 1024) == [
        (512, 1024), (512, 2048), (1536, 2048), (1536, 3072), (2560, 3072), (2560, 4096),
        (3584, 4096)]
    assert _hit_chunks(4096, 1024, (256, 512, 768), 1024)[:3] == [(256, 1024), (512, 1024),
                                                                   (768, 1024)]
    model, _ = tiny_model
    monkeypatch.setattr(warm, "PREFILL_WARM_KEYS", 512)
    engine = InProcessEngine(model, chunk_size=2048, max_context=2048, backend=StandInKernel())
    assert warm.warm_up(engine.runner, max_batch=2, long_chunk=2048, walk_chunk=1024,
                        walk_offsets=(512,), walk_edge=1024) > 0
    assert engine.runner.requests == {}

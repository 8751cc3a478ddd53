"""Differential test over random schedules: whatever the batching, chunking, prefix hits,
preemption and overlap, every request's greedy tokens are mlx-lm's for its prompt alone.

Each schedule draws prompts that share first tokens, long prefixes, whole prompts, or are a
prefix of another; engine limits that put chunk edges inside and across the shared parts
(a smaller prefill budget in steps that decode, too) and, in some schedules, a pool small
enough to preempt; and arrival times from "all in the same step" to "while the others
decode". A failure names the seed, which replays it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from tests.engine_driver import InProcessEngine
from tests.test_scheduler import assert_idle_invariant
from ipc.messages.to_worker import PrefillChunk
from worker_proc.step_inputs import prefill_waves

SCHEDULES = 24
SHARED_LENGTHS = (1, 8, 64, 300)


@dataclass
class Schedule:
    seed: int
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[int]  # engine steps to run before submitting request i
    engine: dict = field(default_factory=dict)

    def describe(self) -> str:
        return (f"seed {self.seed}: prompts {[len(p) for p in self.prompts]}, arrivals "
                f"{self.arrivals}, engine {self.engine}")


def _derived_prompt(rng: random.Random, earlier: list[list[int]], vocab: int) -> list[int]:
    """A prompt related to an earlier one: a shared head, the same prompt, a prefix of
    it, or it extended."""
    base = rng.choice(earlier)
    kind = rng.choice(["share", "share", "same", "prefix", "extend"])
    fresh = [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 400))]
    if kind == "same":
        return list(base)
    if kind == "prefix" and len(base) > 1:
        return base[:rng.randrange(1, len(base))]
    if kind == "extend":
        return base + fresh
    shared = min(len(base), rng.choice(SHARED_LENGTHS))
    return base[:shared] + fresh


def draw_schedule(seed: int, vocab: int) -> Schedule:
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(rng.randrange(6, 13)):
        if prompts and rng.random() < 0.6:
            prompts.append(_derived_prompt(rng, prompts, vocab))
        else:  # ids above the special tokens: no prompt holds an EOS
            prompts.append([rng.randrange(5, vocab) for _ in range(rng.choice([1, 9, 70, 320, 700]))])
    rng.shuffle(prompts)
    # A third of the schedules get a pool near the largest request and longer outputs,
    # whose growth outruns admission's estimate: eviction and preemption.
    tight = rng.random() < 0.35
    max_tokens = [rng.choice([20, 60, 90] if tight else [1, 6, 12]) for _ in prompts]
    chunk = rng.choice([16, 64, 100, 256])
    need = max(len(p) + m for p, m in zip(prompts, max_tokens))
    total = sum(len(p) + m for p, m in zip(prompts, max_tokens))
    capacity = need + rng.randrange(0, need // 2) if tight else total + 1024
    engine = dict(chunk_size=chunk, max_prefill_tokens=rng.choice([chunk, 2 * chunk, 1024]),
                  capacity=capacity, max_running=rng.choice([2, 4, 16]),
                  overlap=rng.choice([False, True, "ahead"]),
                  schedule_policy=rng.choice(["fcfs", "lpm"]),
                  prefill_padding=rng.choice([0.0, 0.25, 1.0]))
    arrivals = [0 if rng.random() < 0.5 else rng.randrange(0, 12) for _ in prompts]
    # Drawn last, so the draws above (and what each seed replays) stay as they were.
    engine["max_prefill_tokens_while_decoding"] = rng.choice([None, 9, 100])
    # Half the schedules replay prefill forwards of recurring shapes from traces, as a
    # GPU server does.
    engine["compile_prefill"] = rng.random() < 0.5
    # A third end unfinished chunks on edges, as the CUDA server's scheduler does.
    engine["chunk_align"] = rng.choice([1, 1, 16])
    # Half of the overlapped ones keep a third step queued at the worker.
    engine["steps_in_flight"] = rng.choice([2, 3])
    # Half spread the prefill of steps that decode over 2 or 3 steps (--prefill-spread).
    engine["prefill_parts"] = rng.choice([1, 1, 2, 3])
    # Half hold every decoding stream to decode first (arrivals come within 12 steps, so
    # under the default rule few streams have decoded long enough to be protected).
    engine["decode_first_for_all"] = rng.random() < 0.5
    # Half the aligned ones pad a prompt's last chunk to the edge, as the CUDA worker does
    # (ModelRunner.tail_bucket).
    padded = rng.random() < 0.5
    engine["tail_bucket"] = engine["chunk_align"] if padded and engine["chunk_align"] > 1 else 0
    return Schedule(seed, prompts, max_tokens, arrivals, engine)


def run_schedule(model, schedule: Schedule) -> tuple[InProcessEngine, dict[str, list[int]]]:
    engine = InProcessEngine(model, max_context=2048, **schedule.engine)
    pending = sorted(range(len(schedule.prompts)), key=lambda i: schedule.arrivals[i])
    step = 0
    while pending:
        while pending and schedule.arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.submit(f"r{i}", schedule.prompts[i], schedule.max_tokens[i], [])
        engine.step()
        step += 1
    results = engine.run_until_idle()
    return engine, {rid: r.token_ids for rid, r in results.items()}


@pytest.fixture(scope="module")
def schedules(tiny_model):
    model, _ = tiny_model
    return [draw_schedule(seed, model.args.vocab_size) for seed in range(SCHEDULES)]


def test_every_schedule_gives_mlx_lm_tokens(tiny_model, oracle, schedules):
    model, _ = tiny_model
    failures, preempted, hits, replayed = [], 0, 0, 0
    for schedule in schedules:
        engine, outputs = run_schedule(model, schedule)
        preempted += engine.scheduler.counters.preemptions > 0
        hits += engine.scheduler.counters.cache_hit_tokens > 0
        replayed += engine.runner.prefill_forwards.replays > 0
        for i, (prompt, n) in enumerate(zip(schedule.prompts, schedule.max_tokens)):
            if outputs[f"r{i}"] != oracle(prompt, n):
                failures.append(f"{schedule.describe()}: r{i} (prompt {len(prompt)}) "
                                f"{outputs[f'r{i}']} != {oracle(prompt, n)}")
        assert_idle_invariant(engine.scheduler)
    assert not failures, "\n".join(failures)
    # The schedules exercised what they are for (a change to draw_schedule could lose it).
    assert preempted >= 3 and hits >= SCHEDULES // 2 and replayed >= 3, (preempted, hits, replayed)


# Windowed and hybrid families (gemma3_text: sliding layers beside full ones; gpt_oss:
# sliding with sinks; llama4: chunk-local; qwen3_next: Gated DeltaNet recurrent layers
# beside attention; deepseek_v32: MLA with its indexer's top-k, own score math) through
# fewer schedules each (bench/schedule_soak.py runs every family, longer): windows of 16
# positions, far shorter than the prompts, so chunks, hits and resumptions cross window
# edges. Each family's seeds hit the prefix cache in every schedule, and one of them
# preempts there (qwen3_next's and deepseek_v32's pools fit 103's requests; 106 preempts
# in neither gemma3_text, gpt_oss nor llama4_text).
FAMILY_SEEDS = {"gemma3_text": (102, 103), "gpt_oss": (102, 103), "llama4_text": (102, 103),
                "qwen3_next": (102, 106), "deepseek_v32": (102, 106)}


@pytest.mark.parametrize("family", list(FAMILY_SEEDS))
def test_windowed_and_hybrid_families_under_random_schedules(family):
    from tests.families import VOCAB, build
    from tests.oracle import mlx_lm_tokens

    model = build(family)
    failures, preempted, hits = [], 0, 0
    for seed in FAMILY_SEEDS[family]:
        schedule = draw_schedule(seed, VOCAB)
        engine, outputs = run_schedule(model, schedule)
        preempted += engine.scheduler.counters.preemptions > 0
        hits += engine.scheduler.counters.cache_hit_tokens > 0
        for i, (prompt, n) in enumerate(zip(schedule.prompts, schedule.max_tokens)):
            if outputs[f"r{i}"] != mlx_lm_tokens(model, prompt, n):  # memoised
                failures.append(f"{family} {schedule.describe()}: r{i} (prompt {len(prompt)})")
        assert_idle_invariant(engine.scheduler)
    assert not failures, "\n".join(failures)
    assert preempted >= 1 and hits == len(FAMILY_SEEDS[family]), (preempted, hits)


def _chunk(rid: str, slots: range) -> PrefillChunk:
    return PrefillChunk(rid=rid, start=0, token_ids=[7] * len(slots), slot_ids=list(slots),
                        sample=True)


def test_a_chunk_reading_another_chunks_writes_runs_in_a_later_wave():
    a, b, c = _chunk("a", range(1, 21)), _chunk("b", range(21, 84)), _chunk("c", range(84, 90))
    # b's cached prefix is a's first token; c's spans b's and a's writes; d reads
    # slots written in an earlier step only.
    d = _chunk("d", range(90, 95))
    prefixes = {"b": [1], "c": [1, 21, 22], "d": [200, 201]}
    waves = prefill_waves([a, b, c, d], prefixes)
    assert [[ch.rid for ch in w] for w in waves] == [["a", "d"], ["b"], ["c"]]
    assert prefill_waves([a, d], {"d": [200]}) == [[a, d]]
    assert prefill_waves([], {}) == []
    with pytest.raises(RuntimeError):  # the plan promised writers come first
        prefill_waves([b, a], {"b": [1]})


def test_a_chunk_starting_from_a_snapshot_saved_this_step_runs_after_its_saver():
    """A recurrent model's hit starts from a state snapshot that a chunk of the same step
    saves at its end; the hit's prefix slots may be another request's, written in an
    earlier step (the saver recomputes cached positions), so only the snapshot orders
    them."""
    saver = PrefillChunk(rid="a", start=200, token_ids=[7] * 100, slot_ids=list(range(500, 600)),
                         sample=False, snapshot_id=17)
    hit = PrefillChunk(rid="b", start=300, token_ids=[7] * 100, slot_ids=list(range(600, 700)),
                       sample=False, snapshot_id=19)
    prefixes = {"b": list(range(1, 301))}  # written in earlier steps
    assert prefill_waves([saver, hit], prefixes) == [[saver, hit]]
    assert prefill_waves([saver, hit], prefixes, {"b": 17}) == [[saver], [hit]]
    assert prefill_waves([saver, hit], prefixes, {"b": 5}) == [[saver, hit]]  # saved before
    with pytest.raises(RuntimeError):
        prefill_waves([hit, saver], prefixes, {"b": 17})


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_a_hit_on_a_snapshot_saved_in_the_same_step_is_exact(family):
    """bench/schedule_soak.py's seed 11003: a 609-token prompt hit the snapshot at 300
    that another prompt's chunk saved in the same step, ran in that chunk's forward and
    started from the snapshot's old contents (its second token on differed)."""
    from tests.families import VOCAB, build
    from tests.oracle import mlx_lm_tokens

    model = build(family)
    schedule = draw_schedule(11003, VOCAB)
    engine, outputs = run_schedule(model, schedule)
    assert engine.scheduler.counters.cache_hit_tokens > 0
    for i, (prompt, n) in enumerate(zip(schedule.prompts, schedule.max_tokens)):
        assert outputs[f"r{i}"] == mlx_lm_tokens(model, prompt, n), f"r{i}"


def test_a_model_on_its_own_caches_runs_its_tails_unpadded(tiny_model, oracle):
    """bench/schedule_soak.py's seed 31002 (deepseek_v41, which the worker serves on
    mlx-lm's own caches): a runner told to pad prompts' last chunks (as the schedules'
    engines are) sent a lone tail to the padded shared forward, which such a runner has
    not, and every request of the step failed. Such a runner pads nothing."""
    model, _ = tiny_model
    prompts = [np.random.default_rng(i).integers(5, model.args.vocab_size, size=n).tolist()
               for i, n in enumerate((21, 37))]
    engine = InProcessEngine(model, own_caches=True, chunk_size=16, chunk_align=16,
                             tail_bucket=16, pad_tails=16)
    for i, prompt in enumerate(prompts):
        engine.submit(f"r{i}", prompt, 6, [])
    results = engine.run_until_idle()
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].error is None, results[f"r{i}"].error
        assert results[f"r{i}"].token_ids == oracle(prompt, 6)


def test_same_step_hit_on_a_shorter_prompt_is_exact(tiny_model, oracle):
    """The case the random schedules first caught: r1 shares r0's first token, both are
    admitted in one step, and r1's longer chunk was run first (before r0 wrote it)."""
    model, _ = tiny_model
    rng = np.random.default_rng(3)
    short = rng.integers(5, model.args.vocab_size, size=20).tolist()
    long = short[:1] + rng.integers(5, model.args.vocab_size, size=63).tolist()
    engine = InProcessEngine(model, chunk_size=512, max_prefill_tokens=4096)
    engine.submit("r0", short, 8, [])
    engine.submit("r1", long, 8, [])
    results = engine.run_until_idle()
    assert engine.scheduler.counters.cache_hit_tokens == 1
    assert results["r0"].token_ids == oracle(short, 8)
    assert results["r1"].token_ids == oracle(long, 8)


def test_padding_queries_past_a_window_keep_every_row_finite():
    """A shared prefill forward pads a short chunk's row (prefill padding) with queries
    placed past the forward's last key; in a sliding layer their windows held no key: NaN
    rows, whose K/V went to the pool's dummy slot, which every other row's masked columns
    multiply by zero (NaN). The schedule that found it (seed 1003 of
    bench/schedule_soak.py: llama with sliding layers on the CUDA path's in-place pool,
    stood in for): mlx-lm's tokens."""
    from tests.engine_driver import StandInInPlaceKernels
    from tests.families import VOCAB, build
    from tests.oracle import mlx_lm_tokens

    model = build("llama_sliding")
    schedule = draw_schedule(1003, VOCAB)
    schedule.engine.update(backend=StandInInPlaceKernels(), compile_prefill=False)
    assert schedule.engine["prefill_padding"] > 0
    _, outputs = run_schedule(model, schedule)
    for i, (prompt, n) in enumerate(zip(schedule.prompts, schedule.max_tokens)):
        assert outputs[f"r{i}"] == mlx_lm_tokens(model, prompt, n), f"r{i}"


def test_copies_of_cached_positions_give_their_window_slots_back():
    """A prompt repeating a cached prefix whose window slots were evicted computes that
    prefix again; its copies (Req.dups) kept every window slot, so in a tight window
    space a lone such request could never plan its next chunk: preempted and readmitted
    for ever. The schedule that found it (seed 3003 of bench/schedule_soak.py with
    `--aborts 0.3`: two requests aborted mid-prompt left their prefixes cached): every
    request finishes, with mlx-lm's tokens, and the scheduler ends idle."""
    from tests.families import VOCAB, build
    from tests.oracle import mlx_lm_tokens

    model = build("llama_sliding")
    schedule = draw_schedule(3003, VOCAB)
    aborts = {11: "r2", 18: "r8"}  # engine step -> the request aborted then
    engine = InProcessEngine(model, max_context=2048, **schedule.engine)
    order = sorted(range(len(schedule.prompts)), key=lambda i: schedule.arrivals[i])
    for step in range(max(schedule.arrivals) + max(aborts) + 1):
        for i in [i for i in order if schedule.arrivals[i] == step]:
            engine.submit(f"r{i}", schedule.prompts[i], schedule.max_tokens[i], [])
        if step in aborts:
            engine.abort(aborts[step])
        engine.step()
    results = engine.run_until_idle(max_steps=5_000)
    assert engine.scheduler.counters.aborted == 2
    for i, (prompt, n) in enumerate(zip(schedule.prompts, schedule.max_tokens)):
        if f"r{i}" not in aborts.values():
            assert results[f"r{i}"].token_ids == mlx_lm_tokens(model, prompt, n), f"r{i}"
    assert_idle_invariant(engine.scheduler)

"""Start-up runs through the paths a server meets first (kernel compilation, cuDNN
graphs, decode traces), so that none of it happens during a user's request."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np

from ipc.messages.common import SamplingParams
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from worker_proc.runner import ModelRunner
from worker_proc.step_inputs import COMPILED_MIN_WIDTH, compiled_batch_size, compiled_table_width

# Start-up traces widths up to this (each trace ~0.1 s of an 8B model's host time on the
# H200; 20 buckets x 7 widths ~15 s); a context first passing it traces then, once per
# bucket, a stall of about one trace.
TRACED_AHEAD_MAX_WIDTH = 16384

# Prefill shapes warmed at start-up over every key length up to this many keys: decode
# first's chunks of a long prompt (warm_up's walk_chunk).
PREFILL_WARM_KEYS = 8192


def warm_up(runner: ModelRunner, max_batch: int, prompt_len: int = 16, long_chunk: int = 0,
            walk_chunk: int = 0, walk_offsets: tuple[int, ...] = (), walk_edge: int = 0,
            tail_top: int = 0) -> int:
    """Run throwaway requests through the paths the server will meet first, so kernel
    compilation happens before the first user request, not during it: a lone prompt in
    one fresh chunk (a forward of one row, as a quiet server's first request meets it),
    where the backend pads long prefill chunks to recurring shapes (bucketed_prefill) a
    lone prompt of two `long_chunk` chunks, or one where the context holds no more (the
    graphs a long prompt's first chunks need, built now: up to a second each on the
    H200), and one in `walk_chunk` chunks to PREFILL_WARM_KEYS (decode first's chunks
    of a long prompt, on the bucket's edges: a cuDNN graph for every key length, which
    the first prompt of a burst otherwise built one a step, 50-110 ms each on the H200;
    walked twice where prefill forwards are traced, to trace them), and for each of
    `walk_offsets` and each multiple E of `walk_edge` a prompt hitting a cached prefix
    of E + offset tokens, its one chunk running to the next edge (padded there as a last
    chunk) or to where decode first's chunk from there ends (_hit_chunks): a spread
    prefill's chunks after a prefix hit between its edges, only such shapes, not the
    chunks from the edges to the hits, which no served prompt runs;
    where the runner pads lone chunks to a multiple of a tail size (pad_tails), a lone
    prompt in chunks of each such width up to `tail_top` (MLX's host work for a forward's
    first row count is 6-20 ms on CUDA, docs/benchmarks.md session 55: a burst's tails
    met them one a step otherwise; the worker passes decode first's piece, not the whole
    chunk, whose forward alone may take a fifth of an H100: once reserved, CUDA's pool
    keeps it, worker_proc.memory.DevicePool);
    then prompts in two chunks (the first fresh, the second read back from the
    pool, with one start and with mixed starts; two sets where prefill forwards are
    traced), then decode batch sizes up to
    max_batch: powers of two, or with compiled decode every batch bucket (each is a trace
    of its own). Uses slots from 1 up: the scheduler has handed none out yet, and every
    slot is written before it is read. Returns the number of steps run."""
    steps_per_size = 2
    if runner.compiles_decode:
        # Row counts whose buckets are every bucket (the last may hold fewer rows).
        sizes = sorted({min(compiled_batch_size(n), max_batch) for n in range(1, max_batch + 1)})
    else:
        sizes = [b for b in (1 << i for i in range(16)) if b <= max_batch] or [1]
    # Where prefill forwards are traced, the two-chunk prompts run twice (a first set,
    # released, then the one that decodes): a shape is traced when it recurs, and a
    # trace's first run compiles its fused kernels (mask, RoPE), ~13 s on the H200 the
    # first time a burst met them mid-serving.
    prompt_sets = 2 if runner.prefill_forwards.compiles else 1
    per_request = prompt_len * prompt_sets + len(sizes) * steps_per_size
    # The same ids serve the windowed layers' slot space, where it is smaller.
    space = min(runner.pool.num_slots, runner.pool.window_slots or runner.pool.num_slots)
    n_req = min(sizes[-1], max(1, space // per_request))
    sizes = [b for b in sizes if b <= n_req]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=per_request)
    rids = [f"warmup-{i}" for i in range(n_req)]
    slots = [iter(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(n_req)]
    # The last request's first chunk is shorter, so its second starts elsewhere.
    splits = [prompt_len // 2] * (n_req - 1) + [prompt_len // 4]

    windowed = runner.window_table is not None

    def prompt_chunk(rid: str, start: int, ids: list[int], sample: bool) -> PrefillChunk:
        return PrefillChunk(rid=rid, start=start, token_ids=[1] * len(ids), sample=sample,
                            slot_ids=ids, window_slot_ids=ids if windowed else [])

    def chunk(i: int, start: int, end: int, sample: bool) -> PrefillChunk:
        return prompt_chunk(rids[i], start, [next(slots[i]) for _ in range(end - start)], sample)

    def lone_prompt(rid: str, step: int, ends: list[int]) -> int:
        """A request alone, prefilled in chunks ending at `ends`, then released; it takes
        slots 1.. (released before any other warm-up request writes them). Returns the
        next step's number."""
        for i, (start, end) in enumerate(zip([0] + ends, ends)):
            new = [NewRequest(rid=rid, sampling=greedy)] if i == 0 else []
            runner.run(ForwardBatch(step=step + i, new_requests=new, prefill=[prompt_chunk(
                rid, start, list(range(1 + start, 1 + end)), end == ends[-1])]))
        runner.run(ForwardBatch(step=step + len(ends), released=[rid]))
        return step + len(ends) + 1

    def hit_prompt(rid: str, step: int, hit: int, end: int) -> int:
        """A request whose first `hit` positions are a cached prefix in slots 1..hit,
        its one chunk running to `end`, then released. Returns the next step's number."""
        prefix = list(range(1, 1 + hit))
        new = NewRequest(rid=rid, sampling=greedy, prefix_slot_ids=prefix,
                         prefix_window_slot_ids=prefix if windowed else [])
        runner.run(ForwardBatch(step=step, new_requests=[new], prefill=[prompt_chunk(
            rid, hit, list(range(1 + hit, 1 + end)), True)]))
        runner.run(ForwardBatch(step=step + 1, released=[rid]))
        return step + 2

    backend = runner.pool.backend
    room = min(space, runner.max_context)
    step = lone_prompt("warmup-solo", 0, [prompt_len])
    n_long = min(2, room // max(long_chunk, 1))
    if backend.bucketed_prefill and long_chunk >= backend.prefill_bucket and n_long:
        # The second chunk only where the context holds it.
        step = lone_prompt("warmup-long", step, [long_chunk * (i + 1) for i in range(n_long)])
    if backend.bucketed_prefill and walk_chunk >= backend.prefill_bucket and room >= walk_chunk:
        walk = list(range(walk_chunk, min(room, PREFILL_WARM_KEYS) + 1, walk_chunk))
        # Twice where prefill forwards replay traces: a shape is traced when it recurs (an
        # eager build's ~10x), which the walk's second pass does now, not a burst's prompt.
        passes = 2 if runner.prefill_forwards.compiles else 1
        for _ in range(passes):
            step = lone_prompt("warmup-walk", step, walk)
        if walk and walk_offsets and walk_edge:  # the hits' prefixes: slots the walk wrote
            for _ in range(passes):
                for hit, end in _hit_chunks(walk[-1], walk_chunk, walk_offsets, walk_edge):
                    step = hit_prompt("warmup-hit", step, hit, end)
    tail = runner.tail_multiple
    if tail and tail_top >= tail:
        ends = [e for e in itertools.accumulate(range(tail, tail_top + 1, tail)) if e <= room]
        if ends:
            step = lone_prompt("warmup-tails", step, ends)
    for again in range(prompt_sets):
        if again:  # the first set goes; the second decodes
            runner.run(ForwardBatch(step=step + 1, released=rids))
            step += 2
        runner.run(ForwardBatch(step=step, new_requests=[NewRequest(rid=r, sampling=greedy)
                                                         for r in rids],
                                prefill=[chunk(i, 0, splits[i], False) for i in range(n_req)]))
        step += 1
        runner.run(ForwardBatch(step=step, prefill=[chunk(i, splits[i], prompt_len, True)
                                                    for i in range(n_req)]))
    for size in sizes:
        for _ in range(steps_per_size):
            step += 1
            ids = [next(slots[i]) for i in range(size)]
            runner.run(ForwardBatch(step=step, decode_rids=rids[:size], decode_slots=ids,
                                    decode_window_slots=ids if windowed else []))
    runner.run(ForwardBatch(step=step + 1, released=rids))
    return step + 1


def _hit_chunks(top: int, walk_chunk: int, offsets: tuple[int, ...],
                edge: int) -> list[tuple[int, int]]:
    """The (start, end) of each first chunk a prompt hitting a cached prefix off the
    edges meets within `top` keys: for a hit at E + offset (E a multiple of `edge`), the
    last chunk padded to the next edge, and decode first's unfinished chunk, which ends on
    the last edge it reaches (the same chunk where decode first's chunk is one edge)."""
    chunks = []
    for start in range(0, top - edge + 1, edge):
        for offset in offsets:
            hit = start + offset
            unfinished = min((hit + walk_chunk) // edge * edge, top)
            chunks += [(hit, end) for end in sorted({start + edge, unfinished})]
    return chunks


def trace_decode_shapes(runner: ModelRunner, max_batch: int) -> int:
    """Compiled decode: trace every (batch bucket, slot-table width) the server can meet,
    beyond those warm_up ran; returns how many. Widths double from COMPILED_MIN_WIDTH
    to the runner's longest context, at most TRACED_AHEAD_MAX_WIDTH."""
    buckets = sorted({compiled_batch_size(n) for n in range(1, max_batch + 1)})
    longest = compiled_table_width(min(runner.max_context, TRACED_AHEAD_MAX_WIDTH))
    widths = []
    width = 2 * COMPILED_MIN_WIDTH  # warm_up ran the narrowest
    while width <= longest:
        widths.append(width)
        width *= 2
    for size in buckets:
        for width in widths:
            runner.trace_decode(size, width)
    return len(buckets) * len(widths)


def probe_prefill_bytes(runner: ModelRunner, step: int, lengths: list[int]) -> float:
    """Bytes of device memory a prefill token holds: the peak MLX reports over one step
    prefilling fresh prompts of `lengths` (one forward where the runner shares forwards
    and they fit its cap), above what was held before it, a token. MLX allocates every
    op's output of a forward as the host launches it, so the peak is about the sum of the
    forward's activations. Random token ids (an MoE's tokens then spread over its
    experts, as served). Uses steps `step` and `step + 1` and slots from 1 up (none
    handed out yet; probe_space bounds them)."""
    windowed = runner.window_table is not None
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size or 2
    rids = [f"memory-probe-{i}" for i in range(len(lengths))]
    chunks, first = [], 1
    for rid, n in zip(rids, lengths):
        ids = list(range(first, first + n))
        first += n
        chunks.append(PrefillChunk(rid=rid, start=0, sample=True, slot_ids=ids,
                                   token_ids=rng.integers(0, vocab, n).tolist(),
                                   window_slot_ids=ids if windowed else []))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    runner.run(ForwardBatch(step=step, new_requests=[NewRequest(rid=r, sampling=greedy)
                                                     for r in rids], prefill=chunks))
    mx.synchronize()
    peak = mx.get_peak_memory() - before
    runner.run(ForwardBatch(step=step + 1, released=rids))
    mx.synchronize()
    mx.clear_cache()
    return peak / sum(lengths)


def probe_space(runner: ModelRunner) -> int:
    """Slots a probe may write from slot 1: the pool's, or the windowed layers' own
    space where that is smaller."""
    pool = runner.pool
    return min(pool.num_slots, pool.window_slots or pool.num_slots)

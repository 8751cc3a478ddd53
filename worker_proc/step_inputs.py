"""Building a step's inputs: pure functions over the step plan and plain arrays (which
prefill chunks share a forward and in what order, which decode rows share one, the
buckets compiled decode pads to, a decode batch's previous tokens), tested without a
model. The runner (worker_proc.runner) executes what these describe."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import numpy as np

from ipc.messages.to_worker import PrefillChunk
from worker_proc.staging import Stage, new_arrays

if TYPE_CHECKING:
    from worker_proc.request_state import RequestState

# A compiled decode forward is traced once per (batch size, slot-table width); widths are
# powers of two from this, so a long decode re-traces a handful of times, not every step.
COMPILED_MIN_WIDTH = 128


def compiled_table_width(length: int) -> int:
    """The slot-table width a compiled decode step over contexts of at most `length`
    tokens runs at: a power of two, at least COMPILED_MIN_WIDTH."""
    return max(COMPILED_MIN_WIDTH, 1 << (length - 1).bit_length())


def compiled_batch_size(n: int) -> int:
    """The batch a compiled decode step of n rows runs at: powers of two up to 8, then
    multiples of 8 (at most 20 traces up to 128 rows, at most 7 pad rows a step)."""
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def rows_by_length(lengths: np.ndarray) -> list[np.ndarray]:
    """Indices of decode rows with one context length each (in batch order within a
    group), for a model that cannot batch rows of different lengths."""
    order = np.argsort(lengths, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(lengths[order])) + 1)


def prefill_waves(chunks: list[PrefillChunk], prefixes: dict[str, list[int]],
                  snapshot_hits: dict[str, int] | None = None) -> list[list[PrefillChunk]]:
    """The step's chunks in waves: a chunk whose request's cached prefix (`prefixes`, by
    rid: the slot ids of requests new to the worker this step) holds slots that an
    earlier chunk of the same step writes runs one wave after that chunk, so its reads
    come after those writes; so does a chunk whose request starts from a state snapshot
    (`snapshot_hits`, by rid: a recurrent model's hits) that an earlier chunk of the step
    saves at its end (PrefillChunk.snapshot_id). The scheduler shares a prompt as soon
    as its last chunk is planned, so a request admitted later in the same plan can hit
    it; grouping by length alone would run the longer chunk first and read slots (or a
    snapshot) not written yet. The prefix's slots need not be the snapshot saver's: a
    chunk recomputing cached positions (the scheduler's copies of them) saves the
    snapshot at a position whose K/V an earlier step wrote.
    NOTE: only a request's first chunk on the worker reads another's writes of the same
    step (later chunks of its own come in later steps), and only from an earlier chunk."""
    hits = snapshot_hits or {}
    if not any(c.rid in prefixes or c.rid in hits for c in chunks):
        return [chunks] if chunks else []
    written = np.concatenate([np.asarray(c.slot_ids, dtype=np.int64) for c in chunks])
    writer = np.repeat(np.arange(len(chunks)), [len(c.slot_ids) for c in chunks])
    order = np.argsort(written, kind="stable")
    written, writer = written[order], writer[order]
    savers = {c.snapshot_id: j for j, c in enumerate(chunks) if c.snapshot_id}
    levels: list[int] = []
    for i, chunk in enumerate(chunks):
        level = _wave_of(i, prefixes.get(chunk.rid), written, writer, levels)
        saver = savers.get(hits.get(chunk.rid, 0))
        if saver is not None:
            if saver >= i:
                raise RuntimeError(f"chunk {i} of a step starts from a snapshot a later chunk saves")
            level = max(level, levels[saver] + 1)
        levels.append(level)
    waves: list[list[PrefillChunk]] = [[] for _ in range(max(levels) + 1)]
    for chunk, level in zip(chunks, levels):
        waves[level].append(chunk)
    return waves


def _wave_of(i: int, prefix: list[int] | None, written: np.ndarray, writer: np.ndarray,
             levels: list[int]) -> int:
    """Chunk i's wave: one past the latest wave of the chunks that write its prefix."""
    if not prefix:
        return 0
    slots = np.asarray(prefix, dtype=np.int64)
    at = np.minimum(np.searchsorted(written, slots), len(written) - 1)
    writers = set(writer[at[written[at] == slots]].tolist())
    if any(w >= i for w in writers):
        raise RuntimeError(f"chunk {i} of a step reads slots a later chunk writes")
    return 1 + max((levels[w] for w in writers), default=-1)


def group_by_length(sizes: list[int], max_padding: float = 0.25,
                    max_tokens: int | Callable[[int], int] | None = None) -> list[list[int]]:
    """Indices of chunks to run together, longest first: a group grows while its padded
    size (members x longest) stays within (1 + max_padding) of its real tokens, and
    within max_tokens (a number, or one for each longest chunk's size; a longer chunk
    is a group of its own)."""
    cap = max_tokens if callable(max_tokens) else lambda _: max_tokens
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        padded = (len(groups[-1]) + 1) * sizes[groups[-1][0]] if groups else 0
        if (groups and padded <= (1 + max_padding) * (real + sizes[i])
                and ((most := cap(sizes[groups[-1][0]])) is None or padded <= most)):
            groups[-1].append(i)
            real += sizes[i]
        else:
            groups.append([i])
            real = sizes[i]
    return groups


def gather_last_tokens(states: list[RequestState], stage: Stage = new_arrays) -> mx.array:
    """Each state's last sampled token, [B] int32: the previous step's tokens array itself
    when the batch is that step's rows in order (the steady case), else one gather per
    distinct source step. stage: makes the gathers' index arrays from numpy ones, all in
    one call (the runner's HostStaging: a batch that changed, a request joining or
    leaving, then allocates nothing; see worker_proc.staging)."""
    first = states[0].last_tokens
    if (first is not None and first.shape[0] == len(states)
            and all(s.last_tokens is first and s.last_row == i for i, s in enumerate(states))):
        return first  # the steady case, without the bookkeeping below
    sources: dict[int, tuple[mx.array, list[int], list[int]]] = {}
    for i, s in enumerate(states):
        assert s.last_tokens is not None, f"{s.rid} has no sampled token to decode from"
        _, rows, where = sources.setdefault(id(s.last_tokens), (s.last_tokens, [], []))
        rows.append(s.last_row)
        where.append(i)
    parts = [np.array(rows, dtype=np.int32) for _, rows, _ in sources.values()]
    if len(sources) > 1:  # the batch's order of the concatenated gathers
        order = [i for _, _, where in sources.values() for i in where]
        parts.append(np.argsort(np.array(order)).astype(np.int32))
    made = stage(*parts)
    gathered = [tokens[index] for (tokens, _, _), index in zip(sources.values(), made)]
    return gathered[0] if len(sources) == 1 else mx.concatenate(gathered)[made[-1]]

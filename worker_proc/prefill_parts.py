"""Prefill forwards spread over several steps, a share of the model's blocks in each.

Launching a forward costs the host nearly the same whatever its length: MLX encodes every
op of every block (~0.2-0.3 ms a llama block on the H100; docs/benchmarks.md, session 36).
A step that carries a prompt's chunk beside decode rows therefore stretches every decoding
stream's gap by a whole forward's launch, however few tokens the chunk has. Spread over k
steps, the chunk's forward runs blocks [L*j/k, L*(j+1)/k) in step j and hands its hidden
state (a lazy array) to the next: each step pays about 1/k of the launch and of the compute.

Exact: each block runs the ops it runs in one forward, on the same input, and writes its
K/V to the pool before any later part (or a later chunk's same block) reads them. The
model's own backbone call is what runs, with the blocks outside the part stood in for (the
ones before hand on the carried hidden state; the first one after stops the call), so its
embedding, masks and final norm are the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


def part_bounds(blocks: int, parts: int, part: int) -> int:
    """The first block of `part` (of `parts`; `parts` itself: the end of the last)."""
    return round(blocks * part / parts)


def spread_refusal(split: Any, cache_count: int, has_states: bool) -> str | None:
    """Why this model's prefill forwards cannot be spread over steps (None: they can).
    split: runner.ModelSplit or None (its models' backbones are read: a loop handing
    each block's output to the next, which is what a part's stand-ins keep);
    cache_count: the model's cache list's length. Any attention kind takes parts (each
    layer reads and writes its own K/V and masks from the forward's layout alone)."""
    if split is None:
        return "its call is not a backbone and an output head (runner.split_model)"
    blocks = getattr(split.backbone, "layers", None)
    if not isinstance(blocks, list) or len(blocks) != cache_count or not blocks:
        return "its backbone's blocks are not one list beside its caches"
    if has_states:
        return "it has recurrent layers (their state would need snapshots mid-forward)"
    return None


def most_parts(split: Any, refusal: str | None) -> int:
    """The most steps a model's prefill forwards may be spread over: a block a part; 1
    where spread_refusal gave a reason."""
    return 1 if refusal is not None else len(split.backbone.layers)


class _Stop(Exception):
    """Ends a backbone's call at the first block after a part: carries that block's input."""

    def __init__(self, hidden: mx.array) -> None:
        super().__init__("part done")
        self.hidden = hidden


class _StandIn:
    """A block outside the part: its attributes are the block's (model code may read them,
    e.g. a layer's kind), its call is not."""

    def __init__(self, block: Any) -> None:
        self._block = block

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block, name)


class _Carried(_StandIn):
    """A block before the part: hands on the hidden state the previous part ended with
    (the model's embedding above it is then left out of the graph)."""

    def __init__(self, block: Any, hidden: mx.array) -> None:
        super().__init__(block)
        self._hidden = hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden


class _StopHere(_StandIn):
    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        raise _Stop(x)


def run_blocks(backbone: Any, tokens: mx.array, caches: list, hidden: mx.array | None,
               start: int, stop: int) -> mx.array:
    """The backbone's call over blocks [start, stop) only, from `hidden` (the residual
    stream after block start - 1; None when start is 0): the residual stream after block
    stop - 1, or, when stop is the last block's end, the backbone's output (its final
    norm applied)."""
    blocks = backbone.layers
    if start > 0 and hidden is None:
        raise RuntimeError(f"a forward part from block {start} without the hidden state before it")
    standing = [(_Carried(b, hidden) if i < start else b if i < stop else _StopHere(b))
                for i, b in enumerate(blocks)]
    backbone.layers = standing
    try:
        return backbone(tokens, cache=caches)
    except _Stop as stopped:
        return stopped.hidden
    finally:
        backbone.layers = blocks


@dataclass
class PartedForward:
    """One prefill forward (chunks of one or more requests) being run part by part: its
    inputs, its caches (valid across steps: they read the forward's layout alone) and the
    hidden state the last part ended with."""

    chunks: list  # PrefillChunk
    states: list  # RequestState, the chunks' own
    tokens: mx.array
    caches: list
    last: mx.array  # each row's last real column
    hidden: mx.array | None = None


@dataclass
class SpreadWave:
    """A step's prefill forwards spread over `parts` steps; `done` of them have run."""

    parts: int
    forwards: list[PartedForward] = field(default_factory=list)
    # Chunks run whole at its start (scored over every position): their logits and
    # requests, sampled with the last part.
    held: list[tuple[mx.array, Any]] = field(default_factory=list)
    done: int = 0

    def rids(self) -> set[str]:
        """The requests of its chunks."""
        return ({s.rid for f in self.forwards for s in f.states}
                | {state.rid for _, state in self.held})

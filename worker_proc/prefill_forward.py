"""Prefill forwards to each row's last logits: built eagerly, or replayed from a trace.

Most of a prefill forward's host time is mlx-lm's Python model code building the graph,
tens of nodes a layer whatever the forward's length; `mx.compile` replays a traced
forward's graph from C++ instead, a few times faster (docs/benchmarks.md, 2026-12-02,
"host build of long-prompt prefill steps"). A trace serves only the shapes it was made
for, and nothing is padded to make shapes meet: padding a forward's keys changes float32
reductions (softmax and the value matmul over a longer row), so the CPU's tokens could
leave mlx-lm's. So a shape's first forward is built eagerly and remembered; when it
recurs (a long prompt's full chunks, prompts of one length) its forwards are traced
once, then replayed.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from worker_proc.attention import ForwardLayout, build_layer_caches
from worker_proc.kv_pool import KVPool
from worker_proc.layer_kinds import LayerKind

logger = logging.getLogger(__name__)

# Most forward shapes traced (each trace holds its graph's tape, thousands of nodes for
# 32 layers, and costs ~10x an eager build to make); later new shapes stay eager.
MAX_TRACED_SHAPES = 64
# Shapes met once that are remembered, waiting to recur; forgotten all at once past this.
MAX_REMEMBERED_SHAPES = 4096

ShapeKey = tuple


class PrefillForwards:
    """A model's prefill forwards to the logits at one position a row.

    split: the model's backbone and output head where its call is just those
    (runner.split_model), the head then run over those positions alone; None: the model's
    own call, every position's logits, indexed. compiles: replay recurring shapes from
    traces; taken where every attention layer is full attention through the attention
    hook (windowed masks are built from host positions), and the model has a head or
    recurrent layers (whose eager build is the longest: ~40 graph nodes a layer). Their
    state arrays, rows and lengths are among a trace's inputs. A model whose code cannot
    be traced builds eagerly from its first failed trace on."""

    def __init__(self, model: Any, split: Any | None, pool: KVPool, compiles: bool) -> None:
        self.model = model
        self.split = split  # runner.ModelSplit
        self.pool = pool
        self.compiles = compiles and traceable(pool) and (split is not None or pool.has_states)
        self._compiled = mx.compile(self._traced) if self.compiles else None
        self._met: set[ShapeKey] = set()
        self._traced_keys: set[ShapeKey] = set()
        self.traces = 0  # how many times mx.compile traced a forward
        self.replays = 0  # forwards that ran through a trace (its first included)

    def last_logits(self, tokens: mx.array, layout: ForwardLayout, last: mx.array | None,
                    state_rows: mx.array, fresh_state: bool,
                    state_lengths: mx.array | None = None) -> mx.array:
        """The logits at each row's last real position, [B, V]: at column `last[b]` of row
        b, or at the last column when `last` is None. state_rows, fresh_state,
        state_lengths: as build_layer_caches takes them (an eager forward over recurrent
        layers)."""
        if self._replays(_key(tokens, layout, last, state_rows, fresh_state, state_lengths)):
            traces = self.traces
            try:
                return self._replay(tokens, layout, last, state_rows, fresh_state, state_lengths)
            except Exception:  # noqa: BLE001 - the model's code under mx.compile, any failure
                if self.traces == traces:  # not the trace's: a replay failing is a real error
                    raise
                logger.exception("prefill forwards of this model cannot be traced; built "
                                 "eagerly from now on")
                self.compiles = False
        caches = build_layer_caches(self.pool, layout, state_rows, fresh_state, state_lengths)
        if self.split is None:
            return rows_at(self.model(tokens, cache=caches), last)
        return self.split.head(rows_at(self.split.backbone(tokens, cache=caches), last))

    def _replays(self, key: ShapeKey) -> bool:
        """Whether a forward of this shape goes through a trace: it has one, or it was met
        before and there is room for one. A shape met for the first time is remembered."""
        if not self.compiles:
            return False
        if key in self._traced_keys:
            return True
        if key in self._met and len(self._traced_keys) < MAX_TRACED_SHAPES:
            self._traced_keys.add(key)
            return True
        if len(self._met) >= MAX_REMEMBERED_SHAPES:
            self._met.clear()
        self._met.add(key)
        return False

    def _replay(self, tokens: mx.array, layout: ForwardLayout, last: mx.array | None,
                state_rows: mx.array, fresh_state: bool,
                state_lengths: mx.array | None) -> mx.array:
        """The forward through its trace: every array the graph depends on is an input;
        the layout's plain values (its RoPE offset when one for all rows, the "causal"
        mask, whether it is fresh, whether the states start fresh) are part of the
        trace's key, as mx.compile keys non-array arguments."""
        pool = self.pool
        marks = pool.marks_to_follow() if pool.in_place else []
        logits, *rest = self._compiled(tokens, layout.write_slots, layout.read_slots,
                                       layout.offset, layout.mask, layout.fresh, last,
                                       state_rows, fresh_state, state_lengths,
                                       *pool.layers, *pool.flat_states(), *marks)
        self.replays += 1
        pool.adopt_traced(rest)
        return logits

    def _traced(self, tokens: mx.array, write_slots: mx.array, read_slots: mx.array,
                offset: int | mx.array, mask: Any, fresh: bool, last: mx.array | None,
                state_rows: mx.array, fresh_state: bool, state_lengths: mx.array | None,
                *arrays: mx.array) -> tuple[mx.array, ...]:
        """What _replay traces: the forward over a view of the pool made of the arrays it
        is given (the K/V layers, the recurrent state arrays, then in place the marks
        their writes follow); returns the logits, then KVPool.traced_writes."""
        self.traces += 1
        n, m = len(self.pool.layers), len(self.pool.flat_states())
        marks = arrays[n + m:] if self.pool.in_place else None
        pool = self.pool.with_layers(arrays[:n], marks[:n] if marks else None,
                                     states=arrays[n:n + m],
                                     state_marks=marks[n:] if marks else None)
        layout = ForwardLayout(write_slots=write_slots, read_slots=read_slots, offset=offset,
                               mask=mask, fresh=fresh)
        caches = build_layer_caches(pool, layout, state_rows, fresh_state, state_lengths)
        if self.split is None:
            logits = rows_at(self.model(tokens, cache=caches), last)
        else:
            logits = self.split.head(rows_at(self.split.backbone(tokens, cache=caches), last))
        return (logits, *pool.traced_writes())


def traceable(pool: KVPool) -> bool:
    """Whether a prefill forward over this pool's layers can be traced: every attention
    layer full attention through the attention hook (recurrent layers may be beside)."""
    return all(s.kind == LayerKind() for s in pool.specs)


def _key(tokens: mx.array, layout: ForwardLayout, last: mx.array | None,
         state_rows: mx.array, fresh_state: bool, state_lengths: mx.array | None) -> ShapeKey:
    """What tells one traced forward from another: the arrays' shapes and the layout's
    plain values (mx.compile's own key, for these inputs)."""
    mask = layout.mask if layout.mask is None or isinstance(layout.mask, str) else layout.mask.shape
    offset = layout.offset if isinstance(layout.offset, int) else layout.offset.shape
    return (tokens.shape, layout.read_slots.shape, layout.write_slots.shape, offset, mask,
            layout.fresh, last is None, state_rows.shape, fresh_state, state_lengths is None)


def rows_at(hidden: mx.array, last: mx.array | None) -> mx.array:
    """Each row's hidden state (or logits) at its last real position, [B, D]."""
    if last is None:
        return hidden[:, -1]
    return hidden[mx.arange(hidden.shape[0]), last]



"""Decode forwards replayed from `mx.compile` traces (the CUDA kernel path's default).

A decode step's graph is the same every step but for its shapes, so it is traced once per
(batch bucket, slot-table width) and replayed from C++: a fraction of an eager build's
host time. Every input is an array (a Python value would be frozen into the trace); the
batch is padded to a bucket and the table's width bucketed (worker_proc.step_inputs), so
a few traces serve every step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from worker_proc.attention import ForwardLayout, build_layer_caches, check_written
from worker_proc.kv_pool import KVPool
from worker_proc.staging import HostStaging
from worker_proc.step_inputs import compiled_batch_size, compiled_table_width


class CompiledDecode:
    """The model's decode forward through its traces, over `pool`. windowed: windowed
    layers have a slot space of their own (their slots are inputs too). staging: the ring
    the steps' inputs are written into (one use a step)."""

    def __init__(self, model: Any, pool: KVPool, windowed: bool, staging: HostStaging) -> None:
        self.model = model
        self.pool = pool
        self.windowed = windowed
        self._staging = staging
        self._compiled = mx.compile(self._forward)
        self.traces = 0  # how many times mx.compile traced the forward

    def run(self, tokens: mx.array, rows: np.ndarray, lengths: np.ndarray, table: np.ndarray,
            window_table: np.ndarray | None, max_context: int) -> mx.array:
        """The logits of the rows `rows` of the slot tables (lengths count the new token),
        fed `tokens`. A pad row reads and writes only slot 0 (the pool's scratch row) and
        its logits are dropped."""
        n = len(rows)
        size = compiled_batch_size(n)
        width = compiled_table_width(int(lengths.max()))
        padded = np.ones(size, dtype=np.int32)
        padded[:n] = lengths
        last = (np.arange(size), padded - 1)

        def bucketed(source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """The rows' write slots and slot table from `source`, padded to the bucket."""
            bucket = np.zeros((size, width), dtype=np.int32)
            bucket[:n, :min(width, max_context)] = source[rows, :width]
            return bucket[last], bucket

        # A pad row's recurrent states are the scratch row's (0).
        state_rows = np.zeros(size, dtype=np.int32)
        state_rows[:n] = rows + 1
        parts = [padded - 1, padded, state_rows, *bucketed(table)]
        if window_table is not None:
            parts.extend(bucketed(window_table))
        offsets, lengths_mx, state_rows_mx, write, table_mx, *windows = self._staging.stage(*parts)
        # Unread where windowed layers share the full slots.
        window_write, window_slots = windows or (write, table_mx)
        if size > n:
            tokens = mx.concatenate([tokens, mx.zeros((size - n,), dtype=tokens.dtype)])
        logits, *rest = self._compiled(
            tokens, offsets, write, table_mx, lengths_mx, window_write, window_slots,
            state_rows_mx, *self.pool.layers, *self.pool.flat_states())
        self.pool.adopt_traced(rest)
        return logits[:n] if size > n else logits

    def trace(self, size: int, width: int) -> None:
        """Trace the forward for `size` rows (a batch bucket) over a `width`-column slot
        table, running nothing: a trace made at start-up is not made mid-serving, as a
        step (about a forward's host time, tens of ms on an 8B model)."""
        rows = mx.zeros((size,), dtype=mx.int32)
        table = mx.zeros((size, width), dtype=mx.int32)
        self._compiled(rows, rows, rows, table, rows + 1, rows, table, rows,
                       *self.pool.layers, *self.pool.flat_states())  # outputs dropped

    def _forward(self, tokens: mx.array, offsets: mx.array, write_slots: mx.array,
                 table: mx.array, lengths: mx.array, window_write: mx.array,
                 window_table: mx.array, state_rows: mx.array,
                 *arrays: mx.array) -> tuple[mx.array, ...]:
        """What run traces: the model over the pool arrays it is given (the K/V layers,
        then the recurrent states; through a view of the pool, so the trace leaves the
        runner's alone); returns the logits, then the writes' marks (in place) or the
        arrays after the writes (scatter): KVPool.traced_writes. The window slots are read
        only where windowed layers have their own space, state_rows only by recurrent
        layers. Steps follow each other's in-place writes by launch order (one stream), as
        the K/V layers' do."""
        self.traces += 1
        n = len(self.pool.layers)
        pool = self.pool.with_layers(arrays[:n], states=arrays[n:])
        layout = ForwardLayout(write_slots=write_slots, read_slots=table, offset=offsets,
                               mask=None, lengths=lengths,
                               window_write_slots=window_write if self.windowed else None,
                               window_read_slots=window_table if self.windowed else None)
        caches = build_layer_caches(pool, layout, state_rows)
        out = self.model(tokens[:, None], cache=caches)
        check_written(caches)
        return (out[:, -1, :], *pool.traced_writes())

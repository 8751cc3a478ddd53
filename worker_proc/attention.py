"""Adapters that let mlx-lm's model code attend over the KV pool.

mlx-lm models call three things on a layer's cache during a forward pass: `offset` (the
RoPE position of the first new token), `make_mask(...)` (on the first layer, once per
forward) and `update_and_fetch(keys, values)`. `PooledKVCache` answers those from a
`ForwardLayout` that describes the whole batch, so the model code runs unchanged.

Other layer kinds (sliding window, linear attention / SSM state) get their own adapter
class here and their own storage beside the pool; `build_layer_caches` is the one place
that maps a model's layers to adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ipc.process import CannotServe
from worker_proc.kv_pool import KVPool
from worker_proc.paged_attention import (RopeSpec, kernel_available, paged_decode_attention,
                                         paged_decode_qkv_attention,
                                         paged_decode_write_attention,
                                         reference_decode_attention, unfused_prefill_attention,
                                         unfused_prefill_fits)

# Decode on the CUDA kernel path with an in-place pool: the attention kernel stores the
# step's K/V itself (paged_decode_write_attention), a launch less per layer than a
# separate write. False: the separate write (for A/B runs, bench/step_breakdown.py).
WRITE_IN_ATTENTION = True


class UnsupportedModelError(CannotServe, RuntimeError):
    """The model has a layer kind the engine cannot serve yet."""


# What mlx-lm's cache classes hold, in a refusal's words.
_CACHE_KINDS = {"RotatingKVCache": "sliding window", "ChunkedKVCache": "chunked local attention",
                "ArraysCache": "recurrent state", "MambaCache": "recurrent state",
                "CacheList": "several caches in one layer"}


@dataclass(frozen=True)
class ForwardLayout:
    """Where one forward pass writes and reads K/V.

    write_slots: [B * S] slot of every new token, row-major.
    read_slots:  [B, L] slots of each row's whole context (new tokens included),
                 right-padded with slot 0.
    offset:      position of each row's first new token (int when B == 1).
    mask:        None or "causal" (dense path).
    lengths:     [B] context length per row, for decode: set, attention reads the pool
                 through `paged_attention` instead of a gathered dense block.
    dense:       for decode on the plain-MLX fallback: the batch's contexts kept across
                 steps (see DenseDecodeContext); None: the CUDA kernel reads the pool.
    fresh:       every row starts at position 0, so its context is exactly this forward's
                 tokens: attention takes their K/V as computed instead of gathering them
                 back from the pool (the same values).
    """

    write_slots: mx.array
    read_slots: mx.array
    offset: int | mx.array
    mask: Any
    lengths: mx.array | None = None
    dense: "DenseDecodeContext | None" = None
    fresh: bool = False

    @classmethod
    def single(cls, context_slots: np.ndarray, start: int, n_new: int) -> "ForwardLayout":
        """One request: n_new tokens at positions start.., context = its first start + n_new slots."""
        end = start + n_new
        return cls(
            write_slots=mx.array(context_slots[start:end]),
            read_slots=mx.array(context_slots[None, :end]),
            offset=start,
            # Same mask mlx-lm's own KVCache gives, so the fused kernel path is the same.
            mask="causal" if n_new > 1 else None,
            fresh=start == 0,
        )

    @classmethod
    def prefill(cls, table_rows: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> "ForwardLayout":
        """Chunks of several requests in one forward, right-padded to the longest: row b
        computes positions starts[b] .. starts[b] + sizes[b] - 1. Padded positions write
        to slot 0 and no real query attends to them (causal from each row's start)."""
        width = int(sizes.max())
        ends = starts + sizes
        cols = np.arange(int(ends.max()))
        read = np.where(cols[None, :] < ends[:, None], table_rows[:, :len(cols)], 0)
        pos = starts[:, None] + np.arange(width)[None, :]
        real = np.arange(width)[None, :] < sizes[:, None]
        write = np.where(real, np.take_along_axis(read, np.minimum(pos, len(cols) - 1), 1), 0)
        if (starts == starts[0]).all():
            # One start for every row (fresh prompts, or one shared cached prefix): the
            # causal mask aligned to the keys' end is then exact for every real query,
            # whatever each row's length, and keeps attention on the fused path.
            offset: int | mx.array = int(starts[0])
            mask: Any = "causal"
        else:
            offset = mx.array(starts.astype(np.int32))
            mask = mx.array((cols[None, None, :] <= pos[:, :, None])[:, None])  # [B, 1, width, L]
        return cls(
            write_slots=mx.array(write.reshape(-1).astype(np.int32)),
            read_slots=mx.array(read.astype(np.int32)),
            offset=offset,
            mask=mask,
            # Padded positions sit after each row's real ones, which the causal mask
            # hides from every real query, whether their K/V come from here or slot 0.
            fresh=bool((starts == 0).all()),
        )

    @classmethod
    def decode(cls, table_rows: np.ndarray, lengths: np.ndarray,
               dense: "DenseDecodeContext | None" = None) -> "ForwardLayout":
        """One new token per row; lengths count the new token. table_rows: [B, >= max(lengths)].
        dense: the fallback's kept context, already planned for this step."""
        max_len = int(lengths.max())
        read = table_rows[:, :max_len]
        write = read[np.arange(len(lengths)), lengths - 1]
        return cls(
            write_slots=mx.array(write),
            read_slots=mx.array(read),
            offset=mx.array(lengths - 1) if len(lengths) > 1 else int(lengths[0] - 1),
            mask=None,
            lengths=mx.array(lengths.astype(np.int32)),
            dense=dense,
        )


class PooledKVCache:
    """One full-attention layer's view of the pool for one forward pass."""

    def __init__(self, pool: KVPool, layer: int, layout: ForwardLayout) -> None:
        self._pool = pool
        self._layer = layer
        self._layout = layout
        # This step's K/V, for the attention kernel to store (see WRITE_IN_ATTENTION).
        self._unwritten: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> int | mx.array:
        return self._layout.offset

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if window_size is not None:
            raise UnsupportedModelError("sliding-window attention is not supported yet")
        mask = self._layout.mask
        if return_array and isinstance(mask, str):
            return _causal_array(n, self._layout.read_slots.shape[1])
        return mask

    @property
    def paged(self) -> bool:
        return self._layout.lengths is not None

    @property
    def written(self) -> bool:
        """Whether this forward's K/V reached the pool (or a kernel that stores them)."""
        return self._unwritten is None

    @property
    def writes_in_attention(self) -> bool:
        """Whether this forward's K/V go to the pool through the attention kernel (paged
        decode on an in-place pool): then attend_qkv may take the place of RoPE,
        update_and_fetch and paged_attention."""
        return (self.paged and self._layout.dense is None and self._pool.in_place
                and WRITE_IN_ATTENTION)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.writes_in_attention:
            self._unwritten = (keys, values)  # paged_attention stores them
            return self._pool.keys(self._layer), self._pool.values(self._layer)
        self._pool.write(self._layer, self._layout.write_slots, keys, values)
        if self._layout.dense is not None:
            self._layout.dense.update(self._layer, self._pool, self._layout.read_slots, keys, values)
        if self.paged:  # attention reads the pool itself (see paged_attention)
            return self._pool.keys(self._layer), self._pool.values(self._layer)
        if self._layout.fresh:
            return keys, values
        return self._pool.read(self._layer, self._layout.read_slots)

    def attend_qkv(self, qkv: mx.array, n_q: int, scale: float, rope: RopeSpec) -> mx.array:
        """A decode layer's attention from its fused q/k/v projection's output [B, 1,
        (n_q + 2 Hkv) * D], unrotated: one kernel rotates q and k, stores the new K/V and
        attends (paged_decode_qkv_attention); [B, 1, n_q * D]. Only where
        writes_in_attention."""
        if not self.writes_in_attention:
            raise RuntimeError("attend_qkv needs the attention kernel to write the pool")
        layout, pool, layer = self._layout, self._pool, self._layer
        out, mark = paged_decode_qkv_attention(
            qkv, n_q, rope, layout.write_slots, pool.layers[layer], layout.read_slots,
            layout.lengths, scale, pool.mark(layer))
        pool.record_write(layer, mark)
        return out

    def paged_attention(self, queries: mx.array, scale: float) -> mx.array:
        layout, layer = self._layout, self._layer
        dense = layout.dense
        if dense is not None and dense.active:
            return dense.attention(layer, queries, scale)
        pool = self._pool
        if self._unwritten is not None:
            keys, values = self._unwritten
            out, mark = paged_decode_write_attention(
                queries, keys, values, layout.write_slots, pool.layers[layer], layout.read_slots,
                layout.lengths, scale, pool.mark(layer))
            pool.record_write(layer, mark)
            self._unwritten = None
            return out
        # No kept context: the runner chose the kernel (paged_kernel_fits); an inactive
        # one: the batch is over its budget, so gather from the pool for this layer.
        attend = paged_decode_attention if dense is None else reference_decode_attention
        return attend(queries, pool.layers[layer], layout.read_slots, layout.lengths, scale,
                      pool.mark(layer))


class DenseDecodeContext:
    """Decode attention for the plain-MLX fallback (CPU, Metal): each layer's K/V of the
    decode batch as a dense [B, H, capacity, D] block kept from step to step.

    Gathering every row's whole context out of the pool each layer and step is most of a
    CPU decode step (a gather, then a transposed copy into attention's layout). While the
    batch stays the same requests, each one a token longer than last step, the block only
    takes each row's new token, and a row outgrowing the capacity extends it with zeros (a
    copy, no gather); any other change (a request joins, leaves or is preempted) rebuilds
    it from the pool with one gather. Rows are right-aligned (left-padded, as mlx-lm's
    batch cache keeps them): every row's newest token sits in the same column, so a step's
    new tokens go in with one slice update per layer, not a scatter of one entry per row
    (on the CPU a 16-row scatter took ~0.1 ms, four a layer with the pool's). Positions
    outside a row's context are masked, so the math is the gather path's: the same values
    under a boolean mask. The pool stays the source of truth; the block is a cache of it,
    within a memory budget (the worker sizes the pool to leave room for it); a batch over
    budget takes the per-layer gather.
    """

    # Capacity is a multiple of this. Smaller: less masked padding in every step's
    # attention, more extensions (CPU, demo-60m, batch 16, context 200: 46.0 ms a step
    # at 16 against 49.7 ms at 64).
    GROWTH = 16

    def __init__(self, num_layers: int, budget_bytes: int, bytes_per_token: int) -> None:
        """budget_bytes: the most the blocks may hold (all layers, K and V); a batch
        needing more is served by gathering from the pool layer by layer, as transient
        arrays (bytes_per_token: one token's K and V over all layers)."""
        self._budget = budget_bytes
        self._bytes_per_token = bytes_per_token
        self.active = False
        self._keys: list[mx.array | None] = [None] * num_layers
        self._values: list[mx.array | None] = [None] * num_layers
        self._rows: tuple[int, ...] = ()
        self._lengths = np.zeros(0, dtype=np.int64)
        self._capacity = 0
        self._end = 0  # columns in use: every row's newest token is at _end - 1
        self._rebuild = True
        self._extend_by = 0  # zero columns to append this step (the rows outgrew the blocks)
        self._columns = mx.zeros((0,), dtype=mx.int32)  # a rebuild's gather: [B, capacity]
        self._gather: mx.array | None = None  # this step's rebuild slots, made once
        self._mask: mx.array | None = None

    def plan(self, rows: tuple[int, ...], lengths: np.ndarray) -> None:
        """Before a decode step: rows identify the batch's requests (the runner's table
        rows, in batch order), lengths their context lengths with the new token."""
        grown = self.active and rows == self._rows and np.array_equal(lengths, self._lengths + 1)
        self._rebuild = not grown
        end = self._end + 1 if grown else int(lengths.max())
        needed = -(-end // self.GROWTH) * self.GROWTH
        # Grown by one column, the blocks fit or are outgrown by one GROWTH.
        self._extend_by = max(0, needed - self._capacity) if grown else 0
        if self._rebuild or self._extend_by:
            self._capacity = needed
            self.active = len(rows) * needed * self._bytes_per_token <= self._budget
            if not self.active:  # free the old blocks now, not at the next rebuild
                self._drop_blocks()
        self._rows, self._lengths, self._end = rows, lengths.copy(), end
        columns = np.arange(self._capacity)[None, :]
        first = (end - lengths)[:, None]  # each row's first column
        # Attention reads columns [0, end) only; rows that all span them need no mask.
        self._mask = (None if (first == 0).all() else
                      mx.array((columns[:, :end] >= first)[:, None, None, :]))
        if self._rebuild:
            # Column c of row i holds its context position c - first[i]; outside the
            # context, position 0's slot (masked anyway, and always a valid index).
            self._columns = mx.array(np.clip(columns - first, 0, None).astype(np.int32))
        self._gather = None

    def reset(self) -> None:
        """Drop the blocks (nothing left to decode): their memory goes back at once."""
        self.active = False
        self._rows = ()
        self._drop_blocks()

    def _drop_blocks(self) -> None:
        self._keys = [None] * len(self._keys)
        self._values = [None] * len(self._values)

    def update(self, layer: int, pool: KVPool, read_slots: mx.array, keys: mx.array,
               values: mx.array) -> None:
        """This step's new K/V ([B, H, 1, D]) into the layer's block; the pool already
        holds them, so a rebuild reads them from there."""
        if not self.active:
            return
        if self._rebuild:
            if self._gather is None:  # [B, capacity] slots, right-aligned; once a step
                width = read_slots.shape[1]
                self._gather = mx.take_along_axis(
                    read_slots, mx.minimum(self._columns, width - 1), axis=1)
            self._keys[layer], self._values[layer] = pool.read(layer, self._gather)
            return
        if self._extend_by:
            self._keys[layer] = _extended(self._keys[layer], self._extend_by)
            self._values[layer] = _extended(self._values[layer], self._extend_by)
        column = self._end - 1
        self._keys[layer][:, :, column:column + 1] = keys
        self._values[layer][:, :, column:column + 1] = values

    def attention(self, layer: int, queries: mx.array, scale: float) -> mx.array:
        keys, values = self._keys[layer], self._values[layer]
        assert keys is not None and values is not None
        if self._end < self._capacity:  # the columns in use (a view), not the spare ones
            keys, values = keys[:, :, :self._end], values[:, :, :self._end]
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=self._mask)


def _extended(block: mx.array | None, columns: int) -> mx.array:
    """block [B, H, C, D] with `columns` zero positions appended along C."""
    assert block is not None
    b, h, _, d = block.shape
    return mx.concatenate([block, mx.zeros((b, h, columns, d), dtype=block.dtype)], axis=2)


def _causal_array(n_new: int, n_total: int) -> mx.array:
    q = mx.arange(n_total - n_new, n_total)[:, None]
    return q >= mx.arange(n_total)[None]


def check_layer_kinds(model: Any) -> None:
    """Refuse models whose layers the pool cannot hold yet, naming every such kind and
    its layers ("layers 0-4, 6-10: RotatingKVCache (sliding window); ...")."""
    layers: dict[str, list[int]] = {}
    for i, cache in enumerate(make_prompt_cache(model)):
        if type(cache) is not KVCache:
            layers.setdefault(_cache_kind(cache), []).append(i)
    if layers:
        found = "; ".join(f"{_layer_ranges(ids)}: {kind}" for kind, ids in layers.items())
        raise UnsupportedModelError(
            f"{found}; only full-attention layers (mlx-lm's KVCache) are supported yet")


def _cache_kind(cache: Any) -> str:
    name = type(cache).__name__
    parts = getattr(cache, "caches", None)  # a CacheList names its members
    shown = f"{name}({', '.join(type(c).__name__ for c in parts)})" if parts else name
    note = _CACHE_KINDS.get(name)
    return f"{shown} ({note})" if note else shown


def _layer_ranges(ids: list[int]) -> str:
    """'layer 5', 'layers 0-4, 6-10' for ascending layer indices."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"layer{'s' if len(ids) > 1 else ''} {text}"


def build_layer_caches(pool: KVPool, layout: ForwardLayout) -> list[PooledKVCache]:
    return [PooledKVCache(pool, i, layout) for i in range(len(pool.specs))]


def check_written(caches: list[PooledKVCache]) -> None:
    """After a forward: every layer stored its K/V. A decode forward leaves the store to
    the attention call; a model that attends some other way than through mlx-lm's
    scaled_dot_product_attention would lose them, so it is refused here."""
    for i, cache in enumerate(caches):
        if not cache.written:
            raise UnsupportedModelError(
                f"layer {i} attends without mlx-lm's scaled_dot_product_attention, which "
                f"stores decode K/V on the CUDA kernel path: this model needs support added")


def install_attention_hook() -> None:
    """Route mlx-lm's attention calls over the pool: decode layers to `paged_attention`,
    prefill on the CUDA backend to `unfused_prefill_attention`.

    mlx-lm's model modules call `scaled_dot_product_attention` (from models/base.py) with
    the layer's cache; for a `PooledKVCache` in paged mode the keys/values it was handed
    are the whole pool, and only the cache knows each row's slots and length. Every other
    call goes to mlx-lm's own function unchanged. Call after the model's module is imported.
    """
    import sys

    import mlx_lm.models.base as base

    original = getattr(base.scaled_dot_product_attention, "__wrapped__", base.scaled_dot_product_attention)

    def attention(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001, ANN202
        if isinstance(cache, PooledKVCache):
            if sinks is not None:
                raise UnsupportedModelError("attention sinks are not supported yet")
            if cache.paged:
                return cache.paged_attention(queries, scale)
            # CUDA: no cuDNN graph build per prompt shape, while the scores stay small.
            if kernel_available() and unfused_prefill_fits(queries.shape, keys.shape[2]):
                return unfused_prefill_attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attention.__wrapped__ = original
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(
                module, "scaled_dot_product_attention", None) in (original, base.scaled_dot_product_attention):
            module.scaled_dot_product_attention = attention

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

from worker_proc.kv_pool import KVPool


class UnsupportedModelError(RuntimeError):
    """The model has a layer kind the engine cannot serve yet."""


@dataclass(frozen=True)
class ForwardLayout:
    """Where one forward pass writes and reads K/V.

    write_slots: [B * S] slot of every new token, row-major.
    read_slots:  [B, L] slots of each row's whole context (new tokens included),
                 right-padded with slot 0.
    offset:      position of each row's first new token (int when B == 1).
    mask:        None, "causal", or a boolean [B, 1, S, L] array for ragged rows.
    """

    write_slots: mx.array
    read_slots: mx.array
    offset: int | mx.array
    mask: Any

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
        )

    @classmethod
    def decode(cls, table_rows: np.ndarray, lengths: np.ndarray) -> "ForwardLayout":
        """One new token per row; lengths count the new token. table_rows: [B, >= max(lengths)]."""
        max_len = int(lengths.max())
        read = table_rows[:, :max_len]
        write = read[np.arange(len(lengths)), lengths - 1]
        mask = None
        if int(lengths.min()) != max_len:
            valid = np.arange(max_len)[None, :] < lengths[:, None]
            mask = mx.array(valid[:, None, None, :])
        return cls(
            write_slots=mx.array(write),
            read_slots=mx.array(read),
            offset=mx.array(lengths - 1) if len(lengths) > 1 else int(lengths[0] - 1),
            mask=mask,
        )


class PooledKVCache:
    """One full-attention layer's view of the pool for one forward pass."""

    def __init__(self, pool: KVPool, layer: int, layout: ForwardLayout) -> None:
        self._pool = pool
        self._layer = layer
        self._layout = layout

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

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._pool.write(self._layer, self._layout.write_slots, keys, values)
        return self._pool.read(self._layer, self._layout.read_slots)


def _causal_array(n_new: int, n_total: int) -> mx.array:
    q = mx.arange(n_total - n_new, n_total)[:, None]
    return q >= mx.arange(n_total)[None]


def check_layer_kinds(model: Any) -> None:
    """Refuse, with a clear message, models whose layers the pool cannot hold yet."""
    for i, cache in enumerate(make_prompt_cache(model)):
        if type(cache) is not KVCache:
            raise UnsupportedModelError(
                f"layer {i} uses {type(cache).__name__} (sliding-window, linear-attention "
                f"or other non-standard cache); only full-attention models are supported yet")


def build_layer_caches(pool: KVPool, layout: ForwardLayout) -> list[PooledKVCache]:
    return [PooledKVCache(pool, i, layout) for i in range(len(pool.specs))]

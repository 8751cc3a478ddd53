"""Layers whose own code places its queries by the count of the keys it was handed, given
each row's own positions, so rows of different lengths can share a forward.

kiln's forwards over rows of different lengths (or starts) right-pad them: the keys a
layer is handed are as many as the longest row's, and each row's positions come with
the forward as one offset a row (the caches' `offset`). Two mlx-lm layers place their
queries at the keys' last positions instead, the longest row's, so every shorter row
beside a longer one goes wrong (the ragged-batch probe, attention.batches_ragged_rows,
decodes a few short rows: M3's block picking starts past them, so the worker must not
count on the probe to run such a model by length):
- MiniMax M3's sparse attention (mlx_lm.models.minimax_m3_vl) picks each query's key
  blocks with its own block and, with no block dropped, attends every key it was handed;
- AFM 7's KV-reuse attention (mlx_lm.models.afm7) rotates its queries at the keys'
  count.
At load the worker swaps in subclasses that take each row's positions from the forward's
offset (and mask what lies past them); where a forward has one offset for every row they
are mlx-lm's own code.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx


def give_rows_their_positions(model: Any) -> int:
    """Swap the subclasses below into the model's MiniMax M3 sparse attention and AFM 7
    KV-reuse attention layers; returns how many layers."""
    swaps = []
    if (m3 := sys.modules.get("mlx_lm.models.minimax_m3_vl")) is not None:
        swaps.append((m3.Attention, lambda m: m.is_sparse_attn, _row_blocks(m3.Attention)))
    if (afm := sys.modules.get("mlx_lm.models.afm7")) is not None:
        swaps.append((afm.KVReuseAttention, lambda m: True, _row_reuse(afm.KVReuseAttention)))
    placed = 0
    for _, m in model.named_modules():
        for cls, applies, placed_cls in swaps:
            if type(m) is cls and applies(m):
                m.__class__ = placed_cls
                placed += 1
    return placed


_CLASSES: dict[type, type] = {}


def _row_blocks(attention: type) -> type:
    if attention not in _CLASSES:
        _CLASSES[attention] = type("RowPlacedBlocks", (attention,), {"_block_mask": _block_mask})
    return _CLASSES[attention]


def _row_reuse(attention: type) -> type:
    if attention not in _CLASSES:
        _CLASSES[attention] = type("RowPlacedReuse", (attention,), {"__call__": _reuse_call})
    return _CLASSES[attention]


def _per_row(offset: Any) -> bool:
    return isinstance(offset, mx.array) and offset.ndim > 0


def _block_mask(self: Any, x: mx.array, mask: Any, offset: Any, cache: Any) -> Any:
    """MiniMax M3: the boolean mask of the key blocks each query keeps ([B, heads, L, S]),
    each row's queries at its own positions offset[b]..; one offset for every row:
    mlx-lm's. The blocks are cut from position 0 as mlx-lm cuts them, so each row picks
    what it picks alone."""
    if not _per_row(offset):
        return type(self).__mro__[1]._block_mask(self, x, mask, offset, cache)
    b, length, _ = x.shape
    heads, dim = self.index_n_heads, self.index_head_dim
    keys = self.index_k_norm(self.index_k_proj(x).reshape(b, length, 1, dim)).transpose(0, 2, 1, 3)
    keys = self.index_rope(keys, offset=offset)
    if cache is not None:  # the keys are stored whatever is picked: later steps score them
        keys, _ = cache.update_and_fetch(keys, mx.zeros((b, 1, length, 0), keys.dtype))
    n_keys = keys.shape[2]
    positions = offset[:, None] + mx.arange(length)  # [B, L]: each row's own
    # What each query may see: the forward's mask where it is one, else causal over the
    # row's own positions (which also hides a shorter row's padding).
    visible = (mask if isinstance(mask, mx.array)
               else (mx.arange(n_keys)[None, None] <= positions[..., None])[:, None])
    size, topk = self.index_block_size, self.index_topk_blocks
    full, tail = divmod(n_keys, size)
    n_blocks = full + bool(tail)
    if topk >= n_blocks:  # no row has more blocks than it keeps: all it sees
        return mx.broadcast_to(visible, (b, self.num_attention_heads, length, n_keys))
    queries = self.index_q_norm(self.index_q_proj(x).reshape(b, length, heads, dim))
    queries = self.index_rope(queries.transpose(0, 2, 1, 3), offset=offset)
    scores = queries.astype(mx.float32) @ keys.astype(mx.float32).swapaxes(-1, -2)
    scores = mx.where(visible, scores, -mx.inf)  # no future or padded key wins a block
    blocks = scores[..., :full * size].reshape(b, heads, length, full, size).max(axis=-1)
    if tail:
        blocks = mx.concatenate([blocks, scores[..., full * size:].max(axis=-1, keepdims=True)],
                                axis=-1)
    if self.index_local_blocks > 0:  # a query's own block (and those before it) always
        own = (positions // size)[:, None, :, None]
        ids = mx.arange(n_blocks)
        blocks = mx.where((ids <= own) & (ids > own - self.index_local_blocks), mx.inf, blocks)
    picked = mx.stop_gradient(mx.argpartition(-blocks, kth=topk - 1, axis=-1)[..., :topk])
    keep = mx.put_along_axis(mx.zeros(blocks.shape, dtype=mx.bool_), picked, mx.array(True),
                             axis=-1)
    keep = mx.repeat(keep, size, axis=-1)[..., :n_keys] & visible
    return mx.repeat(keep, self.num_attention_heads // heads, axis=1)


def _reuse_call(self: Any, x: mx.array, keys: mx.array, values: mx.array,
                mask: Any = None) -> mx.array:
    """AFM 7: attend the reused layer's K/V with the queries at each row's own positions
    (the offset of the cache those K/V came from: attention.fetched_from; the attention
    call, that cache's, masks each row's padding); mlx-lm's where the K/V are no kiln
    cache's or a forward has one offset."""
    from worker_proc.attention import fetched_from

    source = fetched_from(keys)
    if source is None or not _per_row(source.offset):
        return type(self).__mro__[1].__call__(self, x, keys, values, mask)
    b, length, _ = x.shape
    queries = self.q_proj(x).reshape(b, length, self.n_heads, -1).transpose(0, 2, 1, 3)
    queries = self.q_norm(self.rope(queries, offset=source.offset))
    attend = sys.modules[type(self).__mro__[1].__module__].scaled_dot_product_attention
    out = attend(queries, keys, values, cache=None, scale=self.scale, mask=mask)
    return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))

"""MiniMax M3's block-sparse attention, batched over rows of different lengths.

Its sparse layers (mlx_lm.models.minimax_m3_vl) pick each query's key blocks with an
indexer, placing the queries at the last positions of the keys they were handed
(`arange(S - L, S)`). Over kiln's right-padded rows that is the longest row's place, not
each row's, so a row beside longer ones forced the wrong block as its local one, and
with no block dropped attended its padding: such a model ran rows one length at a time
(attention.batches_ragged_rows). Here a layer handed one offset a row (kiln's forwards
over rows of different lengths or starts) places each row's queries at its own
positions and masks what lies past them; with one offset for every row it is mlx-lm's
own code. The blocks are cut from position 0 as mlx-lm cuts them, so each row picks
what it picks alone.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx


def place_block_sparse_rows(model: Any) -> int:
    """Give every MiniMax M3 sparse attention layer of the model its rows' own query
    positions (RowPlacedBlocks); returns how many layers."""
    module = sys.modules.get("mlx_lm.models.minimax_m3_vl")
    if module is None:
        return 0
    placed = 0
    for _, m in model.named_modules():
        if type(m) is module.Attention and m.is_sparse_attn:
            m.__class__ = _row_placed(module.Attention)
            placed += 1
    return placed


_CLASSES: dict[type, type] = {}


def _row_placed(attention: type) -> type:
    if attention not in _CLASSES:
        _CLASSES[attention] = type("RowPlacedBlocks", (attention,),
                                   {"_block_mask": _block_mask, "__doc__": __doc__})
    return _CLASSES[attention]


def _block_mask(self: Any, x: mx.array, mask: Any, offset: Any, cache: Any) -> Any:
    """The boolean mask of the key blocks each query keeps ([B, heads, L, S]), each row's
    queries at its own positions `offset[b]`..; one offset for every row: mlx-lm's."""
    if not isinstance(offset, mx.array) or offset.ndim == 0:
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

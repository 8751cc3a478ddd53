"""Adapters that let mlx-lm's model code attend over the KV pool.

mlx-lm models call three things on a layer's cache during a forward pass: `offset` (the
RoPE position of the first new token), `make_mask(...)` (on the first layer, once per
forward) and `update_and_fetch(keys, values)`. `PooledKVCache` answers those from a
`ForwardLayout` that describes the whole batch, so the model code runs unchanged.

Each layer's adapter knows its `LayerKind` (worker_proc.layer_kinds): full attention, a
sliding window or chunk-local attention, and whether the model attends through mlx-lm's
`scaled_dot_product_attention` or computes scores itself. `build_layer_caches` is the one
place that maps a model's layers to adapters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from worker_proc.decode_backend import DecodeBackend
from worker_proc.gated_delta_cuda import PoolRead, forget_pool_reads, offer_pool_read
from worker_proc.kv_pool import KVPool, StateLayerSpec, attention_specs, flat_specs
from worker_proc.layer_kinds import Kind, LayerKind, ProbeRecorder, UnsupportedModelError
from worker_proc.model_patch import repoint
from worker_proc.paged_attention import RopeSpec
from worker_proc.prefill_attention import causal_mask
from worker_proc.staging import Stage, new_arrays

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
    positions:   prefill: [B, S] position of each new token (row 0 stands for every row
                 when all start together), for the masks of windowed layers.
    window_write_slots, window_read_slots: the same in the windowed layers' own slot
                 space (KVPool.window_slots; None where they share the full one). A
                 position behind every window may read slot 0 or a reused slot there:
                 the windowed masks and tables never let a query see it.
    """

    write_slots: mx.array
    read_slots: mx.array
    offset: int | mx.array
    mask: Any
    lengths: mx.array | None = None
    dense: "DenseDecodeContext | None" = None
    fresh: bool = False
    positions: np.ndarray | None = None
    window_write_slots: mx.array | None = None
    window_read_slots: mx.array | None = None
    # What every layer (of a kind) of this forward shares, made once (see once).
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def once(self, key: tuple, make: Callable[[], T]) -> T:
        """make() the first time this forward asks for `key`, the same value after: what
        each layer would otherwise build again (a kind's prefill mask and key start, its
        decode window's table, a masked attention's bias)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def kind_mask(self, kind: LayerKind, start: int = 0) -> mx.array:
        """A prefill mask for a windowed layer kind: [S, L - start], or [B, 1, S,
        L - start] when rows start at different positions (keys at positions start..L-1
        of each row)."""
        assert self.positions is not None, "a prefill layout has its positions"
        rows, width = self.positions.shape

        def make() -> mx.array:
            n_keys = width if self.fresh else self.read_slots.shape[1]
            # Built in the graph: on the host, a 2,048-token chunk over 8k keys was 16M
            # booleans, ~60 ms of numpy and a copy a forward. The positions too, from the
            # offset (the rows' starts, already on the device): an array made from host
            # data may wait for the device's work in flight (worker_proc.staging).
            first = self.offset if isinstance(self.offset, int) else self.offset[:, None]
            q = (first + mx.arange(width, dtype=mx.int32)[None, :])[:, :, None]
            assert q.shape[0] == rows, "one start, or one a row"
            # A row's padding queries (prefill_padding) may sit past every key: seen from
            # the last one instead, so that their windows hold a key and their rows stay
            # finite (a row of no keys is NaN, which their K/V would carry into the pool's
            # dummy slot, and a masked column times NaN is NaN in every other row).
            # Real queries are never past the last key.
            q = mx.minimum(q, n_keys - 1)
            visible = kind.visible(q, mx.arange(start, n_keys, dtype=mx.int32)[None, None, :])
            return visible[0] if visible.shape[0] == 1 else visible[:, None]

        return self.once(("mask", kind, start), make)

    def key_start(self, kind: LayerKind) -> int:
        """Prefill over a computed context: the first position any of this forward's
        queries sees in a windowed layer kind. Keys before it are behind every window,
        so such a layer reads and scores only positions from here on (a chunk deep into
        a long prompt: its window and itself, not the whole context)."""
        if self.fresh:
            return 0
        assert self.positions is not None, "a prefill layout has its positions"
        positions = self.positions
        return self.once(("start", kind),  # asked per layer (read, mask)
                         lambda: int(np.min(kind.first_visible(positions[:, 0] + 1))))

    def windowed_reads(self, kind: LayerKind, read_slots: mx.array) -> tuple[mx.array, mx.array]:
        """Decode: each row's slots from the first position its query sees, and how many,
        for a windowed layer kind ([B, W] table, W the window or chunk, capped by the
        widest row; [B] lengths), out of read_slots (the layer's space's). Built in the
        graph from them and the lengths, so a compiled decode traces it too."""
        assert self.lengths is not None
        lengths = self.lengths

        def make() -> tuple[mx.array, mx.array]:
            first = kind.first_visible(lengths)
            width = read_slots.shape[1]
            cols = min(kind.span, width)
            # Columns past a row's last position (a chunked kind's) repeat it: unread, a
            # valid index. Capped by the lengths, not width - 1: a number in a compiled
            # trace is a constant of the fused kernel, one compile per table width
            # (seconds mid-serving on CUDA).
            at = mx.minimum(first[:, None] + mx.arange(cols, dtype=first.dtype)[None],
                            lengths[:, None] - 1)
            table = mx.take_along_axis(read_slots, at.astype(mx.int32), axis=1)
            return table, (lengths - first).astype(mx.int32)

        return self.once(("window", kind), make)

    @classmethod
    def single(cls, context_slots: np.ndarray, start: int, n_new: int,
               window_slots: np.ndarray | None = None,
               stage: Stage | None = None) -> "ForwardLayout":
        """One request: n_new tokens at positions start.., context = its first start + n_new
        slots (and window slots, where windowed layers have their own). stage: makes the
        slot arrays from numpy ones (worker_proc.staging; default mx.array each)."""
        end = start + n_new
        windowed = window_slots is not None
        parts = [context_slots[start:end], context_slots[None, :end]]
        if windowed:
            parts += [window_slots[start:end], window_slots[None, :end]]
        write, read, *window = (stage or new_arrays)(*(p.astype(np.int32) for p in parts))
        return cls(
            write_slots=write,
            read_slots=read,
            window_write_slots=window[0] if windowed else None,
            window_read_slots=window[1] if windowed else None,
            offset=start,
            # Same mask mlx-lm's own KVCache gives, so the fused kernel path is the same.
            mask="causal" if n_new > 1 else None,
            fresh=start == 0,
            positions=np.arange(start, end)[None],
        )

    @classmethod
    def prefill(cls, table_rows: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                window_rows: np.ndarray | None = None,
                stage: Stage | None = None, width: int = 0) -> "ForwardLayout":
        """Chunks of several requests in one forward, right-padded to the longest (or to
        `width`, rows of one start only): row b computes positions starts[b] .. starts[b] +
        sizes[b] - 1. Padded positions write to slot 0 and no real query attends to them
        (causal from each row's start). window_rows: the rows' window slots, where
        windowed layers have their own; stage: as single's."""
        ends = starts + sizes
        if width > sizes.max():
            assert (starts == starts[0]).all(), "a set width needs rows of one start"
            cols = np.arange(int(starts[0]) + width)
        else:
            width = int(sizes.max())
            cols = np.arange(int(ends.max()))
        pos = starts[:, None] + np.arange(width)[None, :]
        real = np.arange(width)[None, :] < sizes[:, None]

        def read_write(rows: np.ndarray) -> list[np.ndarray]:
            read = np.where(cols[None, :] < ends[:, None], rows[:, :len(cols)], 0)
            write = np.where(real, np.take_along_axis(read, np.minimum(pos, len(cols) - 1), 1), 0)
            return [write.reshape(-1).astype(np.int32), read.astype(np.int32)]

        parts = read_write(table_rows)
        if window_rows is not None:
            parts += read_write(window_rows)
        one_start = bool((starts == starts[0]).all())
        if not one_start:
            parts.append(starts.astype(np.int32))
        made = (stage or new_arrays)(*parts)
        write, read = made[:2]
        window_write, window_read = (made[2], made[3]) if window_rows is not None else (None, None)
        if one_start:
            # One start for every row (fresh prompts, or one shared cached prefix): the
            # causal mask aligned to the keys' end is then exact for every real query,
            # whatever each row's length, and keeps attention on the fused path.
            offset: int | mx.array = int(starts[0])
            mask: Any = "causal"
        else:
            offset = made[-1]
            mask = _rows_causal(offset, width, len(cols))
        return cls(
            write_slots=write,
            read_slots=read,
            window_write_slots=window_write,
            window_read_slots=window_read,
            offset=offset,
            mask=mask,
            # Padded positions sit after each row's real ones, which the causal mask
            # hides from every real query, whether their K/V come from here or slot 0.
            fresh=bool((starts == 0).all()),
            positions=pos[:1] if isinstance(offset, int) else pos,
        )

    @classmethod
    def decode(cls, table_rows: np.ndarray, lengths: np.ndarray,
               dense: "DenseDecodeContext | None" = None,
               window_rows: np.ndarray | None = None,
               stage: Stage | None = None) -> "ForwardLayout":
        """One new token per row; lengths count the new token. table_rows: [B, >= max(lengths)].
        dense: the fallback's kept context, already planned for this step. window_rows:
        the rows' window slots, where windowed layers have their own. stage: as single's."""
        max_len = int(lengths.max())
        last = (np.arange(len(lengths)), lengths - 1)
        read = table_rows[:, :max_len]
        parts = [read[last], read, lengths]
        if window_rows is not None:
            window_read = window_rows[:, :max_len]
            parts += [window_read[last], window_read]
        one_length = bool((lengths == lengths[0]).all())
        if not one_length:
            parts.append(lengths - 1)
        write, read_mx, lengths_mx, *rest = (stage or new_arrays)(
            *(p.astype(np.int32) for p in parts))
        windowed = window_rows is not None
        return cls(
            write_slots=write,
            read_slots=read_mx,
            window_write_slots=rest[0] if windowed else None,
            window_read_slots=rest[1] if windowed else None,
            # One position for every row: a scalar, as some models' own mask code needs.
            offset=int(lengths[0] - 1) if one_length else rest[-1],
            mask=None,
            lengths=lengths_mx,
            dense=dense,
        )


# The keys each PooledKVCache of the forward being built handed out (id -> the cache and
# the array, kept so the id stays its own): an attention call given them with another
# cache, or none, is that cache's (Gemma 4's KV-shared layers, IQuest-Loop-Coder's second
# pass). Cleared as each forward's caches are built.
_FETCHED: dict[int, tuple["PooledKVCache", mx.array]] = {}


def fetched_from(keys: Any) -> "PooledKVCache | None":
    """The cache of this forward whose update_and_fetch returned `keys`, if any."""
    entry = _FETCHED.get(id(keys))
    return entry[0] if entry is not None and entry[1] is keys else None


class PooledKVCache:
    """One attention layer's view of the pool for one forward pass; decode attention and
    the pool's writes are its pool's backend's (decode_backend)."""

    def __init__(self, pool: KVPool, layer: int, layout: ForwardLayout,
                 kind: LayerKind | None = None) -> None:
        self.pool = pool
        self.layer = layer
        self.layout = layout
        self.kind = kind or LayerKind()
        # This step's K/V, for the attention kernel to store (writes_in_attention).
        self._unwritten: tuple[mx.array, mx.array] | None = None
        # The keys update_and_fetch handed a latent layer's decode (the pool's; see
        # attends_latent): the attention hook knows them again by identity.
        self._latent_keys: mx.array | None = None
        self._fetched: tuple[mx.array, mx.array] | None = None  # see keys_and_values

    @property
    def backend(self) -> DecodeBackend:
        return self.pool.backend

    @property
    def write_slots(self) -> mx.array:
        """Where this forward's new K/V go, in this layer's slot space."""
        return self._in_space(self.layout.write_slots, self.layout.window_write_slots)

    @property
    def read_slots(self) -> mx.array:
        """Each row's context, in this layer's slot space ([B, L])."""
        return self._in_space(self.layout.read_slots, self.layout.window_read_slots)

    def _in_space(self, full: mx.array, window: mx.array | None) -> mx.array:
        """The layout's full-space slots, or its window slots for a layer in the windowed
        layers' own space."""
        if not self.pool.windowed(self.layer):
            return full
        assert window is not None, "the layout has window slots"
        return window

    def reads(self) -> tuple[mx.array, mx.array]:
        """Decode: the slot table and lengths of the positions this layer's queries see
        (a windowed kind's start at each row's window)."""
        if self.kind.windowed:
            return self.layout.windowed_reads(self.kind, self.read_slots)
        return self.layout.read_slots, self.layout.lengths

    def take_unwritten(self) -> tuple[mx.array, mx.array] | None:
        """This step's K/V, left for the attention kernel to store; the caller stores them."""
        unwritten, self._unwritten = self._unwritten, None
        return unwritten

    @property
    def offset(self) -> int | mx.array:
        return self.layout.offset

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        layout, kind = self.layout, self.kind
        if window_size is not None and not (kind.kind is Kind.SLIDING and kind.span == window_size):
            kind = LayerKind(Kind.SLIDING, window_size)  # the model's window, not the cache's
        if self.paged:  # decode: the pool's readers mask by each row's length
            return self._length_mask() if self.kind.own_attention else None
        if kind.windowed:  # one new token too: the context read back is not windowed
            return layout.kind_mask(kind, self.key_start if kind == self.kind else 0)
        mask = layout.mask
        if isinstance(mask, str) and n == 1:
            # One query over its row's context sees every key: no mask, as mlx-lm's caches
            # answer for one token (DeepSeek-V3.2's code takes a mask it is given for a
            # [B, 1, 1, L] one and fails on the [1, L] causal array: prompts one token past
            # a cached prefix, sharing a forward, ended every request of the step).
            return None
        if return_array and isinstance(mask, str):
            return causal_mask(n, n if layout.fresh else layout.read_slots.shape[1])
        return mask

    def _length_mask(self) -> mx.array | None:
        """Decode of a layer that computes its own scores over dense K/V ([B, H, L, D],
        right-padded): which of the L positions each row's query sees, [B, 1, 1, L]; None
        where the rows are of one length (each sees all L), as mlx-lm's caches answer for
        one token. A [B, 1, 1, L] array would not broadcast against Gemma 2's grouped
        [B, Hkv, G, 1, L] scores, and the forwards of models that cannot batch ragged
        rows (batches_ragged_rows) all have rows of one length."""
        if isinstance(self.layout.offset, int):  # ForwardLayout.decode: rows of one length
            return None
        table, lengths = self.reads()
        return (mx.arange(table.shape[1])[None] < lengths[:, None])[:, None, None, :]

    # mlx-lm's ChunkedKVCache protocol (llama4's model reads it): the pool keeps every
    # position, so nothing is trimmed and keys start at position 0.
    start_position = 0

    def maybe_trim_front(self) -> None:
        pass

    @property
    def paged(self) -> bool:
        return self.layout.lengths is not None

    @property
    def key_start(self) -> int:
        """The first context position this prefill layer reads back (ForwardLayout.
        key_start): a windowed layer attending through the hook, whose mask is always
        ours; 0 for the rest (a model's own score code may build masks of its own)."""
        kind = self.kind
        if self.paged or not kind.windowed or kind.own_attention:
            return 0
        return self.layout.key_start(kind)

    @property
    def written(self) -> bool:
        """Whether this forward's K/V reached the pool (or a kernel that stores them)."""
        return self._unwritten is None

    @property
    def writes_in_attention(self) -> bool:
        """Whether this forward's K/V go to the pool through the attention kernel (paged
        decode on an in-place pool; windowed layers and sinks too: the kernel takes the
        new token as the last of the rows' window tables)."""
        return (self.paged and self.layout.dense is None and self.pool.in_place
                and self.backend.write_in_attention and not self.kind.own_attention)

    @property
    def attends_from_qkv(self) -> bool:
        """Whether attend_qkv may take the place of RoPE, update_and_fetch and
        paged_attention: full attention without sinks (the kernel rotates at the row's
        length - 1, a position only a full layer's table gives)."""
        return self.writes_in_attention and self.kind == LayerKind()

    @property
    def attends_latent(self) -> bool:
        """Whether this decode layer's attention goes to the backend's latent attention
        (LayerKind.latent): the model gets the pool's keys, which it hands the attention
        hook untouched, and dense values, from which it scores the RoPE part itself."""
        return self.paged and self.kind.latent and self.backend.attends_latent

    def takes_latent(self, keys: Any, values: Any) -> bool:
        """Whether an attention call over this cache is the latent decode it was set up for
        (the keys update_and_fetch handed out, as both keys and values)."""
        return self._latent_keys is not None and keys is self._latent_keys and values is keys

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.pool.specs[self.layer].values_are_keys:  # kept once: the keys are the values
            fetched = self._fetch(keys, keys[..., :0])
            fetched = (fetched[0], fetched[0])
        else:
            fetched = self._fetch(keys, values)
        _FETCHED[id(fetched[0])] = (self, fetched[0])
        self._fetched = fetched
        return fetched

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """What this forward's update_and_fetch returned, for layers that reuse this one's
        K/V (Gemma 3n's and AFM 7's): their attention call, handed these, is this cache's
        (fetched_from), so it reads the pool as this layer's own does."""
        if self._fetched is None:
            raise RuntimeError(f"layer {self.layer}: K/V read before this forward stored them")
        return self._fetched

    # mlx-lm's KVCache keeps its arrays as `keys` and `values`, and some models' code reads
    # them (DeepSeek-V3.2's indexer). Such a layer is one with its own score math (the probe
    # sees the read: layer_kinds), so what this forward's update_and_fetch returned is the
    # context's dense K/V, as mlx-lm's arrays hold them up to the offset.
    @property
    def keys(self) -> mx.array:
        return self.keys_and_values()[0]

    @keys.setter
    def keys(self, keys: mx.array) -> None:
        """A model's own reassignment (DeepSeek-V3.2 makes the keys depend on its indexer's
        cache): this forward's view; the pool keeps what update_and_fetch stored."""
        self._fetched = (keys, self.keys_and_values()[1])

    @property
    def values(self) -> mx.array:
        return self.keys_and_values()[1]

    @values.setter
    def values(self, values: mx.array) -> None:
        self._fetched = (self.keys_and_values()[0], values)

    def _fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.attends_latent:
            self.pool.write(self.layer, self.write_slots, keys, values)
            self._latent_keys = self.pool.keys(self.layer)
            return self._latent_keys, self.pool.read_values(self.layer, self.reads()[0])
        if self.writes_in_attention:
            self._unwritten = (keys, values)  # paged_attention stores them
            return self.pool.keys(self.layer), self.pool.values(self.layer)
        self.pool.write(self.layer, self.write_slots, keys, values)
        if self.paged and self.kind.own_attention:  # its own score math needs dense K/V
            return self.pool.read(self.layer, self.reads()[0])
        if self.layout.dense is not None:
            self.layout.dense.update(self.layer, self.pool, self.read_slots, keys, values)
        if self.paged:  # attention reads the pool itself (see paged_attention)
            return self.pool.keys(self.layer), self.pool.values(self.layer)
        if self.layout.fresh:
            return keys, values
        start = self.key_start
        return self.pool.read(self.layer, self.read_slots[:, start:] if start else self.read_slots)

    def attend_qkv(self, qkv: mx.array, n_q: int, scale: float, rope: RopeSpec) -> mx.array:
        """A decode layer's attention from its fused q/k/v projection's output [B, 1,
        (n_q + 2 Hkv) * D], unrotated: one kernel rotates q and k, stores the new K/V and
        attends (paged_decode_qkv_attention); [B, 1, n_q * D]. Only where
        attends_from_qkv."""
        if not self.attends_from_qkv:
            raise RuntimeError("attend_qkv needs the attention kernel to write the pool")
        return self.backend.attend_qkv(self, qkv, n_q, scale, rope)

    def paged_attention(self, queries: mx.array, scale: float,
                        sinks: mx.array | None = None) -> mx.array:
        return self.backend.attend(self, queries, scale, sinks)

    def latent_attention(self, queries: mx.array, scale: float, bias: Any) -> mx.array:
        """A latent layer's decode attention (takes_latent): the pool's keys as keys and
        values, the model's scores `bias` ([B, H, 1, L]) added."""
        if not (isinstance(bias, mx.array) and bias.ndim == 4):
            raise RuntimeError(f"layer {self.layer}: latent attention without its scores mask")
        return self.backend.attend_latent(self, queries, scale, bias)


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
        # This step's rebuild slots, made once per slot table (full; windowed layers').
        self._gather: dict[int, mx.array] = {}
        self._mask: mx.array | None = None
        self._kind_masks: dict[LayerKind, mx.array] = {}  # this step's, per windowed kind

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
        self._gather = {}
        self._kind_masks = {}

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
            gather = self._gather.get(id(read_slots))
            if gather is None:  # [B, capacity] slots, right-aligned; once a step and table
                width = read_slots.shape[1]
                gather = mx.take_along_axis(read_slots, mx.minimum(self._columns, width - 1),
                                            axis=1)
                self._gather[id(read_slots)] = gather
            self._keys[layer], self._values[layer] = pool.read(layer, gather)
            return
        if self._extend_by:
            self._keys[layer] = _extended(self._keys[layer], self._extend_by)
            self._values[layer] = _extended(self._values[layer], self._extend_by)
        column = self._end - 1
        self._keys[layer][:, :, column:column + 1] = keys
        self._values[layer][:, :, column:column + 1] = values

    def attention(self, layer: int, queries: mx.array, scale: float,
                  kind: LayerKind | None = None, sinks: mx.array | None = None) -> mx.array:
        keys, values = self._keys[layer], self._values[layer]
        assert keys is not None and values is not None
        if self._end < self._capacity:  # the columns in use (a view), not the spare ones
            keys, values = keys[:, :, :self._end], values[:, :, :self._end]
        mask = self._mask if kind is None or not kind.windowed else self._kind_mask(kind)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask, sinks=sinks)

    def _kind_mask(self, kind: LayerKind) -> mx.array:
        """The columns a windowed kind's queries see: row i's position p sits in column
        p + first_i, and it sees positions from kind.first_visible on. Once a step."""
        if kind not in self._kind_masks:
            first = self._end - self._lengths
            lo = first + kind.first_visible(self._lengths)
            columns = np.arange(self._end)[None, :]
            self._kind_masks[kind] = mx.array((columns >= lo[:, None])[:, None, None, :])
        return self._kind_masks[kind]


def _extended(block: mx.array | None, columns: int) -> mx.array:
    """block [B, H, C, D] with `columns` zero positions appended along C."""
    assert block is not None
    b, h, _, d = block.shape
    return mx.concatenate([block, mx.zeros((b, h, columns, d), dtype=block.dtype)], axis=2)


def _rows_causal(starts: mx.array, n_new: int, n_keys: int) -> mx.array:
    """[B, 1, n_new, n_keys]: row b's query i sees key k when k <= starts[b] + i. Built in
    the graph: on the host, B x n_new x n_keys booleans were milliseconds a forward."""
    queries = starts[:, None] + mx.arange(n_new, dtype=starts.dtype)[None]
    return (mx.arange(n_keys, dtype=starts.dtype)[None, None] <= queries[:, :, None])[:, None]


class PooledStateCache(ArraysCache):
    """One recurrent layer's state for one forward: mlx-lm's ArraysCache protocol over the
    pool's state rows of the forward's requests. Rows whose prompt starts in this forward
    read None (the model starts from its own zero state, as under mlx-lm's cache); the
    layer's new state is written back to the rows. A prefill forward over right-padded
    rows gives `lengths` (each row's real tokens), as mlx-lm's batch prefill does: the
    model masks the padding out of its state (models that do are found at start-up,
    pads_state_rows); left_padding is never used.

    An ArraysCache by type only (its own list of arrays is never made): Mamba's code
    stores its new state only into caches that are one."""

    left_padding = None

    def __init__(self, pool: KVPool, layer: int, rows: mx.array, fresh: bool,
                 lengths: mx.array | None = None) -> None:  # not ArraysCache's: no arrays
        self.pool = pool
        self.layer = layer
        self.rows = rows
        self.fresh = fresh
        self.lengths = lengths
        # In place: states a kernel updated in the pool itself, as handed back to the model.
        self._in_pool: dict[int, mx.array] = {}

    def _index(self, index: int) -> int:
        """A state array's index, as a list takes it: negative from the end, past the end
        an IndexError (where unpacking the cache stops: Kimi-Linear's `q, k, v, ssm =
        cache`)."""
        size = len(self.pool.states[self.layer])
        if not -size <= index < size:
            raise IndexError(index)
        return index % size

    def __getitem__(self, index: int) -> mx.array | None:
        index = self._index(index)
        if self.fresh:
            return None
        value = self.pool.read_state(self.layer, index, self.rows)
        if self.pool.in_place:  # a kernel may update the rows where they are instead
            offer_pool_read(PoolRead(value, self.pool.states[self.layer][index], self.rows,
                                     self.pool.state_mark(self.layer, index),
                                     lambda mark: self._written_in_pool(index, mark)))
        return value

    def _written_in_pool(self, index: int, mark: mx.array) -> mx.array:
        self.pool.record_state_write(self.layer, index, mark)
        self._in_pool[index] = self.pool.read_state(self.layer, index, self.rows)
        return self._in_pool[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        index = self._index(index)
        if self._in_pool.get(index) is value:  # already there
            return
        spec = self.pool.state_specs[self.layer]
        if spec.filling and spec.filling[index]:
            value = _front_filled(value, spec.shapes[index])
        self.pool.write_state(self.layer, index, self.rows, value)

    def empty(self) -> bool:
        return self.fresh

    def advance(self, n: int) -> None:
        if self.lengths is not None:  # as mlx-lm's: what is left of each row's tokens
            self.lengths = self.lengths - n

    def make_mask(self, n: int) -> mx.array | None:
        if self.lengths is None:
            return None
        return mx.arange(n)[None] < self.lengths[:, None]


def _front_filled(value: mx.array, shape: tuple[int, ...]) -> mx.array:
    """A filling state array (StateLayerSpec.filling) still short of its shape: zeros in
    front along each short axis (the batch axis left as it is)."""
    pads = [(0, 0)] + [(full - now, 0) for now, full in zip(value.shape[1:], shape)]
    if not any(before for before, _ in pads):
        return value
    return mx.pad(value, pads)


def build_layer_caches(pool: KVPool, layout: ForwardLayout, state_rows: mx.array | None = None,
                       fresh_state: bool = False,
                       state_lengths: mx.array | None = None) -> list[PooledKVCache | PooledStateCache]:
    """The model's cache list: an adapter per layer in mlx-lm's cache order. state_rows:
    the forward's requests' state rows (needed where the model has recurrent layers);
    fresh_state: their prompts start in this forward; state_lengths: a prefill forward's
    real tokens per row, where rows are right-padded."""
    forget_pool_reads()  # a forward's state reads are offered to its own kernels only
    _FETCHED.clear()
    parts: list[PooledKVCache | PooledStateCache | UnusedCache] = []
    for part, i in pool.order:
        if part == "kv":
            parts.append(PooledKVCache(pool, i, layout, pool.specs[i].kind))
        elif part == "unused":
            parts.append(UnusedCache(i))
        else:
            if state_rows is None:
                raise RuntimeError("a forward over recurrent layers needs its state rows")
            parts.append(PooledStateCache(pool, i, state_rows, fresh_state, state_lengths))
    caches: list[Any] = []
    for size in pool.groups:
        caches.append(PooledCacheList(parts[:size]) if size else parts[0])
        parts = parts[max(size, 1):]
    return caches


@dataclass(frozen=True)
class MixedLayerCache:
    """One layer's caches for a forward that carries a prompt's chunk and decode rows
    together (the runner's mixed forward): its hidden states are [1, n_chunk + B, D],
    the chunk's positions first, then one token of each decode row. A block that knows
    it (decode_block.FastDecodeBlock) runs the projections and the MLP once over all of
    them and attention apart: the chunk through `chunk` (a prefill layout), the rows
    through `rows` (a paged decode layout)."""

    chunk: PooledKVCache
    rows: PooledKVCache
    n_chunk: int

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        """The chunk's mask (the model asks with the whole forward's length)."""
        return self.chunk.make_mask(self.n_chunk, return_array, window_size)


def build_mixed_caches(pool: KVPool, chunk: ForwardLayout, rows: ForwardLayout,
                       n_chunk: int) -> list[MixedLayerCache]:
    """A mixed forward's cache list: a MixedLayerCache a layer (attention layers alone,
    one cache each: see ModelRunner's mixes_rows)."""
    forget_pool_reads()
    _FETCHED.clear()
    assert all(part == "kv" for part, _ in pool.order) and not any(pool.groups)
    return [MixedLayerCache(PooledKVCache(pool, i, chunk, pool.specs[i].kind),
                            PooledKVCache(pool, i, rows, pool.specs[i].kind), n_chunk)
            for _, i in pool.order]


class UnusedCache:
    """Where mlx-lm makes a cache the model's code never filled at the start-up probe
    (UnusedLayerSpec): any use of it now is an error, not a cache kept nowhere."""

    def __init__(self, index: int) -> None:
        self._index = index

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"unused cache {self._index}: the model's code reads `{name}` of a "
                             "cache it never filled at start-up")


class PooledCacheList:
    """A layer of several caches (mlx-lm's CacheList protocol): the model indexes them."""

    def __init__(self, caches: list[PooledKVCache | PooledStateCache]) -> None:
        self.caches = caches

    def __getitem__(self, index: int) -> PooledKVCache | PooledStateCache:
        return self.caches[index]

    def own_scores_part(self) -> PooledKVCache | None:
        """The list's first K/V cache where its layer computes its own scores, else None:
        a model handing attention the whole list with K/V it made itself (DeepSeek-V3.2:
        its MLA expanded, its indexer's picks in the mask) is attended as that cache's
        own-scores layer (in prefill, the backend's attention: no cuDNN graph built for
        each prompt's shape)."""
        parts = [c for c in self.caches if isinstance(c, PooledKVCache)]
        return parts[0] if parts and parts[0].kind.own_attention else None


def check_written(caches: list[PooledKVCache]) -> None:
    """After a forward: every layer stored its K/V. A decode forward leaves the store to
    the attention call; a model that attends some other way than through mlx-lm's
    scaled_dot_product_attention would lose them, so it is refused here."""
    parts = [c for cache in caches
             for c in (cache.caches if isinstance(cache, PooledCacheList)
                       else [cache.chunk, cache.rows] if isinstance(cache, MixedLayerCache)
                       else [cache])]
    for i, cache in enumerate(parts):
        if isinstance(cache, PooledKVCache) and not cache.written and not cache.kind.own_attention:
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
    import mlx_lm.models.base as base

    original = getattr(base.scaled_dot_product_attention, "__wrapped__", base.scaled_dot_product_attention)

    def attention(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001, ANN202
        if ProbeRecorder.current is not None:
            ProbeRecorder.current.saw_attention(cache, queries, keys, values, sinks, mask)
        source = fetched_from(keys)
        if source is not None and source is not cache:
            cache = source  # another layer's K/V, with its cache or none: that cache's
        if isinstance(cache, PooledCacheList):
            cache = cache.own_scores_part() or cache
        if isinstance(cache, PooledKVCache):
            if cache.takes_latent(keys, values):
                return cache.latent_attention(queries, scale, mask)
            own = cache.kind.own_attention
            if cache.paged and not own:
                return cache.paged_attention(queries, scale, sinks)
            if cache.paged and mask is None and not isinstance(cache.offset, int):
                # Rows of different lengths, right-padded in dense K/V, with no mask: the
                # model's mask was another layer's (AFM 7's first layer is paged and has
                # none), so each row's length masks its padding here.
                mask = cache.make_mask(queries.shape[2])
            if not cache.paged:
                # Straight from the pool, where the backend's prefill kernel serves the layer.
                out = cache.backend.paged_prefill_attention(cache, queries, scale, sinks)
                if out is not None:
                    return out
                if cache.kind.windowed:
                    # Ours, not the model's: a model may skip the mask for one new token,
                    # or build it from one scalar offset; the layout knows every row's
                    # window.
                    mask = cache.layout.kind_mask(cache.kind, cache.key_start)
                # A prefill forward's attention; a layer with its own scores (MLA's
                # expanded K/V, its RoPE scores as the mask) too, so no cuDNN graph is
                # built for each prompt's shape, unless the backend leaves it to MLX.
                backend = cache.backend
                prefill = backend.own_prefill_attention if own else backend.prefill_attention
                out = prefill(queries, keys, values, scale, mask, sinks, cache.layout.once)
                if out is not None:
                    return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attention.__wrapped__ = original
    repoint("scaled_dot_product_attention", (original, base.scaled_dot_product_attention),
            attention)


def batches_ragged_rows(model: Any, specs: list, backend: DecodeBackend) -> bool:
    """Whether the model's own code, fed through these adapters, gives every row of a
    decode batch whose rows have different context lengths what that row gets alone.
    Not every mlx-lm model does: Gemma 2 broadcasts a per-row mask against its grouped
    scores and fails, llama4 builds its chunk mask from one scalar offset. The runner
    batches such a model's forwards only over rows of one length. A few rows of random
    K/V in a scratch pool, one decode token each; more rows than any head count, so a
    mask broadcast against heads cannot pass by chance."""
    kv_specs = attention_specs(specs)
    if not kv_specs:
        return True  # no attention layer: no mask to get wrong
    rows = 2 * max(s.n_kv_heads for s in kv_specs) + 3
    table = (1 + np.arange(rows)[:, None] * rows + np.arange(rows)[None]).astype(np.int32)
    pool = KVPool(specs, rows * rows, backend, state_rows=rows)
    pool.layers = [mx.random.normal(a.shape).astype(a.dtype) for a in pool.layers]
    tokens = mx.array(np.arange(rows, dtype=np.int32) + 1)[:, None]

    def decode(picked: np.ndarray, lengths: np.ndarray) -> mx.array:
        # Each run from zero states (a state write updates its array in place).
        pool.states = [[mx.zeros_like(a) for a in layer] for layer in pool.states]
        dense = backend.decode_context(len(kv_specs), 1 << 40, KVPool.bytes_per_slot(specs))
        if dense is not None:  # as the runner decodes
            dense.plan(tuple(int(r) for r in picked), lengths[picked])
        layout = ForwardLayout.decode(table[picked], lengths[picked], dense)
        caches = build_layer_caches(pool, layout, mx.array(picked + 1, dtype=mx.int32))
        return model(tokens[mx.array(picked)], cache=caches)[:, -1, :].astype(mx.float32)

    def batching_error(lengths: np.ndarray) -> tuple[np.ndarray, float]:
        """The batch's logits against each row's alone: each row's largest difference,
        and the largest logit."""
        together = decode(np.arange(rows), lengths)
        alone = mx.concatenate([decode(np.array([r]), lengths) for r in range(rows)])
        return np.array(mx.abs(together - alone).max(axis=-1)), mx.abs(alone).max().item()

    tol = probe_tolerance(model)
    try:
        ragged, scale = batching_error(np.arange(1, rows + 1, dtype=np.int32))
        if float(ragged.max()) <= tol * scale:
            return True  # within the least bound below: no need to measure the rounding
        # Rounding apart: a batch of one length has no per-row masks or offsets to get
        # wrong, so its difference from the rows alone is the batched matmuls' rounding
        # (bf16 on the H200: ~10% of the largest logit for a random 9B hybrid, where a
        # fixed 3% refused it). A row that read another's mask or padding is off by
        # about the logits' own size.
        rounding, _ = batching_error(np.full(rows, rows, dtype=np.int32))
    except Exception:  # noqa: BLE001 - a model that cannot take such a batch at all
        logger.info("ragged-batch probe: the model's code failed on rows of different lengths",
                    exc_info=True)
        return False
    bound = max(tol * scale, 1.5 * float(rounding.max()))
    if float(ragged.max()) <= bound:
        return True
    # What tells a mask bug (most rows off) from rounding that flipped a few rows' choices
    # (an MoE's routing near a tie in 16 bits): for the start-up log, not the verdict.
    off = tol * scale
    logger.info("ragged-batch probe: rows of different lengths differ from each row alone by "
                "up to %.3g, rows of one length by up to %.3g (logits up to %.3g); rows off by "
                "more than %.3g: %d of %d ragged, %d at one length", float(ragged.max()),
                float(rounding.max()), scale, off, int((ragged > off).sum()), rows,
                int((rounding > off).sum()))
    return False


def pads_state_rows(model: Any, specs: list, backend: DecodeBackend) -> bool:
    """Whether a prefill forward over prompts of different lengths, right-padded, leaves
    every row's recurrent state as that prompt alone does (the model keeps padded
    positions out of its state through ArraysCache's `lengths`, as mlx-lm's batch prefill
    relies on); judged by a decode step after it, against each prompt alone, with the
    rounding of a batch of equal lengths as the yardstick. Then prefill chunks of such a
    model may share forwards."""
    if not any(isinstance(s, StateLayerSpec) for s in flat_specs(specs)):
        return True
    rows, longest = 3, 12
    width = longest + 2
    table = (1 + np.arange(rows)[:, None] * width + np.arange(width)[None]).astype(np.int32)
    pool = KVPool(specs, rows * width, backend, state_rows=rows)
    prompts = np.random.default_rng(0).integers(1, 64, size=(rows, longest)).astype(np.int32)

    def decoded(picked: np.ndarray, sizes: np.ndarray) -> mx.array:
        pool.states = [[mx.zeros_like(a) for a in layer] for layer in pool.states]
        state_rows = mx.array(picked + 1, dtype=mx.int32)
        layout = ForwardLayout.prefill(table[picked], np.zeros(len(picked), dtype=np.int64),
                                       sizes[picked])
        tokens = np.where(np.arange(longest)[None] < sizes[picked][:, None], prompts[picked], 0)
        lengths = mx.array(sizes[picked].astype(np.int32)) if len(picked) > 1 else None
        caches = build_layer_caches(pool, layout, state_rows, True, lengths)
        mx.eval(model(mx.array(tokens[:, :int(sizes[picked].max())]), cache=caches),
                pool.landing())
        step = ForwardLayout.decode(table[picked], sizes[picked] + 1)
        caches = build_layer_caches(pool, step, state_rows)
        last = mx.array(prompts[picked, 0])[:, None]
        return model(last, cache=caches)[:, -1, :].astype(mx.float32)

    def sharing_error(sizes: np.ndarray) -> tuple[float, float]:
        together = decoded(np.arange(rows), sizes)
        alone = mx.concatenate([decoded(np.array([r]), sizes) for r in range(rows)])
        return mx.abs(together - alone).max().item(), mx.abs(alone).max().item()

    tol = probe_tolerance(model)
    try:
        padded, scale = sharing_error(np.array([4, 8, longest]))
        if padded <= tol * scale:
            return True  # within the least bound below: no need to measure the rounding
        rounding, _ = sharing_error(np.full(rows, longest))
        return padded <= max(tol * scale, 1.5 * rounding)
    except Exception:  # noqa: BLE001 - a model whose code cannot take padded rows
        return False


def probe_tolerance(model: Any) -> float:
    """The start-up probes' fixed tolerance, relative to the largest logit: float32's
    rounding is far below it, 16-bit models' batched matmuls round more."""
    return 1e-4 if model_dtype(model) == mx.float32 else 3e-2


def model_dtype(model: Any) -> mx.Dtype:
    """The dtype of the model's first floating-point parameter."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32

"""The KV pool: every attention layer's K/V, addressed by the scheduler's slot ids.

Slot 0 is padding: it is never handed out; padded positions write and read it, and the
attention masks hide what they read.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import mlx.core as mx

from worker_proc.decode_backend import DecodeBackend, choose_decode_backend
from worker_proc.layer_kinds import LayerKind
from worker_proc.paged_attention import after_write, split_kv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Shape of one attention layer's cache entry per token, and the layer's kind."""

    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: mx.Dtype
    kind: LayerKind = LayerKind()

    @property
    def bytes_per_slot(self) -> int:
        return (self.n_kv_heads * (self.head_dim + self.v_head_dim)) * self.dtype.size


class KVPool:
    """One array per attention layer, [num_slots + 1, n_kv_heads, head_dim + v_head_dim]:
    a token's keys and values side by side, so a step stores both with one write (on
    MLX's CUDA backend each launch costs ~20 us of host time; two per layer were ~1.4 ms
    of a 6 ms batch-1 step on the H200).

    Two ways to write, fixed per pool:
    - scatter (plain MLX, every backend): the write replaces the layer's array. MLX
      updates the buffer in place only if nothing else holds the old array when the
      write is launched, and a launched read holds its inputs until it completes: a
      write launched while the previous step still reads the layer copies it (the whole
      pool, at a step's scale). So no step may be launched while another runs.
    - in place (`in_place`, where the decode backend says so: the CUDA kernel's): its
      kernel writes the rows into the layer's buffer, which never changes (see
      pool_write_in_place). Writes cannot copy, so steps may be launched back to back:
      the device runs them in launch order. Each write leaves a mark that reads of the
      layer take as an input (`mark`), so they follow it; the next write to the layer
      takes it too, so a read follows every write before it, evaluated or not.
    `landing()` is what a step evaluates for its writes to land: the layer arrays, or
    the marks.
    """

    def __init__(self, specs: list[AttentionLayerSpec], num_slots: int,
                 backend: DecodeBackend | None = None) -> None:
        """backend: who reads and writes the pool (default: the one chosen for these
        layers on this device); it says whether writes go in place."""
        self.specs = specs
        self.num_slots = num_slots
        self.backend = backend or choose_decode_backend(specs)
        self.in_place = self.backend.in_place
        rows = num_slots + 1
        self.layers = [_zeros(rows, s.n_kv_heads, s.head_dim + s.v_head_dim, s.dtype) for s in specs]
        mx.eval(self.layers)
        # In place: each layer's last write's mark, and the marks not yet taken by a step.
        self._marks: list[mx.array | None] = [None] * len(specs)
        self._unlanded: list[mx.array] = []

    @staticmethod
    def bytes_per_slot(specs: list[AttentionLayerSpec]) -> int:
        return sum(s.bytes_per_slot for s in specs)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.layers)

    def keys(self, layer: int) -> mx.array:
        """The layer's keys, [num_slots + 1, n_kv_heads, head_dim] (a strided view)."""
        return self.layers[layer][..., :self.specs[layer].head_dim]

    def values(self, layer: int) -> mx.array:
        return self.layers[layer][..., self.specs[layer].head_dim:]

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store new K/V ([B, H, S, D], the model's layout) under slots [B * S]."""
        if self.in_place:
            self.record_write(layer, self.backend.write_rows(self.layers[layer], slots, keys,
                                                             values, self._marks[layer]))
            return
        b, h, s, _ = keys.shape
        if s == 1:  # decode: [B, H, 1, D] is token-major already
            both = mx.concatenate([keys, values], axis=-1)
        else:  # one copy into token-major [B, S, H, Dk + Dv] (none more for the reshape)
            both = mx.concatenate([keys.swapaxes(1, 2), values.swapaxes(1, 2)], axis=-1)
        self.layers[layer][slots] = both.reshape(b * s, h, both.shape[-1])

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Gather K/V for slots [B, L] into the model's [B, H, L, D] layout."""
        gathered = self.layers[layer][after_write(slots, self._marks[layer])]
        return split_kv(gathered, self.specs[layer].head_dim)

    def record_write(self, layer: int, mark: mx.array) -> None:
        """In place: a kernel wrote the layer (after its previous write); its mark."""
        self._marks[layer] = mark
        self._unlanded.append(mark)

    def mark(self, layer: int) -> mx.array | None:
        """In place: the mark of the layer's last write, for a reader to take as input."""
        return self._marks[layer]

    def landing(self) -> list[mx.array]:
        """What to evaluate for every write so far to land (see the class note)."""
        return list(self._unlanded) if self.in_place else list(self.layers)

    def take_landing(self) -> list[mx.array]:
        """landing(), for a step that takes charge of evaluating it: in place, the marks
        are not handed out again."""
        landing = self.landing()
        self._unlanded.clear()
        return landing

    def with_layers(self, layers: "list[mx.array] | tuple[mx.array, ...]") -> "KVPool":
        """A pool of this layout over the given layer arrays, with no writes yet: what a
        traced (mx.compile) forward writes, so the trace's placeholders stay out of this
        pool."""
        view = copy.copy(self)
        view.layers = list(layers)
        view._marks = [None] * len(self.specs)
        view._unlanded = []
        return view

    def adopt_marks(self, marks: list[mx.array]) -> None:
        """In place: the marks a compiled forward returned (one per layer, in order) stand
        for its writes."""
        assert self.in_place and len(marks) == len(self.layers)
        self._marks = list(marks)
        self._unlanded.extend(marks)


def _zeros(rows: int, heads: int, dim: int, dtype: mx.Dtype) -> mx.array:
    # Filling a flat buffer and reshaping it is ~8x faster on the CPU backend than a 3-D
    # mx.zeros (seen: 1.4 s vs 0.18 s for 512 MiB), which matters for multi-GiB pools.
    return mx.zeros((rows * heads * dim,), dtype).reshape(rows, heads, dim)

"""Host-written step inputs in memory of their own, reused step after step.

On MLX's CUDA backend an array made from host data (`mx.array(numpy)`) takes a buffer
from MLX's buffer cache, which also holds device buffers that kernels left behind; when
it gets one, MLX moves it to managed memory first (cudaMallocManaged and a blocking
cudaMemcpy), which can wait for the work in flight. A decode step made a handful of
such arrays (slot table, lengths, state rows, ...): with two steps in flight, that wait
is the previous step's whole run, so the host's graph building stopped overlapping the
device (measured on a hybrid's compiled decode: docs/benchmarks.md, session 12).

`HostStaging` keeps a few managed buffers of its own and writes each step's inputs (slot
tables, lengths, sampling settings) into one of them through a numpy view, handing out
slices of it: nothing is allocated a step. A buffer is written again only `depth` steps
later; with at most two steps in flight, the steps that read it have finished by then.

A buffer that must grow (a longer context's slot table) is made anew: the host pays for
the new managed pages' first touch (and it may wait as above, were MLX to hand it a
device buffer from its cache). Whether the device reads what the host writes is a
property of the platform, so it is checked once a process (each check reads a result
back: a wait for every step in flight). Buffers start at MIN_ELEMENTS words and grow by
GROWTH, so a serving run meets few growths. At 4,096 words doubling, a spread prefill's
pieces at 1,024-token steps of one prompt's context grew every buffer of their ring
twice, and 32 decoding streams' slot tables grew the decode ring's at each doubling of
their contexts: each growth a 5-18 ms stall of the host with the device busy
(docs/benchmarks.md, session 57).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)

_DTYPES = {np.dtype(np.uint32): mx.uint32, np.dtype(np.float32): mx.float32}
# Steps between two writes of one buffer: two in flight, one being built, one to spare.
DEPTH = 4
MIN_ELEMENTS = 1 << 17  # 512 KiB a buffer: ~16 MiB for a worker's eight rings of four
GROWTH = 4
# Whether the device reads host writes into MLX's arrays here (None: not yet checked).
_reads_host_writes: bool | None = None


# What makes a use's MLX arrays from numpy ones: HostStaging.add / .stage, or new_arrays.
Stage = Callable[..., "list[mx.array]"]


def new_arrays(*parts: np.ndarray) -> list[mx.array]:
    """The parts as new MLX arrays (what HostStaging stands in for)."""
    return [mx.array(p) for p in parts]


class HostStaging:
    """A ring of host-writable 4-byte-word buffers for the small inputs of a use (a decode
    step, a prefill forward, a step's sampling settings): `begin` starts a use, `add`
    writes parts into its buffer; `stage` is both for a use of one call."""

    def __init__(self, depth: int = DEPTH) -> None:
        self._buffers: list[tuple[mx.array, np.ndarray] | None] = [None] * depth
        self._k = 0
        self._at = 0  # where the current use's next part goes in its buffer
        self._unwritable = False
        self.grown = 0  # buffers made or remade (each an allocation)

    def begin(self) -> None:
        """A new use: the next buffer of the ring, last written `depth` uses ago."""
        self._k = (self._k + 1) % len(self._buffers)
        self._at = 0

    def stage(self, *parts: np.ndarray) -> list[mx.array]:
        """begin, then add."""
        self.begin()
        return self.add(*parts)

    def add(self, *parts: np.ndarray) -> list[mx.array]:
        """The parts (numpy arrays of 4-byte int32, uint32 or float32) as MLX arrays of
        their shapes and dtypes, read from the current use's buffer."""
        if self._unwritable:
            return new_arrays(*parts)
        total = sum(p.size for p in parts)
        held = self._buffers[self._k]
        if held is None or held[1].size < self._at + total:
            # This use's earlier parts keep the old buffer alive through their slices.
            made = self._buffer(max(self._at + total, GROWTH * (held[1].size if held else 0),
                                    MIN_ELEMENTS))
            if made is None:
                return self.add(*parts)
            held = self._buffers[self._k] = made
            self._at = 0
        array, view = held
        out = []
        for part in parts:
            n, at = part.size, self._at
            view[at:at + n] = np.ascontiguousarray(part).reshape(-1).view(np.int32)
            staged = array[at:at + n].reshape(part.shape)
            out.append(staged if part.dtype == np.int32 else staged.view(_DTYPES[part.dtype]))
            self._at += n
        return out

    def _buffer(self, size: int) -> tuple[mx.array, np.ndarray] | None:
        """A new buffer and its host view; None (and plain arrays from now on) where MLX
        hands out its arrays' memory read-only, or the device does not read what the host
        writes there (checked once a process, twice over: the second write comes after
        the device read it)."""
        global _reads_host_writes
        self.grown += 1
        began = time.perf_counter()
        array, view = host_view_buffer(size)
        if view.flags.writeable:
            if _reads_host_writes is None:
                _reads_host_writes = all(_device_reads(array, view, first) for first in (7, 11))
            if _reads_host_writes:
                logger.debug("a staging buffer grew to %d words in %.2f ms", size,
                             (time.perf_counter() - began) * 1e3)
                return array, view
        logger.warning("the device does not read host writes into MLX's arrays here: step "
                       "inputs are made as new arrays")
        self._unwritable = True
        return None


def host_view_buffer(size: int) -> tuple[mx.array, np.ndarray]:
    """A new MLX array of `size` int32 zeros and the host's numpy view of its memory (on
    CUDA, making the view moves the buffer to managed memory, once)."""
    array = mx.array(np.zeros(size, dtype=np.int32))
    mx.eval(array)
    return array, np.asarray(array)


def _device_reads(array: mx.array, view: np.ndarray, first: int) -> bool:
    """Whether a computation on the default device sees values just written to view."""
    want = np.arange(first, first + 4, dtype=np.int32)
    view[:4] = want
    seen = (array[:4] + 0).tolist()
    view[:4] = 0
    return seen == want.tolist()

"""A step's results read back through memory the host already reads (CUDA's default;
`--experiments array-readback` reads the arrays themselves, the A/B arm).

On MLX's CUDA backend, reading an array on the host (`tolist`, `item`) moves its device
buffer into a new managed one (cudaMallocManaged and a copy), which the array then keeps.
Once the array is dropped that buffer goes to MLX's buffer cache, and when the cache gives
buffers back (at its cap, or at any allocation it cannot serve while the device's memory
pool reserves over 95% of the card: MLX 0.32's allocator, docs/architecture.md) a managed
one is freed with cudaFree, which waits for all the device's work in flight: the host
stalls for up to the steps in flight, and the device then idles while the host builds the
next one. A decode step's tokens are read every step, so every step adds one such buffer;
the worker's step log sees the cache fall at the step after most slow gaps of Gemma's
mixed traffic (docs/benchmarks.md, sessions 57-58).

`ReadbackRing` copies a step's results, on the device and in one small kernel, into a
ring of managed buffers it holds for the process (one a step, written `depth` steps apart
as HostStaging's are), and hands back a one-element mark: MLX keeps arrays of 8 bytes or
less in a managed region of their own that it never frees with cudaFree. The host waits
on the mark and reads the results from its view of the buffer, so nothing it reads a
step is ever freed. `prefill_mark` is the same for a prefill forward's wait: a one-element
copy of a logit, where a view of the logits would move the whole logits buffer. A step's
prompt logprobs ride in its landing, after its results.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from worker_proc.staging import DEPTH, GROWTH, host_view_buffer

MIN_WORDS = 1 << 14  # 64 KiB a buffer: 128 rows' tokens and top-20 logprobs fit
_NP_DTYPES = {mx.int32: np.int32, mx.uint32: np.uint32, mx.float32: np.float32}

# One thread a word; the ring's row comes in as an input (MLX has no in-place custom
# kernel) and is written through a cast pointer; `done` (its one element) is the mark.
SOURCE = r"""
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) done[0] = 0;
    if (i < src_shape[0]) {
        int* out = const_cast<int*>(dst);
        out[i] = src[i];
    }
"""
_THREADS = 256


@functools.cache
def _copy_kernel():
    # ensure_row_contiguous: the source may be a strided view; the ring's row is always
    # row-contiguous, so MLX hands over its own buffer, never a copy.
    return mx.fast.cuda_kernel(name="kiln_readback", input_names=["dst", "src"],
                               output_names=["done"], source=SOURCE)


def cuda_copy(dst: mx.array, src: mx.array) -> mx.array:
    """Copy src (int32 [n]) into dst[:n] in place on the device; returns the one-element
    mark that follows the copy."""
    n = src.shape[0]
    return _copy_kernel()(inputs=[dst, src], grid=(-(-n // _THREADS) * _THREADS, 1, 1),
                          threadgroup=(_THREADS, 1, 1), output_shapes=[(1,)],
                          output_dtypes=[mx.int32])[0]


# What copies a step's words into a ring buffer and returns the mark (cuda_copy; tests
# stand in for it on the CPU).
Copy = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class Readback:
    """A step's results on their way into a ring buffer: `done` (computed with the step)
    marks their arrival; parts' shapes and dtypes say how to read the words."""

    done: mx.array
    parts: tuple[tuple[tuple[int, ...], type], ...]
    buffer: int  # which of the ring's
    use: int  # the ring's count of landings when this one was made


class ReadbackRing:
    """A ring of host-read buffers a step's results are copied into on the device."""

    def __init__(self, copy: Copy = cuda_copy, depth: int = DEPTH) -> None:
        self._copy = copy
        self._buffers: list[tuple[mx.array, np.ndarray] | None] = [None] * depth
        self._k = 0
        self._uses = 0
        self._last_use = [0] * depth  # by buffer: the landing that wrote it last

    def land(self, *parts: mx.array) -> Readback:
        """Copy the parts (4-byte int32, uint32 or float32 arrays) into the next buffer
        of the ring, lazily: the returned mark computes with the step."""
        words = [p.reshape(-1) if p.dtype == mx.int32 else p.reshape(-1).view(mx.int32)
                 for p in parts]
        flat = words[0] if len(words) == 1 else mx.concatenate(words)
        self._k = (self._k + 1) % len(self._buffers)
        self._uses += 1
        self._last_use[self._k] = self._uses
        array = self._buffer(self._k, flat.shape[0])
        return Readback(self._copy(array, flat),
                        tuple((tuple(p.shape), _NP_DTYPES[p.dtype]) for p in parts),
                        self._k, self._uses)

    def read(self, readback: Readback) -> list[np.ndarray]:
        """Wait for the step and return its parts (copies, in their shapes and dtypes)."""
        if self._last_use[readback.buffer] != readback.use:
            raise RuntimeError(f"a step's results were read back after {len(self._buffers)} "
                               "later landings reused their buffer: more steps in flight "
                               "than the readback ring holds")
        words, at, out = self._words(readback), 0, []
        for shape, dtype in readback.parts:
            n = int(np.prod(shape, dtype=np.int64))
            out.append(words[at:at + n].view(dtype).reshape(shape).copy())
            at += n
        return out

    def _words(self, readback: Readback) -> np.ndarray:
        """The host's view of the words a landing wrote, once they are there."""
        # Waits for this step's work alone (its own event), without the GIL (item() keeps
        # it): a launch thread then gets on with the next step meanwhile.
        mx.eval(readback.done)
        held = self._buffers[readback.buffer]  # the one it landed in (no landing since)
        assert held is not None
        return held[1]

    def _buffer(self, k: int, words: int) -> mx.array:
        """Buffer k, made or remade to hold `words` (one a step in flight still writes
        stays alive through that step's graph)."""
        held = self._buffers[k]
        if held is None or held[1].size < words:
            size = max(words, MIN_WORDS, GROWTH * (held[1].size if held else 0))
            held = self._buffers[k] = host_view_buffer(size)  # managed from here on
        return held[0]


def reads_back_here(copy: Copy = cuda_copy) -> bool:
    """Whether the host reads, through a buffer's view, what `copy` wrote there on the
    device (checked once a process, at start-up)."""
    ring = ReadbackRing(copy, depth=1)
    for first in (5, 105):  # the second time over words the host has read
        want = np.arange(first, first + 40, dtype=np.int32)
        if not np.array_equal(ring.read(ring.land(mx.array(want)))[0], want):
            return False
    return True


def prefill_mark(logits: mx.array) -> mx.array:
    """A one-element copy of a forward's first logit: what the host waits on for that
    forward (a view would move the whole logits buffer to managed memory when read)."""
    return logits.reshape(-1)[:1] + 0

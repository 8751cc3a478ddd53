"""How kiln's CUDA kernels take their constants, and the shape of an in-place write's mark."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# Kernels' constants never come in as arrays of 8 bytes or less: MLX's CUDA allocator keeps
# all such arrays in one managed region, which the host writes whenever it makes a small
# array (a graph's Python scalars), so a kernel reading one waits for that memory's trip
# back from the host: a 64-row q/k norm kernel took 10-34 us against 3 (docs/
# benchmarks.md, session 28). Scalars are template arguments (float_bits, read with
# __int_as_float); small arrays are padded past CONSTANT_ELEMENTS and made by a kernel,
# which puts them in device memory.
CONSTANT_ELEMENTS = 64
# An in-place write's mark (its element 0 written by the kernel): as wide, for the same
# reason (a kernel's store to that region waits on it too).
MARK_SHAPE = (CONSTANT_ELEMENTS,)


def float_bits(x: float) -> int:
    """x as a float32's bits, a signed 32-bit int: a kernel's float constant passed as an
    int template argument (the kernel reads it with __int_as_float)."""
    return int(np.array(x, dtype=np.float32).view(np.int32))


def padded_constant(head: mx.array) -> mx.array:
    """A kernel's small float32 input `head` followed by zeros to CONSTANT_ELEMENTS (at
    least), by a concatenation: an array in device memory on CUDA (see above). Lazy;
    make it outside mx.compile (at load), where it is evaluated once."""
    pad = max(0, CONSTANT_ELEMENTS - head.size)
    return mx.concatenate([head.astype(mx.float32), mx.zeros((pad,), dtype=mx.float32)])

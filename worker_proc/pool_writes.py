"""In-place writes into the KV pool and the recurrent state arrays, and the marks that order
their readers after them (MLX sees neither the writes nor the order on its own)."""

from __future__ import annotations

import functools

import mlx.core as mx

from worker_proc.kernel_constants import MARK_SHAPE


@functools.cache
def _no_write() -> mx.array:
    return mx.zeros(MARK_SHAPE, dtype=mx.int32)


def follow_mark(mark: mx.array | None) -> mx.array:
    """A kernel's input that orders it after the in-place write whose mark is given (a
    constant zero where there is none to follow)."""
    return _no_write() if mark is None else mark


# Writes every new token's keys and values into its pool row, in place: MLX hands a
# kernel its inputs as const pointers and has no in-place custom kernel, so the pool comes
# in as an input and is written through a cast pointer. MLX never learns of the write;
# the `written` output (the mark: its element 0 a zero) is what later readers take as an
# input so that they run after it, and `after` (the previous write's) chains the writes
# to a layer, so a reader of the last one follows them all. One thread per element of a
# token's pool row.
_WRITE_SOURCE = r"""
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) written[0] = 0;
    constexpr int W = DK + DV;
    const int s_len = keys_shape[2];
    const size_t tokens = (size_t)keys_shape[0] * s_len;
    if (i >= tokens * HKV * W) return;
    const int c = i % W;
    const int h = (i / W) % HKV;
    const size_t t = i / ((size_t)W * HKV);
    const size_t b = t / s_len;
    const size_t s = t % s_len;
    const float x = c < DK
        ? static_cast<float>(keys[b * keys_strides[0] + h * keys_strides[1] + s * keys_strides[2]
                                  + c * keys_strides[3]])
        : static_cast<float>(values[b * values_strides[0] + h * values_strides[1]
                                    + s * values_strides[2] + (c - DK) * values_strides[3]]);
    T* pool = const_cast<T*>(kv_pool);
    pool[((size_t)slots[t * slots_strides[0]] * HKV + h) * W + c] = static_cast<T>(x);
"""


@functools.cache
def _write_kernel():
    # ensure_row_contiguous=False: MLX must hand over the pool's own buffer, never a
    # contiguous copy (a write into a copy would be lost); keys and values are read
    # through their strides, so they need no copy either.
    return mx.fast.cuda_kernel(name="kiln_pool_write",
                               input_names=["kv_pool", "keys", "values", "slots", "after"],
                               output_names=["written"], source=_WRITE_SOURCE,
                               ensure_row_contiguous=False)


def after_write(indices: mx.array, mark: mx.array | None) -> mx.array:
    """Slot ids that a gather from the pool reads through, made to follow the in-place
    write whose mark is given (its first element is a zero; None: no write to follow)."""
    return indices if mark is None else indices + mark[0]


def pool_write_in_place(kv_pool: mx.array, slots: mx.array, keys: mx.array,
                        values: mx.array, after: mx.array | None = None) -> mx.array:
    """Store keys [B, H, S, Dk] and values [B, H, S, Dv] (the model's layout) in kv_pool
    [rows, H, Dk + Dv] (KVPool's layer array, as allocated: contiguous) at slots [B * S],
    in place, after the write whose mark is `after`; returns this write's mark (int32 of
    MARK_SHAPE, its first element a zero), which anything that reads the pool afterwards
    must take as an input (a dependency MLX cannot see otherwise).

    Two writes to one slot in a call (padding writes slot 0) leave one of them."""
    b, h, s, dk = keys.shape
    dv = values.shape[-1]
    total = b * s * h * (dk + dv)
    # Values 0 wide (a layer keeping keys alone: MiniMax M3's indexer, values_are_keys)
    # are never read: the keys stand in, so the kernel gets no empty buffer.
    (written,) = _write_kernel()(
        inputs=[kv_pool, keys, values if dv else keys, slots.astype(mx.int32),
                follow_mark(after)],
        template=[("T", kv_pool.dtype), ("TK", keys.dtype), ("HKV", h), ("DK", dk),
                  ("DV", dv)],
        grid=(-(-total // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[MARK_SHAPE], output_dtypes=[mx.int32])
    return written


# Copies whole rows into an array in place (a recurrent layer's state rows: KVPool.states),
# through a cast pointer as the pool write above; one thread per element.
_ROWS_WRITE_SOURCE = r"""
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) written[0] = 0;
    const size_t n = value_shape[1];
    if (i >= (size_t)value_shape[0] * n) return;
    T* out = const_cast<T*>(dst);
    out[(size_t)rows[i / n] * n + i % n] = static_cast<T>(value[i]);
"""


@functools.cache
def _rows_write_kernel():
    # dst must reach the kernel as itself (see _write_kernel); value comes row-contiguous.
    return mx.fast.cuda_kernel(name="kiln_rows_write", input_names=["dst", "rows", "value", "after"],
                               output_names=["written"], source=_ROWS_WRITE_SOURCE,
                               ensure_row_contiguous=False)


def rows_write_in_place(dst: mx.array, rows: mx.array, value: mx.array,
                        after: mx.array | None = None) -> mx.array:
    """Store value [B, *row] as rows `rows` [B] of dst [R, *row] (contiguous, as
    allocated), in place, after the write whose mark is `after`; returns this write's
    mark (see pool_write_in_place). Two writes to one row in a call leave one of them."""
    b = value.shape[0]
    flat = mx.contiguous(value).reshape(b, -1)
    (written,) = _rows_write_kernel()(
        inputs=[dst, rows.astype(mx.int32), flat, follow_mark(after)],
        template=[("T", dst.dtype)],
        grid=(-(-flat.size // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[MARK_SHAPE], output_dtypes=[mx.int32])
    return written

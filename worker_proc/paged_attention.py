"""Decode attention that reads K/V straight from the pool, by slot id, per-row length.

The dense path (gather every row's context into a padded block, mask the padding) works
everywhere but costs a gather per layer and step and, for ragged batches, an array mask
that keeps MLX's fused attention kernel off. On the CUDA backend this module's kernel
reads the pool through the slot table and stops at each row's own length: no gather, no
padding, no mask. It is split along the context (flash-decoding) so a few long rows still
fill the GPU; an MLX reduction merges the splits.

Other backends (the CPU, Metal for now) use the dense path: it is the plain-MLX fallback
that the CPU tests exercise.
"""

from __future__ import annotations

import functools
import logging
import math

import mlx.core as mx

logger = logging.getLogger(__name__)

# Tokens one thread block reads. Small enough that short contexts still make several
# blocks per (row, kv head), large enough that merging the splits stays cheap.
SPLIT_TOKENS = 256
_THREADS = 128  # four warps per block

_SOURCE = r"""
    constexpr int NW = 4;
    constexpr int E = D / 32;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_splits = gridDim.x;
    const int len = lengths[b];
    const int start = split * CHUNK;
    const int end = min(start + CHUNK, len);
    const size_t lmax = table_shape[1];  // a runtime value: a template would recompile per length
    const float sc = scale[0];
    const float neg_inf = __int_as_float(0xff800000);

    float qv[G][E];
    for (int g = 0; g < G; ++g) {
        const T* qp = q + ((size_t)b * HKV * G + kvh * G + g) * D + lane * E;
        for (int e = 0; e < E; ++e) qv[g][e] = static_cast<float>(qp[e]) * sc;
    }
    float m[G], l[G], acc[G][E];
    for (int g = 0; g < G; ++g) {
        m[g] = neg_inf;
        l[g] = 0.f;
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    }
    for (int t = start + warp; t < end; t += NW) {
        const size_t base = ((size_t)table[(size_t)b * lmax + t] * HKV + kvh) * D + lane * E;
        float kv[E], vv[E];
        for (int e = 0; e < E; ++e) {
            kv[e] = static_cast<float>(k_pool[base + e]);
            vv[e] = static_cast<float>(v_pool[base + e]);
        }
        for (int g = 0; g < G; ++g) {
            float s = 0.f;
            for (int e = 0; e < E; ++e) s += qv[g][e] * kv[e];
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
            const float m_new = fmaxf(m[g], s);
            const float alpha = __expf(m[g] - m_new);
            const float p = __expf(s - m_new);
            l[g] = l[g] * alpha + p;
            for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * alpha + p * vv[e];
            m[g] = m_new;
        }
    }

    __shared__ float sm_m[NW][G];
    __shared__ float sm_l[NW][G];
    __shared__ float sm_acc[NW][G][D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
        for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
    }
    __syncthreads();
    const size_t row = ((size_t)b * HKV + kvh) * n_splits + split;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D;
        const int d = i % D;
        float mm = neg_inf;
        for (int w = 0; w < NW; ++w) mm = fmaxf(mm, sm_m[w][g]);
        float ll = 0.f, aa = 0.f;
        for (int w = 0; w < NW; ++w) {
            if (sm_m[w][g] == neg_inf) continue;
            const float f = __expf(sm_m[w][g] - mm);
            ll += sm_l[w][g] * f;
            aa += sm_acc[w][g][d] * f;
        }
        out_acc[(row * G + g) * D + d] = aa;
        if (d == 0) {
            out_ml[(row * G + g) * 2] = mm;
            out_ml[(row * G + g) * 2 + 1] = ll;
        }
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="kiln_paged_decode",
        input_names=["q", "k_pool", "v_pool", "table", "lengths", "scale"],
        output_names=["out_acc", "out_ml"],
        source=_SOURCE,
    )


@functools.cache
def kernel_available() -> bool:
    """The CUDA kernel runs only on MLX's CUDA backend (the GPU must be the default)."""
    try:
        return mx.cuda.is_available() and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def paged_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array,
                           lengths: mx.array, scale: float) -> mx.array:
    """Attention of one new token per row over its pooled context.

    q: [B, Hq, 1, D]; k_pool, v_pool: [slots, Hkv, D]; table: [B, Lmax] int32 slot ids
    (right-padded); lengths: [B] int32 context length per row (the new token included).
    Returns [B, Hq, 1, D] in q's dtype.
    """
    batch, n_q, _, dim = q.shape
    n_kv = k_pool.shape[1]
    group = n_q // n_kv
    l_max = table.shape[1]
    n_splits = max(1, math.ceil(l_max / SPLIT_TOKENS))
    acc, ml = _kernel()(
        inputs=[q.reshape(batch, n_q, dim), k_pool, v_pool, table, lengths, _scale(scale)],
        template=[("T", q.dtype), ("D", dim), ("G", group), ("HKV", n_kv),
                  ("CHUNK", SPLIT_TOKENS)],
        grid=(n_splits * _THREADS, n_kv, batch),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(batch, n_kv, n_splits, group, dim), (batch, n_kv, n_splits, group, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return merge_splits(acc, ml).reshape(batch, n_q, 1, dim).astype(q.dtype)


@functools.cache
def _scale(scale: float) -> mx.array:
    # One device array per model, not a host-to-device copy per layer and step.
    return mx.array([scale], dtype=mx.float32)


def merge_splits(acc: mx.array, ml: mx.array) -> mx.array:
    """Combine per-split partial softmax results: acc [..., S, G, D], ml [..., S, G, 2]
    (running max, running sum) -> [..., G, D]."""
    if acc.shape[-3] == 1:  # one split (contexts up to SPLIT_TOKENS): just normalise
        return acc[..., 0, :, :] / ml[..., 0, :, 1:]
    m, l = ml[..., 0], ml[..., 1]
    m_max = mx.max(m, axis=-2, keepdims=True)
    w = mx.exp(m - m_max)  # empty splits have m = -inf: weight 0
    num = mx.sum(acc * w[..., None], axis=-3)
    den = mx.sum(l * w, axis=-2)
    return num / den[..., None]


def reference_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array,
                               table: mx.array, lengths: mx.array, scale: float) -> mx.array:
    """The plain-MLX meaning of paged_decode_attention: gather, mask, fused SDPA."""
    # Contiguous: on the CPU, attention over the transposed gather view costs ~2x.
    keys = mx.contiguous(k_pool[table].transpose(0, 2, 1, 3))
    values = mx.contiguous(v_pool[table].transpose(0, 2, 1, 3))
    valid = mx.arange(table.shape[1])[None, :] < lengths[:, None]
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale,
                                                mask=valid[:, None, None, :])

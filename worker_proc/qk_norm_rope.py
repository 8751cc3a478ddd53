"""Per-head RMS norm, scale and RoPE of a decode step's q and k heads in one CUDA kernel.

Models that normalise each query and key head before RoPE (Gemma 3) spend four launches
a layer on it in a decode step: a copy of the strided q/k view of the fused projection's
output, the norm, the multiply by the norms' scales, and RoPE (with its transposed
input). On the H200 a 48-layer Gemma decode step is bound by its launches' host time,
and MLX's norm kernel runs slowly on these short rows (docs/benchmarks.md, session 27).
This kernel reads the projection's output in place and writes the rotated heads in
attention's layout, rounding as those ops do: the norm's output, the scaled head and
the rotated head each to the input's dtype. Without the norm it is RoPE alone, for
blocks that only rotate (llama, qwen2: MLX's copy and RoPE, two launches a layer).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from worker_proc.kernel_constants import float_bits
from worker_proc.paged_attention import _ROPE_HEADER, RopeSpec

# A block a (head, row); thread i takes the head's i-th rotation pair. With NORM, the sum
# of squares is reduced over the block: warps (or the one part-warp of a head under 64
# wide) by shuffles, then the warps' partials through shared memory.
_BODY = r"""
    constexpr int HALF = D / 2;
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int i = threadIdx.x;
    const int64_t es = qkv_strides[2];
    const size_t at = (size_t)b * qkv_strides[0] + (size_t)h * D * es;
    const int d1 = TRAD ? 2 * i : i;
    const int d2 = TRAD ? 2 * i + 1 : i + HALF;
    float m1 = static_cast<float>(qkv[at + (size_t)d1 * es]);
    float m2 = static_cast<float>(qkv[at + (size_t)d2 * es]);
    __shared__ float rope_cos[HALF], rope_sin[HALF];
    NORM_PARTIAL
    kiln_rope_angles<D, FREQS>(static_cast<float>(lengths[b * lengths_strides[0]] - 1), rope,
                              rope_cos, rope_sin);
    __syncthreads();
    NORM_APPLY
    if (MSCALE != 0x3f800000) {  // YaRN's input scale (not 1.0f), in T as mlx-lm's multiply
        const float ms = static_cast<float>(static_cast<T>(__int_as_float(MSCALE)));
        m1 = static_cast<float>(static_cast<T>(m1 * ms));
        m2 = static_cast<float>(static_cast<T>(m2 * ms));
    }
    const float c = rope_cos[i], s = rope_sin[i];  // pair i's frequency, either layout
    const size_t o = ((size_t)b * H + h) * D;
    out[o + d1] = static_cast<T>(m1 * c - m2 * s);
    out[o + d2] = static_cast<T>(m1 * s + m2 * c);
"""
_NORM_PARTIAL = r"""constexpr int LANES = HALF < 32 ? HALF : 32;
    constexpr unsigned MASK = LANES == 32 ? 0xffffffffu : (1u << LANES) - 1u;
    constexpr int WARPS = HALF / LANES;
    // Loaded before the reduction's barrier, their latency beside the inputs'.
    const float s1 = static_cast<float>(qk_scale[(size_t)h * D + d1]);
    const float s2 = static_cast<float>(qk_scale[(size_t)h * D + d2]);
    float ss = m1 * m1 + m2 * m2;
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(MASK, ss, o);
    __shared__ float partial[WARPS];
    if (i % LANES == 0) partial[i / LANES] = ss;"""
_NORM_APPLY = r"""float total = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += partial[w];
    const float r = rsqrtf(total / static_cast<float>(D) + __int_as_float(EPS));
    // As mx.fast.rms_norm (x * r, rounded), then the scale's multiply (rounded).
    m1 = static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(m1 * r)) * s1));
    m2 = static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(m2 * r)) * s2));"""


def source(norm: bool) -> str:
    """The kernel's source: the heads normalised and scaled before RoPE, or RoPE alone."""
    return (_BODY.replace("NORM_PARTIAL", _NORM_PARTIAL if norm else "")
            .replace("NORM_APPLY", _NORM_APPLY if norm else ""))


@functools.cache
def _kernel(norm: bool):
    return mx.fast.cuda_kernel(
        name=f"kiln_qk{'_norm' if norm else ''}_rope",
        input_names=["qkv", *(["qk_scale"] if norm else []), "rope", "lengths"],
        output_names=["out"], source=source(norm), header=_ROPE_HEADER,
        ensure_row_contiguous=False)  # qkv read in place; the small inputs are made whole,
                                      # the lengths read through their stride


def fits(rope: RopeSpec) -> bool:
    """Whether the kernel applies this RoPE (over whole heads: its dims the head size): a
    rotation pair a thread, in whole warps (at most a block's 1,024 threads) or in one
    part-warp of a power of two."""
    pairs = rope.dims // 2
    return rope.dims % 2 == 0 and (pairs % 32 == 0 and pairs <= 1024 or pairs in (1, 2, 4, 8, 16))


def decode_qk_norm_rope(qkv: mx.array, heads: int, lengths: mx.array, scale: mx.array | None,
                        eps: float, rope: RopeSpec) -> mx.array:
    """The first `heads` heads of a decode step's fused q/k/v output [B, 1, F] (its q
    heads, then k's), each RMS-normalised (no weight) and multiplied by its row of
    `scale` [heads, D] (scale None: neither), scaled by the RoPE's mscale (YaRN's) and
    rotated at position lengths[b] - 1:
    [B, heads, 1, D], as reference_qk_norm_rope computes (fits(rope) must hold)."""
    batch, dim = qkv.shape[0], rope.dims
    norm = scale is not None
    (out,) = _kernel(norm)(
        inputs=[qkv, *([scale] if norm else []), rope.kernel_params, lengths],
        template=[("T", qkv.dtype), ("D", dim), ("H", heads), ("TRAD", rope.traditional),
                  ("FREQS", rope.freqs is not None), ("EPS", float_bits(eps)),
                  ("MSCALE", float_bits(rope.mscale))],
        grid=(heads * dim // 2, batch, 1), threadgroup=(dim // 2, 1, 1),
        output_shapes=[(batch, heads, 1, dim)], output_dtypes=[qkv.dtype])
    return out


def reference_qk_norm_rope(qkv: mx.array, heads: int, lengths: mx.array, scale: mx.array | None,
                           eps: float, rope: RopeSpec) -> mx.array:
    """What the kernel computes, in MLX ops (the CPU's path, and the CUDA tests' yardstick)."""
    batch, dim = qkv.shape[0], rope.dims
    qk = qkv[..., :heads * dim].reshape(batch, 1, heads, dim)
    if scale is not None:
        qk = mx.fast.rms_norm(qk, None, eps) * scale
    return rope.apply(qk.transpose(0, 2, 1, 3), lengths - 1)

"""A normalised branch added to the residual stream, and the sum normalised again, in one
CUDA kernel: Gemma's sandwich norms.

Gemma 3's block normalises each branch's output before adding it to the residual
(`post_attention_layernorm`, `post_feedforward_layernorm`) and the sum again before the
MLP (`pre_feedforward_layernorm`): five launches a layer in a decode step (three norms,
two adds) whose host time bounds a 48-layer step on the H200 (docs/benchmarks.md,
session 27). Here they are two: h = residual + norm(branch, weight), and with a next
weight also norm(h, next weight), a block a row. Each value is rounded as MLX's ops
round it: the norm's x * r, its product with the weight, the sum (in float16 clipped as
mlx-lm's clip_residual does), the second norm's likewise.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models.gemma3_text import clip_residual

from worker_proc.paged_attention import float_bits

# A block's sum of a float from each of its WARPS warps: shuffles, then the warps'
# partials through `part` (one array a reduction, so a second needs no barrier before it).
_HEADER = r"""
template <int WARPS>
__device__ float kiln_block_sum(float v, float* part) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += part[w];
    return v;
}
"""

# A block a row of BLOCK threads, each holding its E = ceil(D / BLOCK) elements in
# registers between the passes.
_BODY = r"""
    constexpr int E = (D + BLOCK - 1) / BLOCK;
    constexpr int WARPS = BLOCK / 32;
    const size_t row = blockIdx.x;
    const int t = threadIdx.x;
    const T* yr = branch + row * D;
    const T* xr = residual + row * D;
    __shared__ float part1[WARPS], part2[WARPS];
    float v[E];
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        v[e] = d < D ? static_cast<float>(yr[d]) : 0.f;
        ss += v[e] * v[e];
    }
    const float r = rsqrtf(kiln_block_sum<WARPS>(ss, part1) / static_cast<float>(D) + __int_as_float(EPS));
    float hs = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        if (d >= D) continue;
        const float n = static_cast<float>(static_cast<T>(
            static_cast<float>(weight[d]) * static_cast<float>(static_cast<T>(v[e] * r))));
        float sum = static_cast<float>(xr[d]) + n;
        if (CLIP) sum = fminf(fmaxf(sum, -65504.f), 65504.f);  // clip_residual, float16
        const T h = static_cast<T>(sum);
        out[row * D + d] = h;
        v[e] = static_cast<float>(h);
        hs += v[e] * v[e];
    }
    NEXT
"""
_NEXT = r"""
    const float r2 = rsqrtf(kiln_block_sum<WARPS>(hs, part2) / static_cast<float>(D) + __int_as_float(EPS));
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        if (d < D) normed[row * D + d] = static_cast<T>(
            static_cast<float>(next_weight[d]) * static_cast<float>(static_cast<T>(v[e] * r2)));
    }
"""
_MAX_ELEMENTS = 32  # a thread's registers for the row


def source(next_norm: bool) -> str:
    """The kernel's source, with or without the sum's own norm."""
    return _BODY.replace("NEXT", _NEXT if next_norm else "")


def block_threads(dim: int) -> int:
    """Threads a row: 256, or 1,024 for rows past 256 x _MAX_ELEMENTS."""
    return 256 if dim <= 256 * _MAX_ELEMENTS else 1024


def fits(dim: int) -> bool:
    """Whether a row of `dim` fits a block's registers."""
    return dim <= 1024 * _MAX_ELEMENTS


@functools.cache
def _kernel(next_norm: bool):
    return mx.fast.cuda_kernel(
        name=f"kiln_residual_norm{'_next' if next_norm else ''}",
        input_names=["branch", "residual", "weight", *(["next_weight"] if next_norm else [])],
        output_names=["out", *(["normed"] if next_norm else [])], source=source(next_norm),
        header=_HEADER)


def residual_norm(branch: mx.array, residual: mx.array, weight: mx.array, eps: float,
                  next_weight: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """h = clip_residual(residual, rms_norm(branch, weight, eps)) and, with next_weight,
    rms_norm(h, next_weight, eps), as reference_residual_norm computes them (fits(D)
    must hold; [..., D] inputs of one dtype)."""
    dim = branch.shape[-1]
    rows = branch.size // dim
    threads = block_threads(dim)
    next_norm = next_weight is not None
    outs = _kernel(next_norm)(
        inputs=[branch, residual, weight, *([next_weight] if next_norm else [])],
        template=[("T", branch.dtype), ("D", dim), ("BLOCK", threads), ("EPS", float_bits(eps)),
                  ("CLIP", branch.dtype == mx.float16)],
        grid=(rows * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[branch.shape] * (2 if next_norm else 1),
        output_dtypes=[branch.dtype] * (2 if next_norm else 1))
    return outs[0], outs[1] if next_norm else None


def reference_residual_norm(branch: mx.array, residual: mx.array, weight: mx.array, eps: float,
                            next_weight: mx.array | None = None
                            ) -> tuple[mx.array, mx.array | None]:
    """What the kernel computes, in mlx-lm's ops (the CPU's path, the CUDA tests' yardstick)."""
    h = clip_residual(residual, mx.fast.rms_norm(branch, weight, eps))
    return h, None if next_weight is None else mx.fast.rms_norm(h, next_weight, eps)

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

from worker_proc.kernel_constants import float_bits

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
# registers between the passes. Every input is loaded in the first pass, before the first
# reduction's barrier: the residual and the weights' reads then wait beside the branch's,
# not one memory round trip after each reduction.
_BODY = r"""
    constexpr int E = (D + BLOCK - 1) / BLOCK;
    constexpr int WARPS = BLOCK / 32;
    const size_t row = blockIdx.x;
    const int t = threadIdx.x;
    const T* yr = branch + row * D;
    const T* xr = residual + row * D;
    __shared__ float part1[WARPS], part2[WARPS];
    float v[E], res[E], w[E];
    @NEXT_DECLARE@
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        const bool in = d < D;
        v[e] = in ? static_cast<float>(yr[d]) : 0.f;
        res[e] = in ? static_cast<float>(xr[d]) : 0.f;
        w[e] = in ? static_cast<float>(weight[d]) : 0.f;
        @NEXT_LOAD@
        ss += v[e] * v[e];
    }
    const float r = rsqrtf(kiln_block_sum<WARPS>(ss, part1) / static_cast<float>(D)
                           + __int_as_float(EPS));
    float hs = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        if (d >= D) continue;
        const float n = static_cast<float>(static_cast<T>(
            w[e] * static_cast<float>(static_cast<T>(v[e] * r))));
        float sum = res[e] + n;
        if (CLIP) sum = fminf(fmaxf(sum, -65504.f), 65504.f);  // clip_residual, float16
        const T h = static_cast<T>(sum);
        out[row * D + d] = h;
        v[e] = static_cast<float>(h);
        hs += v[e] * v[e];
    }
    @NEXT@
"""
_NEXT = r"""
    const float r2 = rsqrtf(kiln_block_sum<WARPS>(hs, part2) / static_cast<float>(D)
                            + __int_as_float(EPS));
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        if (d < D) normed[row * D + d] = static_cast<T>(
            nw[e] * static_cast<float>(static_cast<T>(v[e] * r2)));
    }
"""
# Elements a thread holds (each the row's, the residual's and the weights'), within a
# block's 64K registers: 16 at 256 threads; 6 at 1,024, whose threads get 64 registers
# (8 compiled to 62 with nvcc: too near for NVRTC's own count).
_ELEMENTS = {256: 16, 1024: 6}


def source(next_norm: bool) -> str:
    """The kernel's source, with or without the sum's own norm."""
    parts = {"@NEXT_DECLARE@": "float nw[E];" if next_norm else "",
             "@NEXT_LOAD@": ("nw[e] = in ? static_cast<float>(next_weight[d]) : 0.f;"
                             if next_norm else ""),
             "@NEXT@": _NEXT if next_norm else ""}
    out = _BODY
    for key, text in parts.items():
        out = out.replace(key, text)
    return out


def block_threads(dim: int) -> int:
    """Threads a row: 256, or 1,024 for longer rows than 256 threads hold."""
    return 256 if dim <= 256 * _ELEMENTS[256] else 1024


def fits(dim: int) -> bool:
    """Whether a row of `dim` fits a block's registers (6,144 wide at most: every Gemma
    3's hidden size)."""
    return dim <= 1024 * _ELEMENTS[1024]


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

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
BLOCK_SUM_HEADER = r"""
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
        header=BLOCK_SUM_HEADER)


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


# A plain residual add and the sum's norm (a llama-style block's attention output, its
# bias and the residual, then the MLP's input norm: GPT-OSS's), a block a row as above:
# the branch plus its bias, rounded as mlx-lm's add rounds it, plus the residual, rounded;
# then the norm of that sum.
_ADD_NORM = r"""
    constexpr int E = (D + BLOCK - 1) / BLOCK;
    constexpr int WARPS = BLOCK / 32;
    const size_t row = blockIdx.x;
    const int t = threadIdx.x;
    __shared__ float part[WARPS];
    float h[E], w[E];
    float hs = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        const bool in = d < D;
        float v = in ? static_cast<float>(branch[row * D + d]) : 0.f;
        @BIAS@
        h[e] = in ? static_cast<float>(static_cast<T>(
            static_cast<float>(residual[row * D + d]) + v)) : 0.f;
        w[e] = in ? static_cast<float>(weight[d]) : 0.f;
        if (in) out[row * D + d] = static_cast<T>(h[e]);
        hs += h[e] * h[e];
    }
    const float r = rsqrtf(kiln_block_sum<WARPS>(hs, part) / static_cast<float>(D)
                           + __int_as_float(EPS));
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = t + e * BLOCK;
        if (d < D) normed[row * D + d] = static_cast<T>(
            w[e] * static_cast<float>(static_cast<T>(h[e] * r)));
    }
"""


def add_norm_source(bias: bool) -> str:
    """The add-and-norm kernel's source, with or without the branch's bias."""
    return _ADD_NORM.replace("@BIAS@", "if (in) v = static_cast<float>(static_cast<T>("
                             "v + static_cast<float>(bias[d])));" if bias else "")


def add_norm_inputs(bias: bool) -> list[str]:
    return ["branch", *(["bias"] if bias else []), "residual", "weight"]


@functools.cache
def _add_norm_kernel(bias: bool):
    return mx.fast.cuda_kernel(
        name=f"kiln_add_norm{'_bias' if bias else ''}", input_names=add_norm_inputs(bias),
        output_names=["out", "normed"], source=add_norm_source(bias), header=BLOCK_SUM_HEADER)


def add_norm(branch: mx.array, bias: mx.array | None, residual: mx.array, weight: mx.array,
             eps: float) -> tuple[mx.array, mx.array]:
    """h = residual + (branch + bias) and rms_norm(h, weight, eps), as reference_add_norm
    computes them (fits(D) must hold; [..., D] inputs of one dtype, bias [D])."""
    dim = branch.shape[-1]
    threads = block_threads(dim)
    inputs = [branch, *([] if bias is None else [bias]), residual, weight]
    out, normed = _add_norm_kernel(bias is not None)(
        inputs=inputs,
        template=[("T", branch.dtype), ("D", dim), ("BLOCK", threads), ("EPS", float_bits(eps))],
        grid=(branch.size // dim * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[branch.shape] * 2, output_dtypes=[branch.dtype] * 2)
    return out, normed


def reference_add_norm(branch: mx.array, bias: mx.array | None, residual: mx.array,
                       weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """What add_norm computes, in mlx-lm's ops and order (its block's `x + o_proj(...)`,
    the Linear's bias added after its matmul, then the RMSNorm call)."""
    h = residual + (branch if bias is None else branch + bias)
    return h, mx.fast.rms_norm(h, weight, eps)

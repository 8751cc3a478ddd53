"""Decode GEMMs as one custom CUDA kernel each, instead of MLX's cuBLAS call (experimental).

On the H200 a 64-row decode step is bound by the host, and MLX's CUDA matmul costs ~17.5 us
of host time a call (bench/launch_cost.py) against ~4 us for a custom kernel: it builds
cuBLASLt descriptors and asks for a heuristic on every call, then records the call by
stream capture. Four GEMMs a layer are ~2.2 ms of a ~7.3 ms step. `gemm` computes
x @ w.T (+ bias) (+ residual) for few rows (x [M, K], w [N, K] as nn.Linear keeps it,
bf16) with tensor cores (mma.sync m16n8k16 through inline PTX, no shared memory
for the operands): each warp owns NT tiles of 8 output columns and a 1/KW slice of K,
streams its weight rows 16 bytes a lane, and the block's KW warps add their partial sums
in shared memory. Within a 32-wide stretch of K each lane loads 8 consecutive k of a row,
and the two MMAs take them in an order of k that A and B share (the same sum; fp32
accumulation as cuBLAS's, in another order, so the last bf16 bit may differ).

Off (MAX_ROWS = 0) until measured on a GPU: bench/skinny_gemm.py times it against
cuBLAS per shape and checks it (--emulate replays its index math in numpy anywhere);
bench/step_breakdown.py's "skinny gemm" variant and `--experiments skinny-gemm` run the
fast decode blocks through it.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from worker_proc.paged_attention import kernel_available

# Decode batches of up to this many rows take the kernel (0: none; at most 128).
MAX_ROWS = 0
DTYPES = (mx.bfloat16,)  # what the kernel's MMA instruction is written for

_HEADER = r"""
__device__ __forceinline__ void kiln_mma(float* c, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

# Lane (g, t) = (lane / 4, lane % 4). For k0 .. k0 + 31 it holds x[row][k0 + 8t .. + 7] and
# w[col][k0 + 8t .. + 7] as uint4 (.x: k +0,1; .y: +2,3; .z: +4,5; .w: +6,7). MMA 1 takes
# .x as the fragment's k 2t, 2t+1 and .y as 2t+8, 2t+9; MMA 2 takes .z and .w the same way.
# A (16 x 16, row): regs (row g, k 2t), (row g+8, k 2t), (row g, k 2t+8), (row g+8, k 2t+8);
# B (16 x 8, col): regs (k 2t, col g), (k 2t+8, col g); C: (g, 2t..2t+1), (g+8, 2t..2t+1).
_SOURCE = r"""
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int M = ROWS;  // x: ROWS rows of K, any leading shape (row-contiguous)
    const int K = w_shape[1];
    const int N = w_shape[0];
    const int K8 = K / 8;
    const int n_first = blockIdx.x * (8 * NT);
    const int k_span = K / KW;
    const int k_begin = warp * k_span;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const uint4 zero4 = make_uint4(0, 0, 0, 0);
    float acc[MT][NT][4];
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
    // The weight stream is what the kernel waits on (DRAM; x is small and stays in L2):
    // the next stretch's weights are loaded before this stretch's MMAs.
    uint4 wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = w4[(size_t)(n_first + 8 * j + g) * K8 + (k_begin >> 3) + t];
    for (int k0 = k_begin; k0 < k_begin + k_span; k0 += 32) {
        const int kq = (k0 >> 3) + t;
        uint4 wn[NT];
        const bool more = k0 + 32 < k_begin + k_span;
        for (int j = 0; j < NT; ++j)
            wn[j] = more ? w4[(size_t)(n_first + 8 * j + g) * K8 + kq + 4] : zero4;
        for (int i = 0; i < MT; ++i) {
            const int r0 = 16 * i + g;
            const uint4 lo = r0 < M ? x4[(size_t)r0 * K8 + kq] : zero4;
            const uint4 hi = r0 + 8 < M ? x4[(size_t)(r0 + 8) * K8 + kq] : zero4;
            for (int j = 0; j < NT; ++j) {
                kiln_mma(acc[i][j], lo.x, hi.x, lo.y, hi.y, wv[j].x, wv[j].y);
                kiln_mma(acc[i][j], lo.z, hi.z, lo.w, hi.w, wv[j].z, wv[j].w);
            }
        }
        for (int j = 0; j < NT; ++j) wv[j] = wn[j];
    }
    __shared__ float part[KW][16 * MT][8 * NT];
    for (int i = 0; i < MT; ++i) {
        for (int j = 0; j < NT; ++j) {
            const int r = 16 * i + g;
            const int col = 8 * j + 2 * t;
            part[warp][r][col] = acc[i][j][0];
            part[warp][r][col + 1] = acc[i][j][1];
            part[warp][r + 8][col] = acc[i][j][2];
            part[warp][r + 8][col + 1] = acc[i][j][3];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * MT * 8 * NT; e += blockDim.x) {
        const int r = e / (8 * NT);
        const int col = e % (8 * NT);
        if (r >= M) continue;
        float s = 0.f;
        for (int k = 0; k < KW; ++k) s += part[k][r][col];
        const size_t at = (size_t)r * N + n_first + col;
        EPILOGUE
        y[at] = static_cast<T>(s);
    }
"""



@functools.cache
def _kernel(bias: bool, residual: bool):
    epilogue = ("s += static_cast<float>(bias[n_first + col]);" if bias else "") + (
        "s += static_cast<float>(residual[at]);" if residual else "")
    return mx.fast.cuda_kernel(
        name=f"kiln_skinny_gemm{'_bias' if bias else ''}{'_residual' if residual else ''}",
        input_names=["x", "w", *(["bias"] if bias else []), *(["residual"] if residual else [])],
        output_names=["y"], source=_SOURCE.replace("EPILOGUE", epilogue), header=_HEADER)


def tiles(m: int) -> tuple[int, int, int]:
    """(MT, NT, KW) for m rows: 16-row tiles to cover m; fewer columns a warp as the rows
    grow (registers); four warps split K."""
    mt = max(1, -(-m // 16))
    return mt, (4 if mt <= 4 else 2), 4


def fits(m: int, k: int, n: int) -> bool:
    """Whether gemm takes these sizes (x [m, k], w [n, k])."""
    mt, nt, kw = tiles(m)
    return mt <= 8 and k % (32 * kw) == 0 and n % (8 * nt) == 0


def gemm(x: mx.array, w: mx.array, bias: mx.array | None = None,
         residual: mx.array | None = None) -> mx.array:
    """x [..., K] @ w [N, K].T (+ bias [N]) (+ residual [..., N]), bf16, at most 128 rows
    (see fits); leading dims as x's, so a [B, 1, K] decode input needs no reshape (a graph
    node each). CUDA only."""
    k = x.shape[-1]
    m = x.size // k
    n = w.shape[0]
    if x.dtype != mx.bfloat16 or w.dtype != mx.bfloat16:
        raise ValueError("skinny gemm: bf16 operands only")
    if not fits(m, k, n) or w.shape[1] != k:
        raise ValueError(f"skinny gemm: unsupported sizes M={m} K={k} N={n}")
    mt, nt, kw = tiles(m)
    inputs = [x, w] + [a for a in (bias, residual) if a is not None]
    (y,) = _kernel(bias is not None, residual is not None)(
        inputs=inputs,
        # ROWS as a template value: decode batches come in a few bucket sizes
        template=[("T", x.dtype), ("ROWS", m), ("MT", mt), ("NT", nt), ("KW", kw)],
        grid=(n // (8 * nt) * 32 * kw, 1, 1), threadgroup=(32 * kw, 1, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])
    return y


def linear(layer: nn.Module, x: mx.array, residual: mx.array | None = None) -> mx.array | None:
    """layer(x) (+ residual) through gemm where it applies: a plain bf16 nn.Linear, a
    batch of at most MAX_ROWS rows, sizes gemm takes, MLX's CUDA backend. None elsewhere
    (the caller computes it as before)."""
    if type(layer) is not nn.Linear or not MAX_ROWS:
        return None
    w = layer.weight
    rows = x.size // x.shape[-1]
    if (rows > MAX_ROWS or x.dtype != w.dtype or w.dtype not in DTYPES
            or not fits(rows, w.shape[1], w.shape[0]) or not available()):
        return None
    return gemm(x, w, layer.get("bias"), residual)


def available() -> bool:
    """The kernel runs on MLX's CUDA backend (as the decode attention kernel)."""
    return kernel_available()

"""A decode step's expert projections over 4-bit (or bfloat16) weights, one kernel a
projection, on tensor cores: each block takes one expert's rows (the step's token-expert pairs come sorted
by expert from fused_moe.route) and a tile of its outputs, reads that tile's weights once
for each pass of up to 32 of those rows and multiplies with bf16 mma.sync.

A decode step gives each expert a handful of rows (64 tokens, 4 experts each among 32:
~8). For sorted MXFP4 rows MLX's gather_qmm runs its grouped GEMM, whose tiles are made
for many rows and read a GPT-OSS expert's weights far below the memory's speed; for affine
weights it takes a kernel a row (docs/benchmarks.md, session 42). Here the weights are
meant to stream once from memory at its speed. Session 42's forms of this kernel summed on
CUDA cores, where a weight's multiply-adds (one a row) and dequantization outweighed its
load; this one dequantizes each weight once into an mma operand and leaves the rows to
the tensor cores. It serves a decode step's 4-bit experts once the step has as many
pairs as experts (`preferred`; off: `--experiments mlx-expert-matmuls`). The first
projection also gathers its tokens itself (the pairs' token ids), a launch less.

Formats: MXFP4 (4-bit E2M1 values, an E8M0 power of two per 32: GPT-OSS as it ships) and
affine 4-bit (a scale and a bias per group of 32, 64 or 128: mlx-lm's default
quantization), bfloat16 inputs. A weight is dequantized in float32 and rounded to bfloat16
(exact for MXFP4 within bfloat16's range; affine values round), products sum in float32,
and the output rounds to bfloat16 once; MLX sums in another order, so the outputs agree
within that rounding, not bit for bit. `reference_expert_rows` is the same projection in
MLX's ops (the CPU's stand-in backend runs it, and gets mlx-lm's values exactly).

bfloat16 experts (`--experiments bf16-expert-rows`, off until measured on a device): MLX's
gather_mm runs GPT-OSS-20B's at 71% of the H200's memory pace (docs/benchmarks.md,
session 24). Their weights need no dequantization, so the mma takes their bytes as loaded;
two forms, weights through registers or (DENSE_FORM's default) through shared memory by
cp.async.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss, qwen3_moe
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from worker_proc.fused_moe import project_experts
from worker_proc.paged_attention import _HEADER, _MMA_HEADER
from worker_proc.quantized_rows import RowsQuantizedLinear

WARPS = 4  # a block's warps (128 threads)
TILES = 1  # output tiles of 16 a warp (two: fewer blocks, ~170 registers, slower
# on GPT-OSS's projections at 1-256 tokens: docs/benchmarks.md, session 43)
CHUNK = 512  # input values staged in shared memory a fill: four k-steps of 128
# Quantized Linear layers' steps of at most this many rows take linear_rows (the kernel
# reads a Linear's weights once a pass of 8 * ROW_TILES rows); bfloat16 ones' steps of at
# most DENSE_MAX_ROWS (a pass of up to 64 rows: two at most).
LINEAR_MAX_ROWS = 256
DENSE_MAX_ROWS = 128
ROW_TILES = 4  # a pass's rows, 8 a tile: an expert with more takes more passes (its
# weights again, from L2 if they are still there); a pass multiplies only the tiles its rows fill

# bfloat16 experts: "staged" (_DENSE_STAGED_SOURCE, weights through shared memory by
# cp.async) or "registers" (_DENSE_SOURCE, each warp's loads in its registers).
DENSE_FORM = "staged"
STAGES = 3  # the staged form's k-steps in shared memory: 24 KB each (64 outputs, 32 rows)

# The mma (m16n8k16, fp32 accumulators) takes the weights as A (16 outputs x 16 inputs)
# and the rows as B (16 inputs x 8 rows); its output tile is 16 outputs x 8 rows. A
# warp owns TILES such output tiles of 16 outputs and a pass's row tiles.
# A dot product does not care in which order its inputs come, so the mma's 16 input
# slots need not be 16 consecutive inputs: lane (g = lane / 4, t = lane % 4) loads 16
# bytes of weight rows g and g + 8 (inputs 32t..32t+31 of the k-step, one MXFP4 group)
# and, for the step's word w and half h, its slots 2t, 2t+1 / 2t+8, 2t+9 stand for inputs
# 32t + 8w + 4h + 0, 1 / 2, 3. The rows' fragments are then 16 consecutive bytes of a row
# (inputs 32t + 8w .. + 7), which shared memory holds at uint4 ((s * 4 + w) * ROWS + r) *
# 4 + t for the chunk's k-step s: a warp's 32 lanes read 32 consecutive uint4 (no bank
# conflicts). The weights of a chunk's k-steps are all loaded before the rows are staged,
# so a warp has TILES * 4 KB in flight.
_SOURCE = r"""
    constexpr int WORDS = KD / 8;
    constexpr int GROUPS = KD / GROUP;
    constexpr int ROWS = ROW_TILES * 8;
    constexpr int STEPS = CHUNK / 128;
    __shared__ uint4 xs[CHUNK / 8 * ROWS];
    __shared__ float lut[16];
@PROLOGUE@
    @LUT_FILL@
    __syncthreads();  // the table
    const int n0 = (blockIdx.x * WARPS + warp) * (TILES * 16);
    for (int r0 = lo; r0 < hi; r0 += ROWS) {
        const int rows = min(ROWS, hi - r0), used = (rows + 7) / 8;  // (row tiles)
        float acc[TILES][ROW_TILES][4];
#pragma unroll
        for (int m = 0; m < TILES; ++m)
#pragma unroll
            for (int j = 0; j < ROW_TILES; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.f;
        for (int c = 0; c < KD; c += CHUNK) {
            uint4 q[STEPS][TILES][2];
            float s[STEPS][TILES][2];
            @BIAS_DECLARE@
#pragma unroll
            for (int st = 0; st < STEPS; ++st)
#pragma unroll
                for (int m = 0; m < TILES; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int k = c + st * 128 + t * 32;
                        const int n = n0 + m * 16 + h * 8 + g;
                        q[st][m][h] = make_uint4(0u, 0u, 0u, 0u);
                        s[st][m][h] = 0.f;
                        @BIAS_ZERO@
                        if (k < KD && n < N) {  // (KD is a multiple of 32: all 32 in)
                            const size_t at = (size_t)e * N + n;
                            q[st][m][h] = *reinterpret_cast<const uint4*>(packed + at * WORDS + k / 8);
                            const size_t gi = at * GROUPS + k / GROUP;
                            @SCALE@
                        }
                    }
            __syncthreads();  // the previous chunk's rows are used
            for (int i = threadIdx.x; i < CHUNK / 8 * used * 8; i += WARPS * 32) {
                const int ut = i & 3, r = (i >> 2) % (used * 8), sw = (i >> 2) / (used * 8);
                const int k = c + (sw >> 2) * 128 + ut * 32 + (sw & 3) * 8;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (r < rows && k < KD)
                    v = *reinterpret_cast<const uint4*>(x + (size_t)(@ROW@) * KD + k);
                xs[((sw * ROWS) + r) * 4 + ut] = v;
            }
            __syncthreads();
#pragma unroll
            for (int st = 0; st < STEPS; ++st) {
                if (c + st * 128 >= KD) break;
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    uint4 b[ROW_TILES];
#pragma unroll
                    for (int j = 0; j < ROW_TILES; ++j)
                        if (j < used) b[j] = xs[((st * 4 + w) * ROWS + j * 8 + g) * 4 + t];
#pragma unroll
                    for (int m = 0; m < TILES; ++m) {
                        const uint32_t w0 = w == 0 ? q[st][m][0].x : w == 1 ? q[st][m][0].y : w == 2 ? q[st][m][0].z : q[st][m][0].w;
                        const uint32_t w1 = w == 0 ? q[st][m][1].x : w == 1 ? q[st][m][1].y : w == 2 ? q[st][m][1].z : q[st][m][1].w;
                        float d0[8], d1[8];
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            d0[i] = @VALUE0@;
                            d1[i] = @VALUE1@;
                        }
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const uint32_t a0 = kiln_pack<__nv_bfloat16>(d0[4 * half], d0[4 * half + 1]);
                            const uint32_t a1 = kiln_pack<__nv_bfloat16>(d1[4 * half], d1[4 * half + 1]);
                            const uint32_t a2 = kiln_pack<__nv_bfloat16>(d0[4 * half + 2], d0[4 * half + 3]);
                            const uint32_t a3 = kiln_pack<__nv_bfloat16>(d1[4 * half + 2], d1[4 * half + 3]);
#pragma unroll
                            for (int j = 0; j < ROW_TILES; ++j)
                                if (j < used)
                                    kiln_mma<__nv_bfloat16>(acc[m][j], a0, a1, a2, a3,
                                                            half ? b[j].z : b[j].x, half ? b[j].w : b[j].y);
                        }
                    }
                }
            }
        }
        // acc[m][j][i]: output n0 + m * 16 + g + 8 * (i / 2) of row r0 + j * 8 + 2t + i % 2.
#pragma unroll
        for (int m = 0; m < TILES; ++m)
#pragma unroll
            for (int j = 0; j < ROW_TILES; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = j * 8 + 2 * t + (i & 1), n = n0 + m * 16 + g + 8 * (i >> 1);
                    if (r < rows && n < N) out[(size_t)(r0 + r) * N + n] = static_cast<__nv_bfloat16>(acc[m][j][i]);
                }
    }
"""

# MXFP4: a nibble's E2M1 value from a table, times the group's E8M0 scale 2^(s - 127)
# from its bits (s = 0: 2^-127, a subnormal).
_MXFP4 = {
    "@LUT_FILL@": (
        "if (threadIdx.x < 16) { const float v[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};"
        " lut[threadIdx.x] = threadIdx.x < 8 ? v[threadIdx.x] : -v[threadIdx.x - 8]; }"),
    "@SCALE@": (
        "{ const unsigned bits = exponents[gi];"
        " s[st][m][h] = bits ? __int_as_float(bits << 23) : __int_as_float(0x00400000); }"),
    "@VALUE0@": "lut[(w0 >> (4 * i)) & 15u] * s[st][m][0]",
    "@VALUE1@": "lut[(w1 >> (4 * i)) & 15u] * s[st][m][1]",
    "@BIAS_DECLARE@": "", "@BIAS_ZERO@": "",
}

# Affine: a value is q * scale + bias, q in 0..15.
_AFFINE = {
    "@LUT_FILL@": "if (threadIdx.x < 16) lut[threadIdx.x] = (float)threadIdx.x;",
    "@SCALE@": ("s[st][m][h] = static_cast<float>(scales[gi]);"
                " bias[st][m][h] = static_cast<float>(biases[gi]);"),
    "@VALUE0@": "fmaf(lut[(w0 >> (4 * i)) & 15u], s[st][m][0], bias[st][m][0])",
    "@VALUE1@": "fmaf(lut[(w1 >> (4 * i)) & 15u], s[st][m][1], bias[st][m][1])",
    "@BIAS_DECLARE@": "float bias[STEPS][TILES][2];",
    "@BIAS_ZERO@": "bias[st][m][h] = 0.f;",
}


# bfloat16 weights (a SwitchLinear's, [experts, N, KD]): no dequantization, so a weight's
# 16 bytes are its mma fragment registers as they are. A k-step of 128 inputs is four words
# of 32; for word w, lane (g, t) loads 16 bytes of weight rows g and g + 8, inputs
# 32w + 8t .. + 7, and the mma's slots 2t, 2t+1 / 2t+8, 2t+9 of half h stand for inputs
# 32w + 8t + 4h + 0, 1 / 2, 3 (the rows' fragments likewise): each load instruction then
# reads 64 consecutive bytes of each of a warp's 8 weight rows. A chunk is one k-step:
# 16 uint4 a lane (4 KB a warp) in flight, loaded before the rows are staged.
_DENSE_SOURCE = r"""
    constexpr int ROWS = ROW_TILES * 8;
    __shared__ uint4 xs[16 * ROWS];
@PROLOGUE@
    const int n0 = (blockIdx.x * WARPS + warp) * 16;
    for (int r0 = lo; r0 < hi; r0 += ROWS) {
        const int rows = min(ROWS, hi - r0), used = (rows + 7) / 8;  // (row tiles)
        float acc[ROW_TILES][4];
#pragma unroll
        for (int j = 0; j < ROW_TILES; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
        for (int c = 0; c < KD; c += 128) {
            uint4 q[4][2];
#pragma unroll
            for (int w = 0; w < 4; ++w)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int k = c + w * 32 + t * 8, n = n0 + h * 8 + g;
                    q[w][h] = make_uint4(0u, 0u, 0u, 0u);
                    if (k < KD && n < N)  // (KD is a multiple of 8: a word is all in)
                        q[w][h] = *reinterpret_cast<const uint4*>(weight + ((size_t)e * N + n) * KD + k);
                }
            __syncthreads();  // the previous chunk's rows are used
            for (int i = threadIdx.x; i < 16 * used * 8; i += WARPS * 32) {
                const int ut = i & 3, r = (i >> 2) % (used * 8), w = (i >> 2) / (used * 8);
                const int k = c + w * 32 + ut * 8;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (r < rows && k < KD)
                    v = *reinterpret_cast<const uint4*>(x + (size_t)(@ROW@) * KD + k);
                xs[((w * ROWS) + r) * 4 + ut] = v;
            }
            __syncthreads();
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                if (c + w * 32 >= KD) break;
                uint4 b[ROW_TILES];
#pragma unroll
                for (int j = 0; j < ROW_TILES; ++j)
                    if (j < used) b[j] = xs[((w * ROWS) + j * 8 + g) * 4 + t];
                kiln_word_mma<ROW_TILES>(acc, q[w][0], q[w][1], b, used);
            }
        }
        kiln_store_rows<ROW_TILES>(acc, out, r0, rows, n0 + g, N, t);
    }
"""


# bfloat16 weights through shared memory: the same fragments and input order as
# _DENSE_SOURCE, but each k-step's weight tile (BN outputs x 128 inputs, 16 KB) and rows
# come by cp.async STAGES - 1 k-steps ahead, so a block keeps up to 32 KB of weights in
# flight whatever its registers, and no warp waits on its own loads between mma's. A
# tile row's 16-byte chunks are stored at chunk ^ kiln_swz(row % 8): a quarter warp's
# fragment reads (rows 2i and 2i + 1, 4 chunks each) then fall on distinct banks.
_DENSE_STAGED_SOURCE = r"""
    constexpr int ROWS = ROW_TILES * 8;
    constexpr int BN = WARPS * 16;
    constexpr int STEPS = (KD + 127) / 128;
    extern __shared__ __align__(16) unsigned char kiln_dynamic[];
    __nv_bfloat16* ws = reinterpret_cast<__nv_bfloat16*>(kiln_dynamic);  // [STAGES][BN][128]
    __nv_bfloat16* xs = ws + STAGES * BN * 128;                           // [STAGES][ROWS][128]
@PROLOGUE@
    const int nb = blockIdx.x * BN;
    const int r_lo = warp * 16 + g;  // this lane's fragment rows: r_lo and r_lo + 8
    const int swz = kiln_swz(g);     // (r_lo % 8 == (r_lo + 8) % 8 == g)
    for (int r0 = lo; r0 < hi; r0 += ROWS) {
        const int rows = min(ROWS, hi - r0), used = (rows + 7) / 8;  // (row tiles)
        // k-step s into stage b: one commit group; chunks past N, KD or the rows zeroed.
        auto issue = [&](int s, int b) {
            const int k0 = s * 128;
            __nv_bfloat16* wt = ws + (size_t)b * BN * 128;
            for (int c = threadIdx.x; c < BN * 16; c += WARPS * 32) {
                const int row = c >> 4, piece = c & 15, n = nb + row, k = k0 + piece * 8;
                __nv_bfloat16* dst = wt + row * 128 + (piece ^ kiln_swz(row & 7)) * 8;
                if (n < N && k < KD)
                    kiln_cp_async16(dst, weight + ((size_t)e * N + n) * KD + k);
                else
                    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
            }
            __nv_bfloat16* xt = xs + (size_t)b * ROWS * 128;
            for (int c = threadIdx.x; c < used * 8 * 16; c += WARPS * 32) {
                const int r = c >> 4, piece = c & 15, k = k0 + piece * 8;
                __nv_bfloat16* dst = xt + r * 128 + (piece ^ kiln_swz(r & 7)) * 8;
                if (r < rows && k < KD)
                    kiln_cp_async16(dst, x + (size_t)(@ROW@) * KD + k);
                else
                    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
            }
            kiln_cp_commit();
        };
        float acc[ROW_TILES][4];
#pragma unroll
        for (int j = 0; j < ROW_TILES; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
        __syncthreads();  // the previous pass's stages are read
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < STEPS) issue(s, s); else kiln_cp_commit();
        }
        for (int s = 0; s < STEPS; ++s) {
            kiln_cp_wait<STAGES - 2>();
            __syncthreads();  // k-step s landed for every thread; stage (s - 1) % STAGES read
            if (s + STAGES - 1 < STEPS) issue(s + STAGES - 1, (s + STAGES - 1) % STAGES);
            else kiln_cp_commit();
            const __nv_bfloat16* wt = ws + (size_t)(s % STAGES) * BN * 128;
            const __nv_bfloat16* xt = xs + (size_t)(s % STAGES) * ROWS * 128;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                if (s * 128 + w * 32 >= KD) break;
                const int at = ((4 * w + t) ^ swz) * 8;
                const uint4 lo_w = *reinterpret_cast<const uint4*>(wt + r_lo * 128 + at);
                const uint4 hi_w = *reinterpret_cast<const uint4*>(wt + (r_lo + 8) * 128 + at);
                uint4 b[ROW_TILES];
#pragma unroll
                for (int j = 0; j < ROW_TILES; ++j)
                    if (j < used) b[j] = *reinterpret_cast<const uint4*>(xt + (j * 8 + g) * 128 + at);
                kiln_word_mma<ROW_TILES>(acc, lo_w, hi_w, b, used);
            }
        }
        kiln_cp_wait<0>();
        kiln_store_rows<ROW_TILES>(acc, out, r0, rows, nb + r_lo, N, t);
    }
"""


# Every form's start: the lane's place, and the block's expert (blockIdx.y) and its sorted
# pairs [lo, hi); a block whose expert has none ends.
_PROLOGUE = """    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int e = blockIdx.y;
    int lo, hi;
    kiln_expert_pairs(experts, experts_shape[0], e, lo, hi);
    if (lo == hi) return;"""


# A quantized Linear's rows (linear_rows): one expert, every row of x its pair.
_LINEAR_PROLOGUE = """    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int e = 0, lo = 0, hi = x_shape[0];"""


def source(mode: str, gather: bool, linear: bool = False) -> str:
    """The kernel's source for a weight format ("mxfp4", "affine", "bf16": bfloat16
    weights read through registers, "bf16_staged": through shared memory); gather: the
    rows are x's rows named by `tokens` (the pairs' token ids), else x's own rows in pair
    order; linear: a Linear layer's rows (no experts: every row of x, one weight
    matrix)."""
    parts = {"@ROW@": "tokens[r0 + r]" if gather else "r0 + r",
             "@PROLOGUE@": _LINEAR_PROLOGUE if linear else _PROLOGUE}
    if mode in ("bf16", "bf16_staged"):
        out = _DENSE_SOURCE if mode == "bf16" else _DENSE_STAGED_SOURCE
    else:
        out = _SOURCE
        parts.update(_MXFP4 if mode == "mxfp4" else _AFFINE)
    for key, text in parts.items():
        out = out.replace(key, text)
    return out


_PAIRS_HEADER = r"""
// The sorted pairs [lo, hi) of expert e: two binary searches over the pairs' experts.
__device__ inline void kiln_expert_pairs(const uint32_t* experts, int pairs, int e, int& lo, int& hi) {
    lo = 0, hi = pairs;
    while (lo < hi) { const int m = (lo + hi) >> 1; if ((int)experts[m] < e) lo = m + 1; else hi = m; }
    hi = pairs;
    for (int a = lo; a < hi;) { const int m = (a + hi) >> 1; if ((int)experts[m] <= e) a = m + 1; else hi = m; }
}
// bfloat16 weights: a word's two mma's (halves h) into each of a pass's used row tiles,
// weight rows g and g + 8 (inputs 32w + 8t .. + 7) as A, each row tile's row g as B.
template <int ROW_TILES>
__device__ __forceinline__ void kiln_word_mma(float (&acc)[ROW_TILES][4], const uint4& lo_w,
                                              const uint4& hi_w, const uint4 (&b)[ROW_TILES], int used) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint32_t a0 = half ? lo_w.z : lo_w.x, a2 = half ? lo_w.w : lo_w.y;
        const uint32_t a1 = half ? hi_w.z : hi_w.x, a3 = half ? hi_w.w : hi_w.y;
#pragma unroll
        for (int j = 0; j < ROW_TILES; ++j)
            if (j < used)
                kiln_mma<__nv_bfloat16>(acc[j], a0, a1, a2, a3, half ? b[j].z : b[j].x,
                                        half ? b[j].w : b[j].y);
    }
}
// A bfloat16 pass's outputs: acc[j][i] is output n + 8 * (i / 2) of row r0 + j * 8 + 2t + i % 2.
template <int ROW_TILES>
__device__ __forceinline__ void kiln_store_rows(const float (&acc)[ROW_TILES][4], __nv_bfloat16* out,
                                                int r0, int rows, int n, int N, int t) {
#pragma unroll
    for (int j = 0; j < ROW_TILES; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = j * 8 + 2 * t + (i & 1), at = n + 8 * (i >> 1);
            if (r < rows && at < N) out[(size_t)(r0 + r) * N + at] = static_cast<__nv_bfloat16>(acc[j][i]);
        }
}
"""


def header(mode: str = "mxfp4") -> str:
    """The kernel's helpers: the mma and its fragments' packing (paged_attention's), the
    pairs' search and the bfloat16 forms' mma and store; for the staged form cp.async's."""
    return (_HEADER if mode == "bf16_staged" else "") + _MMA_HEADER + _PAIRS_HEADER


def shared_bytes(mode: str, row_tiles: int = ROW_TILES) -> int:
    """The dynamic shared memory a block of the kernel takes (the staged form's stages)."""
    return STAGES * (WARPS * 16 + row_tiles * 8) * 128 * 2 if mode == "bf16_staged" else 0


def inputs(mode: str, gather: bool, linear: bool = False) -> list[str]:
    """The kernel's inputs: the rows (and the pairs' experts and tokens), then bf16
    weights, or the packed 4-bit values and then MXFP4's E8M0 exponents or the affine
    groups' scales and biases."""
    rows = ["x", *([] if linear else ["experts"]), *(["tokens"] if gather else [])]
    if mode in ("bf16", "bf16_staged"):
        return [*rows, "weight"]
    return [*rows, "packed", *(["exponents"] if mode == "mxfp4" else ["scales", "biases"])]


@functools.cache
def _kernel(mode: str, gather: bool, row_tiles: int = ROW_TILES, linear: bool = False):
    kind = "_gather" if gather else "_linear" if linear else ""
    return mx.fast.cuda_kernel(name=f"kiln_expert_rows_{mode}{kind}",
                               input_names=inputs(mode, gather, linear), output_names=["out"],
                               source=source(mode, gather, linear), header=header(mode),
                               shared_memory=shared_bytes(mode, row_tiles))


def weight_mode(module: nn.Module) -> str | None:
    """The kernel's name for an experts' weight format: "mxfp4" or "affine" (4-bit
    QuantizedSwitchLinear), "bf16" (a bfloat16 SwitchLinear), None for any other."""
    if type(module) is SwitchLinear:
        return "bf16" if module["weight"].dtype == mx.bfloat16 else None
    if type(module) is not QuantizedSwitchLinear:
        return None
    return _four_bit_mode(module)


def _four_bit_mode(module: nn.Module) -> str | None:
    """A 4-bit quantized module's format as the kernel takes it, or None."""
    if module.bits != 4 or getattr(module, "global_scale", None) is not None:
        return None
    if module.mode == "mxfp4":
        ok = module.group_size == 32 and "biases" not in module
    elif module.mode == "affine":  # (scales and biases in bf16: gather_qmm's output dtype
        # promotes x's with theirs, and the kernel's is x's)
        ok = (module.group_size in (32, 64, 128) and "biases" in module
              and module["scales"].dtype == module["biases"].dtype == mx.bfloat16)
    else:
        return None
    return module.mode if ok else None


def fits(module: nn.Module, dims: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes this projection: 4-bit experts (MXFP4 in groups of 32,
    or affine in groups of 32, 64 or 128) without a global scale, or bfloat16 experts as
    wide as a multiple of 8; inputs of dtype bfloat16 (the mma's operands; others keep
    MLX's gather_qmm / gather_mm) and dims wide, as the weights' rows."""
    return _takes(weight_mode(module), module, dims, dtype)


def _takes(mode: str | None, module: nn.Module, dims: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes rows of dims inputs in dtype over module's weights in
    format `mode` (None: none it takes)."""
    if mode is None or dtype != mx.bfloat16:
        return False
    width = module["weight"].shape[-1]
    return dense_fits(dims, width) if mode == "bf16" else dims == width * 8


def dense_fits(dims: int, width: int) -> bool:
    """Whether rows of `dims` take bfloat16 experts of `width` inputs: as wide, whole
    16-byte words."""
    return dims == width and dims % 8 == 0


def linear_mode(linear: nn.Module) -> str | None:
    """The kernel's name for a Linear layer's weight format: a 4-bit quantized Linear's
    ("mxfp4", "affine"), "bf16" for a bfloat16 Linear, None for any other."""
    if isinstance(linear, nn.QuantizedLinear):
        return _four_bit_mode(linear)
    if isinstance(linear, nn.Linear):
        return "bf16" if linear["weight"].dtype == mx.bfloat16 else None
    return None


def linear_fits(linear: nn.Module, dims: int, dtype: mx.Dtype) -> bool:
    """Whether linear_rows takes this Linear: 4-bit weights in the formats the experts'
    kernel takes or bfloat16 ones, bfloat16 rows of dims inputs (bfloat16: whole 16-byte
    words)."""
    return _takes(linear_mode(linear), linear, dims, dtype)


class KernelRowsQuantizedLinear(RowsQuantizedLinear):
    """A RowsQuantizedLinear whose product with a step of at most LINEAR_MAX_ROWS rows
    (decode steps) goes through linear_rows where it fits (`--experiments
    quantized-rows-kernel`). MLX's CUDA quantized GEMM at those rows ran no faster than
    bfloat16's dense one although it reads a quarter of the bytes (docs/benchmarks.md,
    session 45); larger steps (prefill forwards) keep it, where its tiles suit them."""

    def matmul(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows > LINEAR_MAX_ROWS or not linear_fits(self, x.shape[-1], x.dtype):
            return super().matmul(x)
        out = linear_rows(self, x.reshape(rows, x.shape[-1]))
        return out.reshape(*x.shape[:-1], -1)


class KernelRowsLinear(nn.Linear):
    """A bfloat16 Linear whose product with a step of at most DENSE_MAX_ROWS rows goes
    through linear_rows where it fits (`--experiments bf16-rows-kernel`), not MLX's GEMM
    (cuBLAS), which ran a 64-row step's Gemma-3-12B projections at 68-84% of an H100's
    memory pace (docs/benchmarks.md, session 47). decode_block's residual adds inside the
    o and down GEMMs stay cuBLAS's (mx.addmm)."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows > DENSE_MAX_ROWS or not linear_fits(self, x.shape[-1], x.dtype):
            return super().__call__(x)
        out = linear_rows(self, x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return out + self["bias"] if "bias" in self else out


def _bf16_linear(m: nn.Module) -> bool:
    """Whether m is a Linear (KernelRowsLinear or not) whose bfloat16 weights linear_rows
    takes (whole 16-byte words a row)."""
    return (isinstance(m, nn.Linear) and linear_mode(m) == "bf16"
            and m["weight"].shape[-1] % 8 == 0)


def kernel_rows_linears(model: nn.Module) -> int:
    """Swap KernelRowsLinear into every (exactly) nn.Linear of the model whose bfloat16
    weights linear_rows takes; returns how many."""
    count = 0
    for _, m in model.named_modules():
        if type(m) is nn.Linear and _bf16_linear(m):
            m.__class__ = KernelRowsLinear
            count += 1
    return count


def bf16_linear_layers(model: nn.Module) -> int:
    """The model's Linear layers whose bfloat16 weights linear_rows takes (swapped or not)."""
    return sum(_bf16_linear(m) for _, m in model.named_modules())


def kernel_rows_layers(model: nn.Module) -> int:
    """The model's quantized Linear layers whose 4-bit format linear_rows takes."""
    return sum(isinstance(m, nn.QuantizedLinear) and _four_bit_mode(m) is not None
               for _, m in model.named_modules())


def bf16_expert_layers(model: nn.Module) -> int:
    """The model's mixture-of-experts blocks that fused_experts serves (GPT-OSS's,
    Qwen3-MoE's) whose experts are bfloat16."""
    count = 0
    for _, m in model.named_modules():
        switch = (m.experts if type(m) is gpt_oss.MLPBlock else
                  m.switch_mlp if type(m) is qwen3_moe.Qwen3MoeSparseMoeBlock else None)
        count += switch is not None and weight_mode(switch.down_proj) == "bf16"
    return count


def preferred(module: nn.Module, pairs: int) -> bool:
    """Whether the kernel, not MLX's, takes a step of `pairs` pairs: once there are as many
    pairs as experts. Below (a one-token step: four pairs over 32 experts) MLX's
    matrix-vector kernels read the few busy experts' weights a little faster
    (docs/benchmarks.md, session 43)."""
    return pairs >= module["weight"].shape[0]


def expert_rows(module: nn.Module, x: mx.array, experts: mx.array,
                tokens: mx.array | None = None, dense_form: str = DENSE_FORM,
                row_tiles: int = ROW_TILES) -> mx.array:
    """The projection (without its bias) of each sorted pair's row: x's row tokens[p]
    (tokens given) or x's row p, by the weights of expert experts[p]; [pairs, 1, out]
    in bfloat16 (fits must hold; experts sorted, uint32). dense_form: bfloat16 weights'
    kernel ("staged" or "registers") and its rows a pass in tiles of 8 (row_tiles: an
    expert's weights are read once a pass)."""
    mode = weight_mode(module)
    if mode == "bf16":
        mode = "bf16_staged" if dense_form == "staged" else "bf16"
    dims = module["weight"].shape[-1] * (1 if mode.startswith("bf16") else 8)
    out = _project(mode, module, x.reshape(-1, dims), experts, tokens, row_tiles)
    return out[:, None]


def linear_rows(linear: nn.Module, x: mx.array) -> mx.array:
    """A 4-bit quantized or bfloat16 Linear's product (without its bias) with x's rows
    [rows, dims], [rows, out] in bfloat16 (linear_fits must hold): the experts' kernel as
    one expert whose pairs are all the rows (bfloat16: its staged form, up to 64 rows a
    pass, so that a step of up to 64 reads the weights once)."""
    mode = linear_mode(linear)
    if mode == "bf16":
        return _project("bf16_staged", linear, x, None, None, min(8, -(-x.shape[0] // 8)))
    return _project(mode, linear, x, None, None, ROW_TILES)


def _project(mode: str, module: nn.Module, flat: mx.array, experts: mx.array | None,
             tokens: mx.array | None, row_tiles: int) -> mx.array:
    """The kernel's launch for a weight format (source's modes) over x's rows [*, dims]:
    [pairs, out] (experts None: a Linear's [rows, out], its weights made one expert's)."""
    linear = experts is None
    weight = module["weight"][None] if linear else module["weight"]
    count, outs, _ = weight.shape
    dims = flat.shape[-1]
    pairs = flat.shape[0] if linear else experts.shape[0]
    rows = [flat, *([] if linear else [experts]), *([] if tokens is None else [tokens])]
    gather = tokens is not None
    if mode.startswith("bf16"):
        args, tiles, kernel = [*rows, weight], 1, _kernel(mode, gather, row_tiles, linear)
        template = [("KD", dims), ("N", outs), ("WARPS", WARPS), ("ROW_TILES", row_tiles),
                    *([("STAGES", STAGES)] if mode == "bf16_staged" else [])]
    else:
        scales, biases = module["scales"], module.get("biases")
        args = [*rows, weight, scales[None] if linear else scales,
                *([] if biases is None else [biases[None] if linear else biases])]
        tiles, kernel = TILES, _kernel(mode, gather, ROW_TILES, linear)
        template = [("KD", dims), ("N", outs), ("GROUP", module.group_size), ("WARPS", WARPS),
                    ("TILES", TILES), ("ROW_TILES", ROW_TILES), ("CHUNK", CHUNK)]
    blocks = -(-outs // (WARPS * tiles * 16))
    (out,) = kernel(
        inputs=args, template=template,
        grid=(blocks * WARPS * 32, count, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(pairs, outs)], output_dtypes=[flat.dtype])
    return out


def reference_expert_rows(module: nn.Module, x: mx.array, experts: mx.array,
                          tokens: mx.array | None = None) -> mx.array:
    """What expert_rows computes, as mlx-lm's SwitchLinear calls MLX (the rows gathered,
    then gather_qmm or gather_mm told they come sorted)."""
    rows = x.reshape(-1, x.shape[-1])
    rows = (rows if tokens is None else rows[tokens])[:, None]
    return project_experts(module, rows, experts, sort=True)

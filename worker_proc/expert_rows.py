"""A decode step's expert projections over 4-bit weights, one kernel a projection: each
block takes one expert's rows (the step's token-expert pairs come sorted by expert from
fused_moe.route) and a tile of its outputs, reads that tile's weights once for all of
those rows and sums on CUDA cores.

A decode step gives each expert a handful of rows (64 tokens, 4 experts each among 32:
~8). For sorted MXFP4 rows MLX's gather_qmm runs its grouped GEMM, whose tiles are made
for many rows and read a GPT-OSS expert's weights far below the memory's speed; for affine
weights it takes a kernel a row (docs/benchmarks.md, session 42). Here the weights are
meant to stream once from memory at its speed, the work per weight (a few rows'
multiply-adds) hidden under it. Session 42's first form of this kernel (4-byte loads)
lost to MLX's at most row counts; this one is unmeasured, hence off by default
(`--experiments expert-rows`). The first projection also gathers its tokens itself
(the pairs' token ids), a launch less.

Formats: MXFP4 (4-bit E2M1 values, an E8M0 power of two per 32: GPT-OSS as it ships) and
affine 4-bit (a scale and a bias per group of 32, 64 or 128: mlx-lm's default
quantization). Values are dequantized exactly and summed in float32, then rounded to the
input's dtype once; MLX sums in another order, so the outputs agree within that rounding,
not bit for bit. `reference_expert_rows` is the same projection in MLX's ops (the CPU's
stand-in backend runs it, and gets mlx-lm's values exactly).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from worker_proc.fused_moe import project_experts

BLOCK = 256  # threads: 8 warps
OUTS = 4  # outputs a warp (32 a block)
ROWS = 8  # rows a pass (an expert with more takes more passes, its tile from L2 again)
CHUNK = 32 * 32  # input values a pass: 32 a lane, one 16-byte load of a weight row
TILE = BLOCK // 32 * OUTS

# Each lane loads 16 bytes (4 words, 32 values: one MXFP4 group, or part of an affine
# one) of each of its warp's OUTS weight rows a pass, all before it sums, so a warp has
# 2 KB in flight. Word by word it dequantizes the OUTS rows' 8 values once, then for each
# of the expert's rows takes their dot product with the row's 8 inputs (from shared
# memory) and adds it, times the group's scale (and, affine, the group's bias times the
# inputs' sum), to that row's sum. A warp's lanes then sum their parts. The inputs sit
# in shared memory as float4s laid out so that the lanes reading their w-th word's h-th
# half read consecutive float4s (value lane * 32 + w * 8 + h * 4 + j at float4
# (w * 2 + h) * 32 + lane): no bank conflicts.
_SOURCE = r"""
    constexpr int WARPS = BLOCK / 32;
    constexpr int WORDS = KD / 8;
    constexpr int WORDS_PER_GROUP = GROUP / 8;
    constexpr int PIECES = CHUNK / 4;
    __shared__ float4 xs[ROWS][PIECES];
    @LUT_DECLARE@
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = blockIdx.y;
    const int pairs = experts_shape[0];
    @LUT_FILL@
    // This expert's pairs [lo, hi) of the sorted ones.
    int lo = 0, hi = pairs;
    while (lo < hi) { const int m = (lo + hi) >> 1; if ((int)experts[m] < e) lo = m + 1; else hi = m; }
    hi = pairs;
    for (int a = lo; a < hi;) { const int m = (a + hi) >> 1; if ((int)experts[m] <= e) a = m + 1; else hi = m; }
    if (lo == hi) return;
    const int n0 = blockIdx.x * (WARPS * OUTS) + warp * OUTS;
    for (int r0 = lo; r0 < hi; r0 += ROWS) {
        const int rows = min(ROWS, hi - r0);
        float acc[OUTS][ROWS];
#pragma unroll
        for (int o = 0; o < OUTS; ++o)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[o][r] = 0.f;
        for (int c = 0; c < KD; c += CHUNK) {
            __syncthreads();
            for (int i = threadIdx.x; i < ROWS * PIECES; i += BLOCK) {
                const int r = i / PIECES, piece = i % PIECES, k = c + piece * 4;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (r < rows && k < KD) {  // (KD is a multiple of 32: k..k+3 all in)
                    const size_t at = (size_t)(@ROW@) * KD + k;
                    v = make_float4(static_cast<float>(x[at]), static_cast<float>(x[at + 1]),
                                    static_cast<float>(x[at + 2]), static_cast<float>(x[at + 3]));
                }
                xs[r][(((piece >> 1) & 3) * 2 + (piece & 1)) * 32 + (piece >> 3)] = v;
            }
            __syncthreads();
            const int word0 = c / 8 + lane * 4;  // (WORDS is a multiple of 4)
            if (word0 >= WORDS) continue;
            uint4 q[OUTS];
            float s[OUTS];
            @AFFINE_DECLARE@
#pragma unroll
            for (int o = 0; o < OUTS; ++o) {
                const int n = n0 + o;
                q[o] = make_uint4(0u, 0u, 0u, 0u);
                s[o] = 0.f;
                @AFFINE_ZERO@
                if (n < N) {
                    const size_t at = (size_t)e * N + n;
                    q[o] = *reinterpret_cast<const uint4*>(packed + at * WORDS + word0);
                    const size_t g = at * (KD / GROUP) + word0 / WORDS_PER_GROUP;
                    @SCALE@
                }
            }
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                float d[OUTS][8];
#pragma unroll
                for (int o = 0; o < OUTS; ++o) {
                    const uint32_t word = w == 0 ? q[o].x : w == 1 ? q[o].y : w == 2 ? q[o].z : q[o].w;
#pragma unroll
                    for (int j = 0; j < 8; ++j) d[o][j] = @VALUE@;
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r >= rows) break;
                    const float4 a = xs[r][(w * 2) * 32 + lane];
                    const float4 b = xs[r][(w * 2 + 1) * 32 + lane];
                    @AFFINE_SUM@
#pragma unroll
                    for (int o = 0; o < OUTS; ++o) {
                        float t = d[o][0] * a.x;
                        t = fmaf(d[o][1], a.y, t);
                        t = fmaf(d[o][2], a.z, t);
                        t = fmaf(d[o][3], a.w, t);
                        t = fmaf(d[o][4], b.x, t);
                        t = fmaf(d[o][5], b.y, t);
                        t = fmaf(d[o][6], b.z, t);
                        t = fmaf(d[o][7], b.w, t);
                        acc[o][r] = fmaf(s[o], t, acc[o][r]);
                        @AFFINE_ADD@
                    }
                }
            }
        }
#pragma unroll
        for (int o = 0; o < OUTS; ++o) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float v = acc[o][r];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
                if (lane == 0 && r < rows && n0 + o < N)
                    out[(size_t)(r0 + r) * N + n0 + o] = static_cast<T>(v);
            }
        }
    }
"""

# MXFP4: a nibble's E2M1 value from a table, the group's E8M0 scale 2^(s - 127) from its
# bits (s = 0: 2^-127, a subnormal).
_MXFP4 = {
    "@LUT_DECLARE@": "__shared__ float lut[16];",
    "@LUT_FILL@": (
        "if (threadIdx.x < 16) { const float m[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};"
        " lut[threadIdx.x] = threadIdx.x < 8 ? m[threadIdx.x] : -m[threadIdx.x - 8]; }"
        " __syncthreads();"),
    "@SCALE@": (
        "{ const unsigned b = exponents[g];"
        " s[o] = b ? __int_as_float(b << 23) : __int_as_float(0x00400000); }"),
    "@VALUE@": "lut[(word >> (4 * j)) & 15u]",
    "@AFFINE_DECLARE@": "", "@AFFINE_ZERO@": "", "@AFFINE_SUM@": "", "@AFFINE_ADD@": "",
}

# Affine: value = q * scale + bias, so a group's part of a dot product is
# scale * sum(q x) + bias * sum(x).
_AFFINE = {
    "@LUT_DECLARE@": "", "@LUT_FILL@": "",
    "@SCALE@": "s[o] = static_cast<float>(scales[g]); bias_of[o] = static_cast<float>(biases[g]);",
    "@VALUE@": "static_cast<float>((word >> (4 * j)) & 15u)",
    "@AFFINE_DECLARE@": "float bias_of[OUTS];",
    "@AFFINE_ZERO@": "bias_of[o] = 0.f;",
    "@AFFINE_SUM@": "const float xsum = a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;",
    "@AFFINE_ADD@": "acc[o][r] = fmaf(bias_of[o], xsum, acc[o][r]);",
}


def source(mode: str, gather: bool) -> str:
    """The kernel's source for a weight format ("mxfp4" or "affine"); gather: the rows are
    x's rows named by `tokens` (the pairs' token ids), else x's own rows in pair order."""
    parts = {**(_MXFP4 if mode == "mxfp4" else _AFFINE),
             "@ROW@": "tokens[r0 + r]" if gather else "r0 + r"}
    out = _SOURCE
    for key, text in parts.items():
        out = out.replace(key, text)
    return out


def inputs(mode: str, gather: bool) -> list[str]:
    """The kernel's inputs: the packed 4-bit values, then MXFP4's E8M0 exponents or the
    affine groups' scales and biases."""
    return ["x", "experts", *(["tokens"] if gather else []), "packed",
            *(["exponents"] if mode == "mxfp4" else ["scales", "biases"])]


@functools.cache
def _kernel(mode: str, gather: bool):
    return mx.fast.cuda_kernel(name=f"kiln_expert_rows_{mode}{'_gather' if gather else ''}",
                               input_names=inputs(mode, gather), output_names=["out"],
                               source=source(mode, gather))


def fits(module: nn.Module, x: mx.array) -> bool:
    """Whether the kernel takes this projection: 4-bit experts (MXFP4 in groups of 32,
    or affine in groups of 32, 64 or 128) without a global scale, inputs of a float
    dtype as wide as the weights' rows."""
    if type(module) is not QuantizedSwitchLinear or module.bits != 4:
        return False
    if getattr(module, "global_scale", None) is not None:
        return False
    if module.mode == "mxfp4":
        ok = module.group_size == 32 and "biases" not in module
    elif module.mode == "affine":
        ok = module.group_size in (32, 64, 128) and "biases" in module
    else:
        return False
    dims = module["weight"].shape[-1] * 8
    return ok and x.shape[-1] == dims and x.dtype in (mx.float32, mx.float16, mx.bfloat16)


def expert_rows(module: QuantizedSwitchLinear, x: mx.array, experts: mx.array,
                tokens: mx.array | None = None) -> mx.array:
    """The projection (without its bias) of each sorted pair's row: x's row tokens[p]
    (tokens given) or x's row p, by the weights of expert experts[p]; [pairs, 1, out]
    in x's dtype (fits must hold; experts sorted, uint32)."""
    mode = module.mode
    weight, scales = module["weight"], module["scales"]
    count, outs, words = weight.shape
    dims = words * 8
    flat = x.reshape(-1, dims)
    pairs = experts.shape[0]
    args = [flat, experts, *([] if tokens is None else [tokens]), weight, scales,
            *([module["biases"]] if mode == "affine" else [])]
    tiles = (outs + TILE - 1) // TILE
    (out,) = _kernel(mode, tokens is not None)(
        inputs=args,
        template=[("T", x.dtype), ("KD", dims), ("N", outs), ("GROUP", module.group_size),
                  ("BLOCK", BLOCK), ("OUTS", OUTS), ("ROWS", ROWS), ("CHUNK", CHUNK)],
        grid=(tiles * BLOCK, count, 1), threadgroup=(BLOCK, 1, 1),
        output_shapes=[(pairs, outs)], output_dtypes=[x.dtype])
    return out[:, None]


def reference_expert_rows(module: QuantizedSwitchLinear, x: mx.array, experts: mx.array,
                          tokens: mx.array | None = None) -> mx.array:
    """What expert_rows computes, as mlx-lm's SwitchLinear calls MLX (the rows gathered,
    then gather_qmm told they come sorted)."""
    rows = x.reshape(-1, x.shape[-1])
    rows = (rows if tokens is None else rows[tokens])[:, None]
    return project_experts(module, rows, experts, sort=True)

"""Decode attention that reads K/V straight from the pool, by slot id, per-row length.

The dense path (gather every row's context into a padded block, mask the padding) works
everywhere but costs a gather per layer and step and, for ragged batches, an array mask
that keeps MLX's fused attention kernel off. On the CUDA backend this module's kernel
reads the pool through the slot table and stops at each row's own length: no gather, no
padding, no mask. It is split along the context (flash-decoding) so a few short rows
still fill the GPU; a second small kernel merges the splits.

Other backends (the CPU, Metal for now) use the dense path: it is the plain-MLX fallback
that the CPU tests exercise.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from worker_proc.kernel_constants import MARK_SHAPE, float_bits, padded_constant
from worker_proc.pool_writes import after_write, follow_mark

logger = logging.getLogger(__name__)

# How a row's context is split across thread blocks (flash-decoding). Enough blocks to
# fill the GPU's SMs even for one short row (at batch 1, a few big splits left most SMs
# idle: ~0.25 ms a layer), but no split longer than MAX_SPLIT_TOKENS (long rows at large
# batches stay parallel) or shorter than MIN_SPLIT_TOKENS (merging would dominate). Up to
# 1024 tokens, a large batch's rows take one block each, so no merge kernel runs: on the
# H200 a 2,048-block target was slower at 64 and 128 rows (the merge and a second wave of
# blocks cost more than the added parallelism; session 9 in docs/benchmarks.md).
TARGET_BLOCKS = 512
MIN_SPLIT_TOKENS = 32
MAX_SPLIT_TOKENS = 1024
_THREADS = 128  # four warps per block
# Lanes sharing one token's dot products (8, 16 or 32: head sizes are multiples of 32),
# and passes of 32 / LANES_PER_TOKEN tokens a warp takes per iteration: see _BODY. 16 x 1
# was fastest on the H200 at 64 and 128 rows (bench/attention_kernel.py); 32 lanes repeat
# the softmax math on every lane, more passes or fewer lanes cost registers (occupancy).
LANES_PER_TOKEN = 16
PASSES = 1
# Heads this wide or wider take WIDE_HEAD_LANES lanes a token: at 16, a lane of a 256-wide
# head holds 16 elements of each of q, the accumulators, K and V, ~135-146 registers a
# thread at 2 query heads a KV head (ptxas, bench/cuda_kernel_report.py), room for three
# blocks an SM, so a 64-row step's 512 blocks (Gemma 3's 8 KV heads) ran in two waves; at
# 32, ~72-88 (at 4 or 8 query heads a KV head 16 lanes take ~200-255 and spill). On the
# H200 (session 40) 32 lanes won at 64 rows x 8 KV heads (7-24% with warp-copied tiles),
# 16 at 128 rows (3-9%): 256-wide heads of 2 query heads a KV head take 16 lanes past
# WIDE_HEAD_MAX_ROW_HEADS (rows x KV heads).
WIDE_HEAD_DIM = 256
WIDE_HEAD_LANES = 32
WIDE_HEAD_MAX_ROW_HEADS = 512


def lanes_per_token(dim: int, group: int = 1, row_heads: int = 0) -> int:
    """Lanes sharing a token's dot products in the CUDA-core kernel, for heads of `dim`
    with `group` query heads a KV head, in a launch over `row_heads` (rows x KV heads)."""
    if dim < WIDE_HEAD_DIM:
        return LANES_PER_TOKEN
    if dim == WIDE_HEAD_DIM and group <= 2 and row_heads > WIDE_HEAD_MAX_ROW_HEADS:
        return LANES_PER_TOKEN
    return WIDE_HEAD_LANES


# K/V tiles a block keeps in flight through shared memory (cp.async, sm_80+), fewer where
# they would not fit (staged_tiles); 0: the register prefetch (_REGISTER_PIPE). On the
# H200 eight tiles (of 16 x 1 lanes, 512-block target) tied or beat the register prefetch
# at 1-128 rows of 256-2,048 tokens, by 5-14% at 64-128 rows of 1,024+ (session 24 in
# docs/benchmarks.md). The decode backend's option (decode_backend.KernelDecode.stages).
DEFAULT_STAGES = 8
_STAGE_BYTES_MAX = 32 * 1024  # the most the tiles take (the measured 8 x 4 KiB)
# A block's shared memory is static (declared in the source): at most 48 KiB. Beside the
# tiles it holds the split's slot ids, the warps' partials for the merge (G heads of D)
# and, in the fused q/k/v variant, RoPE's D floats (as ptxas reports them).
_STATIC_SHARED_MAX = 48 * 1024


def _shared_bytes(dim: int, group: int) -> int:
    """A block's shared memory besides the staged tiles, every variant's most."""
    return 4 * MAX_SPLIT_TOKENS + _THREADS // 32 * group * (dim + 2) * 4 + 4 * dim


def fits_shared_memory(dim: int, group: int) -> bool:
    """Whether a block serving `group` query heads of `dim` fits in its static shared
    memory with no staged tiles (many query heads a KV head, as multi-query models have,
    do not)."""
    return _shared_bytes(dim, group) <= _STATIC_SHARED_MAX


def staged_tiles(dim: int, itemsize: int, group: int, stages: int = DEFAULT_STAGES,
                 lanes: int = 0) -> int:
    """Tiles of the staged pipeline for this head size, pool dtype and query heads per KV
    head (and lanes a token: lanes_per_token's for a small launch where 0): `stages`,
    fewer where they would not fit beside the rest of the block's shared memory
    (Llama-3-70B's 8 query heads a KV head leave room for 6), 0 when fewer than two fit
    (the register prefetch then) or when off."""
    if stages < 2:
        return 0
    tile = (_THREADS // 32 * PASSES * (32 // (lanes or lanes_per_token(dim, group)))
            * 2 * dim * itemsize)
    room = min(_STAGE_BYTES_MAX, _STATIC_SHARED_MAX - _shared_bytes(dim, group))
    tiles = min(stages, room // tile)
    return tiles if tiles >= 2 else 0


# A block's end: its warps' partials (max, sum, accumulators of the G x D outputs, in
# shared memory as PART_M / PART_L / PART_ACC of warp w) made one, then written (WRITE:
# normalised, or as the split's partial for the merge).
_COMBINE = r"""    __syncthreads();
    const size_t part_at = ((size_t)b * HKV + kvh) * n_splits + split;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D;
        const int d = i % D;
        float mm = kiln_lowest;
#pragma unroll
        for (int w = 0; w < PARTS; ++w) mm = fmaxf(mm, PART_M);
        float ll = 0.f, aa = 0.f;
#pragma unroll
        for (int w = 0; w < PARTS; ++w) {
            const float f = exp2f(PART_M - mm);
            ll += PART_L * f;
            aa += PART_ACC * f;
        }
        WRITE
    }
"""


# One block per (split, KV head, row), four warps. A token's dot products take L lanes
# (LANES, a template argument), E = D / L elements each, so a warp pass covers 32 / L
# tokens; U passes (PASSES) make a warp's share of an iteration. Each lane keeps an online
# softmax of its own tokens for the whole query-head group; the lanes of a warp then merge
# by shuffles, the four warps in shared memory. K/V rows come as one vector load a lane
# (registers) or from a shared-memory tile (staged), ahead of the math that reads them:
# see the PIPE_ parts below. With one split (_DIRECT_WRITE) the block writes the
# normalised output in q's dtype; otherwise its partial (acc, max, sum) for _MERGE_SOURCE.
# Scores are kept in log2 units (q scaled by log2(e)), so each exponential is one exp2.
# Maxima start at -FLT_MAX, not -inf, so that a lane with no token yet rescales by
# exp(0) = 1 rather than exp(-inf + inf) = NaN, and an empty partial weighs exp(-huge) = 0.
_BODY = r"""
    constexpr int NW = 4;
    constexpr int L = LANES;
    constexpr int TPW = 32 / L;
    constexpr int U = PASSES;
    constexpr int E = D / L;
    constexpr int STEP = NW * U * TPW;
    using V = kiln_vec<P, E>;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane / L;    // the lane's token within a pass
    const int part = lane % L;   // its slice of the head: elements part * E ...
    const int n_splits = gridDim.x;
    const int len = LENGTH;
    const int lmax = table_shape[1];  // runtime values: a template would recompile per length
    const int chunk = (lmax + n_splits - 1) / n_splits;
    const int start = split * chunk;
    const int end = min(start + chunk, len);
    const float sc = __int_as_float(SCALE) * 1.4426950408889634f;  // log2 units: exp2 is one instruction
    PROLOGUE
    float qv[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int qd = part * E + e;
            qv[g][e] = Q_LOAD * sc;
        }
    }
    float m[G], l[G], acc[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = kiln_lowest;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    }
    // The split's slot ids, staged once in shared memory: a K/V load's address then
    // waits on shared memory, not on a dependent global load, every iteration.
    __shared__ int sm_slots[CHUNK_MAX];
    {
        const int* row_slots = ROW_SLOTS;
        for (int i = threadIdx.x; i < end - start; i += blockDim.x) sm_slots[i] = SLOT_AT;
    }
    __syncthreads();
    V kb[U], vb[U];
    PIPE_SETUP
    for (int at = start; at < end; at += STEP) {
        PIPE_FETCH
        float s[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float x = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) x += qv[g][e] * static_cast<float>(kb[u].v[e]);
                s[u][g] = x;
            }
        }
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], off);
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float m_new = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (at + (warp * U + u) * TPW + sub < end) m_new = fmaxf(m_new, s[u][g]);
            }
            if (m_new != m[g]) {  // rescale only when the max moved (rarely, past the first tokens)
                const float alpha = exp2f(m[g] - m_new);
                l[g] *= alpha;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const bool ok = at + (warp * U + u) * TPW + sub < end;
                const float p = ok ? exp2f(s[u][g] - m_new) : 0.f;
                l[g] += p;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] += p * static_cast<float>(vb[u].v[e]);
            }
            m[g] = m_new;
        }
        PIPE_NEXT
    }
    // The warp's token streams (lanes part, part + L, ...) into one, by shuffles.
#pragma unroll
    for (int off = L; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffff, m[g], off);
            const float lo = __shfl_xor_sync(0xffffffff, l[g], off);
            const float mm = fmaxf(m[g], mo);
            const float fs = exp2f(m[g] - mm);
            const float fo = exp2f(mo - mm);
            l[g] = l[g] * fs + lo * fo;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float ao = __shfl_xor_sync(0xffffffff, acc[g][e], off);
                acc[g][e] = acc[g][e] * fs + ao * fo;
            }
            m[g] = mm;
        }
    }

    __shared__ float sm_m[NW][G];
    __shared__ float sm_l[NW][G];
    __shared__ float sm_acc[NW][G][D];
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (part == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
#pragma unroll
            for (int e = 0; e < E; ++e) sm_acc[warp][g][part * E + e] = acc[g][e];
        }
    }
""" + _COMBINE.replace("PARTS", "NW").replace("PART_M", "sm_m[w][g]").replace(
    "PART_L", "sm_l[w][g]").replace("PART_ACC", "sm_acc[w][g][d]")

# E elements of P as one load: aligned to the largest power of two dividing its size
# (16 bytes at most: wider loads do not exist), which every lane's offset (a multiple of
# E elements) keeps.
_HEADER = r"""
// The running maxima's start (-FLT_MAX; see _BODY) and an empty split's max in the merge.
constexpr float kiln_lowest = -3.402823466e38f;
template <typename P, int E>
struct kiln_vec_align {
    static constexpr int bytes = static_cast<int>(sizeof(P)) * E;
    static constexpr int low = bytes & -bytes;
    static constexpr int value = low > 16 ? 16 : low;
};
template <typename P, int E>
struct alignas(kiln_vec_align<P, E>::value) kiln_vec {
    P v[E];
};
// cp.async (sm_80+): a 16-byte copy global -> shared that the thread does not wait for;
// copies are committed in groups, and wait_group<N> waits until at most N are pending.
// Older GPUs copy at once (same results, nothing in flight; the barriers still order it).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ inline void kiln_cp_async16(void* dst, const void* src) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(to), "l"(src));
}
__device__ inline void kiln_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void kiln_cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
#else
__device__ inline void kiln_cp_async16(void* dst, const void* src) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ inline void kiln_cp_commit() {}
template <int N>
__device__ inline void kiln_cp_wait() {}
#endif
"""

_DIRECT_WRITE = "out[(((size_t)b * HKV + kvh) * G + g) * D + d] = static_cast<T>(aa / ll);"
# With attention sinks, one split: the head's sink logit (log2 units, as the maxima) joins
# the denominator here, as the merge adds it after several splits.
_DIRECT_SINK_WRITE = """const float sink = static_cast<float>(sinks[kvh * G + g]) * 1.4426950408889634f;
        const float top = fmaxf(mm, sink);
        const float f = exp2f(mm - top);
        out[(((size_t)b * HKV + kvh) * G + g) * D + d] =
            static_cast<T>(aa * f / (ll * f + exp2f(sink - top)));"""
_SPLIT_WRITE = """out[(part_at * G + g) * D + d] = aa;
        if (d == 0) {
            out_ml[(part_at * G + g) * 2] = mm;
            out_ml[(part_at * G + g) * 2 + 1] = ll;
        }"""

# One block per (KV head, row): weights each split's partial by 2^(its max - the max of
# all), maxima in log2 units as _BODY keeps them, and normalises. Empty splits (past the
# row's length) have max -FLT_MAX: weight 0. With SINKS (attention sinks, GPT-OSS), each
# query head's sink logit joins the softmax's denominator once, here, as a token with
# no value would: its max and sum start at the sink instead of at nothing.
_MERGE_SOURCE = r"""
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int n_splits = acc_shape[2];
    const size_t first = ((size_t)b * HKV + kvh) * n_splits;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D;
        const int d = i % D;
        float mm = kiln_lowest;
        SINK_MAX
        for (int s = 0; s < n_splits; ++s) mm = fmaxf(mm, ml[((first + s) * G + g) * 2]);
        float num = 0.f, den = 0.f;
        SINK_SUM
        for (int s = 0; s < n_splits; ++s) {
            const float ms = ml[((first + s) * G + g) * 2];
            const float f = exp2f(ms - mm);
            den += ml[((first + s) * G + g) * 2 + 1] * f;
            num += acc[((first + s) * G + g) * D + d] * f;
        }
        out[(((size_t)b * HKV + kvh) * G + g) * D + d] = static_cast<T>(num / den);
    }
"""


# The body's parts that differ between the two kinds of kernel. Reading only: every
# input row-contiguous (MLX copies any that is not). Writing this step's K/V as well
# (paged_decode_write_attention): no input is copied (the pool must be its own buffer),
# so the others are read through their strides; the step's token is attended from the
# K/V inputs, never from the pool that this launch writes.
def _pool_load(slot: str) -> str:
    """Source loading pass `u`'s key and value (the lane's slice) from the pool row `slot`."""
    return f"""const size_t base = ((size_t)({slot}) * HKV + kvh) * 2 * D + part * E;
            kk[u] = *reinterpret_cast<const V*>(kv_pool + base);
            vv[u] = *reinterpret_cast<const V*>(kv_pool + base + D);"""


# How K/V reach the registers the math reads (kb, vb: the warp's U passes of this
# iteration). Registers (STAGES 0): each lane loads its rows of the next iteration before
# this one's math, so one iteration's loads are in flight while it computes, at the cost
# of registers (and so of blocks an SM). Staged (STAGES >= 2, sm_80+): the block copies
# whole tiles of STEP tokens into shared memory with cp.async, STAGES - 1 tiles ahead,
# which keeps more bytes in flight without registers; lanes then read their rows from the
# tile. The default (DEFAULT_STAGES); bench/attention_kernel.py --stages compares them.
_REGISTER_PIPE = {
    "PIPE_SETUP": """auto load = [&](int at, V* kk, V* vv) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t0 = at + (warp * U + u) * TPW + sub;
            const int t = t0 < end ? t0 : start;  // past the end: any valid row, masked below
            NEW_TOKEN {
                """ + _pool_load("sm_slots[t - start]") + """
            }
        }
    };
    if (start < end) load(start, kb, vb);  // an empty split (past the row's end) loads nothing""",
    "PIPE_FETCH": """V kn[U], vn[U];
        if (at + STEP < end) load(at + STEP, kn, vn);""",
    "PIPE_NEXT": """#pragma unroll
        for (int u = 0; u < U; ++u) {
            kb[u] = kn[u];
            vb[u] = vn[u];
        }""",
}

_STAGED_PIPE = {
    "PIPE_SETUP": """constexpr int ROW = 2 * D;  // a token's K/V row of one head, in elements
    constexpr int PIECE = 16 / static_cast<int>(sizeof(P));  // elements a 16-byte copy moves
    __shared__ __align__(16) P stage[STAGES][STEP][ROW];
    // Tile `at` (STEP tokens) into stage `into`; one commit group a tile, empty past the end.
    auto issue = [&](int at, int into) {
        for (int c = threadIdx.x; c < STEP * (ROW / PIECE); c += blockDim.x) {
            const int j = c / (ROW / PIECE);
            const int piece = c % (ROW / PIECE);
            const int t = at + j;
            if (t < end SKIP_NEW) {
                const P* row = kv_pool + ((size_t)sm_slots[t - start] * HKV + kvh) * ROW;
                kiln_cp_async16(&stage[into][j][piece * PIECE], row + piece * PIECE);
            }
        }
        kiln_cp_commit();
    };
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(start + k * STEP, k);
    int tile = 0;""",
    "PIPE_FETCH": """kiln_cp_wait<STAGES - 2>();  // this tile's copies are done (this thread's)
        __syncthreads();  // ... and every thread's; the stage refilled next was read by all
        issue(at + (STAGES - 1) * STEP, (tile + STAGES - 1) % STAGES);
        V* kk = kb;  // the names the kernel kind's new-token part stores to
        V* vv = vb;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = (warp * U + u) * TPW + sub;
            const int t = at + j;
            NEW_TOKEN if (t < end) {
                kk[u] = *reinterpret_cast<const V*>(&stage[tile % STAGES][j][part * E]);
                vv[u] = *reinterpret_cast<const V*>(&stage[tile % STAGES][j][D + part * E]);
            } else {  // never copied: zeros, so that p = 0 times it stays 0 (not NaN)
#pragma unroll
                for (int e = 0; e < E; ++e) kk[u].v[e] = vv[u].v[e] = static_cast<P>(0.f);
            }
        }""",
    "PIPE_NEXT": "++tile;",
}

# The staged pipeline with a tile slice a warp (`warp_tiles`): each warp copies only the
# tokens it computes (its U * TPW rows of each tile), so a tile's arrival is a warp's
# affair (wait, then __syncwarp) and no iteration waits at a block-wide barrier for the
# slowest warp's copies. Same shared memory, same math.
_WARP_STAGED_PIPE = dict(_STAGED_PIPE)
_WARP_STAGED_PIPE["PIPE_SETUP"] = _STAGED_PIPE["PIPE_SETUP"].replace(
    """        for (int c = threadIdx.x; c < STEP * (ROW / PIECE); c += blockDim.x) {
            const int j = c / (ROW / PIECE);""",
    """        constexpr int WT = U * TPW;  // a warp's tokens a tile
        for (int c = lane; c < WT * (ROW / PIECE); c += 32) {
            const int j = warp * WT + c / (ROW / PIECE);""")
_WARP_STAGED_PIPE["PIPE_FETCH"] = _STAGED_PIPE["PIPE_FETCH"].replace(
    """        __syncthreads();  // ... and every thread's; the stage refilled next was read by all""",
    """        __syncwarp();  // ... and the warp's; the stage refilled next was read by them""")
assert all(_WARP_STAGED_PIPE[k] != _STAGED_PIPE[k] for k in ("PIPE_SETUP", "PIPE_FETCH"))
# Whether the staged pipeline copies a tile slice a warp (_WARP_STAGED_PIPE), the
# default: on the H200 at 64 and 128 rows of 256 and 1,024 tokens (Gemma 3's heads) it
# beat the block's copies in every case, by 2-28% (docs/benchmarks.md, session 40;
# `--experiments block-tiles` and bench/attention_kernel.py --tiles block,warp compare).
DEFAULT_WARP_TILES = True

_READ_ONLY = {
    "PROLOGUE": "",
    "SKIP_NEW": "",
    "NEW_TOKEN": "",
    "LENGTH": "lengths[b]",
    "ROW_SLOTS": "table + (size_t)b * lmax",
    "SLOT_AT": "row_slots[start + i]",
    "Q_LOAD": "static_cast<float>(q[((size_t)b * HKV * G + kvh * G + g) * D + qd])",
    "NEW_COPY": "",
}


def _write_new(fused: bool, mma: bool = False) -> dict[str, str]:
    """The parts of the write-and-attend kernel (mma: of the tensor-core body). q, k_new
    and v_new come as three strided [B, H, 1, D] inputs; fused: as one `qkv` input, a
    fused projection's [B, 1, (Hq + 2 Hkv) * D] output (no view nodes to make them), and
    the kernel rotates q and the new k itself (kiln_rope in _ROPE_HEADER) at each row's
    new position."""
    if fused:
        offsets = """const size_t row = (size_t)b * qkv_strides[0];
    const int64_t es = qkv_strides[2];
    const size_t q_at = row + (size_t)(kvh * G) * D * es;
    const size_t k_at = row + (size_t)(HKV * G + kvh) * D * es;
    const size_t v_at = row + (size_t)(HKV * G + HKV + kvh) * D * es;
    // The new token's angles, once a block: every rotated element below reads them.
    __shared__ float rope_cos[D / 2], rope_sin[D / 2];
    kiln_rope_angles<D, ROPE_FREQS>(static_cast<float>(len - 1), rope, rope_cos, rope_sin);
    __syncthreads();
    """

        def q_elem(g: str, d: str) -> str:
            return f"kiln_rope<T, D, ROPE_TRADITIONAL>(qkv, q_at + (size_t)({g}) * D * es, es, {d}, rope_cos, rope_sin)"

        def k_elem(d: str) -> str:
            return f"kiln_rope<T, D, ROPE_TRADITIONAL>(qkv, k_at, es, {d}, rope_cos, rope_sin)"

        def v_elem(d: str) -> str:
            return f"static_cast<float>(qkv[v_at + (size_t)({d}) * es])"
    else:
        offsets = """const size_t k_at = (size_t)b * k_new_strides[0] + (size_t)kvh * k_new_strides[1];
    const size_t v_at = (size_t)b * v_new_strides[0] + (size_t)kvh * v_new_strides[1];
    """

        def q_elem(g: str, d: str) -> str:
            return (f"static_cast<float>(q[(size_t)b * q_strides[0] + (size_t)(kvh * G + {g}) * q_strides[1]"
                    f" + (size_t)({d}) * q_strides[3]])")

        def k_elem(d: str) -> str:
            return f"static_cast<float>(k_new[k_at + (size_t)({d}) * k_new_strides[3]])"

        def v_elem(d: str) -> str:
            return f"static_cast<float>(v_new[v_at + (size_t)({d}) * v_new_strides[3]])"

    store = offsets + """if (split == 0) {  // one block per (row, head) stores the head's new K/V
        P* pool = const_cast<P*>(kv_pool);
        const size_t dst = ((size_t)slots[b * slots_strides[0]] * HKV + kvh) * 2 * D;
        for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) {
            const float x = i < D ? """ + k_elem("i") + """
                                  : """ + v_elem("i - D") + """;
            pool[dst + i] = static_cast<P>(x);
        }
        if (b == 0 && kvh == 0 && threadIdx.x == 0) mark[0] = 0;
    }
    """
    common = {
        "LENGTH": "lengths[b * lengths_strides[0]]",
        "ROW_SLOTS": "table + (size_t)b * table_strides[0]",
        "SLOT_AT": "row_slots[(size_t)(start + i) * table_strides[1]]",
        "Q_LOAD": q_elem("g", "qd"),
    }
    if mma:
        return common | {
            # This step's token's row, as the pool rounds it, once a block in shared
            # memory: the tiles take it from there (NEW_COPY), never from the pool that
            # this launch writes.
            "PROLOGUE": store + """__shared__ __align__(16) P sm_new[2 * D];
    if (start <= len - 1 && len - 1 < end) {
        for (int i = threadIdx.x; i < 2 * D; i += blockDim.x)
            sm_new[i] = static_cast<P>(i < D ? """ + k_elem("i") + """ : """ + v_elem("i - D") + """);
    }""",
            "NEW_COPY": """if (t == len - 1) {
                    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&sm_new[piece * 8]);
                } else""",
        }
    return common | {
        "PROLOGUE": store + """// This step's token, as the pool rounds it (this lane's slice), read once here: in
    // the token loop its loads (and, fused, its rotation) cost every iteration registers.
    V k_mine, v_mine;
    if (start <= len - 1 && len - 1 < end) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            k_mine.v[e] = static_cast<P>(""" + k_elem("part * E + e") + """);
            v_mine.v[e] = static_cast<P>(""" + v_elem("part * E + e") + """);
        }
    }""",
        "SKIP_NEW": "&& t != len - 1",  # this step's token: not in the pool yet
        # This step's token, not yet in the pool this launch writes, from the registers.
        "NEW_TOKEN": """if (t == len - 1) {
                kk[u] = k_mine;
                vv[u] = v_mine;
            } else""",
    }


# A head rotated as mx.fast.rope rotates it (MLX's CUDA RoPE, same formulas and order, so
# the same rounding where the compiler contracts alike), at position pos over the whole head.
# kiln_rope_angles: the cos and sin of each frequency i < D/2 at pos, into a block's shared
# memory (the caller syncs); rope: [log2(base), scale] or [unused, scale, *freqs]
# (FREQS: frequencies given). kiln_rope: element d, rounded to T as RoPE's output is;
# x[at + j * step] is the head's element j. Computing the angles once a block, not once
# an element, keeps ~20 sin/cos evaluations a thread off the kernel's start.
_ROPE_HEADER = r"""
template <int D, bool FREQS>
__device__ void kiln_rope_angles(float pos, const float* rope, float* cos_t, float* sin_t) {
    constexpr int HALF = D / 2;
    for (int i = threadIdx.x; i < HALF; i += blockDim.x) {
        const float inv_freq = FREQS
            ? static_cast<float>(1.0 / rope[2 + i])
            : exp2f(-(static_cast<float>(i) / static_cast<float>(HALF)) * rope[0]);
        const float theta = (rope[1] * pos) * inv_freq;
        cos_t[i] = cosf(theta);  // what MLX's cos(float) and sin(float) call
        sin_t[i] = sinf(theta);
    }
}

template <typename T, int D, bool TRAD, typename X>
__device__ float kiln_rope(const X* x, size_t at, int64_t step, int d, const float* cos_t,
                           const float* sin_t) {
    constexpr int HALF = D / 2;
    const int i = TRAD ? d / 2 : d % HALF;
    const bool first = TRAD ? d % 2 == 0 : d < HALF;
    const int d1 = TRAD ? 2 * i : i;
    const int d2 = TRAD ? 2 * i + 1 : i + HALF;
    const float c = cos_t[i];
    const float s = sin_t[i];
    const float x1 = static_cast<float>(x[at + (size_t)d1 * step]);
    const float x2 = static_cast<float>(x[at + (size_t)d2 * step]);
    return static_cast<float>(static_cast<T>(first ? x1 * c - x2 * s : x1 * s + x2 * c));
}
"""


def _source(direct: bool, write_new: bool, fused: bool = False, staged: bool = False,
            sinks: bool = False, warp_tiles: bool = False) -> str:
    source = _BODY.replace("WRITE", (_DIRECT_SINK_WRITE if sinks else _DIRECT_WRITE)
                           if direct else _SPLIT_WRITE)
    # The pipeline first: its parts hold names (NEW_TOKEN, SKIP_NEW) that the kernel
    # kind's parts fill in.
    pipe = (_WARP_STAGED_PIPE if warp_tiles else _STAGED_PIPE) if staged else _REGISTER_PIPE
    for name, text in pipe.items():
        source = source.replace(name, text)
    for name, text in (_write_new(fused) if write_new else _READ_ONLY).items():
        source = source.replace(name, text)
    return source


# The tensor-core kernel (mma): the same blocks (split, KV head, row) and the same
# outputs as _BODY, but the dot products run as bf16/fp16 mma.sync tiles (m16n8k16, fp32
# accumulators): a KV head's G query heads are the tile's rows (up to 16, the rest
# zero), a warp takes 16 tokens an iteration: S = Q K^T in two 8-token tiles, an online
# softmax on S's fragments (a row's four lanes agree by two shuffles a tile, not four a
# token), then O += P V with P straight from S's registers (as flash attention does, P
# rounds to the values' dtype). _BODY spends ~50 warp instructions a token and KV head
# on CUDA cores; this ~3 of mma and loads. Where fewer token warps fit (wide heads),
# more warps split the output's columns (MmaLayout), each computing its tokens' scores.
#
# K/V come through shared memory as in _STAGED_PIPE: whole rows (a head's 2D elements)
# by cp.async, STAGES tiles of 16 tokens a warp. Rows are stored with their 16-byte
# chunks permuted (chunk ^ kiln_swz(row), within each 128 bytes) so that both reads
# below hit 32 distinct banks: K as 16-byte loads (a lane reads 8 consecutive elements
# of one key: QK's k dimension is summed over, so Q's fragments take the same order of
# head elements and every k-step's two mma share one load) and V by ldmatrix.trans
# (8 rows of one chunk). Tokens past the split's end are zeros, so p = 0 times them
# stays 0.
# A tensor-core body's copy of tile `at` into stage `into` (its rows' 16-byte chunks
# permuted by kiln_swz), one commit group a tile, rows past the split's end zeroed;
# COPY_ROW issues row j's chunk `piece` (token t) as cp.async.
_ISSUE_TILE = r"""    auto issue = [&](int at, int into) {
        for (int c = threadIdx.x; c < TILE * CPR; c += blockDim.x) {
            const int j = c / CPR;
            const int piece = c % CPR;
            const int t = at + j;
            P* dst = &stage[into][j][(piece ^ kiln_swz(j)) * 8];
            if (t < end) {
                COPY_ROW
            } else if (at < end) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            }
        }
        kiln_cp_commit();
    };
"""
_MMA_COPY_ROW = """NEW_COPY {
                    const P* row = kv_pool + ((size_t)sm_slots[t - start] * HKV + kvh) * ROW;
                    kiln_cp_async16(dst, row + piece * 8);
                }"""
_LATENT_COPY_ROW = "kiln_cp_async16(dst, kv_pool + (size_t)sm_slots[t - start] * row_stride + piece * 8);"


# A tensor-core kernel's P V for 16 tokens (rows VR of the tile at VROW) into the warp's
# output fragments from column tile COL0 on, and then the row sums over a fragment row's
# four lanes: shared by the decode and prefill bodies (paged_prefill).
MMA_PV_STEP = """#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t v[4];
            kiln_ldmatrix_t4(v, VROW + ((D / 8 + COL0n + (lane >> 4)) ^ kiln_swz(VR)) * 8);
            kiln_mma<P>(o[n], pa[0], pa[1], pa[2], pa[3], v[0], v[1]);
            kiln_mma<P>(o[n + 1], pa[0], pa[1], pa[2], pa[3], v[2], v[3]);
        }"""
MMA_ROW_SUMS = """// A row's sum over its four lanes (its max already agrees).
    l_lo += __shfl_xor_sync(0xffffffff, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffff, l_lo, 2);"""

_MMA_BODY = r"""
    constexpr int TW = TOKEN_WARPS;   // warps over the tile's tokens, 16 each
    constexpr int DW = COLUMN_WARPS;  // ... times warps over the output's columns
    constexpr int TILE = 16 * TW;     // tokens a block takes an iteration
    constexpr int ROW = 2 * D;      // a token's K/V row of one head, in elements
    constexpr int CPR = ROW / 8;    // its 16-byte chunks
    constexpr int KS = D / 32;      // QK's k-steps of 32 elements (two mma each)
    constexpr int NT = D / 8 / DW;  // PV's output tiles of 8 columns a warp takes
    constexpr bool HI = G > 8;      // query heads in the fragments' upper 8 rows too
    const int split = blockIdx.x;
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int tw = warp / DW;  // the warp's 16 tokens of a tile
    const int n0 = warp % DW * NT;  // ... and its first output tile
    const int gid = lane >> 2;  // fragment row (query head); K's token in an 8-token tile
    const int tid = lane & 3;   // fragment column pair
    const int n_splits = gridDim.x;
    const int len = LENGTH;
    const int lmax = table_shape[1];
    const int chunk = (lmax + n_splits - 1) / n_splits;
    const int start = split * chunk;
    const int end = min(start + chunk, len);
    const float sc = __int_as_float(SCALE) * 1.4426950408889634f;  // scores in log2 units, as _BODY
    PROLOGUE
    __shared__ int sm_slots[CHUNK_MAX];
    __shared__ __align__(16) P sm_q[G][D];
    {
        const int* row_slots = ROW_SLOTS;
        for (int i = threadIdx.x; i < end - start; i += blockDim.x) sm_slots[i] = SLOT_AT;
        for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
            const int g = i / D;
            const int qd = i % D;
            sm_q[g][qd] = static_cast<P>(Q_LOAD);
        }
    }
    STAGE_DECL
    // Tile `at` into stage `into`: one commit group a tile; rows past the end zeroed.
ISSUE_TILE    __syncthreads();  // the slots and q are in place
    uint32_t qlo[KS][4], qhi[KS][4];  // Q's A fragments: rows gid, gid + 8
#pragma unroll
    for (int c = 0; c < KS; ++c) {
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const uint4 lo = gid < G ? *reinterpret_cast<const uint4*>(&sm_q[gid][c * 32 + tid * 8]) : zero;
        qlo[c][0] = lo.x; qlo[c][1] = lo.y; qlo[c][2] = lo.z; qlo[c][3] = lo.w;
        uint4 hi = zero;
        if (HI && gid + 8 < G) hi = *reinterpret_cast<const uint4*>(&sm_q[HI ? gid + 8 : 0][c * 32 + tid * 8]);
        qhi[c][0] = hi.x; qhi[c][1] = hi.y; qhi[c][2] = hi.z; qhi[c][3] = hi.w;
    }
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(start + k * TILE, k);
    float o[NT][4];  // O's fragments: rows gid (0, 1) and gid + 8 (2, 3)
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_lo = kiln_lowest, m_hi = kiln_lowest, l_lo = 0.f, l_hi = 0.f;
    int tile = 0;
    for (int at = start; at < end; at += TILE, ++tile) {
        kiln_cp_wait<STAGES - 2>();
        __syncthreads();
        issue(at + (STAGES - 1) * TILE, (tile + STAGES - 1) % STAGES);
        const int t0 = at + tw * 16;  // the warp's first token
        if (t0 >= end) continue;        // warp-uniform: the split's last, partial tile
        const P* rows = &stage[tile % STAGES][tw * 16][0];
        float s[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.f;
            const int r = h * 8 + gid;
            const P* key = rows + r * ROW;
#pragma unroll
            for (int c = 0; c < KS; ++c) {
                const uint4 k = *reinterpret_cast<const uint4*>(key + ((c * 4 + tid) ^ kiln_swz(r)) * 8);
                kiln_mma<P>(s[h], qlo[c][0], qhi[c][0], qlo[c][1], qhi[c][1], k.x, k.y);
                kiln_mma<P>(s[h], qlo[c][2], qhi[c][2], qlo[c][3], qhi[c][3], k.z, k.w);
            }
        }
        // s[h][j]: token t0 + h * 8 + tid * 2 + (j & 1), row gid (j < 2) or gid + 8.
        float top_lo = kiln_lowest, top_hi = kiln_lowest;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const bool ok = t0 + h * 8 + tid * 2 + j < end;
                s[h][j] = ok ? s[h][j] * sc : kiln_lowest;
                s[h][j + 2] = ok ? s[h][j + 2] * sc : kiln_lowest;
                top_lo = fmaxf(top_lo, s[h][j]);
                top_hi = fmaxf(top_hi, s[h][j + 2]);
            }
        }
        top_lo = fmaxf(top_lo, __shfl_xor_sync(0xffffffff, top_lo, 1));
        top_lo = fmaxf(top_lo, __shfl_xor_sync(0xffffffff, top_lo, 2));
        const float new_lo = fmaxf(m_lo, top_lo);
        const float a_lo = exp2f(m_lo - new_lo);
        m_lo = new_lo;
        float new_hi = m_hi, a_hi = 1.f;
        if (HI) {
            top_hi = fmaxf(top_hi, __shfl_xor_sync(0xffffffff, top_hi, 1));
            top_hi = fmaxf(top_hi, __shfl_xor_sync(0xffffffff, top_hi, 2));
            new_hi = fmaxf(m_hi, top_hi);
            a_hi = exp2f(m_hi - new_hi);
            m_hi = new_hi;
        }
        uint32_t pa[4];  // P's A fragment over the warp's 16 tokens
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float p0 = s[h][0] > kiln_lowest ? exp2f(s[h][0] - new_lo) : 0.f;
            const float p1 = s[h][1] > kiln_lowest ? exp2f(s[h][1] - new_lo) : 0.f;
            l_lo = l_lo * (h == 0 ? a_lo : 1.f) + p0 + p1;
            pa[2 * h] = kiln_pack<P>(p0, p1);
            if (HI) {
                const float p2 = s[h][2] > kiln_lowest ? exp2f(s[h][2] - new_hi) : 0.f;
                const float p3 = s[h][3] > kiln_lowest ? exp2f(s[h][3] - new_hi) : 0.f;
                l_hi = l_hi * (h == 0 ? a_hi : 1.f) + p2 + p3;
                pa[2 * h + 1] = kiln_pack<P>(p2, p3);
            } else {
                pa[2 * h + 1] = 0u;
            }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= a_lo; o[n][1] *= a_lo;
            if (HI) { o[n][2] *= a_hi; o[n][3] *= a_hi; }
        }
        // V's B fragments by ldmatrix.trans: lane = matrix (lane / 8: tokens 0-7 or
        // 8-15, this or the next 8 columns) x row (lane % 8); four matrices, two n-tiles.
        const int vr = (lane >> 3 & 1) * 8 + (lane & 7);
        const P* vrow = rows + vr * ROW;
MMA_PV_STEP
    }
    kiln_cp_wait<0>();
    MMA_ROW_SUMS
    if (HI) {
        l_hi += __shfl_xor_sync(0xffffffff, l_hi, 1);
        l_hi += __shfl_xor_sync(0xffffffff, l_hi, 2);
    }
    __syncthreads();  // the stages are free: the warps' partials go there
    float* sm_m = reinterpret_cast<float*>(&stage[0][0][0]);
    float* sm_l = sm_m + TW * G;
    float* sm_acc = sm_l + TW * G;  // [TW][G][D]: a token warp's columns from its DW warps
    const bool first = warp % DW == 0;  // the DW warps of tokens agree on max and sum
    if (gid < G) {
        if (tid == 0 && first) { sm_m[tw * G + gid] = m_lo; sm_l[tw * G + gid] = l_lo; }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            sm_acc[(tw * G + gid) * D + (n0 + n) * 8 + tid * 2] = o[n][0];
            sm_acc[(tw * G + gid) * D + (n0 + n) * 8 + tid * 2 + 1] = o[n][1];
        }
    }
    if (HI && gid + 8 < G) {
        const int g8 = HI ? gid + 8 : 0;
        if (tid == 0 && first) { sm_m[tw * G + g8] = m_hi; sm_l[tw * G + g8] = l_hi; }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            sm_acc[(tw * G + g8) * D + (n0 + n) * 8 + tid * 2] = o[n][2];
            sm_acc[(tw * G + g8) * D + (n0 + n) * 8 + tid * 2 + 1] = o[n][3];
        }
    }
""".replace("ISSUE_TILE", _ISSUE_TILE.replace("COPY_ROW", _MMA_COPY_ROW)).replace(
    "MMA_PV_STEP", MMA_PV_STEP.replace("VROW", "vrow").replace("COL0", "n0 + ").replace(
        "VR", "vr")).replace("MMA_ROW_SUMS", MMA_ROW_SUMS) + _COMBINE.replace("PARTS", "TW").replace("PART_M", "sm_m[w * G + g]").replace(
    "PART_L", "sm_l[w * G + g]").replace("PART_ACC", "sm_acc[(w * G + g) * D + d]")

# The tensor-core kernel's helpers (sm_80+: bf16 mma and cp.async).
_MMA_HEADER = r"""
// A stored row's chunk permutation: rows 0..7 to distinct values in 0..7, and rows 2i and
// 2i + 1 to opposite halves (see _MMA_BODY).
__device__ inline int kiln_swz(int row) { return ((row & 1) << 2) | ((row >> 1) & 3); }
template <typename P> struct kiln_mma_op;
""" + "".join(r"""template <> struct kiln_mma_op<CTYPE> {
    static __device__ inline void run(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                      uint32_t a3, uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.PTX.PTX.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};
""".replace("CTYPE", ctype).replace("PTX", ptx)
              for ctype, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16"))) + r"""// c (16 x 8, fp32) += a (16 x 16) b (16 x 8): the PTX fragment layouts.
template <typename P>
__device__ inline void kiln_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                uint32_t b0, uint32_t b1) {
    kiln_mma_op<P>::run(c, a0, a1, a2, a3, b0, b1);
}
__device__ inline uint32_t kiln_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ inline uint32_t kiln_bits(__half x) { return __half_as_ushort(x); }
// Two floats as P, the first in the low half (a fragment register's element order).
template <typename P>
__device__ inline uint32_t kiln_pack(float x, float y) {
    return kiln_bits(static_cast<P>(x)) | (kiln_bits(static_cast<P>(y)) << 16);
}
// Four 8 x 8 matrices of 16-bit elements from shared memory, transposed: lane i gives
// the address of row i % 8 of matrix i / 8.
__device__ inline void kiln_ldmatrix_t4(uint32_t* r, const void* p) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at) : "memory");
}
"""

@functools.cache
def _kernel(direct: bool, write_new: bool = False, fused: bool = False, staged: bool = False,
            sinks: bool = False, mma: bool = False, dynamic_bytes: int = 0,
            warp_tiles: bool = False):
    """The decode kernel of a kind; sinks (one split only): `sinks` is its last input;
    mma: the tensor-core body (_MMA_BODY; `staged` does not apply), its tiles in this
    many bytes of dynamic shared memory if not 0."""
    assert direct or not sinks, "several splits take the sinks in the merge"
    outputs = ["out"] if direct else ["out", "out_ml"]
    # MLX caches a compiled kernel by name and template arguments: one name a source.
    body = (("_mma_dyn" if dynamic_bytes else "_mma") if mma
            else ("_wstaged" if warp_tiles else "_staged") if staged else "")
    kind = f"{body}_decode_{'direct' if direct else 'split'}{'_sinks' if sinks else ''}"
    extra = ["sinks"] if sinks else []
    header = _HEADER + (_MMA_HEADER if mma else "")
    if write_new:
        new = ["qkv"] if fused else ["q", "k_new", "v_new"]
        source = (_mma_source(direct, True, fused, sinks, dynamic_bytes > 0) if mma
                  else _source(direct, True, fused, staged, sinks, warp_tiles))
        return mx.fast.cuda_kernel(
            name=f"kiln_paged_write{'_qkv_rope' if fused else ''}{kind}",
            # `written`: the mark of the layer's previous in-place write, which this
            # launch follows; `mark` (out): this launch's, as pool_write_in_place's.
            input_names=[*new, "kv_pool", "table", "lengths", "written", "slots",
                         *(["rope"] if fused else []), *extra],
            output_names=[*outputs, "mark"], source=source,
            header=header + (_ROPE_HEADER if fused else ""), ensure_row_contiguous=False,
            shared_memory=dynamic_bytes)
    return mx.fast.cuda_kernel(
        name=f"kiln_paged{kind}",
        # `written`: the mark of this layer's in-place pool write (pool_write_in_place),
        # an input only so that the kernel runs after it.
        input_names=["q", "kv_pool", "table", "lengths", "written", *extra],
        output_names=outputs,
        source=(_mma_source(direct, False, sinks=sinks, dynamic=dynamic_bytes > 0) if mma
                else _source(direct, False, staged=staged, sinks=sinks, warp_tiles=warp_tiles)),
        header=header, shared_memory=dynamic_bytes)


# The tensor-core kernel's tiles: static shared memory, or the launch's dynamic shared
# memory where they and the rest pass a block's static 48 KiB (MmaConfig.stage_bytes).
_STATIC_STAGES = "__shared__ __align__(16) P stage[STAGES][TILE][ROW];"
_DYNAMIC_STAGES = """extern __shared__ __align__(16) unsigned char kiln_dynamic[];
    auto& stage = *reinterpret_cast<P (*)[STAGES][TILE][ROW]>(kiln_dynamic);"""


def _mma_source(direct: bool, write_new: bool, fused: bool = False, sinks: bool = False,
                dynamic: bool = False) -> str:
    source = _MMA_BODY.replace("WRITE", (_DIRECT_SINK_WRITE if sinks else _DIRECT_WRITE)
                               if direct else _SPLIT_WRITE)
    source = source.replace("STAGE_DECL", _DYNAMIC_STAGES if dynamic else _STATIC_STAGES)
    for name, text in (_write_new(fused, mma=True) if write_new else _READ_ONLY).items():
        source = source.replace(name, text)
    return source


_DYNAMIC_SHARED_MAX = 227 * 1024  # a block's opt-in limit on sm_80/sm_90


@dataclass(frozen=True)
class MmaLayout:
    """How the tensor-core kernel's warps share a block's work: token_warps take 16
    tokens each of a tile, column_warps split the output's columns among them (each
    recomputing its tokens' scores, cheap on tensor cores); `stages` tiles in flight."""

    token_warps: int
    column_warps: int
    stages: int

    @property
    def threads(self) -> int:
        return 32 * self.token_warps * self.column_warps

    def stage_bytes(self, dim: int, itemsize: int = 2) -> int:
        """The tiles' shared memory: `stages` tiles of 16 K/V rows a token warp."""
        return self.stages * 16 * self.token_warps * 2 * dim * itemsize


@dataclass(frozen=True)
class MmaConfig:
    """The tensor-core kernel's shape: its tiles take at most stage_bytes (32 KiB: static
    shared memory; more, with the rest past a block's static 48 KiB, the launch's dynamic
    shared memory), `stages` tiles a block keeps (one in flight while the other is read),
    `warps` a block: over tokens as the tiles fit them (with the defaults 4 for 64-wide
    heads, 2 for 128, 1 for 256), then over the output's columns."""

    stage_bytes: int = 32 * 1024
    stages: int = 2
    warps: int = 4

    def layout(self, dim: int, itemsize: int = 2) -> MmaLayout | None:
        """The warps for heads this wide (None: not even one warp's tiles fit)."""
        token = next((w for w in (8, 4, 2, 1) if w <= self.warps and MmaLayout(
            w, 1, self.stages).stage_bytes(dim, itemsize) <= self.stage_bytes), 0)
        if not token:
            return None
        column = max(1, self.warps // token)
        while column > 1 and (dim // 8) % (2 * column):  # whole ldmatrix pairs a warp
            column //= 2
        return MmaLayout(token, column, self.stages)

    def dynamic_bytes(self, dim: int, group: int) -> int:
        """The dynamic shared memory a launch takes for its tiles: 0 (the tiles are
        static) unless they and the rest pass a block's static 48 KiB."""
        layout = self.layout(dim)
        assert layout is not None
        tiles = layout.stage_bytes(dim)
        return tiles if tiles + _mma_static_bytes(dim, group) > _STATIC_SHARED_MAX else 0

    def fits(self, dtype: mx.Dtype, pool_dtype: mx.Dtype, dim: int, group: int) -> bool:
        """Whether the kernel serves these heads: 16-bit floats (q as the pool stores
        them: the mma's operands), heads a multiple of 32 wide, up to 16 query heads a
        KV head (one fragment's rows), its shared memory within a block's (the warps'
        partials reuse the tiles)."""
        if not _mma_operands(dtype, pool_dtype):
            return False
        if dim % 32 or not 1 <= group <= 16:
            return False
        layout = self.layout(dim)
        if layout is None or self.stages < 2:
            return False
        tiles = layout.stage_bytes(dim)
        rest = _mma_static_bytes(dim, group)
        partials = layout.token_warps * group * (dim + 2) * 4
        return (rest <= _STATIC_SHARED_MAX and tiles + rest <= _DYNAMIC_SHARED_MAX
                and partials <= tiles)


def _mma_operands(dtype: mx.Dtype, pool_dtype: mx.Dtype) -> bool:
    """Whether queries of dtype over a pool of pool_dtype are mma.sync's operands as they
    are: 16-bit floats, q as the pool stores them (both tensor-core kernels)."""
    return dtype == pool_dtype and dtype in (mx.bfloat16, mx.float16)


def _mma_static_bytes(dim: int, group: int) -> int:
    """A tensor-core block's static shared memory besides the tiles (slot ids, q, the
    step's K/V row, RoPE's table), every variant's most."""
    return 4 * MAX_SPLIT_TOKENS + group * dim * 2 + 2 * dim * 2 + 4 * dim


# Wider tiles (`--experiments mma-wide-tiles`): two token warps for 256-wide heads
# (Gemma), four for 128, in dynamic shared memory.
MMA_WIDE_TILES = MmaConfig(stage_bytes=64 * 1024)


@functools.cache
def tensor_cores_available() -> bool:
    """Whether the CUDA device runs the tensor-core kernel's bf16/fp16 mma and cp.async
    (sm_80 and later)."""
    if not kernel_available():
        return False
    return int(mx.device_info().get("compute_capability_major", 0)) >= 8


def mma_preferred(dim: int) -> bool:
    """Whether the tensor-core kernel (default shape) beats the CUDA-core one for heads
    this wide, as measured on the H200 (docs/benchmarks.md, session 25): up to 128 (-20
    to -60% a layer at 36-128 rows of 2k tokens); not 256 (+2-48%)."""
    return dim <= 128


# Latent (MLA) decode attention: mlx-lm's DeepSeek-V3 family attends, at decode, its
# absorbed queries q (the latent's width D) against the cache's keys as both keys and
# values (the pool row's first D elements: the latent), and adds the scores of the RoPE
# part as the mask, which the model computes itself from the cache's values (the row's
# rest). One KV head and many query heads (16 to 128): a block takes 16 of them as an
# mma tile's rows (grid y), one split of one row's context (grid x). An iteration's tile
# of 8 tokens a warp: each warp scores its 8 tokens over all of D (S = Q K^T, 16 x 8),
# writes them (with the bias, in log2 units) to shared memory; then every warp takes
# the whole tile's scores (the same online softmax in each, so their maxima and sums
# agree) and its own D / WARPS output columns of O += P V (V by ldmatrix.trans from the
# same tile). The tiles' rows are the latent's 16-byte chunks, permuted per row as the
# tensor-core kernel's (kiln_swz), which keeps both reads free of bank conflicts.
_LATENT_BODY = r"""
    constexpr int W = WARPS;
    constexpr int TILE = 8 * W;     // tokens an iteration
    constexpr int CPR = D / 8;      // a latent row's 16-byte chunks
    constexpr int KS = D / 32;      // QK's k-steps of 32 elements (two mma each)
    constexpr int NT = D / 8 / W;   // PV's output tiles of 8 columns a warp takes
    constexpr int SW = TILE + 8;    // a score row's stride in sm_s (floats)
    constexpr int QW = D + 32;      // a query row's in sm_q: rows gid and gid + 1 of a
                                    // fragment load 64 bytes apart (no bank conflict)
    const int split = blockIdx.x;
    const int g0 = blockIdx.y * 16;  // the block's query heads: g0 ..
    const int b = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gid = lane >> 2;  // fragment row (query head); S's token in the warp's 8
    const int tid = lane & 3;   // fragment column pair
    const int n0 = warp * NT;   // the warp's first output tile
    const int n_splits = gridDim.x;
    const int len = lengths[b];
    const int lmax = table_shape[1];
    const int chunk = (lmax + n_splits - 1) / n_splits;
    const int start = split * chunk;
    const int end = min(start + chunk, len);
    const int lb = bias_shape[3];
    const size_t row_stride = (size_t)kv_pool_shape[1] * kv_pool_shape[2];
    const float sc = __int_as_float(SCALE) * 1.4426950408889634f;  // log2 units, as _MMA_BODY
    __shared__ int sm_slots[CHUNK_MAX];
    __shared__ __align__(16) P sm_q[16][QW];
    __shared__ float sm_s[16][SW];
    extern __shared__ __align__(16) unsigned char kiln_dynamic[];
    auto& stage = *reinterpret_cast<P (*)[STAGES][TILE][D]>(kiln_dynamic);
    {
        const int* row_slots = table + (size_t)b * lmax + start;
        for (int i = threadIdx.x; i < end - start; i += blockDim.x) sm_slots[i] = row_slots[i];
        for (int i = threadIdx.x; i < 16 * D; i += blockDim.x) {
            const int r = i / D;
            sm_q[r][i % D] = g0 + r < H ? q[((size_t)b * H + g0 + r) * D + i % D] : static_cast<P>(0.f);
        }
    }
ISSUE_TILE    __syncthreads();  // the slots and q are in place
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(start + k * TILE, k);
    float o[NT][4];  // O's fragments: rows gid (0, 1) and gid + 8 (2, 3)
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_lo = kiln_lowest, m_hi = kiln_lowest, l_lo = 0.f, l_hi = 0.f;
    const P* bias_lo = bias + ((size_t)b * H + min(g0 + gid, H - 1)) * lb;
    const P* bias_hi = bias + ((size_t)b * H + min(g0 + gid + 8, H - 1)) * lb;
    int tile = 0;
    for (int at = start; at < end; at += TILE, ++tile) {
        kiln_cp_wait<STAGES - 2>();
        __syncthreads();  // this tile landed; the last one's scores are read
        issue(at + (STAGES - 1) * TILE, (tile + STAGES - 1) % STAGES);
        const P (*rows)[D] = stage[tile % STAGES];
        {   // S for the warp's 8 tokens: Q's fragments from shared memory, K's from the tile.
            // The bias is loaded first, its global latency under the mma; the mma run
            // four accumulator chains, not one chain of D / 16 dependent mma.
            float b_lo[2], b_hi[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = warp * 8 + tid * 2 + j;
                const bool ok = at + col < end;
                b_lo[j] = ok ? static_cast<float>(bias_lo[at + col]) : 0.f;
                b_hi[j] = ok ? static_cast<float>(bias_hi[at + col]) : 0.f;
            }
            float s4[4][4] = {};
            const P* key = rows[warp * 8 + gid];
            const int swz = kiln_swz(warp * 8 + gid);
#pragma unroll
            for (int c = 0; c < KS; ++c) {
                const uint4 qa = *reinterpret_cast<const uint4*>(&sm_q[gid][c * 32 + tid * 8]);
                const uint4 qb = *reinterpret_cast<const uint4*>(&sm_q[gid + 8][c * 32 + tid * 8]);
                const uint4 k = *reinterpret_cast<const uint4*>(key + ((c * 4 + tid) ^ swz) * 8);
                kiln_mma<P>(s4[(c & 1) * 2], qa.x, qb.x, qa.y, qb.y, k.x, k.y);
                kiln_mma<P>(s4[(c & 1) * 2 + 1], qa.z, qb.z, qa.w, qb.w, k.z, k.w);
            }
            // s[j]: token warp * 8 + tid * 2 + (j & 1) of the tile, row gid (j < 2) or gid + 8.
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = warp * 8 + tid * 2 + j;
                const bool ok = at + col < end;
                const float lo = (s4[0][j] + s4[1][j]) + (s4[2][j] + s4[3][j]);
                const float hi = (s4[0][j + 2] + s4[1][j + 2]) + (s4[2][j + 2] + s4[3][j + 2]);
                sm_s[gid][col] = ok ? lo * sc + b_lo[j] * 1.4426950408889634f : kiln_lowest;
                sm_s[gid + 8][col] = ok ? hi * sc + b_hi[j] * 1.4426950408889634f : kiln_lowest;
            }
        }
        __syncthreads();  // the tile's scores are in place
        float x_lo[TILE / 16][4], x_hi[TILE / 16][4];  // P's A fragments' scores
        float top_lo = kiln_lowest, top_hi = kiln_lowest;
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = kk * 16 + (j >> 1) * 8 + tid * 2 + (j & 1);
                x_lo[kk][j] = sm_s[gid][col];
                x_hi[kk][j] = sm_s[gid + 8][col];
                top_lo = fmaxf(top_lo, x_lo[kk][j]);
                top_hi = fmaxf(top_hi, x_hi[kk][j]);
            }
        }
        top_lo = fmaxf(top_lo, __shfl_xor_sync(0xffffffff, top_lo, 1));
        top_lo = fmaxf(top_lo, __shfl_xor_sync(0xffffffff, top_lo, 2));
        top_hi = fmaxf(top_hi, __shfl_xor_sync(0xffffffff, top_hi, 1));
        top_hi = fmaxf(top_hi, __shfl_xor_sync(0xffffffff, top_hi, 2));
        const float new_lo = fmaxf(m_lo, top_lo), new_hi = fmaxf(m_hi, top_hi);
        const float a_lo = exp2f(m_lo - new_lo), a_hi = exp2f(m_hi - new_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        l_lo *= a_lo;
        l_hi *= a_hi;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= a_lo; o[n][1] *= a_lo;
            o[n][2] *= a_hi; o[n][3] *= a_hi;
        }
        const int vr = (lane >> 3 & 1) * 8 + (lane & 7);  // ldmatrix's row (see _MMA_BODY)
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
            float p[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                p[j] = x_lo[kk][j] > kiln_lowest ? exp2f(x_lo[kk][j] - new_lo) : 0.f;
                p[j + 4] = x_hi[kk][j] > kiln_lowest ? exp2f(x_hi[kk][j] - new_hi) : 0.f;
                l_lo += p[j];
                l_hi += p[j + 4];
            }
            const uint32_t a0 = kiln_pack<P>(p[0], p[1]), a1 = kiln_pack<P>(p[4], p[5]);
            const uint32_t a2 = kiln_pack<P>(p[2], p[3]), a3 = kiln_pack<P>(p[6], p[7]);
            const int r = kk * 16 + vr;
            const P* vrow = rows[r];
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                uint32_t v[4];
                kiln_ldmatrix_t4(v, vrow + ((n0 + n + (lane >> 4)) ^ kiln_swz(r)) * 8);
                kiln_mma<P>(o[n], a0, a1, a2, a3, v[0], v[1]);
                kiln_mma<P>(o[n + 1], a0, a1, a2, a3, v[2], v[3]);
            }
        }
    }
    kiln_cp_wait<0>();
    l_lo += __shfl_xor_sync(0xffffffff, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffff, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffff, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffff, l_hi, 2);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int g = g0 + gid + half * 8;
        if (g >= H) continue;
        // A split's partial as the merge reads a KV head's: each query head its own.
        const size_t part_at = ((size_t)b * H + g) * n_splits + split;
        const float mm = half ? m_hi : m_lo;
        const float ll = half ? l_hi : l_lo;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int d = (n0 + n) * 8 + tid * 2 + j;
                const float aa = o[n][half * 2 + j];
                WRITE
            }
        }
    }
""".replace("ISSUE_TILE", _ISSUE_TILE.replace("COPY_ROW", _LATENT_COPY_ROW))
_LATENT_DIRECT_WRITE = "out[((size_t)b * H + g) * D + d] = static_cast<T>(aa / ll);"
_LATENT_SPLIT_WRITE = """out[part_at * D + d] = aa;
                if (warp == 0 && tid == 0 && n == 0 && j == 0) {
                    out_ml[part_at * 2] = mm;
                    out_ml[part_at * 2 + 1] = ll;
                }"""


@dataclass(frozen=True)
class LatentConfig:
    """The latent kernel's shape: `warps` a block (8 tokens each a tile; each then takes
    D / warps output columns) and `stages` tiles in flight, in dynamic shared memory."""

    warps: int = 4
    stages: int = 2

    def tile_bytes(self, dim: int) -> int:
        return self.stages * 8 * self.warps * dim * 2

    def fits(self, dtype: mx.Dtype, pool_dtype: mx.Dtype, dim: int, row: int = 0) -> bool:
        """Whether the kernel serves these queries: 16-bit floats as the pool stores them
        (the mma's operands), a latent width whose columns split into whole ldmatrix
        pairs a warp (an even number of warps: a tile's tokens in 16s), pool rows of
        `row` elements (default dim) in whole 16-byte chunks (cp.async's), tiles and the
        rest within a block's shared memory."""
        if not _mma_operands(dtype, pool_dtype):
            return False
        if self.stages < 2 or self.warps % 2 or dim % 32 or (dim // 8) % (2 * self.warps):
            return False
        if (row or dim) % 8:
            return False
        static = 4 * MAX_SPLIT_TOKENS + 16 * (dim + 32) * 2 + 16 * (8 * self.warps + 8) * 4
        return static <= _STATIC_SHARED_MAX and static + self.tile_bytes(dim) <= _DYNAMIC_SHARED_MAX


@functools.cache
def _latent_kernel(direct: bool, shared_bytes: int):
    """The latent kernel, its tiles in `shared_bytes` of dynamic shared memory."""
    return mx.fast.cuda_kernel(
        name=f"kiln_paged_latent_{'direct' if direct else 'split'}",
        input_names=["q", "kv_pool", "table", "lengths", "bias", "written"],
        output_names=["out"] if direct else ["out", "out_ml"],
        source=_LATENT_BODY.replace("WRITE", _LATENT_DIRECT_WRITE if direct else _LATENT_SPLIT_WRITE),
        header=_HEADER + _MMA_HEADER, shared_memory=shared_bytes)


def paged_latent_attention(q: mx.array, kv_pool: mx.array, table: mx.array, lengths: mx.array,
                           bias: mx.array, scale: float, written: mx.array | None = None,
                           config: LatentConfig = LatentConfig()) -> mx.array:
    """Latent (MLA) decode attention over the pool, on tensor cores (config.fits).

    q: [B, H, 1, D], the absorbed queries; kv_pool: [slots, 1, D + R], a row's first D
    elements the latent (keys and values both), the rest the RoPE part, which the model
    scored itself: bias [B, H, 1, L] (added to scale * q . latent; L >= the table's
    width is read only up to each row's length); table, lengths, written: as
    paged_decode_attention's. Returns [B, H, 1, D] in q's dtype."""
    batch, heads, _, dim = q.shape
    tiles = -(-heads // 16)
    splits = num_splits(batch, tiles, table.shape[1])
    threads = 32 * config.warps
    inputs = [q.reshape(batch, heads, dim), kv_pool, table, lengths, bias, follow_mark(written)]
    template = [("T", q.dtype), ("P", kv_pool.dtype), ("D", dim), ("H", heads),
                ("SCALE", float_bits(scale)),
                ("WARPS", config.warps), ("STAGES", config.stages),
                ("CHUNK_MAX", MAX_SPLIT_TOKENS)]
    grid = (splits * threads, tiles, batch)
    shared = config.tile_bytes(dim)
    if splits == 1:
        (out,) = _latent_kernel(True, shared)(
            inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
            output_shapes=[(batch, heads, dim)], output_dtypes=[q.dtype])
        return out.reshape(batch, heads, 1, dim)
    # The partials laid out as the merge's "KV heads" of one query head each: a merge
    # block a (query head, row), not one a row over every head's columns (a short row's
    # many splits at 128 heads made that block the step's cost: docs/benchmarks.md,
    # session 26).
    acc, ml = _latent_kernel(False, shared)(
        inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
        output_shapes=[(batch, heads, splits, 1, dim), (batch, heads, splits, 1, 2)],
        output_dtypes=[mx.float32, mx.float32])
    (out,) = _merge_kernel(False)(
        inputs=[acc, ml], template=[("T", q.dtype), ("D", dim), ("G", 1), ("HKV", heads)],
        grid=(_THREADS, heads, batch), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(batch, heads, dim)], output_dtypes=[q.dtype])
    return out.reshape(batch, heads, 1, dim)


def reference_latent_attention(q: mx.array, kv_pool: mx.array, table: mx.array,
                               lengths: mx.array, bias: mx.array, scale: float,
                               written: mx.array | None = None) -> mx.array:
    """The plain-MLX meaning of paged_latent_attention: the latent gathered as keys and
    values, the bias masked past each row's length, MLX's fused attention (what mlx-lm's
    own call computes from a dense cache: the same values, bit for bit, where the model
    masked the bias already)."""
    latent, _ = split_kv(kv_pool[after_write(table, written)], q.shape[-1])
    valid = (mx.arange(table.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    bias = mx.where(valid, bias[..., :table.shape[1]],
                    mx.array(mx.finfo(bias.dtype).min, bias.dtype))
    return mx.fast.scaled_dot_product_attention(q, latent, latent, scale=scale, mask=bias)


_SINK_MAX = "const float sink = static_cast<float>(sinks[kvh * G + g]) * 1.4426950408889634f;\n        mm = sink;"
_SINK_SUM = "den = exp2f(sink - mm);"


def merge_source(sinks: bool) -> str:
    """The merge kernel's source, with or without attention sinks."""
    return (_MERGE_SOURCE.replace("SINK_MAX", _SINK_MAX if sinks else "")
            .replace("SINK_SUM", _SINK_SUM if sinks else ""))


@functools.cache
def _merge_kernel(sinks: bool = False):
    return mx.fast.cuda_kernel(name=f"kiln_paged_decode_merge{'_sinks' if sinks else ''}",
                               input_names=["acc", "ml", *(["sinks"] if sinks else [])],
                               output_names=["out"], source=merge_source(sinks), header=_HEADER)


@functools.cache
def kernel_available() -> bool:
    """The CUDA kernel runs only on MLX's CUDA backend (the GPU must be the default)."""
    try:
        return mx.cuda.is_available() and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def num_splits(batch: int, n_kv: int, l_max: int) -> int:
    """How many blocks share each (row, KV head): see TARGET_BLOCKS."""
    most = max(1, math.ceil(l_max / MIN_SPLIT_TOKENS))
    least = max(1, math.ceil(l_max / MAX_SPLIT_TOKENS))
    wanted = math.ceil(TARGET_BLOCKS / (batch * n_kv))
    return min(most, max(least, wanted))


def paged_decode_attention(q: mx.array, kv_pool: mx.array, table: mx.array,
                           lengths: mx.array, scale: float,
                           written: mx.array | None = None,
                           sinks: mx.array | None = None,
                           stages: int = DEFAULT_STAGES, mma: MmaConfig | None = None,
                           warp_tiles: bool = DEFAULT_WARP_TILES) -> mx.array:
    """Attention of one new token per row over its pooled context.

    q: [B, Hq, 1, D]; kv_pool: [slots, Hkv, 2 * D], keys then values (KVPool's layout);
    table: [B, Lmax] int32 slot ids (right-padded); lengths: [B] int32 context length per
    row (the new token included); written: the mark of the pool write this step made to
    kv_pool in place (pool_write_in_place), which the kernel must follow; sinks: [Hq]
    attention sink logits (GPT-OSS), or None. Returns [B, Hq, 1, D] in q's dtype.
    """
    batch, n_q, _, dim = q.shape
    inputs = [q.reshape(batch, n_q, dim), kv_pool, table, lengths, follow_mark(written)]
    out, _ = _attend(inputs, q.dtype, batch, n_q, dim, kv_pool, table.shape[1], scale,
                     write_new=False, sinks=sinks, stages=stages, mma=mma, warp_tiles=warp_tiles)
    return out.reshape(batch, n_q, 1, dim)


@dataclass(frozen=True)
class RopeSpec:
    """A RoPE that a kernel applies to q and the new keys itself, at each row's new
    position (length - 1): mx.fast.rope's math with these arguments (base None: freqs
    given), over whole heads (the kernels take dims == the head size only); mscale:
    YaRN's input scale, multiplied into the rotated dims first as mlx-lm's YarnRoPE does
    (the write-and-attend kernel takes only 1; worker_proc/qk_norm_rope.py any)."""

    dims: int
    traditional: bool
    base: float | None
    scale: float
    freqs: mx.array | None = None
    mscale: float = 1.0

    def apply(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """The same rotation by MLX ops (what the kernels replace)."""
        if self.mscale != 1.0:
            x = x.at[..., :self.dims].multiply(self.mscale)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                            scale=self.scale, offset=offset, freqs=self.freqs)

    @functools.cached_property
    def kernel_params(self) -> mx.array:
        """The kernel's `rope` input: [log2(base), scale], or [0, scale, *freqs], padded
        (padded_constant: a device array, made at load)."""
        if self.freqs is None:
            assert self.base is not None
            # float32 like MLX's std::log2 of its float base
            return padded_constant(mx.array(np.array(
                [np.log2(np.float32(self.base)), self.scale], np.float32)))
        head = mx.array([0.0, self.scale], dtype=mx.float32)
        return padded_constant(mx.concatenate([head, self.freqs.astype(mx.float32)]))


def paged_decode_write_attention(q: mx.array, keys: mx.array, values: mx.array,
                                 slots: mx.array, kv_pool: mx.array, table: mx.array,
                                 lengths: mx.array, scale: float,
                                 after: mx.array | None = None,
                                 sinks: mx.array | None = None,
                                 stages: int = DEFAULT_STAGES,
                                 mma: MmaConfig | None = None,
                                 warp_tiles: bool = DEFAULT_WARP_TILES
                                 ) -> tuple[mx.array, mx.array]:
    """paged_decode_attention for a pool written in place, storing the step's new keys
    and values ([B, Hkv, 1, D] each, any strides) at slots [B] in the same launch: the
    pool write of pool_write_in_place and the attention in one kernel, a launch less per
    layer and step. The new token is each row's last in `table` (a windowed layer's
    table starts at its window). Follows the write whose mark is `after`; returns the
    attention's output and this write's mark (see pool_write_in_place)."""
    batch, n_q, _, dim = q.shape
    inputs = [q, keys, values, kv_pool, table, lengths, follow_mark(after), slots]
    out, mark = _attend(inputs, q.dtype, batch, n_q, dim, kv_pool, table.shape[1], scale,
                        write_new=True, sinks=sinks, stages=stages, mma=mma,
                        warp_tiles=warp_tiles)
    assert mark is not None
    return out.reshape(batch, n_q, 1, dim), mark


def paged_decode_qkv_attention(qkv: mx.array, n_q: int, rope: RopeSpec, slots: mx.array,
                               kv_pool: mx.array, table: mx.array, lengths: mx.array,
                               scale: float, after: mx.array | None = None,
                               stages: int = DEFAULT_STAGES,
                               mma: MmaConfig | None = None,
                               warp_tiles: bool = DEFAULT_WARP_TILES
                               ) -> tuple[mx.array, mx.array]:
    """paged_decode_write_attention straight from a fused q/k/v projection's output qkv
    [B, 1, (n_q + 2 Hkv) * D] (q heads, then k, then v), unrotated: the kernel applies
    `rope` to q and the new k itself. Returns the attention's output as [B, 1, n_q * D],
    the o projection's input, and this write's mark. Against RoPE, its copy of the
    strided heads and a separate write: two launches and ~11 view nodes less a layer."""
    batch = qkv.shape[0]
    n_kv = kv_pool.shape[1]
    dim = qkv.shape[-1] // (n_q + 2 * n_kv)
    inputs = [qkv, kv_pool, table, lengths, follow_mark(after), slots, rope.kernel_params]
    out, mark = _attend(inputs, qkv.dtype, batch, n_q, dim, kv_pool, table.shape[1], scale,
                        write_new=True, rope=rope, stages=stages, mma=mma,
                        warp_tiles=warp_tiles)
    assert mark is not None
    return out.reshape(batch, 1, n_q * dim), mark


def _attend(inputs: list[mx.array], dtype: mx.Dtype, batch: int, n_q: int, dim: int,
            kv_pool: mx.array, width: int, scale: float, write_new: bool,
            rope: RopeSpec | None = None, sinks: mx.array | None = None,
            stages: int = DEFAULT_STAGES, mma: MmaConfig | None = None,
            warp_tiles: bool = DEFAULT_WARP_TILES) -> tuple[mx.array, mx.array | None]:
    """Launch the decode kernel (and the merge, for several splits): [B, Hq, D] in
    `dtype`, and the write's mark when it stores the new K/V. rope: the fused q/k/v
    variant (paged_decode_qkv_attention). sinks: [Hq] sink logits, which the kernel adds
    with one split, the merge with several. mma: the tensor-core kernel of this shape
    where it serves these heads (MmaConfig.fits), else the CUDA-core one with `stages`
    (warp_tiles: each warp copying its own tokens' rows of the staged tiles)."""
    n_kv = kv_pool.shape[1]
    group = n_q // n_kv
    splits = num_splits(batch, n_kv, width)
    mark_shape, mark_dtype = ([MARK_SHAPE], [mx.int32]) if write_new else ([], [])
    template = [("T", dtype), ("D", dim), ("G", group), ("HKV", n_kv), ("P", kv_pool.dtype),
                ("CHUNK_MAX", MAX_SPLIT_TOKENS), ("SCALE", float_bits(scale))]
    if rope is not None:
        template += [("ROPE_TRADITIONAL", rope.traditional), ("ROPE_FREQS", rope.freqs is not None)]
    tensor_cores = mma is not None and mma.fits(dtype, kv_pool.dtype, dim, group)
    if tensor_cores:
        layout = mma.layout(dim)
        threads = layout.threads
        template += [("TOKEN_WARPS", layout.token_warps), ("COLUMN_WARPS", layout.column_warps),
                     ("STAGES", layout.stages)]
        dynamic = mma.dynamic_bytes(dim, group)
    else:
        threads, dynamic = _THREADS, 0
        lanes = lanes_per_token(dim, group, batch * n_kv)
        template += [("LANES", lanes), ("PASSES", PASSES)]
        stages = staged_tiles(dim, kv_pool.dtype.size, group, stages, lanes)
        if stages:
            template.append(("STAGES", stages))
    kernel = functools.partial(_kernel, write_new=write_new, fused=rope is not None,
                               staged=stages > 0 and not tensor_cores, mma=tensor_cores,
                               dynamic_bytes=dynamic, warp_tiles=warp_tiles)
    grid = (splits * threads, n_kv, batch)
    if splits == 1:
        with_sinks = sinks is not None
        out, *mark = kernel(True, sinks=with_sinks)(
            inputs=[*inputs, *([sinks] if with_sinks else [])], template=template, grid=grid,
            threadgroup=(threads, 1, 1),
            output_shapes=[(batch, n_q, dim), *mark_shape], output_dtypes=[dtype, *mark_dtype])
        return out, (mark[0] if mark else None)
    acc, ml, *mark = kernel(False)(
        inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
        output_shapes=[(batch, n_kv, splits, group, dim), (batch, n_kv, splits, group, 2),
                       *mark_shape],
        output_dtypes=[mx.float32, mx.float32, *mark_dtype])
    (out,) = _merge_kernel(sinks is not None)(
        inputs=[acc, ml, *([sinks] if sinks is not None else [])],
        template=[("T", dtype), ("D", dim), ("G", group), ("HKV", n_kv)],
        grid=(_THREADS, n_kv, batch), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(batch, n_q, dim)], output_dtypes=[dtype])
    return out, (mark[0] if mark else None)


def split_kv(gathered: mx.array, head_dim: int) -> tuple[mx.array, mx.array]:
    """[B, L, H, Dk + Dv] gathered pool rows -> keys [B, H, L, Dk], values [B, H, L, Dv]."""
    # Contiguous: attention over the transposed gather view was ~2x slower on the CPU.
    k = mx.contiguous(gathered[..., :head_dim].transpose(0, 2, 1, 3))
    v = mx.contiguous(gathered[..., head_dim:].transpose(0, 2, 1, 3))
    return k, v


def reference_decode_attention(q: mx.array, kv_pool: mx.array, table: mx.array,
                               lengths: mx.array, scale: float,
                               written: mx.array | None = None,
                               sinks: mx.array | None = None) -> mx.array:
    """The plain-MLX meaning of paged_decode_attention: gather, mask, fused SDPA (keys
    of q's head size, values the rest of a pool row), with attention sinks if given."""
    keys, values = split_kv(kv_pool[after_write(table, written)], q.shape[-1])
    valid = mx.arange(table.shape[1])[None, :] < lengths[:, None]
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale,
                                                mask=valid[:, None, None, :], sinks=sinks)

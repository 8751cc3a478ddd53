"""Prefill attention that reads K/V from the pool itself: a chunk's queries against each
row's context through its slot table, causal, optionally windowed and with sinks, on
tensor cores (sm_80+, 16-bit pools).

Without it, a prefill forward gathers every row's context out of the pool into dense K/V,
then attends through MLX's fused call (cuDNN, heads up to 128 wide, a graph per padded
shape) or MLX's matmul fallback (wider heads: Gemma's 256, whose scores are materialised).
This kernel takes the place of the gather, the copies and either attention: each block holds
16 x WARPS (query, head) rows of one KV head in shared memory, and streams the context's
K/V through shared memory in tiles (cp.async, two stages), every warp scoring its 16 rows
against a tile on tensor cores and keeping an online softmax, so no score matrix exists
and the graph has one node a layer whatever the shapes. Its fragments follow the decode
kernel's (paged_attention._MMA_BODY): rows are (query position, head) pairs instead of
heads. On by default for heads cuDNN does not take (KernelDecode.paged_prefill).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from worker_proc.kernel_constants import CONSTANT_ELEMENTS, float_bits
from worker_proc.paged_attention import (_HEADER, _MMA_HEADER, MMA_PV_STEP, MMA_ROW_SUMS,
                                         split_kv)
from worker_proc.pool_writes import after_write, follow_mark

WARPS = 4  # warps a block, 16 (query, head) rows each
STAGES = 2  # K/V tiles in shared memory: one computed on while the next one lands

# The kernel's body. Template arguments: T (queries, output and pool alike), P (the same
# type, as the decode kernel's helpers name it), D (head size, keys and values alike: a
# multiple of 64, so that a row's 16-byte pieces come in whole groups of 8 to permute),
# STAGES, G (query heads a KV head), HKV, TILE (tokens a K/V tile),
# WINDOW (0: every earlier position; W: a query sees itself and the W - 1 before it),
# SCALE (float bits). Inputs: q [B, HKV * G, S, D], kv_pool [slots, HKV, 2 * D] (a token's
# row: keys, then values), table [B, L] (each row's slot of every context position),
# starts [>= B] (each row's first query position), written (ordering only), and sinks
# [HKV * G] when SINKS. Output: out [B, HKV * G, S, D].
_BODY = r"""
    constexpr int ROWS = 16 * WARPS;   // (query, head) rows a block takes: query r / G, head r % G
    constexpr int ROW = 2 * D;         // a token's K/V row of one head, in elements
    constexpr int CPR = ROW / 8;       // its 16-byte pieces
    constexpr int KS = D / 32;         // QK's k-steps of 32 elements (two mma each)
    constexpr int NT = D / 8;          // the output's tiles of 8 columns
    constexpr int TN = TILE / 8;       // a K/V tile's score tiles of 8 tokens
    const int b = blockIdx.z;
    const int kvh = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gid = lane >> 2;  // fragment row (and K's token in an 8-token tile)
    const int tid = lane & 3;   // fragment column pair
    const int S = q_shape[2];
    const int L = table_shape[1];
    const int first = starts[b];  // the row's first query position
    const int r0 = blockIdx.x * ROWS;
    const int* row_slots = table + (size_t)b * L;
    const float sc = __int_as_float(SCALE) * 1.4426950408889634f;  // log2 units, as the decode kernel
    extern __shared__ __align__(16) unsigned char kiln_dynamic[];
    P* stage = reinterpret_cast<P*>(kiln_dynamic);      // [STAGES][TILE][ROW]
    P* sm_q = stage + (size_t)STAGES * TILE * ROW;     // [ROWS][D]
    // The block's queries and the keys they see at most: [t_begin, t_end).
    const int q_hi = min((r0 + ROWS - 1) / G, S - 1);
    const int t_end = min(first + q_hi + 1, L);
    // A padding query past the last key is placed at it (ForwardLayout.kind_mask's rule).
    const int t_begin = WINDOW > 0 ? max(0, min(first + r0 / G, L - 1) - WINDOW + 1) : 0;
    for (int c = threadIdx.x; c < ROWS * (D / 8); c += blockDim.x) {
        const int r = c / (D / 8);
        const int piece = c % (D / 8);
        const int i = (r0 + r) / G;
        const int g = (r0 + r) % G;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (i < S) {
            v = *reinterpret_cast<const uint4*>(q + (((size_t)b * HKV * G + kvh * G + g) * S + i) * D + piece * 8);
        }
        *reinterpret_cast<uint4*>(sm_q + (size_t)r * D + (piece ^ kiln_swz(r)) * 8) = v;
    }
    // Tile `at` into stage `into`: one commit group a tile; rows past the end zeroed.
    auto issue = [&](int at, int into) {
        for (int c = threadIdx.x; c < TILE * CPR; c += blockDim.x) {
            const int j = c / CPR;
            const int piece = c % CPR;
            const int t = at + j;
            P* dst = stage + ((size_t)into * TILE + j) * ROW + (piece ^ kiln_swz(j)) * 8;
            if (t < t_end) {
                const P* src = kv_pool + ((size_t)row_slots[t] * HKV + kvh) * ROW;
                kiln_cp_async16(dst, src + piece * 8);
            } else if (at < t_end) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            }
        }
        kiln_cp_commit();
    };
    issue(t_begin, 0);
    // This lane's two rows (fragment rows gid and gid + 8 of the warp's 16).
    const int r_lo = r0 + warp * 16 + gid;
    const int r_hi = r_lo + 8;
    const bool ok_lo = r_lo / G < S;
    const bool ok_hi = r_hi / G < S;
    const int p_lo = min(first + r_lo / G, L - 1);
    const int p_hi = min(first + r_hi / G, L - 1);
    // The warp's positions, for skipping tiles none of its rows sees (warp-uniform).
    const int w_first = min(first + (r0 + warp * 16) / G, L - 1);
    const int w_last = min(first + min((r0 + warp * 16 + 15) / G, S - 1), L - 1);
    const P* wq = sm_q + (size_t)warp * 16 * D;
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_lo = kiln_lowest, m_hi = kiln_lowest, l_lo = 0.f, l_hi = 0.f;
    int tile = 0;
    for (int at = t_begin; at < t_end; at += TILE, ++tile) {
        kiln_cp_wait<0>();  // this tile's copies (this thread's) ...
        __syncthreads();    // ... and every thread's; the other stage was read by all
        issue(at + TILE, (tile + 1) % STAGES);
        if (at > w_last || (WINDOW > 0 && at + TILE <= w_first - WINDOW + 1)) continue;
        const P* rows = stage + (size_t)(tile % STAGES) * TILE * ROW;
        float s[TN][4];
#pragma unroll
        for (int n = 0; n < TN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int c = 0; c < KS; ++c) {
            const uint4 lo = *reinterpret_cast<const uint4*>(wq + (size_t)gid * D + ((c * 4 + tid) ^ kiln_swz(gid)) * 8);
            const uint4 hi = *reinterpret_cast<const uint4*>(wq + (size_t)(gid + 8) * D + ((c * 4 + tid) ^ kiln_swz(gid + 8)) * 8);
#pragma unroll
            for (int n = 0; n < TN; ++n) {
                const int r = n * 8 + gid;
                const uint4 k = *reinterpret_cast<const uint4*>(rows + (size_t)r * ROW + ((c * 4 + tid) ^ kiln_swz(r)) * 8);
                kiln_mma<P>(s[n], lo.x, hi.x, lo.y, hi.y, k.x, k.y);
                kiln_mma<P>(s[n], lo.z, hi.z, lo.w, hi.w, k.z, k.w);
            }
        }
        // s[n][j]: token at + n * 8 + tid * 2 + (j & 1), row r_lo (j < 2) or r_hi.
        float top_lo = kiln_lowest, top_hi = kiln_lowest;
#pragma unroll
        for (int n = 0; n < TN; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int t = at + n * 8 + tid * 2 + j;
                const bool see_lo = ok_lo && t <= p_lo && t < t_end && (WINDOW == 0 || t > p_lo - WINDOW);
                const bool see_hi = ok_hi && t <= p_hi && t < t_end && (WINDOW == 0 || t > p_hi - WINDOW);
                s[n][j] = see_lo ? s[n][j] * sc : kiln_lowest;
                s[n][j + 2] = see_hi ? s[n][j + 2] * sc : kiln_lowest;
                top_lo = fmaxf(top_lo, s[n][j]);
                top_hi = fmaxf(top_hi, s[n][j + 2]);
            }
        }
        top_lo = fmaxf(top_lo, __shfl_xor_sync(0xffffffff, top_lo, 1));
        top_lo = fmaxf(top_lo, __shfl_xor_sync(0xffffffff, top_lo, 2));
        top_hi = fmaxf(top_hi, __shfl_xor_sync(0xffffffff, top_hi, 1));
        top_hi = fmaxf(top_hi, __shfl_xor_sync(0xffffffff, top_hi, 2));
        const float new_lo = fmaxf(m_lo, top_lo);
        const float new_hi = fmaxf(m_hi, top_hi);
        const float a_lo = exp2f(m_lo - new_lo);
        const float a_hi = exp2f(m_hi - new_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        l_lo *= a_lo;
        l_hi *= a_hi;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= a_lo; o[n][1] *= a_lo;
            o[n][2] *= a_hi; o[n][3] *= a_hi;
        }
        // P V a k-step of 16 tokens at a time; V's B fragments by ldmatrix.trans (lane =
        // matrix (tokens 0-7 or 8-15, this or the next 8 columns) x row).
        const int vr = (lane >> 3 & 1) * 8 + (lane & 7);
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
            uint32_t pa[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* sv = s[2 * kk + h];
                const float p0 = sv[0] > kiln_lowest ? exp2f(sv[0] - new_lo) : 0.f;
                const float p1 = sv[1] > kiln_lowest ? exp2f(sv[1] - new_lo) : 0.f;
                const float p2 = sv[2] > kiln_lowest ? exp2f(sv[2] - new_hi) : 0.f;
                const float p3 = sv[3] > kiln_lowest ? exp2f(sv[3] - new_hi) : 0.f;
                l_lo += p0 + p1;
                l_hi += p2 + p3;
                pa[2 * h] = kiln_pack<P>(p0, p1);
                pa[2 * h + 1] = kiln_pack<P>(p2, p3);
            }
            const int vt = kk * 16 + vr;
            const P* vrow = rows + (size_t)vt * ROW;
    MMA_PV_STEP
        }
    }
    kiln_cp_wait<0>();
    MMA_ROW_SUMS
    l_hi += __shfl_xor_sync(0xffffffff, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffff, l_hi, 2);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? r_hi : r_lo;
        if (!(half ? ok_hi : ok_lo)) continue;
        const int i = r / G;
        const int head = kvh * G + r % G;
        float mm = half ? m_hi : m_lo;
        float den = half ? l_hi : l_lo;
        float f = 1.f;
        FINISH
        // A row that saw no key (an empty table): zeros, not 0 / 0 (its K/V would go to
        // the pool's dummy slot, which other rows' masked columns multiply by 0).
        if (den == 0.f) { den = 1.f; f = 0.f; }
        T* dst = out + (((size_t)b * HKV * G + head) * S + i) * D;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int d = n * 8 + tid * 2;
            dst[d] = static_cast<T>(o[n][half * 2] * f / den);
            dst[d + 1] = static_cast<T>(o[n][half * 2 + 1] * f / den);
        }
    }
"""

_PLAIN_FINISH = "(void)mm;"
# With attention sinks: the head's sink logit (log2 units) joins the denominator, as a
# token with no value would (the decode kernel's _DIRECT_SINK_WRITE).
_SINK_FINISH = """{
            const float sink = static_cast<float>(sinks[head]) * 1.4426950408889634f;
            const float top = fmaxf(mm, sink);
            f = exp2f(mm - top);
            den = den * f + exp2f(sink - top);
        }"""


def source(sinks: bool) -> str:
    pv = MMA_PV_STEP.replace("VROW", "vrow").replace("COL0", "").replace("VR", "vt")
    return (_BODY.replace("MMA_PV_STEP", pv).replace("MMA_ROW_SUMS", MMA_ROW_SUMS)
            .replace("FINISH", _SINK_FINISH if sinks else _PLAIN_FINISH))


HEADER = _HEADER + _MMA_HEADER


def tile_tokens(dim: int) -> int:
    """Tokens a K/V tile: fewer for wide heads, whose output fragments take the registers."""
    return 64 if dim <= 128 else 32


def shared_bytes(dim: int, itemsize: int) -> int:
    """A block's dynamic shared memory: the K/V stages and its queries."""
    return (STAGES * tile_tokens(dim) * 2 * dim + 16 * WARPS * dim) * itemsize


def paged_prefill_fits(dtype: mx.Dtype, pool_dtype: mx.Dtype, key_dim: int,
                       value_dim: int) -> bool:
    """Whether the kernel serves these heads: queries and pool of one 16-bit type, keys
    and values of one size, a multiple of 64 up to 256."""
    return (pool_dtype in (mx.bfloat16, mx.float16) and dtype == pool_dtype
            and key_dim == value_dim and key_dim % 64 == 0 and key_dim <= 256)


@functools.cache
def _kernel(sinks: bool, shared: int):
    # MLX caches a compiled kernel by name and template arguments: one name a source.
    return mx.fast.cuda_kernel(
        name=f"kiln_paged_prefill{'_sinks' if sinks else ''}",
        input_names=["q", "kv_pool", "table", "starts", "written", *(["sinks"] if sinks else [])],
        output_names=["out"], source=source(sinks), header=HEADER, shared_memory=shared)


def _padded_starts(starts: mx.array) -> mx.array:
    """Each row's first query position, padded past the small arrays MLX keeps in managed
    memory (kernel_constants)."""
    return mx.concatenate([starts.astype(mx.int32), mx.zeros((CONSTANT_ELEMENTS,), mx.int32)])


def paged_prefill_attention(q: mx.array, kv_pool: mx.array, table: mx.array,
                            starts: mx.array, scale: float, written: mx.array | None = None,
                            window: int = 0, sinks: mx.array | None = None) -> mx.array:
    """Attention of q [B, Hq, S, D] (row b's queries at positions starts[b] + 0..S-1) over
    each row's context in the pool: position t of row b is pool row table[b, t]; a query at
    p sees positions t <= p (and t > p - window when window > 0), t < L, a padding query
    past the last position as if at it (ForwardLayout.kind_mask). [B, Hq, S, D]."""
    batch, n_q, length, dim = q.shape
    n_kv = kv_pool.shape[1]
    tile = tile_tokens(dim)
    shared = shared_bytes(dim, kv_pool.dtype.size)
    rows = 16 * WARPS
    blocks = -(-(length * (n_q // n_kv)) // rows)
    template = [("T", q.dtype), ("P", kv_pool.dtype), ("D", dim), ("G", n_q // n_kv),
                ("HKV", n_kv), ("TILE", tile), ("WARPS", WARPS), ("STAGES", STAGES), ("WINDOW", window),
                ("SCALE", float_bits(scale))]
    inputs = [q, kv_pool, table.astype(mx.int32), _padded_starts(starts), follow_mark(written)]
    if sinks is not None:
        inputs.append(sinks.astype(q.dtype))
    (out,) = _kernel(sinks is not None, shared)(
        inputs=inputs, template=template, grid=(blocks * 32 * WARPS, n_kv, batch),
        threadgroup=(32 * WARPS, 1, 1), output_shapes=[q.shape], output_dtypes=[q.dtype])
    return out


def reference_paged_prefill_attention(q: mx.array, kv_pool: mx.array, table: mx.array,
                                      starts: mx.array, scale: float,
                                      written: mx.array | None = None, window: int = 0,
                                      sinks: mx.array | None = None) -> mx.array:
    """The plain-MLX meaning of paged_prefill_attention: gather, mask, fused SDPA."""
    keys, values = split_kv(kv_pool[after_write(table, written)], q.shape[-1])
    position = starts.astype(mx.int32)[:, None] + mx.arange(q.shape[2], dtype=mx.int32)[None]
    position = mx.minimum(position, table.shape[1] - 1)
    t = mx.arange(table.shape[1], dtype=mx.int32)[None, None, :]
    visible = t <= position[:, :, None]
    if window > 0:
        visible = visible & (t > position[:, :, None] - window)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale,
                                                mask=visible[:, None], sinks=sinks)

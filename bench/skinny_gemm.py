"""A decode-shaped GEMM as one custom CUDA kernel, against MLX's cuBLAS matmul (experiment).

    python bench/skinny_gemm.py                 # on MLX's CUDA backend: check, then time
    python bench/skinny_gemm.py --emulate       # anywhere: the kernel's index math in numpy

Why: on the H200 a 64-row decode step is bound by the host, and MLX's CUDA matmul costs
~17.5 us of host time a call (bench/launch_cost.py) against ~4 us for a custom kernel:
it builds cuBLASLt descriptors and asks for a heuristic on every call, then records the
call by stream capture. Four GEMMs a layer are ~2.2 ms of a ~7.3 ms step. This kernel
computes y = x @ w.T (+ c) for few rows (x [M, K], w [N, K] as nn.Linear keeps it, bf16)
with tensor cores (mma.sync m16n8k16 through inline PTX, no shared memory for the
operands): each warp owns NT tiles of 8 output columns and a 1/KW slice of K, streams its
weight rows 16 bytes a lane, and the block's KW warps add their partial sums in shared
memory. Within a 32-wide stretch of K each lane loads 8 consecutive k of a row, and the
two MMAs take them in an order of k that A and B share (the sum is the same; rounding
follows fp32 accumulation, as cuBLAS's does, in another order).

Prints, per shape: the largest error against mx.matmul (relative to the output's scale),
and the time a call when 200 independent calls are launched and waited for: host (until
mx.async_eval returns) and total, both per call. A step pays max(host, device) per GEMM.
Not used by the engine; if it wins here, the next step is a Linear that calls it for
decode batches of up to 64 rows.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import mlx.core as mx
import numpy as np

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
    const int M = x_shape[0];
    const int K = x_shape[1];
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
        ADD_RESIDUAL
        y[at] = static_cast<T>(s);
    }
"""


@functools.cache
def _kernel(add: bool):
    source = _SOURCE.replace("ADD_RESIDUAL", "s += static_cast<float>(c[at]);" if add else "")
    return mx.fast.cuda_kernel(
        name=f"kiln_skinny_gemm{'_add' if add else ''}",
        input_names=["x", "w", *(["c"] if add else [])], output_names=["y"],
        source=source, header=_HEADER)


def tiles(m: int) -> tuple[int, int, int]:
    """(MT, NT, KW) for m rows: 16-row tiles to cover m; fewer columns a warp as the rows
    grow (registers); four warps split K."""
    mt = max(1, -(-m // 16))
    return mt, (4 if mt <= 4 else 2), 4


def skinny_gemm(x: mx.array, w: mx.array, c: mx.array | None = None) -> mx.array:
    """x [M, K] @ w [N, K].T (+ c [M, N]), bf16, for M up to 128, K a multiple of
    32 * KW, N of 8 * NT."""
    m, k = x.shape
    n = w.shape[0]
    mt, nt, kw = tiles(m)
    if k % (32 * kw) or n % (8 * nt) or mt > 8:
        raise ValueError(f"skinny_gemm: unsupported shape M={m} K={k} N={n}")
    inputs = [x, w] + ([c] if c is not None else [])
    (y,) = _kernel(c is not None)(
        inputs=inputs, template=[("T", x.dtype), ("MT", mt), ("NT", nt), ("KW", kw)],
        grid=(n // (8 * nt) * 32 * kw, 1, 1), threadgroup=(32 * kw, 1, 1),
        output_shapes=[(m, n)], output_dtypes=[x.dtype])
    return y


def emulate(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The kernel's loads, fragment layout and reduction replayed in numpy (float64), to
    check its index math where no GPU is."""
    m, k = x.shape
    n = w.shape[0]
    mt, nt, kw = tiles(m)
    y = np.zeros((m, n))
    for block in range(n // (8 * nt)):
        n_first = block * 8 * nt
        part = np.zeros((kw, 16 * mt, 8 * nt))
        for warp in range(kw):
            acc = np.zeros((mt, nt, 32, 4))  # per lane, as the registers hold it
            span = k // kw
            for k0 in range(warp * span, (warp + 1) * span, 32):
                def lane_x(row: int, t: int) -> np.ndarray:  # 8 values, zero past M
                    return x[row, k0 + 8 * t:k0 + 8 * t + 8] if row < m else np.zeros(8)
                for half in range(2):  # MMA 1 takes .x/.y, MMA 2 .z/.w
                    for i in range(mt):
                        for j in range(nt):
                            a = np.zeros((16, 16))
                            b = np.zeros((16, 8))
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                lo, hi = lane_x(16 * i + g, t), lane_x(16 * i + g + 8, t)
                                wv = w[n_first + 8 * j + g, k0 + 8 * t:k0 + 8 * t + 8]
                                first, second = 4 * half, 4 * half + 2  # .x/.z, .y/.w
                                a[g, 2 * t:2 * t + 2] = lo[first:first + 2]
                                a[g + 8, 2 * t:2 * t + 2] = hi[first:first + 2]
                                a[g, 2 * t + 8:2 * t + 10] = lo[second:second + 2]
                                a[g + 8, 2 * t + 8:2 * t + 10] = hi[second:second + 2]
                                b[2 * t:2 * t + 2, g] = wv[first:first + 2]
                                b[2 * t + 8:2 * t + 10, g] = wv[second:second + 2]
                            d = a @ b
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                acc[i, j, lane] += [d[g, 2 * t], d[g, 2 * t + 1],
                                                    d[g + 8, 2 * t], d[g + 8, 2 * t + 1]]
            for i in range(mt):
                for j in range(nt):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        r, c = 16 * i + g, 8 * j + 2 * t
                        part[warp, r, c:c + 2] = acc[i, j, lane, :2]
                        part[warp, r + 8, c:c + 2] = acc[i, j, lane, 2:]
        total = part.sum(axis=0)
        y[:, n_first:n_first + 8 * nt] = total[:m]
    return y


def _timed(fn, args_list: list[tuple], repeats: int = 5) -> tuple[float, float]:
    """Per call, microseconds: host (until async_eval returns) and total, medians."""
    hosts, totals = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        outs = [fn(*a) for a in args_list]
        mx.async_eval(outs)
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        hosts.append((t1 - t0) / len(args_list) * 1e6)
        totals.append((t2 - t0) / len(args_list) * 1e6)
    return statistics.median(hosts[1:]), statistics.median(totals[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulate", action="store_true", help="check the index math in numpy")
    p.add_argument("--rows", default="16,32,64,128")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    if args.emulate:
        rng = np.random.default_rng(0)
        for m, k, n in [(5, 256, 64), (16, 512, 32), (40, 256, 64), (100, 128, 16)]:
            x, w = rng.standard_normal((m, k)), rng.standard_normal((n, k))
            err = np.abs(emulate(x, w) - x @ w.T).max()
            print(f"emulated M={m} K={k} N={n}: max error {err:.2e}")
            assert err < 1e-9
        return
    shapes = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
              ("down", 4096, 14336)]
    print(f"{'rows':>5} {'gemm':>8} {'rel err':>9} {'add err':>9} {'mlx host':>9} {'mlx total':>10}"
          f" {'ours host':>10} {'ours total':>11}   (us a call, {args.calls} calls)")
    for m in (int(r) for r in args.rows.split(",")):
        for name, n, k in shapes:
            ws = [mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02 for _ in range(2)]
            xs = [mx.random.normal((m, k)).astype(mx.bfloat16) for _ in range(4)]
            c = mx.random.normal((m, n)).astype(mx.bfloat16)
            mx.eval(ws, xs, c)
            want = (xs[0] @ ws[0].T).astype(mx.float32)
            got = skinny_gemm(xs[0], ws[0]).astype(mx.float32)
            scale = mx.abs(want).max().item()
            err = mx.abs(got - want).max().item() / scale
            add_want = mx.addmm(c, xs[0], ws[0].T).astype(mx.float32)
            add_err = mx.abs(skinny_gemm(xs[0], ws[0], c).astype(mx.float32) - add_want).max().item() / scale
            calls = [(xs[i % 4], ws[i % 2]) for i in range(args.calls)]
            theirs = _timed(lambda a, b: a @ b.T, calls)
            ours = _timed(skinny_gemm, calls)
            print(f"{m:>5} {name:>8} {err:>9.1e} {add_err:>9.1e} {theirs[0]:>9.1f} {theirs[1]:>10.1f}"
                  f" {ours[0]:>10.1f} {ours[1]:>11.1f}", flush=True)


if __name__ == "__main__":
    main()

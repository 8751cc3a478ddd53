"""worker_proc/skinny_gemm.py's decode GEMM kernel against MLX's cuBLAS matmul.

    python bench/skinny_gemm.py                 # on MLX's CUDA backend: check, then time
    python bench/skinny_gemm.py --emulate       # anywhere: the kernel's index math in numpy

Prints, per shape of an 8B llama's decode GEMMs (q/k/v and gate/up fused): the largest
error against mx.matmul and mx.addmm (relative to the output's scale), and the time a call
when 200 independent calls are launched and waited for: host (until mx.async_eval
returns) and total, both per call, microseconds. A host-bound decode step pays about
max(host, device) per GEMM, so "ours total" below "mlx total" at 64 rows is the case for
turning the kernel on (worker_proc.skinny_gemm.MAX_ROWS).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from worker_proc.skinny_gemm import gemm, tiles


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
            got = gemm(xs[0], ws[0]).astype(mx.float32)
            scale = mx.abs(want).max().item()
            err = mx.abs(got - want).max().item() / scale
            add_want = mx.addmm(c, xs[0], ws[0].T).astype(mx.float32)
            add_err = mx.abs(gemm(xs[0], ws[0], residual=c).astype(mx.float32) - add_want).max().item() / scale
            calls = [(xs[i % 4], ws[i % 2]) for i in range(args.calls)]
            theirs = _timed(lambda a, b: a @ b.T, calls)
            ours = _timed(gemm, calls)
            print(f"{m:>5} {name:>8} {err:>9.1e} {add_err:>9.1e} {theirs[0]:>9.1f} {theirs[1]:>10.1f}"
                  f" {ours[0]:>10.1f} {ours[1]:>11.1f}", flush=True)


if __name__ == "__main__":
    main()

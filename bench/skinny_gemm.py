"""Whether expert_rows' bfloat16 kernel, run as a single expert, reads a decode step's dense
projection weights faster than MLX's matmul (cuBLAS on CUDA) does.

    python bench/skinny_gemm.py                      # CUDA: Llama-3-8B and Gemma-3-12B shapes
    python bench/skinny_gemm.py --rows 64,128 --layers 24
    python bench/skinny_gemm.py --tiny               # anywhere: small shapes, float32 MLX only

A decode step's projections are [rows, K] x [K, N] with few rows, so they read their
weights and little else: at 64 rows the H100 ran Gemma-3-12B's q/k/v and o projections at
68-74% of its memory's pace and gate/up at 84% (docs/benchmarks.md, session 47). The
experts' kernel (worker_proc/expert_rows.py) streams weights by cp.async through shared
memory; with one expert and every row its pair it computes x @ w.T. For each shape, a
chain of --layers independent weight matrices (more bytes than the L2 holds), timed
after warm-up: µs a call (median of --runs) and the weights' GB/s, for MLX's matmul and
the kernel's staged form at one pass (all rows: row tiles = rows / 8) and at its default
passes of 32 rows. The kernel's outputs are checked against the matmul's (bfloat16
rounding). On the CPU (--tiny) only MLX's matmul runs: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, K, N): the projections of a decode step, q/k/v and gate/up fused as served.
SHAPES = [("llama-3-8b q/k/v", 4096, 6144), ("llama-3-8b o", 4096, 4096),
          ("llama-3-8b gate/up", 4096, 28672), ("llama-3-8b down", 14336, 4096),
          ("gemma-3-12b q/k/v", 3840, 8192), ("gemma-3-12b o", 4096, 3840),
          ("gemma-3-12b gate/up", 3840, 30720), ("gemma-3-12b down", 15360, 3840)]
TINY = [("tiny", 256, 512)]


def _median_us(run, calls: int, runs: int) -> float:
    """Median µs a call of `run` (which launches `calls` calls and returns their outputs)."""
    for _ in range(3):
        mx.eval(run())
    times = []
    for _ in range(runs):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="64", help="rows a call, ','-joined")
    p.add_argument("--layers", type=int, default=16, help="weight matrices in a chain")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="small float32 shapes, MLX only")
    args = p.parse_args()
    dtype = mx.float32 if args.tiny else mx.bfloat16
    kernel = not args.tiny
    if kernel:
        from mlx_lm.models.switch_layers import SwitchLinear

        from worker_proc.expert_rows import ROW_TILES, expert_rows
    print(f"{mx.default_device()}, {dtype}, chains of {args.layers}")
    for name, k, n in TINY if args.tiny else SHAPES:
        weights = [(0.02 * mx.random.normal((n, k), key=mx.random.key(i))).astype(dtype)
                   for i in range(args.layers)]
        mx.eval(weights)
        gb = n * k * weights[0].itemsize / 1e9
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, k), key=mx.random.key(99)).astype(dtype)
            mx.eval(x)
            line = [f"{name:<22} rows {rows:>4}"]
            us = _median_us(lambda: [x @ w.T for w in weights], len(weights), args.runs)
            line.append(f"matmul {us:7.1f} µs {gb / us * 1e6:6.0f} GB/s")
            if kernel:
                experts = mx.zeros((rows,), dtype=mx.uint32)
                modules = []
                for w in weights:
                    m = SwitchLinear(k, n, 1, bias=False)
                    m.weight = w[None]
                    modules.append(m)
                want = x @ weights[0].T
                for tiles in sorted({-(-rows // 8), ROW_TILES}):
                    run = (lambda t: lambda: [expert_rows(m, x, experts, row_tiles=t)
                                              for m in modules])(tiles)
                    got = expert_rows(modules[0], x, experts, row_tiles=tiles)[:, 0]
                    err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
                    us = _median_us(run, len(modules), args.runs)
                    line.append(f"kernel ({tiles * 8} rows a pass) {us:7.1f} µs "
                                f"{gb / us * 1e6:6.0f} GB/s (max |diff| {err:.3g})")
            print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()

"""Host time MLX spends per graph node, by kind of node: what a decode step's node count costs.

    python bench/launch_cost.py [--nodes 2000] [--rows 64] [--width 4096]

A decode step on the H200 is bound by the host: build (making the lazy graph, or replaying
a compiled trace) plus launch (`mx.async_eval` walking the graph and encoding each node).
This times both per node for chains of one kind of node, so the cost of the kinds a
step is made of can be told apart:

- views: transposes, reshapes (no kernel: the output shares the input's buffer), as each
  Linear's `weight.T` and each head split adds;
- elementwise: an add (one small kernel);
- matmul: [rows, width] x [width, width] (a GEMM launch);
- compiled: the elementwise chain through `mx.compile` (fused into few kernels).

Each chain is built, launched and waited for `--repeats` times; medians, microseconds a
node. The device's own time shows in "wait".
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import mlx.core as mx


def transpose_chain(x: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = x.T
    return x


def reshape_chain(x: mx.array, n: int) -> mx.array:
    shape = x.shape
    for i in range(n):
        x = x.reshape(-1) if i % 2 == 0 else x.reshape(shape)
    return x


def add_chain(x: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = x + 1.0
    return x


def matmul_chain(x: mx.array, w: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = x @ w
    return x


def timed(build: Callable[[], mx.array], repeats: int) -> tuple[float, float, float]:
    builds, launches, waits = [], [], []
    for _ in range(repeats + 1):  # the first run compiles kernels: dropped
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        builds.append(t1 - t0)
        launches.append(t2 - t1)
        waits.append(t3 - t2)
    return (statistics.median(builds[1:]), statistics.median(launches[1:]),
            statistics.median(waits[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2000)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n, dtype = args.nodes, mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    x = mx.random.normal((args.rows, args.width)).astype(dtype)
    w = (mx.random.normal((args.width, args.width)) * args.width ** -0.5).astype(dtype)
    # A quarter of the nodes for GEMMs: a chain of big ones is device time, not host time.
    gemms = max(1, n // 4)
    compiled_adds = mx.compile(lambda a: add_chain(a, n))
    mx.eval(x, w)
    cases = {
        "view: transpose": (lambda: transpose_chain(x, n), n),
        "view: reshape": (lambda: reshape_chain(x, n), n),
        "elementwise add": (lambda: add_chain(x, n), n),
        "matmul": (lambda: matmul_chain(x, w, gemms), gemms),
        "elementwise add, compiled": (lambda: compiled_adds(x), n),
    }
    print(f"{mx.default_device()}, {args.rows} x {args.width} {dtype}; microseconds a node")
    print(f"{'chain':<28}{'nodes':>7}{'build':>9}{'launch':>9}{'wait':>9}")
    for name, (build, nodes) in cases.items():
        b, l, wt = timed(build, args.repeats)
        print(f"{name:<28}{nodes:>7}{b / nodes * 1e6:>9.2f}{l / nodes * 1e6:>9.2f}"
              f"{wt / nodes * 1e6:>9.2f}", flush=True)


if __name__ == "__main__":
    main()

"""Whether expert_rows' kernel, run as a single expert, reads a decode step's projection
weights faster than MLX's matmul (cuBLAS on CUDA) does in bfloat16, and than MLX's
quantized matmul in 4 bits (`--experiments bf16-rows-kernel`'s and
`quantized-rows-kernel`'s question).

    python bench/skinny_gemm.py                      # CUDA: Llama-3-8B and Gemma-3-12B shapes
    python bench/skinny_gemm.py --rows 64,128,256 --weights mxfp4:32,affine:64
    python bench/skinny_gemm.py --tiny               # anywhere: small shapes, float32 MLX only

A decode step's projections are [rows, K] x [K, N] with few rows, so they read their
weights and little else: at 64 rows the H100 ran Gemma-3-12B's q/k/v and o projections at
68-74% of its memory's pace and gate/up at 84% (docs/benchmarks.md, session 47). The
experts' kernel (worker_proc/expert_rows.py) streams weights by cp.async through shared
memory; with one expert and every row its pair it computes x @ w.T (linear_rows, as
`--experiments bf16-rows-kernel` and `quantized-rows-kernel` serve it). For each shape, a
chain of --layers independent weight matrices (more bytes than the L2 holds), timed
after warm-up (quantized_matmul.time_calls): µs a call (median of --runs) and the
weights' GB/s, for MLX's matmul
(bf16) or quantized matmul on the rows as one matrix (4-bit MXFP4, affine: as the worker
calls it on CUDA) and for linear_rows. The kernel's outputs are checked against MLX's
(bfloat16 rounding). On the CPU (--tiny) only MLX's bf16 matmul runs: a smoke test of
the script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quantized_matmul import time_calls  # noqa: E402

# (name, K, N): the projections of a decode step, q/k/v and gate/up fused as served.
SHAPES = [("llama-3-8b q/k/v", 4096, 6144), ("llama-3-8b o", 4096, 4096),
          ("llama-3-8b gate/up", 4096, 28672), ("llama-3-8b down", 14336, 4096),
          ("gemma-3-12b q/k/v", 3840, 8192), ("gemma-3-12b o", 4096, 3840),
          ("gemma-3-12b gate/up", 3840, 30720), ("gemma-3-12b down", 15360, 3840)]
TINY = [("tiny", 256, 512)]


def _layers(k: int, n: int, weights: str, dtype: mx.Dtype, layers_n: int) -> list[nn.Module]:
    """layers_n random Linear layers in dtype: plain (weights "bf16") or quantized to 4-bit
    MODE:GROUP."""
    layers: list[nn.Module] = []
    for i in range(layers_n):
        linear = nn.Linear(k, n, bias=False)
        linear.weight = (0.02 * mx.random.normal((n, k), key=mx.random.key(i))).astype(dtype)
        if weights != "bf16":
            mode, group = weights.split(":")
            linear = nn.QuantizedLinear.from_linear(linear, group_size=int(group), bits=4,
                                                    mode=mode)
            linear.set_dtype(dtype)
        layers.append(linear)
    return layers


def _line(name: str, k: int, n: int, rows: int, weights: str, args: argparse.Namespace) -> str:
    """One shape, row count and weight format: MLX's call of the layers (the rows as one
    matrix, as the worker calls them on CUDA) and, on CUDA, linear_rows."""
    dtype = mx.float32 if args.tiny else mx.bfloat16
    layers = _layers(k, n, weights, dtype, args.layers)
    x = mx.random.normal((rows, k), key=mx.random.key(99)).astype(dtype)
    mx.eval([m.parameters() for m in layers], x)
    gb = sum(v.nbytes for _, v in tree_flatten(layers[0].parameters())) / 1e9
    line = [f"{name:<22} {weights:<9} rows {rows:>4}"]
    us = time_calls([lambda m=m: m(x) for m in layers], args.runs)
    line.append(f"MLX {us:7.1f} µs {gb / us * 1e6:6.0f} GB/s")
    if not args.tiny:
        from worker_proc.expert_rows import linear_rows

        got, want = linear_rows(layers[0], x), layers[0](x)
        err = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
        us = time_calls([lambda m=m: linear_rows(m, x) for m in layers], args.runs)
        line.append(f"kernel {us:7.1f} µs {gb / us * 1e6:6.0f} GB/s (max |diff| {err:.3g})")
    return "  ".join(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="64", help="rows a call, ','-joined")
    p.add_argument("--layers", type=int, default=16, help="weight matrices in a chain")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--weights", default="bf16,mxfp4:32,affine:64",
                   help="','-joined: bf16, or 4-bit MODE:GROUP (CUDA)")
    p.add_argument("--tiny", action="store_true", help="small float32 shapes, MLX only")
    args = p.parse_args()
    print(f"{mx.default_device()}, chains of {args.layers}")
    for name, k, n in TINY if args.tiny else SHAPES:
        for rows in (int(r) for r in args.rows.split(",")):
            for weights in ["bf16"] if args.tiny else args.weights.split(","):
                print(_line(name, k, n, rows, weights, args), flush=True)


if __name__ == "__main__":
    main()

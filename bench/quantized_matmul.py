"""MLX's quantized matmul alone at a decode step's shapes: µs a call and the weights'
GB/s, the same call on a [rows, 1, inputs] input (as mlx-lm hands a decode step's rows
to a projection; RowsQuantizedLinear flattens it), and the matmul in the activations'
dtype.

    python bench/quantized_matmul.py                      # GPT-OSS-20B's attention, MXFP4
    python bench/quantized_matmul.py --shapes 4096x2880,4096x2944 --rows 8,64
    python bench/quantized_matmul.py --mode affine --bits 4 --group 64 --shapes 4096x14336

A shape is INPUTSxOUTPUTS. Each call reads weights of its own (--layers of them, called
in turn as a model's layers are), so L2 holds none of them from the call before. MLX's
CUDA backend picks its kernel by shape: a matrix-vector kernel below 8 rows, above it a
tiled tensor-core GEMM only where the outputs are a multiple of 128 and the inputs of
64 (else a naive GEMM), so a shape and its outputs padded to the next multiple of 128
(GPT-OSS's 2,880 and 2,944) tell whether padding pays.

"first ms" is a case's first quantized call: on CUDA it includes compiling the kernel
MLX picked, where no earlier case or run compiled it (MLX compiles its tiled quantized
GEMMs at first use, one module per activation dtype, format and tile of rows, and keeps
them in MLX_PTX_CACHE_DIR, else <tmp>/mlx/<version>/ptx): point MLX_PTX_CACHE_DIR at an
empty directory to see what a fresh machine's first start pays.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


@dataclass(frozen=True)
class Case:
    inputs: int
    outputs: int
    rows: int


@dataclass(frozen=True)
class Result:
    case: Case
    quantized_us: float
    first_ms: float  # the first quantized call (MLX's kernel compile included, if any)
    row_batch_us: float  # the same quantized matmul of a [rows, 1, inputs] input
    dense_us: float
    weight_bytes: int  # the quantized weights' (values, scales, biases) a call


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        k, sep, n = part.partition("x")
        if not (sep and k.isdigit() and n.isdigit()):
            raise argparse.ArgumentTypeError(f"shape {part!r}: want INPUTSxOUTPUTS, e.g. 2880x5120")
        shapes.append((int(k), int(n)))
    return shapes


def first_call_ms(call: Callable[[], mx.array]) -> float:
    t0 = time.perf_counter()
    mx.eval(call())
    return (time.perf_counter() - t0) * 1e3


def time_calls(calls: list[Callable[[], mx.array]], repeats: int) -> float:
    """Median µs a call over `repeats` rounds of every call in turn (each round one eval)."""
    mx.eval([c() for c in calls])  # warm-up: kernels compiled, buffers cached
    per_round = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([c() for c in calls])
        per_round.append((time.perf_counter() - t0) / len(calls))
    return statistics.median(per_round) * 1e6


def run_case(case: Case, args: argparse.Namespace) -> Result:
    dtype = getattr(mx, args.dtype)
    x = mx.random.normal((case.rows, case.inputs)).astype(dtype)
    dense = [(mx.random.normal((case.outputs, case.inputs)) * 0.02).astype(dtype)
             for _ in range(args.layers)]
    quantized = [mx.quantize(w, group_size=args.group, bits=args.bits, mode=args.mode)
                 for w in dense]
    mx.eval(x, dense, quantized)

    def qcall(parts: tuple, rows: mx.array) -> Callable[[], mx.array]:
        w, scales, *biases = parts
        return lambda: mx.quantized_matmul(rows, w, scales, biases[0] if biases else None,
                                           transpose=True, group_size=args.group,
                                           bits=args.bits, mode=args.mode)

    batched = x[:, None]  # as mlx-lm hands a decode step's rows to a projection
    first = first_call_ms(qcall(quantized[0], x))
    return Result(case, time_calls([qcall(p, x) for p in quantized], args.repeats), first,
                  time_calls([qcall(p, batched) for p in quantized], args.repeats),
                  time_calls([(lambda w=w: x @ w.T) for w in dense], args.repeats),
                  sum(a.nbytes for a in quantized[0]))


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default="2880x5120,4096x2880,4096x2944",
                   help="INPUTSxOUTPUTS, comma-separated (default: GPT-OSS-20B's fused q/k/v, "
                        "its o projection, and that padded to 128)")
    p.add_argument("--rows", default="1,8,64,128")
    p.add_argument("--mode", default="mxfp4")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=24, help="distinct weights called in turn")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    print(f"device {mx.default_device()}, {args.mode} {args.bits}-bit groups of {args.group}, "
          f"{args.dtype} activations, {args.layers} weights in turn")
    print(f"{'inputs x outputs':>18} {'rows':>5} {'quantized us':>13} {'GB/s':>7} "
          f"{'[rows, 1, in] us':>17} {args.dtype + ' us':>14} {'first ms':>9}")
    results = []
    for k, n in args.shapes:
        for rows in (int(r) for r in args.rows.split(",")):
            r = run_case(Case(k, n, rows), args)
            results.append(r)
            print(f"{f'{k} x {n}':>18} {rows:>5} {r.quantized_us:>13.1f} "
                  f"{r.weight_bytes / r.quantized_us / 1e3:>7.0f} {r.row_batch_us:>17.1f} "
                  f"{r.dense_us:>14.1f} {r.first_ms:>9.1f}")
    return results


if __name__ == "__main__":
    main()

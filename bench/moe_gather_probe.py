"""Does this device compute mlx-lm's MoE layer as the CPU does? An open question of
session 29 (docs/benchmarks.md): on the H200, mlx-lm's float32 GPT-OSS MLP came out ~0.85
off the CPU's at some token counts (33, 56, 70) and right at others (19, 64, 86, 128), and
an emulation of TF32 rounding in its router flips no expert choice there, so the cause is
not the router's precision.

    python bench/moe_gather_probe.py [--tokens 19,33,56,64,70,86,128] [--seeds 4]

mlx-lm's SwitchGLU sorts its (token, expert) pairs by expert from 64 pairs on
(switch_layers._gather_sort) and then calls gather_mm with sorted_indices. For each dtype
and token count (top-2 of 4 experts, routes drawn at random), over --seeds draws, the
largest |device - CPU| relative to the CPU's largest output, of: argpartition's top 2 of
4 (mlx-lm's GPT-OSS top-k; 0 or 1: 1 is a wrong set), argsort's order as a sorted
permutation (0 or 1), one sorted gather_mm, the same pairs unsorted on
the device, and the whole SwitchGLU given the same routes. The CPU side runs float32 (its
gather_mm takes no other) on the same rounded inputs. On the CPU itself every column is 0.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU


def _on_cpu(fn, *arrays: mx.array) -> mx.array:
    with mx.stream(mx.cpu):
        out = fn(*(a.astype(mx.float32) for a in arrays))
        mx.eval(out)
    return out


def _rel(device: mx.array, cpu: mx.array) -> float:
    device = device.astype(mx.float32)
    return (mx.abs(device - cpu).max() / mx.maximum(mx.abs(cpu).max(), 1e-6)).item()


def probe(tokens: int, dtype: mx.Dtype, seed: int, hidden: int, inter: int,
          experts: int = 4, top: int = 2) -> tuple[float, ...]:
    mx.random.seed(seed)
    x = mx.random.normal((tokens, hidden)).astype(dtype)
    # mlx-lm's top-k (GPT-OSS's mlx_topk): argpartition's last `top` must be the top set
    logits = mx.random.normal((tokens, experts)).astype(dtype)
    picked = np.sort(np.array(mx.argpartition(logits, kth=-top, axis=-1)[:, -top:]), axis=1)
    best = np.sort(np.argsort(np.array(logits.astype(mx.float32)), axis=1)[:, -top:], axis=1)
    bad_topk = float((picked != best).any())
    routes = mx.argsort(mx.random.uniform(shape=(tokens, experts)), axis=-1)[:, :top]
    routes = routes.astype(mx.uint32)
    # argsort over the flattened routes, as _gather_sort does
    flat = routes.flatten()
    order = mx.argsort(flat)
    taken = np.array(flat[order])
    bad_order = float(sorted(np.array(order).tolist()) != list(range(flat.size))
                      or bool((np.diff(taken.astype(np.int64)) < 0).any()))
    # one sorted gather_mm, then the same pairs unsorted
    w = (mx.random.normal((experts, inter, hidden)) / hidden ** 0.5).astype(dtype)
    rows = x[order // top][:, None, :]
    idx = flat[order]
    mm = lambda a, b, i, s: mx.gather_mm(a, b.swapaxes(-1, -2), rhs_indices=i, sorted_indices=s)  # noqa: E731
    sorted_out = mm(rows, w, idx, True)
    cpu = _on_cpu(lambda a, b: mm(a, b, idx, False), rows, w)
    unsorted_out = mm(rows, w, idx, False)
    # the whole layer, the same weights and routes on both
    glu = SwitchGLU(hidden, inter, experts, bias=True)
    glu.set_dtype(dtype)
    mx.eval(glu.parameters())
    layer = glu(x[None], routes[None])
    with mx.stream(mx.cpu):
        glu.set_dtype(mx.float32)
        layer_cpu = glu(x[None].astype(mx.float32), routes[None])
        mx.eval(layer_cpu)
    return (bad_topk, bad_order, _rel(sorted_out, cpu), _rel(unsorted_out, cpu),
            _rel(layer, layer_cpu))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="19,33,56,64,70,86,128")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128, help="the GPU family test's GPT-OSS")
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--dtypes", default=None,
                   help="default float32,bfloat16 (float32 alone on the CPU, whose gather_mm "
                        "takes no other)")
    args = p.parse_args()
    on_cpu = mx.default_device() == mx.cpu
    dtypes = [getattr(mx, d) for d in
              (args.dtypes or ("float32" if on_cpu else "float32,bfloat16")).split(",")]
    print(f"device {mx.default_device()}, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, 4 experts, top 2; worst of {args.seeds} seeds, relative")
    print(f"{'dtype':<10}{'tokens':>7}{'pairs':>7}{'bad top-k':>11}{'bad order':>11}"
          f"{'sorted mm':>11}{'unsorted mm':>13}{'SwitchGLU':>11}")
    for dtype in dtypes:
        for n in (int(t) for t in args.tokens.split(",")):
            worst = np.max([probe(n, dtype, s, args.hidden, args.intermediate)
                            for s in range(args.seeds)], axis=0)
            print(f"{str(dtype).split('.')[-1]:<10}{n:>7}{2 * n:>7}{worst[0]:>11.0f}"
                  f"{worst[1]:>11.0f}{worst[2]:>11.1e}{worst[3]:>13.1e}{worst[4]:>11.1e}",
                  flush=True)


if __name__ == "__main__":
    main()

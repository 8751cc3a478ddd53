"""Decode attention paths on one layer: the paged kernel vs gather+mask vs the fused kernel
on a contiguous cache (the ceiling), by batch and context.

    python bench/attention_paths.py [--json out.json]

Shapes follow Llama-3-8B (32 query heads, 8 KV heads, head dim 128, bf16). Prints
milliseconds per call (median of timed repeats after warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from tests.attention_cases import ragged_slot_table
from worker_proc.paged_attention import (kernel_available, paged_decode_attention,
                                         reference_decode_attention)


def _timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def case(batch: int, lengths: np.ndarray, n_q=32, n_kv=8, dim=128, dtype=mx.bfloat16) -> dict:
    rng = np.random.default_rng(0)
    slots = int(lengths.sum()) + 1
    table = ragged_slot_table(lengths, slots, rng)
    q = mx.random.normal((batch, n_q, 1, dim)).astype(dtype)
    k = mx.random.normal((slots, n_kv, dim)).astype(dtype)
    v = mx.random.normal((slots, n_kv, dim)).astype(dtype)
    kv = mx.concatenate([k, v], axis=-1)  # KVPool's layout
    t, ln = mx.array(table), mx.array(lengths.astype(np.int32))
    dense_k = mx.random.normal((batch, n_kv, int(lengths.max()), dim)).astype(dtype)
    dense_v = mx.random.normal((batch, n_kv, int(lengths.max()), dim)).astype(dtype)
    mx.eval(q, kv, t, ln, dense_k, dense_v)
    scale = dim ** -0.5
    out = {"batch": batch, "max_len": int(lengths.max()), "mean_len": float(lengths.mean()),
           "gather_mask_ms": _timed(lambda: reference_decode_attention(q, kv, t, ln, scale)),
           "fused_contiguous_no_mask_ms": _timed(
               lambda: mx.fast.scaled_dot_product_attention(q, dense_k, dense_v, scale=scale))}
    if kernel_available():
        out["paged_kernel_ms"] = _timed(lambda: paged_decode_attention(q, kv, t, ln, scale))
        diff = mx.abs(paged_decode_attention(q, kv, t, ln, scale).astype(mx.float32)
                      - reference_decode_attention(q, kv, t, ln, scale).astype(mx.float32))
        out["max_abs_diff"] = float(diff.max())
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    args = p.parse_args()
    rng = np.random.default_rng(1)
    cases = [(1, np.array([4096])), (64, np.full(64, 2048)), (128, np.full(128, 1024)),
             (64, rng.integers(100, 2048, 64)), (128, rng.integers(100, 600, 128)),
             (1, np.array([400])), (16, rng.integers(100, 600, 16))]
    results = [case(b, ln) for b, ln in cases]
    print(f"{'batch':>6}{'max len':>9}{'mean len':>10}{'paged':>9}{'gather+mask':>13}{'fused dense':>13}")
    for r in results:
        print(f"{r['batch']:>6}{r['max_len']:>9}{r['mean_len']:>10.0f}{r.get('paged_kernel_ms', float('nan')):>9.3f}"
              f"{r['gather_mask_ms']:>13.3f}{r['fused_contiguous_no_mask_ms']:>13.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

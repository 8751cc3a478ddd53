"""Does a KV-pool scatter update in place on this backend, with and without a step in flight?

    python bench/pool_update_probe.py --pool-gb 40

A synthetic decode loop over `layers` pool arrays: each step scatters one new token per
row into every layer's pool and runs paged attention over it. Times three schedules:
sync (wait for each step), ahead (async_eval step N+1 before waiting for N, as the
overlap pipeline does), deferred (build N+1, wait for N, then async_eval N+1).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from worker_proc.paged_attention import kernel_available, paged_decode_attention, reference_decode_attention


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pool-gb", type=float, default=40.0)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    n_kv, dim, dtype = 8, 128, mx.bfloat16
    per_slot = args.layers * 2 * n_kv * dim * 2
    slots = int(args.pool_gb * 2**30 / per_slot)
    # KVPool's layout: a head's keys, then its values.
    pool = [mx.zeros((slots * n_kv * 2 * dim,), dtype).reshape(slots, n_kv, 2 * dim)
            for _ in range(args.layers)]
    mx.eval(pool)
    print(f"pool: {slots} slots, {args.pool_gb} GiB, active {mx.get_active_memory() / 2**30:.1f} GiB")
    attend = paged_decode_attention if kernel_available() else reference_decode_attention
    ctx = 64
    table = np.arange(1, 1 + args.batch * 4096, dtype=np.int32).reshape(args.batch, 4096)

    def build(step: int) -> mx.array:
        length = ctx + step
        t = mx.array(table[:, :length])
        ln = mx.array(np.full(args.batch, length, np.int32))
        write = mx.array(table[:, length - 1])
        q = mx.ones((args.batch, 32, 1, dim), dtype)
        out = q
        for i in range(args.layers):
            pool[i][write] = mx.ones((args.batch, n_kv, 2 * dim), dtype) * (step % 7)
            out = out + attend(q, pool[i], t, ln, dim ** -0.5)
        return out.sum()

    for schedule in ("sync", "ahead", "deferred", "sync"):
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        pending = None
        for step in range(args.steps):
            nxt = build(step)
            if schedule == "sync":
                mx.eval(nxt, pool)
            elif schedule == "ahead":
                mx.async_eval(nxt, pool)
                if pending is not None:
                    pending.item()
                pending = nxt
            else:
                if pending is not None:
                    pending.item()
                mx.async_eval(nxt, pool)
                pending = nxt
        if pending is not None:
            pending.item()
        dt = (time.perf_counter() - t0) / args.steps * 1e3
        print(f"{schedule:>9}: {dt:8.2f} ms/step, peak {mx.get_peak_memory() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()

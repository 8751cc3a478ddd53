"""What launching one op costs the host, by kind, at a prefill forward's shapes.

    python bench/launch_cost.py                       # bf16, an 8B layer's shapes
    python bench/launch_cost.py --rows 512 --context 4096 --layers 32
    python bench/launch_cost.py --dtype float32 --rows 16 --context 64 --hidden 256   # CPU smoke

Session 35 (docs/benchmarks.md) found a decode-first step with a prompt chunk host-bound on
the H100 and H200: an eager 32-layer prefill forward's `mx.async_eval` takes ~11 ms of host
time whatever the chunk's length (78 tokens or 512), against ~3.4 ms for a compiled decode
step's. This says which ops that time goes to. For each kind it builds `--layers`
independent instances (inputs made and evaluated beforehand), then times the graph's
construction (build), `mx.async_eval` of all of them (launch: on CUDA, encoding each op
into MLX's CUDA graphs and launching those; on the CPU the work itself), and the wait for
the results; per op, the median over `--repeats`. Kinds: a projection's GEMM, MLX's fused
attention causal and with an additive bias (cuDNN on CUDA for heads up to 128), rms_norm,
RoPE, a padding copy, a gather of the context's slots from a pool, SwiGLU's elementwise
ops. A kind is what its model code calls: some are several MLX ops (SwiGLU's sigmoid and
two multiplies; a pad's fill and copy), so "per op" is per call. "llama layer" is a whole
decoder layer of mlx-lm's llama (its attention over its KVCache holding `--context - --rows`
positions, and its MLP): per op there means per layer, so 32 of them are a forward's
layers. MLX's CUDA launch settings are read from the environment at start-up
(MLX_MAX_OPS_PER_BUFFER, MLX_USE_CUDA_GRAPHS, ...): run once per setting to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx


@dataclass(frozen=True)
class Shapes:
    rows: int  # the chunk's tokens
    context: int  # keys it attends (cached prefix and itself)
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    dtype: mx.Dtype


@dataclass(frozen=True)
class Cost:
    kind: str
    build_us: float  # per op
    launch_us: float  # per op
    wait_ms: float  # all of them


def _rand(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    return (mx.random.normal(shape) * 0.1).astype(dtype)


def kinds(s: Shapes) -> dict[str, Callable[[], Callable[[], mx.array]]]:
    """Each kind: a maker of one instance's inputs, returning the op to build over them."""
    d, rows, ctx = s.dtype, s.rows, s.context

    def gemm() -> Callable[[], mx.array]:
        x, w = _rand((rows, s.hidden), d), _rand(((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), d)
        mx.eval(x, w)
        return lambda: x @ w.T

    def attention(bias: bool) -> Callable[[], Callable[[], mx.array]]:
        def make() -> Callable[[], mx.array]:
            q = _rand((1, s.heads, rows, s.head_dim), d)
            k, v = (_rand((1, s.kv_heads, ctx, s.head_dim), d) for _ in range(2))
            mask: mx.array | str = "causal"
            if bias:
                allowed = mx.arange(ctx)[None] <= (mx.arange(rows) + ctx - rows)[:, None]
                mask = mx.where(allowed, mx.array(0, d), mx.array(-mx.inf, d))[None, None]
            mx.eval(q, k, v, *([mask] if bias else []))
            return lambda: mx.fast.scaled_dot_product_attention(
                q, k, v, scale=s.head_dim ** -0.5, mask=mask)
        return make

    def rms_norm() -> Callable[[], mx.array]:
        x, w = _rand((rows, s.hidden), d), mx.ones((s.hidden,), dtype=d)
        mx.eval(x, w)
        return lambda: mx.fast.rms_norm(x, w, 1e-5)

    def rope() -> Callable[[], mx.array]:
        x = _rand((1, s.heads, rows, s.head_dim), d)
        mx.eval(x)
        return lambda: mx.fast.rope(x, s.head_dim, traditional=False, base=500000.0,
                                    scale=1.0, offset=ctx - rows)

    def pad() -> Callable[[], mx.array]:
        x = _rand((1, s.heads, rows, s.head_dim), d)
        mx.eval(x)
        return lambda: mx.pad(x, [(0, 0), (0, 0), (0, 8), (0, 0)])

    def gather() -> Callable[[], mx.array]:
        pool = _rand((2 * ctx, s.kv_heads, s.head_dim), d)
        slots = mx.random.permutation(2 * ctx)[:ctx].astype(mx.int32)
        mx.eval(pool, slots)
        return lambda: pool[slots]

    def swiglu() -> Callable[[], mx.array]:
        a, b = _rand((rows, s.intermediate), d), _rand((rows, s.intermediate), d)
        mx.eval(a, b)
        return lambda: a * mx.sigmoid(a) * b

    def llama_layer() -> Callable[[], mx.array]:
        # mlx-lm's own block over its own cache, as mlx_lm.generate prefills a chunk after
        # context - rows cached tokens: whether a whole layer's launch costs the sum of its
        # ops', and whether MLX's cost is kiln's.
        from mlx_lm.models.cache import KVCache
        from mlx_lm.models.llama import ModelArgs, TransformerBlock

        block = TransformerBlock(ModelArgs(
            model_type="llama", hidden_size=s.hidden, num_hidden_layers=1,
            intermediate_size=s.intermediate, num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads, head_dim=s.head_dim, rms_norm_eps=1e-5,
            vocab_size=32, rope_theta=500000.0))
        block.set_dtype(d)
        cache, before = KVCache(), ctx - rows
        if before:
            cache.update_and_fetch(*(_rand((1, s.kv_heads, before, s.head_dim), d)
                                     for _ in range(2)))
        x = _rand((1, rows, s.hidden), d)
        mx.eval(block.parameters(), x, *([cache.keys, cache.values] if before else []))

        def forward() -> mx.array:
            cache.offset = before  # each run rewrites the same chunk's positions
            return block(x, mask="causal", cache=cache)
        return forward

    return {"gemm (qkv)": gemm, "attention (causal)": attention(False),
            "attention (bias)": attention(True), "rms_norm": rms_norm, "rope": rope,
            "pad copy": pad, "gather (pool)": gather, "swiglu": swiglu,
            "llama layer": llama_layer}


def measure(kind: str, make: Callable[[], Callable[[], mx.array]], layers: int,
            repeats: int) -> Cost:
    ops = [make() for _ in range(layers)]
    builds, launches, waits = [], [], []
    for run in range(repeats + 1):  # the first meets its shapes cold: not counted
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [op() for op in ops]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t3 = time.perf_counter()
        if run:
            builds.append(t1 - t0)
            launches.append(t2 - t1)
            waits.append(t3 - t2)
    return Cost(kind, statistics.median(builds) / layers * 1e6,
                statistics.median(launches) / layers * 1e6, statistics.median(waits) * 1e3)


def main(argv: list[str] | None = None) -> list[Cost]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32, help="instances of each op launched together")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default="", help="','-joined names to run (default: all)")
    args = p.parse_args(argv)
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    shapes = Shapes(args.rows, args.context, args.hidden, heads, kv_heads, head_dim,
                    args.intermediate, getattr(mx, args.dtype))
    table = kinds(shapes)
    wanted = [k.strip() for k in args.kinds.split(",") if k.strip()] or list(table)
    unknown = [k for k in wanted if k not in table]
    if unknown:
        p.error(f"unknown kinds {unknown}; known: {list(table)}")
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MLX_"))
    print(f"{mx.default_device()}, {args.dtype}, {args.rows} rows over {args.context} keys, "
          f"{args.layers} ops a launch{', ' + settings if settings else ''}")
    print(f"{'kind':20s} {'build us/op':>12s} {'launch us/op':>13s} {'wait ms':>9s}")
    costs = []
    for kind in wanted:
        cost = measure(kind, table[kind], args.layers, args.repeats)
        costs.append(cost)
        print(f"{kind:20s} {cost.build_us:12.1f} {cost.launch_us:13.1f} {cost.wait_ms:9.2f}",
              flush=True)
    return costs


if __name__ == "__main__":
    main()

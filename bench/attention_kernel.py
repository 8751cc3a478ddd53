"""Decode attention alone: kiln's paged kernel against MLX's fused attention, by batch.

    python bench/attention_kernel.py --batch-sizes 1,64,128 --context 256
    python bench/attention_kernel.py --shapes 32x4,16x2 --targets 512,2048
    python bench/attention_kernel.py --latent 16,128 --batch-sizes 1,64,128 --context 1024

On MLX's CUDA backend. Each layer has its own pool (as the served model's do, so L2
holds none of a layer's K/V when it comes round), every row `--context` tokens long with
its slots in a random order (as a long-running pool hands them out), Llama-3-8B's heads
(32 query, 8 KV, 128 wide) in bf16. A "step" is `--layers` launches, each layer's output
the next one's query, evaluated as one graph; the figure is its median time over
`--repeats`, per layer. Every kernel shape (lanes a token x passes, see
worker_proc/paged_attention._BODY), split target (TARGET_BLOCKS) and K/V pipeline (STAGES)
given is checked against the plain-MLX reference first.

The yardstick, "mlx sdpa", is mx.fast.scaled_dot_product_attention over dense
[B, 8, context, 128] K/V of equal lengths (no table, no padding): what a bare decode loop's
attention costs. Its K/V sit in the cache's layout, so it reads the same bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cuda_kernel_report import kernel_shapes, stage_counts  # noqa: E402
from bench.serving import int_list  # noqa: E402
from worker_proc import paged_attention as pa  # noqa: E402

N_Q, N_KV, DIM = 32, 8, 128
SCALE = DIM ** -0.5


# Reading the bytes alone: each warp streams a row's tokens for one KV head, four tokens
# an iteration, 16-byte loads a lane (a token's K/V row, 2 x D bf16, in 512-byte warp
# loads), slot ids through the table as the kernel reads them; a sum keeps the loads
# alive.
_STREAM_SOURCE = r"""
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int len = lengths[b];
    const int lmax = table_shape[1];
    const int* row = table + (size_t)b * lmax;
    float acc = 0.f;
    for (int t0 = warp * 4; t0 < len; t0 += 16) {
        for (int c = lane * 8; c < 2 * D; c += 256) {
            uint4 x[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int t = min(t0 + u, len - 1);
                x[u] = *reinterpret_cast<const uint4*>(kv_pool + ((size_t)row[t] * HKV + kvh) * 2 * D + c);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) acc += __int_as_float((x[u].x ^ x[u].y) & 0x3f800000) + __int_as_float((x[u].z ^ x[u].w) & 0x3f800000);
        }
    }
    out[((size_t)b * HKV + kvh) * 128 + threadIdx.x] = acc;
"""


def stream_us(batch: int, context: int, layers: int, repeats: int, rng: np.random.Generator,
              order: str) -> float:
    """µs a layer of reading the K/V bytes alone, in the kernel's pattern."""
    pools, table, lengths, _ = _pools(batch, context, layers, rng, order)
    kernel = mx.fast.cuda_kernel(name="kiln_bench_stream", input_names=["kv_pool", "table", "lengths"],
                                 output_names=["out"], source=_STREAM_SOURCE)

    def step() -> list[mx.array]:
        return [kernel(inputs=[pool, table, lengths], template=[("HKV", N_KV), ("D", DIM)],
                       grid=(128, N_KV, batch), threadgroup=(128, 1, 1),
                       output_shapes=[(batch, N_KV, 128)], output_dtypes=[mx.float32])[0]
                for pool in pools]

    return _time(step, repeats) / layers * 1e6


def _pools(batch: int, context: int, layers: int, rng: np.random.Generator, order: str
           ) -> tuple[list[mx.array], mx.array, mx.array, mx.array]:
    """Per-layer pools, the shared slot table (slots in random or contiguous order),
    lengths and new slots."""
    rows = batch * context + 1
    pools = [mx.random.normal((rows, N_KV, 2 * DIM)).astype(mx.bfloat16) for _ in range(layers)]
    ids = np.arange(1, rows)
    order = (rng.permutation(ids) if order == "random" else ids).astype(np.int32).reshape(batch, context)
    lengths = mx.full((batch,), context, dtype=mx.int32)
    return pools, mx.array(order), lengths, mx.array(order[:, -1])


def _time(step, repeats: int) -> float:
    """Median seconds of step() evaluated, after warm-up."""
    for _ in range(3):
        mx.eval(step())
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(step())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paged_us(batch: int, context: int, layers: int, repeats: int, rng: np.random.Generator,
             check: bool, order: str = "random",
             stages: int = pa.DEFAULT_STAGES,
             mma: pa.MmaConfig | None = None,
             warp_tiles: bool = pa.DEFAULT_WARP_TILES) -> tuple[float, float]:
    """(µs a layer, max abs error against the reference) of the write-and-attend kernel
    with the module's current shape and split target, K/V staged `stages` tiles ahead
    (mma: the tensor-core kernel instead)."""
    pools, table, lengths, slots = _pools(batch, context, layers, rng, order)
    q0 = mx.random.normal((batch, N_Q, 1, DIM)).astype(mx.bfloat16)
    kv_new = mx.random.normal((batch, N_KV, 1, 2 * DIM)).astype(mx.bfloat16)
    k_new, v_new = kv_new[..., :DIM], kv_new[..., DIM:]
    mx.eval(pools, q0, kv_new)
    error = 0.0
    if check:
        out, mark = pa.paged_decode_write_attention(q0, k_new, v_new, slots, pools[0], table,
                                                    lengths, SCALE, stages=stages, mma=mma,
                                                    warp_tiles=warp_tiles)
        mx.eval(out, mark)
        ref = pa.reference_decode_attention(q0, pools[0], table, lengths, SCALE)
        error = float(mx.max(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32))))

    def step() -> mx.array:
        q, mark = q0, None
        for pool in pools:
            q, mark = pa.paged_decode_write_attention(q, k_new, v_new, slots, pool, table,
                                                      lengths, SCALE, after=mark, stages=stages,
                                                      mma=mma, warp_tiles=warp_tiles)
        return q

    return _time(step, repeats) / layers * 1e6, error


def sdpa_us(batch: int, context: int, layers: int, repeats: int) -> float:
    """µs a layer of MLX's fused attention over dense equal-length K/V."""
    kvs = [mx.random.normal((batch, N_KV, context, 2 * DIM)).astype(mx.bfloat16)
           for _ in range(layers)]
    q0 = mx.random.normal((batch, N_Q, 1, DIM)).astype(mx.bfloat16)
    mx.eval(kvs, q0)
    # Views of the pool-like layout, as the paged kernel reads (no copy: strided K/V).
    halves = [(kv[..., :DIM], kv[..., DIM:]) for kv in kvs]

    def step() -> mx.array:
        q = q0
        for k, v in halves:
            q = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)
        return q

    return _time(step, repeats) / layers * 1e6


LATENT, ROPE = 512, 64  # MLA's (DeepSeek-V3, Moonlight, Kimi): a pool row [latent | RoPE part]


def latent_us(batch: int, context: int, layers: int, repeats: int, heads: int,
              rng: np.random.Generator, config: pa.LatentConfig | None) -> tuple[float, float]:
    """(µs a layer, max abs error against the reference) of latent (MLA) decode attention
    over `heads` query heads: the latent kernel of this config, or (None) its plain-MLX
    meaning, the latent gathered from the pool (what the model's own code attends)."""
    rows = batch * context + 1
    pools = [mx.random.normal((rows, 1, LATENT + ROPE)).astype(mx.bfloat16) for _ in range(layers)]
    order = rng.permutation(np.arange(1, rows)).astype(np.int32).reshape(batch, context)
    table, lengths = mx.array(order), mx.full((batch,), context, dtype=mx.int32)
    q0 = mx.random.normal((batch, heads, 1, LATENT)).astype(mx.bfloat16)
    bias = mx.random.normal((batch, heads, 1, context)).astype(mx.bfloat16)
    scale = (LATENT // 4 + ROPE) ** -0.5
    mx.eval(pools, q0, bias)

    def attend(q: mx.array, pool: mx.array) -> mx.array:
        if config is None:
            return pa.reference_latent_attention(q, pool, table, lengths, bias, scale)
        return pa.paged_latent_attention(q, pool, table, lengths, bias, scale, config=config)

    ref = pa.reference_latent_attention(q0, pools[0], table, lengths, bias, scale)
    error = float(mx.max(mx.abs(attend(q0, pools[0]).astype(mx.float32) - ref.astype(mx.float32))))

    def step() -> mx.array:
        q = q0
        for pool in pools:
            q = attend(q, pool)
        return q

    return _time(step, repeats) / layers * 1e6, error


def _set_heads(n_q: int, n_kv: int, dim: int) -> None:
    """The attention shape every measurement uses (module constants)."""
    global N_Q, N_KV, DIM, SCALE
    if n_q % n_kv or dim % 32:
        sys.exit(f"--heads {n_q},{n_kv},{dim}: query heads a multiple of the KV heads, "
                 "a head size a multiple of 32")
    N_Q, N_KV, DIM, SCALE = n_q, n_kv, dim, dim ** -0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int_list, default=[1, 64, 128])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--shapes", type=kernel_shapes, default=None,
                   help="kernel shapes, lanes a token x passes: 32x4,16x2 (default: as served "
                        "for --heads)")
    p.add_argument("--targets", type=int_list, default=[pa.TARGET_BLOCKS],
                   help="TARGET_BLOCKS values")
    p.add_argument("--stages", type=stage_counts, default=[pa.DEFAULT_STAGES],
                   help="the kernel's stages: 0 register prefetch, >= 2 cp.async tiles in flight")
    p.add_argument("--tiles", type=lambda v: v.split(","), default=["warp"],
                   help="with stages >= 2: who copies a tile, block (every thread, a "
                        "barrier an iteration) or warp (each warp its own tokens), or both: "
                        "block,warp")
    p.add_argument("--mma", action="store_true",
                   help="the tensor-core kernel too, at each split target")
    p.add_argument("--mma-warps", type=int_list, default=[pa.MmaConfig.warps],
                   help="with --mma: a block's warps (see MmaConfig)")
    p.add_argument("--mma-stage-kib", type=int_list, default=[pa.MmaConfig.stage_bytes // 1024],
                   help="with --mma: the tiles' shared memory in KiB (more token warps where "
                        "it holds them; past 48 KiB with the rest, dynamic shared memory)")
    p.add_argument("--mma-stages", type=int_list, default=[pa.MmaConfig.stages],
                   help="with --mma: tiles a block keeps (>= 2)")
    p.add_argument("--order", choices=("random", "contiguous"), default="random",
                   help="each row's slots: shuffled across the pool, or consecutive")
    p.add_argument("--heads", type=int_list, default=[N_Q, N_KV, DIM],
                   help="query heads, KV heads, head size (default Llama-3-8B's: 32,8,128; "
                        "e.g. 64,8,128 for 8 query heads a KV head)")
    p.add_argument("--latent", type=int_list, default=[],
                   help="instead: latent (MLA) decode attention at these query heads (a "
                        "512-wide latent beside a 64-wide RoPE part: Moonlight 16, "
                        "DeepSeek-V3 128), the kernel at each --latent-warps x "
                        "--latent-stages against the gathered latent")
    p.add_argument("--latent-warps", type=int_list, default=[pa.LatentConfig.warps])
    p.add_argument("--latent-stages", type=int_list, default=[pa.LatentConfig.stages])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if len(args.heads) != 3:
        p.error("--heads: query heads, KV heads, head size (three numbers)")
    _set_heads(*args.heads)
    served = args.shapes is None  # each batch's lanes as the server picks them
    args.shapes = args.shapes or [(0, pa.PASSES)]
    if not pa.kernel_available():
        sys.exit("needs MLX's CUDA backend")
    rng = np.random.default_rng(0)
    rows = []
    if args.latent:
        latent_table(args, rng, rows)
        if args.json:
            args.json.write_text(json.dumps({"context": args.context, "rows": rows}, indent=1))
        return
    print(f"heads {N_Q}/{N_KV} of {DIM}, context {args.context}, {args.layers} layers, "
          f"slots in {args.order} order; "
          "µs a layer (max abs error vs reference)")
    for batch in args.batch_sizes:
        ref = sdpa_us(batch, args.context, args.layers, args.repeats)
        rows.append({"batch": batch, "kernel": "mlx sdpa", "us": ref})
        print(f"batch {batch:4d}  mlx sdpa (dense, equal lengths)   {ref:8.1f}")
        floor = stream_us(batch, args.context, args.layers, args.repeats, rng, args.order)
        rows.append({"batch": batch, "kernel": "stream", "us": floor})
        print(f"batch {batch:4d}  reading the K/V alone            {floor:8.1f}")
        for (lanes, passes), target, stages, owner in itertools.product(
                args.shapes, args.targets, args.stages, args.tiles):
            if not served:
                pa.LANES_PER_TOKEN = pa.WIDE_HEAD_LANES = lanes
            pa.PASSES, pa.TARGET_BLOCKS = passes, target
            lanes = pa.lanes_per_token(DIM, N_Q // N_KV, batch * N_KV)
            tiles = pa.staged_tiles(DIM, 2, N_Q // N_KV, stages, lanes)
            if owner == "warp" and not tiles:
                continue  # the register prefetch has no tiles to own
            splits = pa.num_splits(batch, N_KV, args.context)
            us, err = paged_us(batch, args.context, args.layers, args.repeats, rng, True,
                               args.order, stages, warp_tiles=owner == "warp")
            label = (f"kiln {lanes}x{passes}{f' staged {tiles} ({owner})' if tiles else ''}, "
                     f"target {target} ({splits} splits)")
            rows.append({"batch": batch, "kernel": label, "us": us, "max_abs_error": err})
            print(f"batch {batch:4d}  {label:40s} {us:8.1f}   ({err:.4f})")
        for target, warps, kib, stages in itertools.product(
                args.targets if args.mma else [], args.mma_warps, args.mma_stage_kib,
                args.mma_stages):
            pa.TARGET_BLOCKS = target
            mma = pa.MmaConfig(kib * 1024, stages, warps)
            if not mma.fits(mx.bfloat16, mx.bfloat16, DIM, N_Q // N_KV):
                print(f"batch {batch:4d}  kiln mma: {warps} warps, {stages} x {kib} KiB "
                      "do not fit these heads")
                continue
            splits = pa.num_splits(batch, N_KV, args.context)
            us, err = paged_us(batch, args.context, args.layers, args.repeats, rng, True,
                               args.order, mma=mma)
            layout = mma.layout(DIM)
            label = (f"kiln mma {layout.token_warps}x{layout.column_warps} warps {stages} stages"
                     f"{' dyn' if mma.dynamic_bytes(DIM, N_Q // N_KV) else ''}, "
                     f"target {target} ({splits} splits)")
            rows.append({"batch": batch, "kernel": label, "us": us, "max_abs_error": err})
            print(f"batch {batch:4d}  {label:40s} {us:8.1f}   ({err:.4f})")
    if args.json:
        args.json.write_text(json.dumps({"context": args.context, "order": args.order,
                                         "rows": rows}, indent=1))


def latent_table(args: argparse.Namespace, rng: np.random.Generator, rows: list) -> None:
    """--latent: each batch and head count, the gathered latent then each kernel config;
    GB/s counts the latent's bytes read once."""
    print(f"latent attention ({LATENT} latent + {ROPE} RoPE), context {args.context}, "
          f"{args.layers} layers, slots in random order; µs a layer (max abs error vs "
          "reference), latent GB/s")
    configs = [None] + [pa.LatentConfig(w, s) for w, s in
                        itertools.product(args.latent_warps, args.latent_stages)]
    for batch, heads, config in itertools.product(args.batch_sizes, args.latent, configs):
        if config is not None and not config.fits(mx.bfloat16, mx.bfloat16, LATENT):
            print(f"batch {batch:4d}  {config} does not fit")
            continue
        us, err = latent_us(batch, args.context, args.layers, args.repeats, heads, rng, config)
        label = ("gathered latent, mlx sdpa" if config is None else
                 f"kiln latent {config.warps} warps {config.stages} stages "
                 f"({pa.num_splits(batch, -(-heads // 16), args.context)} splits)")
        rate = batch * args.context * LATENT * 2 / us / 1e3
        rows.append({"batch": batch, "heads": heads, "kernel": label, "us": us,
                     "max_abs_error": err})
        print(f"batch {batch:4d} heads {heads:3d}  {label:44s} {us:8.1f}   ({err:.4f})  {rate:6.0f}")


if __name__ == "__main__":
    main()

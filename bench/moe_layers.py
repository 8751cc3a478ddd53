"""A decode step's mixture-of-experts layers alone: GPT-OSS-20B-shaped MLP blocks (MXFP4
experts as it ships, an 8-bit router as mlx_lm.convert leaves it, gate/up fused, down
padded as the CUDA worker pads it; or --experts bf16, nothing quantized), chained and
compiled, through mlx-lm's MLPBlock call and through kiln's fused path
(fused_moe.fused_experts: the routing and combine kernels, the dense router), with and
without kiln's experts' kernel (expert_rows; for bf16 experts in both its forms). Prints
ms a step (wall, after warm-up), the host's build and launch ms, and the largest
difference from mlx-lm's output; --timeline adds CUPTI's kernels of each
(bench/device_timeline.py; needs cupti-python).

    python bench/moe_layers.py                       # CUDA: 24 layers at 64 and 1 rows
    python bench/moe_layers.py --rows 8,64,128 --timeline
    python bench/moe_layers.py --experts bf16        # the bf16 shape (38 GB of experts)
    python bench/moe_layers.py --tiny                # anywhere: a small model, float32

Random weights route a step's rows over nearly every expert (as a trained model's
balanced router does); a random checkpoint served on real text may route them to few,
which makes every expert matmul cheaper than a real model's (docs/benchmarks.md,
session 42).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_proc.expert_padding import pad_expert_outputs  # noqa: E402
from worker_proc.fused_moe import ExpertsPlan, experts_plan, fused_experts  # noqa: E402
from worker_proc.fused_projections import fuse_projections  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    layers: int


GPT_OSS_20B = Shape(2880, 2880, 32, 4, 24)
TINY = Shape(64, 64, 4, 2, 4)


def build_layers(shape: Shape, dtype: mx.Dtype, pad: bool, quantize: bool = True
                 ) -> list[nn.Module]:
    """shape.layers GPT-OSS MLP blocks with random weights, quantized as served (quantize)
    or left in dtype."""
    from mlx_lm.models import gpt_oss
    from mlx_lm.models.switch_layers import SwitchLinear

    args = gpt_oss.ModelArgs(
        model_type="gpt_oss", hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
        num_local_experts=shape.experts, num_experts_per_tok=shape.top_k, vocab_size=100,
        rms_norm_eps=1e-5, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"], rope_theta=150000,
        rope_scaling=None)

    def which(path: str, module: nn.Module) -> bool | dict:
        if path.endswith("router"):
            return {"group_size": 64, "bits": 8, "mode": "affine"}
        return isinstance(module, SwitchLinear)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = gpt_oss.MLPBlock(args)

    layers = []
    for _ in range(shape.layers):
        holder = Holder()
        holder.set_dtype(dtype)
        if quantize:
            nn.quantize(holder, group_size=32, bits=4, mode="mxfp4", class_predicate=which)
        fuse_projections(holder)
        if pad and quantize:
            pad_expert_outputs(holder)
        mx.eval(holder.parameters())
        layers.append(holder.mlp)
    return layers


def chains(layers: list[nn.Module], backends: dict[str, Any]
           ) -> dict[str, Callable[[mx.array], mx.array]]:
    """Each variant's step: x through every layer, residual added."""
    plans: list[ExpertsPlan] = [experts_plan(m) for m in layers]
    assert all(p is not None for p in plans)

    def unfused(x: mx.array) -> mx.array:
        for m in layers:
            x = x + m(x)
        return x

    def fused(backend: Any) -> Callable[[mx.array], mx.array]:
        def step(x: mx.array) -> mx.array:
            for plan in plans:
                out = fused_experts(plan, backend, x, x)
                assert out is not None, "the backend left a layer to mlx-lm's call"
                x = out[0]
            return x
        return step

    return {"mlx-lm MLPBlock": unfused, **{name: fused(b) for name, b in backends.items()}}


def time_step(step: Callable[[mx.array], mx.array], x: mx.array, runs: int
              ) -> tuple[float, float]:
    """(wall ms, host build+launch ms) a step, compiled, after three warm-up steps."""
    compiled = mx.compile(step)
    for _ in range(3):
        mx.eval(compiled(x))
    mx.synchronize()
    host = 0.0
    start = time.perf_counter()
    for _ in range(runs):
        at = time.perf_counter()
        y = compiled(x)
        mx.async_eval(y)
        host += time.perf_counter() - at
        mx.eval(y)
    mx.synchronize()
    return (time.perf_counter() - start) / runs * 1e3, host / runs * 1e3


def _register_form() -> type:
    from worker_proc.decode_backend import KernelDecode
    from worker_proc.expert_rows import expert_rows

    class RegisterForm(KernelDecode):
        """The bf16 experts' kernel in its other form (weights read into registers)."""

        def _expert_rows(self, module, x, experts, tokens):  # noqa: ANN001, ANN202
            return expert_rows(module, x, experts, tokens, dense_form="registers")

    return RegisterForm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="64,1", help="decode rows a step, ','-joined")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4",
                   help="the experts' (and router's) weights: MXFP4 (an 8-bit router) or bf16")
    p.add_argument("--tiny", action="store_true",
                   help="4 small layers in float32 with the CPU tests' stand-in kernels")
    p.add_argument("--timeline", action="store_true",
                   help="CUPTI's kernels of each variant's steps (CUDA, cupti-python)")
    args = p.parse_args()
    trace = None
    if args.timeline:
        from device_timeline import KernelTrace, analyse, print_report
        trace = KernelTrace()  # before the first graph: see KernelTrace
    if args.tiny:
        from tests.engine_driver import StandInKernel
        shape, dtype = TINY, mx.float32
        kernel = StandInKernel
    else:
        from worker_proc.decode_backend import KernelDecode
        shape, dtype = GPT_OSS_20B, mx.bfloat16
        kernel = KernelDecode
    dense = args.experts == "bf16"
    backends = {"kiln fused, MLX's expert matmuls": kernel(expert_rows_kernel=False),
                "kiln fused + expert_rows": kernel(dense_expert_rows=dense)}
    if dense and not args.tiny:
        backends["kiln fused + expert_rows, registers"] = _register_form()(dense_expert_rows=True)
    layers = build_layers(shape, dtype, pad=not args.tiny, quantize=not dense)
    steps = chains(layers, backends)
    print(f"{shape.layers} GPT-OSS MLP blocks: {shape.experts} {args.experts} experts, top "
          f"{shape.top_k}, {shape.hidden} wide, {dtype}, {mx.default_device()}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = (0.1 * mx.random.normal((rows, 1, shape.hidden), key=mx.random.key(rows))).astype(dtype)
        mx.eval(x)
        want = steps["mlx-lm MLPBlock"](x).astype(mx.float32)
        for name, step in steps.items():
            wall, host = time_step(step, x, 3 if args.tiny else args.runs)
            diff = float(mx.abs(step(x).astype(mx.float32) - want).max())
            print(f"rows {rows:>4}  {name:<34} {wall:8.2f} ms a step  (host {host:6.2f} ms)"
                  f"  max |diff| {diff:.3g}", flush=True)
            if trace is not None:
                compiled = mx.compile(step)
                mx.eval(compiled(x))
                mx.synchronize()
                trace.restart()
                for _ in range(5):
                    mx.eval(compiled(x))
                mx.synchronize()
                print_report(analyse(trace.take(), rows, 5, top=12))


if __name__ == "__main__":
    main()

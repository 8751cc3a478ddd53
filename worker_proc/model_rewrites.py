"""The rewrites the worker makes to a loaded model before it serves it, in one place, so
that the benchmarks that time a served step (bench/step_breakdown.py,
bench/device_timeline.py) run the model the server runs.

Each rewrite swaps modules or their classes in place and keeps the model's outputs
(within rounding): projections fused into one matmul a group (fused_projections),
quantized experts' outputs padded to whole tiles of MLX's grouped kernel
(expert_padding, CUDA), the fast decode call of the common blocks (decode_block), offset
RMSNorms' 1 + weight summed once (offset_norms), attention layers that place each
row's queries at its own positions (row_positions), short convolutions as shifted
multiply-adds (depthwise_conv, CUDA) and quantized Linear layers that hand MLX their rows
as one matrix (quantized_rows, CUDA; or a decode step's to expert_rows' kernel)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from worker_proc.decode_block import speed_up_decode_blocks
from worker_proc.depthwise_conv import replace_depthwise_convs
from worker_proc.expert_padding import pad_expert_outputs
from worker_proc.fused_projections import fuse_projections
from worker_proc.offset_norms import sum_offset_norms
from worker_proc.expert_rows import KernelRowsQuantizedLinear, kernel_rows_linears
from worker_proc.quantized_rows import RowsQuantizedLinear, flatten_quantized_rows
from worker_proc.row_positions import give_rows_their_positions


@dataclass(frozen=True)
class Rewrites:
    """What rewrite_for_serving changed: counts of modules (0: none)."""

    fused_groups: int
    padded_experts: int
    fast_blocks: int
    summed_norms: int
    placed_layers: int
    convs: int
    flat_quantized: int
    kernel_linears: int = 0


def rewrite_for_serving(model: nn.Module, *, on_cuda: bool, fuse: bool, fast_blocks: bool,
                        pad_experts: bool, flat_rows: bool | None = None,
                        sum_norms: bool = True, rows_kernel: bool = False,
                        dense_rows_kernel: bool = False) -> Rewrites:
    """Apply the rewrites in the order the worker needs them (fast blocks find their
    projections fused; experts are padded before the blocks learn their shapes).
    on_cuda: MLX runs on CUDA (the fast blocks' residual adds inside the o and down GEMMs,
    short convolutions rewritten); fuse: projections fused (fast_blocks implies it);
    pad_experts: where MLX's grouped kernel reads whole tiles (CUDA); flat_rows: quantized
    Linear layers' rows flattened (RowsQuantizedLinear; None: on CUDA); rows_kernel: and
    a decode step's rows through the experts' 4-bit kernel (KernelRowsQuantizedLinear);
    dense_rows_kernel: bfloat16 Linear layers' through its bfloat16 form (KernelRowsLinear)."""
    fused = 0
    if fuse or fast_blocks:
        fused = fuse_projections(model)
        # The separate weights' buffers sit in MLX's cache, which the device reports as
        # used: give them back before the pool is sized from free memory (~8.5 GiB on
        # an 8B model, which shrank the H200's pool by 5 GiB).
        mx.clear_cache()
    padded = pad_expert_outputs(model) if pad_experts else 0
    if padded:
        mx.clear_cache()  # the unpadded weights' buffers, as after fusing
    blocks = speed_up_decode_blocks(model, residual_in_gemm=on_cuda) if fast_blocks else 0
    norms = sum_offset_norms(model) if sum_norms else 0
    placed = give_rows_their_positions(model)
    convs = replace_depthwise_convs(model) if on_cuda else 0
    flat = 0
    if on_cuda if flat_rows is None else flat_rows:
        flat = flatten_quantized_rows(
            model, KernelRowsQuantizedLinear if rows_kernel else RowsQuantizedLinear)
    linears = kernel_rows_linears(model) if dense_rows_kernel else 0
    return Rewrites(fused, padded, blocks, norms, placed, convs, flat, linears)

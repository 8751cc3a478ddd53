"""Quantized Linear layers that hand MLX a decode step's rows as one matrix.

A decode step's input is [rows, 1, dims] (mlx-lm's [batch, tokens, dims]); MLX's CUDA
backend takes the last axis but one as its quantized GEMM's rows and the others as a
batch, so it ran one single-row GEMM a row, each reading the whole weight matrix again
(a tile of 16 rows, 15 empty). As [rows, dims] the weights are read once a step. Each
output row is its input row's alone either way. model_rewrites swaps the class in on
CUDA; fused_moe's calls that keep a bias apart go through `quantized_matmul` below."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class RowsQuantizedLinear(nn.QuantizedLinear):
    """A quantized Linear whose input's leading axes are flattened into one of rows before
    MLX's quantized matmul, and restored after."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim <= 2:
            return super().__call__(x)
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def quantized_matmul(linear: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """The layer's quantized matmul of x without its bias, its rows flattened as the
    layer's own call flattens them."""
    rows = x.reshape(-1, x.shape[-1]) if isinstance(linear, RowsQuantizedLinear) else x
    out = mx.quantized_matmul(rows, linear["weight"], scales=linear["scales"],
                              biases=linear.get("biases"), transpose=True,
                              group_size=linear.group_size, bits=linear.bits, mode=linear.mode)
    return out.reshape(*x.shape[:-1], -1)


def flatten_quantized_rows(model: nn.Module) -> int:
    """Swap RowsQuantizedLinear into every (exactly) QuantizedLinear of the model; returns
    how many."""
    count = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = RowsQuantizedLinear
            count += 1
    return count

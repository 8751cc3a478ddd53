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
        out = self.matmul(x)
        return out + self["bias"] if "bias" in self else out

    def matmul(self, x: mx.array) -> mx.array:
        """x's product with the weights, without the bias."""
        rows = x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x
        out = mx.quantized_matmul(rows, self["weight"], scales=self["scales"],
                                  biases=self.get("biases"), transpose=True,
                                  group_size=self.group_size, bits=self.bits, mode=self.mode)
        return out.reshape(*x.shape[:-1], -1) if x.ndim > 2 else out


def quantized_matmul(linear: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """The layer's quantized matmul of x without its bias, its rows flattened as the
    layer's own call flattens them."""
    if isinstance(linear, RowsQuantizedLinear):
        return linear.matmul(x)
    return mx.quantized_matmul(x, linear["weight"], scales=linear["scales"],
                               biases=linear.get("biases"), transpose=True,
                               group_size=linear.group_size, bits=linear.bits, mode=linear.mode)


def flatten_quantized_rows(model: nn.Module, cls: type = RowsQuantizedLinear) -> int:
    """Swap cls (RowsQuantizedLinear or a subclass) into every (exactly) QuantizedLinear of
    the model; returns how many."""
    count = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = cls
            count += 1
    return count

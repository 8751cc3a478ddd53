"""Depthwise causal convolutions (recurrent layers' short convolutions) without cuDNN.

Hybrid and state-space models (Qwen3-Next, Qwen3.5, LFM2, Mamba 2, Nemotron-H, ...) run a
depthwise `nn.Conv1d` over each chunk: kernel 3-4, one filter per channel. On MLX's CUDA
backend every convolution is a cuDNN graph that MLX builds (and caches) for each new
input shape, and a server's prefill forwards come in a new (rows, length) nearly every
step: each paid a build of hundreds of milliseconds (docs/benchmarks.md, session 12).
With a filter this short the convolution is K shifted multiply-adds, which plain
element-wise kernels do with no per-shape build; the sum is kept in float32, as cuDNN
accumulates.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger(__name__)


class ShiftedConv1d(nn.Module):
    """A depthwise, unpadded, stride-1 nn.Conv1d as shifted multiply-adds: [B, L, C] ->
    [B, L - K + 1, C] (cross-correlation, as MLX's conv1d)."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        # [C, K, 1] -> K arrays [C]: tap k of every channel. Apart, not rows of one array:
        # indexing a row in the forward is a gather kernel per tap and step.
        weight = conv.weight[:, :, 0].astype(mx.float32)
        self.taps = [mx.contiguous(weight[:, i]) for i in range(weight.shape[1])]
        self.has_bias = "bias" in conv
        if self.has_bias:
            self.bias = conv.bias

    def __call__(self, x: mx.array) -> mx.array:
        k = len(self.taps)
        n = x.shape[1] - k + 1
        out = x[:, :n].astype(mx.float32) * self.taps[0]
        for i in range(1, k):
            out = out + x[:, i:i + n].astype(mx.float32) * self.taps[i]
        if self.has_bias:
            out = out + self.bias.astype(mx.float32)
        return out.astype(x.dtype)


def is_depthwise(conv: Any) -> bool:
    """Whether a module is an nn.Conv1d ShiftedConv1d computes the same as."""
    if not isinstance(conv, nn.Conv1d):
        return False
    channels, _, per_group = conv.weight.shape
    return (per_group == 1 and conv.groups == channels and conv.stride == 1
            and conv.padding == 0 and conv.dilation == 1)


def replace_depthwise_convs(model: nn.Module) -> int:
    """Swap every depthwise nn.Conv1d attribute of the model's modules for a ShiftedConv1d
    (after its weights are loaded); returns how many."""
    swaps = [(parent, name, child) for _, parent in model.named_modules()
             for name, child in parent.children().items() if is_depthwise(child)]
    for parent, name, child in swaps:
        setattr(parent, name, ShiftedConv1d(child))
    if swaps:
        mx.eval([getattr(parent, name).taps for parent, name, _ in swaps])
    return len(swaps)

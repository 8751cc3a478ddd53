"""One matmul for the projections that read the same activations: attention's q/k/v, the
MLP's gate/up, and a Gated DeltaNet layer's input projections (Qwen3.5's four, Qwen3-Next's
two).

mlx-lm's model code calls each projection on the same input in turn. On MLX's CUDA
backend every call is a kernel launch of ~15-20 us of host time, and host launch time is
what bounds a decode step at 64 rows on the H200, so a llama layer's five input
projections cost three launches more than a fused pair would. `fuse_projections` swaps
each such group of Linear (or QuantizedLinear) modules for parts of one shared module:
the first part called computes the concatenated matmul, every part returns its columns
(views, no copy), and the group lets go of the input once each part has been taken. The
model code runs unchanged; a model whose projections do not match (other input sizes,
quantization, or bias) keeps them separate.

On the CPU the parts equal the separate matmuls bit for bit (tests compare greedy tokens
with mlx-lm's), as BLAS computes each output column from the same row and column alone.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger(__name__)

# The groups to fuse: the fused module's attribute name, then the parts' in the order the
# model code calls them.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
    # Gated DeltaNet: two of its four (Qwen3.5) are a column per value head, GEMMs that
    # cost a launch each and nearly nothing else.
    ("in_proj_all", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    ("in_proj_qkvzba", ("in_proj_qkvz", "in_proj_ba")),
)


class _SharedProjection:
    """The fused module of a group and the last input it projected."""

    def __init__(self, fused: nn.Module, sizes: list[int]) -> None:
        self.fused = fused
        self._bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        self._count = len(sizes)
        self._input: mx.array | None = None
        self._parts: list[mx.array] = []
        self._taken = 0

    def part(self, index: int, x: mx.array) -> mx.array:
        if x is not self._input:  # a new input (identity: the same array object)
            self._parts = mx.split(self.fused(x), self._bounds, axis=-1)
            self._input, self._taken = x, 0
        out = self._parts[index]
        self._taken += 1
        if self._taken == self._count:  # every part taken: hold nothing across forwards
            self._input, self._parts = None, []
        return out


class ProjectionPart(nn.Module):
    """Stands where one projection of a fused group was; returns its share of the group's
    matmul of the input."""

    def __init__(self, shared: _SharedProjection, index: int) -> None:
        super().__init__()
        self._shared = shared
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared.part(self._index, x)


def _fused_module(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing every part's output side by side; None if they differ in kind,
    input size, dtype, quantization or bias."""
    first = parts[0]
    kind = type(first)
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not kind for p in parts):
        return None
    keys = sorted(k for k in ("weight", "scales", "biases", "bias") if k in first)
    for p in parts:
        if sorted(k for k in ("weight", "scales", "biases", "bias") if k in p) != keys:
            return None
        if p.weight.shape[1] != first.weight.shape[1] or p.weight.dtype != first.weight.dtype:
            return None
        if kind is nn.QuantizedLinear and (p.group_size, p.bits, p.mode) != (
                first.group_size, first.bits, first.mode):
            return None
    out_dims = sum(p.weight.shape[0] for p in parts)
    # The constructors draw (lazy) initial weights, replaced before anything evaluates them.
    if kind is nn.Linear:
        fused: nn.Module = nn.Linear(first.weight.shape[1], out_dims, bias="bias" in first)
    else:
        in_dims = first.weight.shape[1] * 32 // first.bits
        fused = nn.QuantizedLinear(in_dims, out_dims, "bias" in first, first.group_size,
                                   first.bits, mode=first.mode)
    for key in keys:
        fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of GROUPS among the model's modules in place (see the module
    note); returns how many groups were fused. Each group's weights are concatenated and
    evaluated before the next, and the originals dropped, so memory grows by one group's
    weights at most."""
    fused_groups = 0
    for _, module in model.named_modules():
        for fused_name, names in GROUPS:
            parts: list[Any] = [module.get(n) for n in names]
            if any(p is None for p in parts) or fused_name in module:
                continue
            fused = _fused_module(parts)
            if fused is None:
                continue
            mx.eval(fused.parameters())
            shared = _SharedProjection(fused, [p.weight.shape[0] for p in parts])
            setattr(module, fused_name, fused)
            for i, name in enumerate(names):
                setattr(module, name, ProjectionPart(shared, i))
            fused_groups += 1
    if fused_groups:
        logger.info("fused %d projection groups (q/k/v, gate/up, recurrent inputs) into one "
                    "matmul each", fused_groups)
    return fused_groups

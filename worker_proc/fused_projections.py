"""One matmul for the projections that read the same activations: attention's q/k/v, the
MLP's gate/up (a mixture of experts' too), and a Gated DeltaNet layer's input projections
(Qwen3.5's four, Qwen3-Next's two).

mlx-lm's model code calls each projection on the same input in turn. On MLX's CUDA
backend every call is a kernel launch of ~15-20 us of host time, and host launch time is
what bounds a decode step at 64 rows on the H200, so a llama layer's five input
projections cost three launches more than a fused pair would. `fuse_projections` swaps
each such group of Linear (or QuantizedLinear) modules for parts of one shared module:
the first part called computes the concatenated matmul, every part returns its columns
(views, no copy), and the group lets go of the input once each part has been taken. The
model code runs unchanged; a model whose projections do not match (other input sizes,
quantization, or bias) keeps them separate. Experts' projections (mlx-lm's SwitchLinear and
QuantizedSwitchLinear, [experts, out, in]) fuse along their outputs the same way: the
parts of a SwitchGLU are called with the same (sorted) tokens and expert indices, and one
gather_mm serves both.

On the CPU the parts equal the separate matmuls bit for bit (tests compare greedy tokens
with mlx-lm's), as BLAS computes each output column from the same row and column alone.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

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
        self._input: tuple | None = None
        self._parts: list[mx.array] = []
        self._taken = 0

    def _same_input(self, x: mx.array, args: tuple, kwargs: dict) -> bool:
        if self._input is None:
            return False
        last_x, last_args, last_kwargs = self._input
        return (x is last_x and len(args) == len(last_args)
                and all(a is b for a, b in zip(args, last_args)) and kwargs == last_kwargs)

    def part(self, index: int, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        # A new input: not the same array objects (experts' parts also take the expert
        # indices, and whether they come sorted).
        if not self._same_input(x, args, kwargs):
            self._parts = mx.split(self.fused(x, *args, **kwargs), self._bounds, axis=-1)
            self._input, self._taken = (x, args, kwargs), 0
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

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return self._shared.part(self._index, x, *args, **kwargs)


_EXPERTS = (SwitchLinear, QuantizedSwitchLinear)  # weights [experts, out, in]


def _out_axis(part: nn.Module) -> int:
    """The axis of a part's parameters along which its outputs run."""
    return 1 if isinstance(part, _EXPERTS) else 0


def _fused_module(parts: list[nn.Module]) -> nn.Module | None:
    """One module computing every part's output side by side; None if they differ in kind,
    input size, dtype, quantization or bias."""
    first = parts[0]
    kind = type(first)
    if (kind not in (nn.Linear, nn.QuantizedLinear, *_EXPERTS)
            or any(type(p) is not kind for p in parts)):
        return None
    if kind is QuantizedSwitchLinear and any(p.global_scale is not None for p in parts):
        return None  # nvfp4 experts with a scale of their own each
    keys = _parameter_keys(first)
    axis = _out_axis(first)
    for p in parts:
        if _parameter_keys(p) != keys:
            return None
        if (_other_dims(p.weight, axis) != _other_dims(first.weight, axis)
                or p.weight.dtype != first.weight.dtype):
            return None
        if kind in (nn.QuantizedLinear, QuantizedSwitchLinear) and (
                p.group_size, p.bits, p.mode) != (first.group_size, first.bits, first.mode):
            return None
    out_dims = sum(p.weight.shape[axis] for p in parts)
    # The constructors draw (lazy) initial weights, replaced before anything evaluates them.
    if kind is nn.Linear:
        fused: nn.Module = nn.Linear(first.weight.shape[1], out_dims, bias="bias" in first)
    elif kind is nn.QuantizedLinear:
        in_dims = first.weight.shape[1] * 32 // first.bits
        fused = nn.QuantizedLinear(in_dims, out_dims, "bias" in first, first.group_size,
                                   first.bits, mode=first.mode)
    elif kind is SwitchLinear:
        fused = SwitchLinear(first.input_dims, out_dims, first.num_experts, bias="bias" in first)
    else:
        fused = QuantizedSwitchLinear(first.input_dims, out_dims, first.num_experts,
                                      "bias" in first, first.group_size, first.bits,
                                      mode=first.mode)
        if "biases" not in keys:
            fused.biases = None
    for key in keys:
        fused[key] = mx.concatenate([p[key] for p in parts], axis=axis)
    return fused


def _other_dims(weight: mx.array, axis: int) -> tuple[int, ...]:
    """A weight's shape without its output axis (input size, experts)."""
    return tuple(weight.shape[:axis] + weight.shape[axis + 1:])


def _parameter_keys(part: nn.Module) -> list[str]:
    """The parameters a part holds, sorted (QuantizedSwitchLinear keeps `biases` as None
    where its mode has none)."""
    return sorted(k for k in ("weight", "scales", "biases", "bias")
                  if k in part and part[k] is not None)


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
            shared = _SharedProjection(fused, [p.weight.shape[_out_axis(p)] for p in parts])
            setattr(module, fused_name, fused)
            for i, name in enumerate(names):
                setattr(module, name, ProjectionPart(shared, i))
            fused_groups += 1
    if fused_groups:
        logger.info("fused %d projection groups (q/k/v, gate/up, experts' gate/up, recurrent "
                    "inputs) into one "
                    "matmul each", fused_groups)
    return fused_groups

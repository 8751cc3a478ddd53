"""RMSNorms whose scale is stored as an offset from one, with the sum made once at load.

Gemma's RMSNorm (and the models that reuse its module) multiplies by `1 + weight`, and
mlx-lm adds the one on every call: on a GPU an add kernel of its own before each norm,
six a Gemma-3 layer (its input, post-attention, pre- and post-feed-forward norms and the
q/k norms), ~290 launches of a 48-layer decode step whose host time is the step's
bound. The sum never changes, so it is made once here and the norm reads it: the same
array, rounded the same way, so outputs are unchanged to the bit.

Modules are found by what they compute, not by class name: a module with one parameter,
a 1-D `weight`, and an `eps`, whose output equals `mx.fast.rms_norm(x, 1 + weight, eps)`
for inputs in the weight's dtype and in float32.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

logger = logging.getLogger(__name__)


class _SummedOnce:
    """Mixed into an offset-norm's class: the call reads the sum made at load."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self._one_plus_weight, self.eps)  # type: ignore[attr-defined]


_CLASSES: dict[type, type] = {}


def _summed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"SummedOnce{cls.__name__}", (_SummedOnce, cls), {})
    return _CLASSES[cls]


def _is_offset_norm(module: nn.Module) -> bool:
    if isinstance(module, (_SummedOnce, nn.RMSNorm)) or not isinstance(getattr(module, "eps", None), float):
        return False
    params = tree_flatten(module.parameters())
    if len(params) != 1 or params[0][0] != "weight" or params[0][1].ndim != 1:
        return False
    weight = params[0][1]
    for dtype in {weight.dtype, mx.float32}:
        x = mx.random.normal((2, weight.shape[0]), key=mx.random.key(0)).astype(dtype)
        try:
            out = module(x)
        except Exception:  # noqa: BLE001 - a module that wants other arguments: not a norm
            return False
        if not (isinstance(out, mx.array) and out.shape == x.shape
                and mx.array_equal(out, mx.fast.rms_norm(x, 1.0 + weight, module.eps)).item()):
            return False
    return True


def sum_offset_norms(model: nn.Module) -> int:
    """Give every offset RMSNorm of the model its `1 + weight` once (see the module
    note); returns how many. Call after the weights are loaded and cast."""
    count = 0
    for _, module in model.named_modules():
        if _is_offset_norm(module):
            module._one_plus_weight = 1.0 + module.weight  # underscore: not a parameter
            mx.eval(module._one_plus_weight)
            module.__class__ = _summed_class(type(module))
            count += 1
    if count:
        logger.info("%d RMSNorms read 1 + weight made once at load", count)
    return count

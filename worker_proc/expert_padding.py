"""Quantized experts' projections padded to whole tiles of MLX's grouped CUDA kernel.

mlx-lm's SwitchGLU sorts a step's token-expert pairs by expert once there are 64 or more
(every decode step of 16+ rows with 4 experts a token) and calls `mx.gather_qmm` with
`sorted_indices`. On CUDA, MLX 0.32.4 then computes the rows of one expert together, each
tile of its weights read once for a tile of rows (`gather_qmm_rhs_sm80`), but only where
the projection's output size is a multiple of that kernel's 128-wide tile (and 4 or 8
bits, 16-bit activations, an input size a multiple of 64, four rows or more an expert on
average). Elsewhere each row is a matrix-vector product of its own, and an expert's
weights are read again for every row routed to it. GPT-OSS's down projections (2,880
outputs; its fused gate/up's 5,760 are whole tiles) miss it: at 64 rows its MXFP4 step
took ~6x its experts' read (docs/benchmarks.md, session 39).

`pad_expert_outputs` gives each such projection zero output rows up to the next whole
tile and cuts its output back (`PaddedExperts`): 2.2% more weight bytes on GPT-OSS, and
the outputs kept are the same products (a zero row adds nothing to the others; on the
CPU they are equal bit for bit). A fused group's shared module (fused_projections) is
left as it is: its parts read its columns by position. Since worker_proc.expert_rows
serves 4-bit bf16 decode steps (its own kernel, whole tiles or not), the padding pays off
in prefill forwards, where MLX's grouped kernel still takes the sorted rows.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from worker_proc.fused_projections import GROUPS

logger = logging.getLogger(__name__)

TILE = 128  # the grouped kernel's output tile
_FUSED_NAMES = frozenset(name for name, _ in GROUPS)


class PaddedExperts(nn.Module):
    """Stands where a quantized experts' projection was: the padded projection, its
    output cut back to the original size."""

    def __init__(self, inner: QuantizedSwitchLinear, out_dims: int) -> None:
        super().__init__()
        self.inner = inner
        self.out_dims = out_dims

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return self.inner(x, indices, sorted_indices=sorted_indices)[..., :self.out_dims]


def _pad_rows(a: mx.array, extra: int, axis: int) -> mx.array:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return mx.pad(a, widths)


def _pad(module: QuantizedSwitchLinear, tile: int) -> PaddedExperts | None:
    n = module.weight.shape[1]
    extra = -n % tile
    if not extra:
        return None
    # Zero codes are zero in every mode (affine with zero scales and biases; the float
    # modes' code 0 is +0.0 whatever its scale), and a zero bias keeps them so.
    for key in ("weight", "scales", "biases"):
        if module.get(key) is not None:
            module[key] = _pad_rows(module[key], extra, axis=1)
    if "bias" in module:
        module["bias"] = _pad_rows(module["bias"], extra, axis=1)
    mx.eval(module.parameters())
    return PaddedExperts(module, n)


def pad_expert_outputs(model: nn.Module, tile: int = TILE) -> int:
    """Pad every quantized experts' projection the model calls by name whose output size
    is not a multiple of `tile` (see the module note); returns how many."""
    padded = 0
    for _, parent in model.named_modules():
        for name, child in list(parent.children().items()):
            if not isinstance(child, QuantizedSwitchLinear) or name in _FUSED_NAMES:
                continue
            wrapper = _pad(child, tile)
            if wrapper is not None:
                setattr(parent, name, wrapper)
                padded += 1
    if padded:
        logger.info("padded %d quantized experts' projections to whole %d-row tiles",
                    padded, tile)
    return padded


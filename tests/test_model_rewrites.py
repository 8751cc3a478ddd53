"""worker_proc/quantized_rows.py: quantized Linear layers that hand MLX a decode step's
rows as one matrix (RowsQuantizedLinear, on by default with MLX's CUDA backend) give
every row what the layer gave it before, and a quantized model keeps mlx-lm's tokens."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step

from tests.families import build
from worker_proc.fused_moe import linear_and_bias
from worker_proc.quantized_rows import RowsQuantizedLinear, flatten_quantized_rows


def _quantized(bias: bool, mode: str = "affine") -> nn.QuantizedLinear:
    mx.random.seed(3)
    linear = nn.Linear(128, 96, bias=bias)
    return nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4, mode=mode)


@pytest.mark.parametrize("shape", [(7, 1, 128), (1, 5, 128), (3, 2, 128), (128,)])
@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_rows_flattened_give_each_row_its_own_output(shape, mode):
    layer = _quantized(bias=True, mode=mode)
    x = mx.random.normal(shape)
    before = layer(x)
    layer.__class__ = RowsQuantizedLinear
    after = layer(x)
    assert after.shape == before.shape
    assert mx.allclose(after, before, atol=1e-5).item()


def test_linear_and_bias_flattens_where_the_layer_does():
    layer = _quantized(bias=True)
    x = mx.random.normal((6, 1, 128))
    out, bias = linear_and_bias(layer, x)
    layer.__class__ = RowsQuantizedLinear
    flat_out, flat_bias = linear_and_bias(layer, x)
    assert flat_out.shape == out.shape == (6, 1, 96)
    assert flat_bias is bias
    assert mx.allclose(flat_out, out, atol=1e-5).item()


def test_a_quantized_model_keeps_its_greedy_tokens():
    model = build("llama")
    nn.quantize(model, group_size=32, bits=4)
    prompt = mx.array([5, 17, 3, 99, 42, 7])

    def greedy() -> list[int]:
        steps = generate_step(prompt, model, max_tokens=12, sampler=lambda l: mx.argmax(l, -1))
        return [int(t) for t, _ in steps]

    want = greedy()
    swapped = flatten_quantized_rows(model)
    assert swapped == sum(type(m) is RowsQuantizedLinear for _, m in model.named_modules()) > 0
    assert greedy() == want

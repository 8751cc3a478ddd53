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


def test_kernel_rows_send_decode_steps_of_4bit_bf16_layers_to_the_kernel(monkeypatch):
    """--experiments quantized-rows-kernel: a KernelRowsQuantizedLinear hands a step of up
    to LINEAR_MAX_ROWS bfloat16 rows over 4-bit weights to expert_rows.linear_rows (stood
    in for by MLX's product here) and adds its bias after; more rows, other dtypes and other
    bit widths keep MLX's quantized matmul. The worker's rewrite swaps it in."""
    from worker_proc import expert_rows
    from worker_proc.model_rewrites import rewrite_for_serving

    calls: list[tuple[int, ...]] = []

    def stand_in(linear, x):  # noqa: ANN001, ANN202
        calls.append(x.shape)
        return RowsQuantizedLinear.matmul(linear, x)

    monkeypatch.setattr(expert_rows, "linear_rows", stand_in)
    for mode, bits in (("affine", 4), ("mxfp4", 4), ("affine", 8)):
        layer = nn.QuantizedLinear.from_linear(nn.Linear(128, 96, bias=True), group_size=32,
                                               bits=bits, mode=mode)
        layer.set_dtype(mx.bfloat16)
        for shape in ((8, 1, 128), (3, 2, 128), (expert_rows.LINEAR_MAX_ROWS + 1, 128)):
            x = mx.random.normal(shape).astype(mx.bfloat16)
            layer.__class__ = RowsQuantizedLinear
            want = layer(x)
            layer.__class__ = expert_rows.KernelRowsQuantizedLinear
            calls.clear()
            got = layer(x)
            assert got.shape == want.shape and mx.array_equal(got, want).item()
            taken = bits == 4 and shape[0] <= expert_rows.LINEAR_MAX_ROWS
            rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
            assert calls == ([(rows, 128)] if taken else []), (mode, bits, shape)
        calls.clear()
        layer(mx.random.normal((8, 1, 128)))  # float32 rows: MLX's
        assert not calls
    model = build("llama")
    nn.quantize(model, group_size=32, bits=4)
    done = rewrite_for_serving(model, on_cuda=False, fuse=False, fast_blocks=False,
                               pad_experts=False, flat_rows=True, rows_kernel=True)
    kinds = {type(m) for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert done.flat_quantized > 0 and kinds == {expert_rows.KernelRowsQuantizedLinear}


def test_kernel_rows_send_decode_steps_of_bf16_linears_to_the_kernel(monkeypatch):
    """--experiments bf16-rows-kernel: a KernelRowsLinear hands a step of up to
    DENSE_MAX_ROWS bfloat16 rows to expert_rows.linear_rows (stood in for by MLX's product)
    and adds its bias after; more rows and float32 rows keep MLX's GEMM. The rewrite swaps
    it into bfloat16 Linear layers only, and a fast decode block still puts the o and down
    projections' residual adds inside their GEMM."""
    from worker_proc import expert_rows
    from worker_proc.model_rewrites import rewrite_for_serving

    calls: list[tuple[int, ...]] = []

    def stand_in(linear, x):  # noqa: ANN001, ANN202
        calls.append(x.shape)
        return x @ linear["weight"].T

    monkeypatch.setattr(expert_rows, "linear_rows", stand_in)
    layer = nn.Linear(128, 96, bias=True)
    layer.set_dtype(mx.bfloat16)
    for shape in ((8, 1, 128), (3, 2, 128), (expert_rows.DENSE_MAX_ROWS + 1, 128)):
        x = mx.random.normal(shape).astype(mx.bfloat16)
        layer.__class__ = nn.Linear
        want = (x @ layer["weight"].T) + layer["bias"]
        layer.__class__ = expert_rows.KernelRowsLinear
        calls.clear()
        got = layer(x)
        assert got.shape == want.shape
        taken = shape[0] <= expert_rows.DENSE_MAX_ROWS
        if taken:  # (MLX's addmm rounds once, the kernel's product and bias twice)
            assert mx.array_equal(got, want).item()
        rows = shape[0] * (shape[1] if len(shape) == 3 else 1)
        assert calls == ([(rows, 128)] if taken else []), shape
    calls.clear()
    layer(mx.random.normal((8, 1, 128)))  # float32 rows: MLX's
    assert not calls

    model = build("llama")
    model.set_dtype(mx.bfloat16)
    done = rewrite_for_serving(model, on_cuda=True, fuse=True, fast_blocks=True,
                               pad_experts=False, flat_rows=False, dense_rows_kernel=True)
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert done.kernel_linears == len(linears) > 0
    assert {type(m) for m in linears} == {expert_rows.KernelRowsLinear}
    addmm = mx.addmm
    added: list[int] = []
    monkeypatch.setattr(mx, "addmm", lambda *a, **k: added.append(1) or addmm(*a, **k))
    block = model.layers[0]
    outs, ins = block.self_attn.o_proj.weight.shape
    block._residual(mx.zeros((2, 1, outs), dtype=mx.bfloat16), block.self_attn.o_proj,
                    mx.zeros((2, 1, ins), dtype=mx.bfloat16))
    assert added and not calls
    float32 = build("llama")
    assert rewrite_for_serving(float32, on_cuda=False, fuse=False, fast_blocks=False,
                               pad_experts=False, dense_rows_kernel=True).kernel_linears == 0

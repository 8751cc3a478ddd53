"""Quantized experts' projections padded to whole tiles: the same outputs and tokens."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, StandInKernel, assert_greedy
from tests.test_worker import _prompts
from worker_proc.expert_padding import PaddedExperts, pad_expert_outputs
from worker_proc.fused_projections import fuse_projections


def _quantized(name: str, mode: str):  # noqa: ANN202 - an mlx-lm model
    from mlx_lm.models.switch_layers import SwitchLinear

    from tests.families import build

    model = build(name)
    nn.quantize(model, group_size=32, bits=4, mode=mode,
                class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    return model


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_a_padded_projection_gives_the_same_outputs_sorted_or_not(mode):
    """GPT-OSS's experts (biases too): each projection padded from 64 or 96 outputs to 128,
    its output cut back, equals the unpadded one for rows in token order and sorted by
    expert (the order mlx-lm's SwitchGLU sends 64 or more pairs in)."""
    padded, plain = _quantized("gpt_oss", mode), _quantized("gpt_oss", mode)
    assert pad_expert_outputs(padded, tile=128) == 3 * len(padded.model.layers)
    mlp, ref = padded.model.layers[0].mlp.experts, plain.model.layers[0].mlp.experts
    assert isinstance(mlp.down_proj, PaddedExperts) and mlp.down_proj.inner.weight.shape[1] == 128
    x = mx.random.normal((40, 1, 64), key=mx.random.key(3))
    indices = mx.random.randint(0, 4, (40,), key=mx.random.key(4))
    for idx, sort in ((indices, False), (mx.sort(indices), True)):
        got = mlp.up_proj(x[:, None], idx, sorted_indices=sort)
        want = ref.up_proj(x[:, None], idx, sorted_indices=sort)
        assert got.shape == want.shape
        assert np.array_equal(np.array(got), np.array(want))  # zero rows add nothing
    assert pad_expert_outputs(padded, tile=128) == 0  # already whole tiles


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_padded_experts_keep_mlx_lm_tokens_fused_or_not(name):
    """Served as on the CUDA path (compiled decode, the kernels stood in for), batched and
    chunked, with the gate/up pair fused (its shared module keeps its size) and not:
    mlx-lm's greedy tokens from the unpadded model."""
    from tests.oracle import mlx_lm_tokens

    oracle_model = _quantized(name, "mxfp4")
    for fuse in (False, True):
        served = _quantized(name, "mxfp4")
        if fuse:
            fuse_projections(served)
        layers = len(served.model.layers)
        assert pad_expert_outputs(served, tile=128) == (1 if fuse else 3) * layers
        prompts = _prompts(4, [33, 5, 60, 17], 512, seed=31)
        engine = InProcessEngine(served, chunk_size=48, compile_decode=True, overlap="ahead",
                                 backend=StandInKernel())
        assert_greedy(engine, prompts, 10, [], lambda p, n: mlx_lm_tokens(oracle_model, p, n),
                      ties_of=oracle_model)

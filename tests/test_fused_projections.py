"""Fused q/k/v and gate/up projections: the same tokens as mlx-lm's separate matmuls."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, StandInKernel, assert_greedy
from tests.test_worker import _eos, _prompts
from worker_proc.fused_projections import ProjectionPart, fuse_projections


# One wide matmul and three narrow ones need not round alike (MKL 2026.2.1 differs in the
# last bit); the promise is the same values up to float32 rounding.
RTOL, ATOL = 1e-5, 1e-6


def assert_close(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=RTOL, atol=ATOL)


@pytest.fixture()
def fused_tiny(tiny_model_dir):
    """A second copy of the tiny model, fused (the fixture's copy stays mlx-lm's own: it
    is the oracle)."""
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    layers = len(model.layers)
    assert fuse_projections(model) == 2 * layers
    return model


def test_fused_model_generates_mlx_lm_tokens_batched_and_chunked(tiny_model, oracle, fused_tiny):
    _, tokenizer = tiny_model
    attention = fused_tiny.layers[0].self_attn
    assert isinstance(attention.q_proj, ProjectionPart) and "qkv_proj" in attention
    assert "gate_up_proj" in fused_tiny.layers[0].mlp
    prompts = _prompts(6, [3, 70, 130, 9, 40, 257], fused_tiny.args.vocab_size, seed=21)
    engine = InProcessEngine(fused_tiny, chunk_size=64, max_prefill_tokens=200)
    assert_greedy(engine, prompts, 24, _eos(tokenizer), oracle, ties_of=tiny_model[0])


def test_quantized_projections_fuse_to_the_same_logits(tiny_model_dir):
    import mlx_lm

    theirs, _ = mlx_lm.load(str(tiny_model_dir))
    ours, _ = mlx_lm.load(str(tiny_model_dir))
    for model in (theirs, ours):
        nn.quantize(model, group_size=32, bits=4)
    assert fuse_projections(ours) == 2 * len(ours.layers)
    assert isinstance(ours.layers[0].self_attn["qkv_proj"], nn.QuantizedLinear)
    tokens = mx.array([[7, 8, 9, 10, 11, 12]])
    assert_close(ours(tokens), theirs(tokens))


def test_projections_that_differ_stay_separate():
    class Block(nn.Module):
        def __init__(self, bias_on_v: bool) -> None:
            super().__init__()
            self.q_proj = nn.Linear(8, 8, bias=False)
            self.k_proj = nn.Linear(8, 4, bias=False)
            self.v_proj = nn.Linear(8, 4, bias=bias_on_v)
            self.gate_proj = nn.Linear(8, 16, bias=False)
            self.up_proj = nn.Linear(4, 16, bias=False)  # another input size

    mixed, plain = Block(bias_on_v=True), Block(bias_on_v=False)
    assert fuse_projections(mixed) == 0 and "qkv_proj" not in mixed
    x = mx.random.normal((2, 8))
    want = [plain.q_proj(x), plain.k_proj(x), plain.v_proj(x)]
    assert fuse_projections(plain) == 1 and "gate_up_proj" not in plain
    got = [plain.q_proj(x), plain.k_proj(x), plain.v_proj(x)]
    for a, b in zip(got, want):
        assert_close(a, b)
    # A new input is projected afresh; parts called out of order still match.
    y = mx.random.normal((3, 8))
    assert_close(plain.v_proj(y), y @ plain["qkv_proj"].weight[12:].T)


def test_fused_model_through_compiled_decode(tiny_model, oracle, fused_tiny, monkeypatch):
    """The parts run inside mx.compile's trace too (the CUDA default decode path, stood in
    for on the CPU)."""
    _, tokenizer = tiny_model
    prompts = _prompts(3, [50, 6, 21], fused_tiny.args.vocab_size, seed=22)
    engine = InProcessEngine(fused_tiny, compile_decode=True, overlap="ahead",
                             backend=StandInKernel())
    assert_greedy(engine, prompts, 20, _eos(tokenizer), oracle, ties_of=tiny_model[0])


def test_only_a_near_tie_excuses_different_tokens(tiny_model, oracle):
    """The tie allowance of the fused tests cannot hide a real difference: a token off
    mlx-lm's greedy pick by more than NEAR_TIE is reported."""
    from tests.oracle import divergence_off_a_tie

    model, tokenizer = tiny_model
    prompt = _prompts(1, [30], model.args.vocab_size, seed=40)[0]
    want = oracle(prompt, 8)
    assert divergence_off_a_tie(model, prompt, want, want, _eos(tokenizer)) is None
    wrong = want[:3] + [(want[3] + 1) % model.args.vocab_size] + want[4:]
    assert "at token 3" in divergence_off_a_tie(model, prompt, wrong, want, _eos(tokenizer))
    assert "at token 5" in divergence_off_a_tie(model, prompt, want[:5], want, _eos(tokenizer))


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_gated_deltanet_input_projections_fuse_and_keep_mlx_lm_tokens(name):
    """A Gated DeltaNet layer's input projections (Qwen3.5's qkv/z/b/a, Qwen3-Next's qkvz/ba)
    become one matmul, as served on the CUDA path (compiled decode, the kernels stood
    in for); batched and chunked, mlx-lm's greedy tokens from the unfused model."""
    from tests.families import build
    from tests.oracle import mlx_lm_tokens

    oracle_model, served = build(name), build(name)  # one seed: the same weights
    # Per layer: its input group and gate/up; Qwen3-Next's MoE layers also their experts'.
    assert fuse_projections(served) == (12 if name == "qwen3_next" else 8)
    linear = next(layer.linear_attn for layer in served.layers if hasattr(layer, "linear_attn"))
    assert {"in_proj_all", "in_proj_qkvzba"} & set(linear.children())
    prompts = _prompts(4, [33, 5, 60, 17], 512, seed=23)
    engine = InProcessEngine(served, chunk_size=16, compile_decode=True, overlap="ahead",
                             backend=StandInKernel())
    assert_greedy(engine, prompts, 16, [], lambda p, n: mlx_lm_tokens(oracle_model, p, n),
                  ties_of=oracle_model)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text"])
@pytest.mark.parametrize("quantized", [None, "affine", "mxfp4"])
def test_experts_gate_and_up_fuse_and_keep_mlx_lm_tokens(name, quantized):
    """A mixture of experts' gate and up projections (mlx-lm's SwitchGLU: SwitchLinear
    or QuantizedSwitchLinear, affine or MXFP4 (no biases), GPT-OSS's with biases) become
    one gather matmul, sorted
    tokens (prefill chunks of 32+ tokens) and unsorted (decode) alike; as served on the
    CUDA path (compiled decode, the kernels stood in for), batched and chunked, mlx-lm's
    greedy tokens from the unfused model."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

    from tests.families import build
    from tests.oracle import mlx_lm_tokens

    def make():
        model = build(name)
        if quantized:
            nn.quantize(model, group_size=32, bits=4, mode=quantized,
                        class_predicate=lambda _, m: isinstance(m, SwitchLinear))
        return model

    oracle_model, served = make(), make()  # one seed: the same weights
    fuse_projections(served)
    experts = [m for _, m in served.named_modules() if isinstance(m, SwitchGLU)]
    assert experts and all("gate_up_proj" in m for m in experts)
    kind = QuantizedSwitchLinear if quantized else SwitchLinear
    assert all(type(m.gate_up_proj) is kind for m in experts)
    prompts = _prompts(4, [33, 5, 60, 17], 512, seed=29)
    engine = InProcessEngine(served, chunk_size=48, compile_decode=True, overlap="ahead",
                             backend=StandInKernel())
    assert_greedy(engine, prompts, 12, [], lambda p, n: mlx_lm_tokens(oracle_model, p, n),
                  ties_of=oracle_model)

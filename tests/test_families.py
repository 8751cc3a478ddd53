"""Every attention kind mlx-lm serves, on tiny random float32 models of each family:
greedy tokens equal mlx-lm's, alone and batched with others, with chunked prefill across
the window's edge, prefix hits before and past the window, preemption and overlap."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from tests.engine_driver import InProcessEngine
from tests.families import FAMILIES, VOCAB, WINDOW, build
from tests.test_scheduler import assert_idle_invariant
from worker_proc.layer_kinds import Kind, UnsupportedModelError
from worker_proc.memory import probe_attention_specs

# What each family's layers must come out as (so a probe that loses a kind fails here).
EXPECTED_KINDS = {
    "llama_sliding": {Kind.FULL, Kind.SLIDING}, "gemma3_text": {Kind.FULL, Kind.SLIDING},
    "gpt_oss": {Kind.FULL, Kind.SLIDING}, "ministral3": {Kind.FULL, Kind.SLIDING},
    "olmo3": {Kind.FULL, Kind.SLIDING}, "cohere2": {Kind.FULL, Kind.SLIDING},
    "exaone4": {Kind.FULL, Kind.SLIDING}, "llama4_text": {Kind.FULL, Kind.CHUNKED},
}
OWN_SCORES = {"gemma2", "deepseek_v3"}  # the model computes attention scores itself
SINKS = {"gpt_oss"}
# Their own code mishandles rows of different lengths in one forward (a per-row mask
# broadcast against grouped heads; a chunk mask from one scalar offset).
BY_LENGTH = {"gemma2", "llama4_text"}


def mlx_lm_tokens(model, prompt: list[int], n: int) -> list[int]:
    """mlx_lm.generate's greedy tokens (its generate_step, no EOS: ids run to n)."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [3, 40, 70, 17, 1, 33]
    prompts = [rng.integers(5, VOCAB, size=n).tolist() for n in lengths]
    prompts[5][:24] = prompts[2][:24]  # a cached prefix longer than the window
    return prompts


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, build(request.param)


def test_layer_kinds_are_read_from_mlx_lm(family):
    name, model = family
    kinds = [s.kind for s in probe_attention_specs(model)]
    assert {k.kind for k in kinds} == EXPECTED_KINDS.get(name, {Kind.FULL})
    assert all(k.span == WINDOW for k in kinds if k.windowed)
    assert all(k.own_attention for k in kinds) == (name in OWN_SCORES)
    assert any(k.sinks for k in kinds) == (name in SINKS)


def test_only_models_that_cannot_batch_ragged_rows_run_rows_by_length(family):
    name, model = family
    assert InProcessEngine(model).runner.ragged == (name not in BY_LENGTH)


def test_batched_chunked_and_cached_equal_mlx_lm(family):
    name, model = family
    prompts = _prompts(seed=len(name))
    overlap = [False, True, "ahead"][len(name) % 3]
    engine = InProcessEngine(model, chunk_size=12, max_prefill_tokens=48, overlap=overlap)
    for i, p in enumerate(prompts[:5]):
        engine.submit(f"r{i}", p, 20, [])
    results = engine.run_until_idle()
    # Later: a hit on r2's prompt past the window, and r1's whole prompt again.
    engine.submit("hit", prompts[5], 20, [])
    engine.submit("again", prompts[1], 20, [])
    results = engine.run_until_idle()
    assert engine.scheduler.counters.cache_hit_tokens >= 24 + len(prompts[1]) - 1
    for rid, p in [*((f"r{i}", p) for i, p in enumerate(prompts[:5])),
                   ("hit", prompts[5]), ("again", prompts[1])]:
        assert results[rid].token_ids == mlx_lm_tokens(model, p, 20), f"{name} {rid}"
    assert_idle_invariant(engine.scheduler)


def test_alone_and_under_preemption_equal_mlx_lm(family):
    name, model = family
    prompts = _prompts(seed=100 + len(name))
    alone = InProcessEngine(model, chunk_size=16)
    alone.submit("x", prompts[2], 30, [])
    assert alone.run_until_idle()["x"].token_ids == mlx_lm_tokens(model, prompts[2], 30)
    tight = InProcessEngine(model, capacity=130, chunk_size=16, max_running=4)
    for i, p in enumerate(prompts[1:4]):
        tight.submit(f"r{i}", p, 30, [])
    results = tight.run_until_idle()
    assert tight.scheduler.counters.preemptions > 0
    for i, p in enumerate(prompts[1:4]):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(model, p, 30), f"{name} r{i}"
    assert_idle_invariant(tight.scheduler)


def test_a_4_bit_quantized_model_equals_mlx_lm():
    import mlx.nn as nn

    model = build("qwen3")
    nn.quantize(model, group_size=32, bits=4)
    prompts = _prompts(seed=7)
    engine = InProcessEngine(model, chunk_size=16)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 16, [])
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(model, p, 16)


@pytest.mark.parametrize("config,named", [
    (dict(model_type="mamba2", num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=64,
          intermediate_size=128, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
          conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
          time_step_limit=(0.0, float("inf")), time_step_rank=8), "ArraysCache"),
])
def test_a_recurrent_model_is_refused_naming_its_layer_kinds(config, named):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    with pytest.raises(UnsupportedModelError, match=rf"layers 0-1: {named}"):
        probe_attention_specs(model)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "llama_sliding"])
def test_the_kernel_path_reads_each_window(name):
    """The CUDA decode path (the kernel stood in for by its plain-MLX meaning) and its
    compiled trace: windowed layers hand it a slot table that starts at each row's
    window, sinks go to MLX's attention; mlx-lm's tokens."""
    from tests.engine_driver import StandInKernel

    model = build(name)
    prompts = _prompts(seed=200 + len(name))
    engine = InProcessEngine(model, chunk_size=16, compile_decode=True, overlap="ahead",
                             backend=StandInKernel())
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 24, [])
    results = engine.run_until_idle()
    assert engine.runner.decode_traces > 0
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(model, p, 24), f"{name} r{i}"

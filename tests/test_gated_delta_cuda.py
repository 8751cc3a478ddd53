"""The gated delta rule's CUDA kernel against mlx-lm's ops (GPU only; on the CPU the
routing is not installed and mlx-lm's own path runs), and kiln's normalize_qk against
mlx-lm's (anywhere)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta as mlx_lm_gated_delta

from worker_proc.gated_delta_cuda import gated_delta, install_gated_delta_kernel
from worker_proc.paged_attention import kernel_available


def test_nothing_is_routed_without_the_cuda_backend():
    if kernel_available():
        pytest.skip("MLX's CUDA backend is here")
    before = mlx_lm_gated_delta.gated_delta_ops
    assert install_gated_delta_kernel() is False
    assert mlx_lm_gated_delta.gated_delta_ops is before


@pytest.mark.skipif(not kernel_available(), reason="the kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_equals_mlx_lm_ops(dtype, masked):
    b, t, hk, hv, dk, dv = 3, 7, 2, 4, 64, 32
    mx.random.seed(0)
    q, k = (mx.random.normal((b, t, hk, dk)).astype(dtype) * 0.3 for _ in range(2))
    v = mx.random.normal((b, t, hv, dv)).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (b, t, hv))
    beta = mx.random.uniform(0.0, 1.0, (b, t, hv)).astype(dtype)
    state = mx.random.normal((b, hv, dv, dk)) * 0.1
    mask = (mx.arange(t)[None] < mx.array([7, 4, 1])[:, None]) if masked else None
    original = getattr(mlx_lm_gated_delta.gated_delta_ops, "__wrapped__",
                       mlx_lm_gated_delta.gated_delta_ops)
    want_y, want_state = original(q, k, v, g, beta, state, mask)
    got_y, got_state = gated_delta(q, k, v, g, beta, state, mask)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got_state, want_state, atol=tol, rtol=tol).item()
    real = mask[..., None, None] if masked else mx.array(True)
    diff = mx.where(real, mx.abs(got_y.astype(mx.float32) - want_y.astype(mx.float32)), 0)
    assert diff.max().item() <= tol * max(1.0, mx.abs(want_y).max().item())


@pytest.mark.skipif(not kernel_available(), reason="the kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("masked", [False, True])
def test_the_kernel_in_the_pool_equals_it_apart(masked):
    """The recurrence run on rows of the state array itself: the same outputs as over
    gathered rows, those rows updated in place, the others untouched."""
    from worker_proc.gated_delta_cuda import gated_delta_in_pool
    from worker_proc.pool_writes import after_write

    b, t, hk, hv, dk, dv = 3, 5, 2, 4, 64, 32
    mx.random.seed(1)
    q, k = (mx.random.normal((b, t, hk, dk)).astype(mx.bfloat16) * 0.3 for _ in range(2))
    v = mx.random.normal((b, t, hv, dv)).astype(mx.bfloat16)
    # Strided as the model's split conv output is: the kernel must not read it raw.
    v = mx.concatenate([v, v], axis=-1)[..., :dv]
    g = mx.random.uniform(0.5, 1.0, (b, t, hv))
    beta = mx.random.uniform(0.0, 1.0, (b, t, hv))
    pool = mx.random.normal((7, hv, dv, dk)) * 0.1
    before = pool * 1  # a copy, made before the pool is written
    rows = mx.array([5, 2, 6], dtype=mx.int32)
    mask = (mx.arange(t)[None] < mx.array([5, 3, 1])[:, None]) if masked else None
    want_y, want_state = gated_delta(q, k, v, g, beta, before[rows], mask)
    mx.eval(pool, before, want_y, want_state)
    got_y, mark = gated_delta_in_pool(q, k, v, g, beta, pool, rows, None, mask)
    after = pool[after_write(mx.arange(7), mark)]
    real = mask[..., None, None] if masked else mx.array(True)
    assert mx.array_equal(mx.where(real, got_y, 0), mx.where(real, want_y, 0)).item()
    assert mx.allclose(after[rows], want_state, atol=1e-6).item()
    others = mx.array([0, 1, 3, 4])
    assert mx.array_equal(after[others], before[others]).item()


@pytest.mark.skipif(not kernel_available(), reason="the in-place pool needs MLX's CUDA backend")
def test_state_rows_are_written_in_place_after_their_marks():
    from worker_proc.pool_writes import after_write, rows_write_in_place

    pool = mx.zeros((6, 3, 4))
    mx.eval(pool)
    value = mx.arange(2 * 12, dtype=mx.float32).reshape(2, 3, 4)
    rows = mx.array([4, 1], dtype=mx.int32)
    mark = rows_write_in_place(pool, rows, value)
    got = pool[after_write(rows, mark)]
    again = rows_write_in_place(pool, rows[:1], value[1:] * 2, after=mark)
    assert mx.array_equal(got, value).item()
    assert mx.array_equal(pool[after_write(mx.array([4, 0]), again)][0], value[1] * 2).item()


@pytest.mark.skipif(not kernel_available(), reason="the in-place pool needs MLX's CUDA backend")
@pytest.mark.parametrize("compile_decode", [False, True])
def test_a_hybrid_served_in_place_keeps_its_states_without_copies(compile_decode):
    """A qwen3_5 hybrid on the CUDA path, pipelined as served: its state rows are written
    in place (peak memory below half of one state array: a scatter copies its whole
    array), compiled decode traced and prefill forwards replayed (compiled case), and
    greedy tokens equal mlx-lm's."""
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.models import qwen3_5

    from tests.engine_driver import InProcessEngine
    from tests.families import _COMMON, RECURRENT_FAMILIES, VOCAB

    # tests.families' qwen3_5 with heads the kernels take (a multiple of 32 wide).
    config = {**_COMMON, **RECURRENT_FAMILIES["qwen3_5"]}
    config["text_config"] = {**config["text_config"], "head_dim": 32, "linear_key_head_dim": 32,
                             "linear_value_head_dim": 32}
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    install_gated_delta_kernel()

    def mlx_lm_tokens(prompt: list[int], n: int) -> list[int]:
        return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]

    # State rows for 1,024 requests: one state array alone is several times what a step
    # of four requests allocates, so a copy of any shows.
    engine = InProcessEngine(model, max_running=1024, compile_decode=compile_decode,
                             compile_prefill=compile_decode, overlap="ahead")
    assert engine.pool.in_place
    largest = max(a.nbytes for a in engine.pool.flat_states())
    rng = np.random.default_rng(9)
    prompts = [rng.integers(5, VOCAB, size=n).tolist() for n in (30, 7, 52, 19)]
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 20, [])
    results = engine.run_until_idle()
    # Alone, one after the other: the second's prefill forwards replay the first's shapes.
    for i, p in enumerate([prompts[2][::-1], prompts[2][1:] + prompts[2][:1]], start=len(prompts)):
        prompts.append(p)
        engine.submit(f"r{i}", p, 20, [])
        results.update(engine.run_until_idle())
    assert (engine.runner.prefill_forwards.replays > 0) == compile_decode
    over = mx.get_peak_memory() - before
    assert over < largest // 2, f"peak {over / 2**20:.1f} MiB over a {largest / 2**20:.1f} MiB state array"
    assert (engine.runner.decode_traces > 0) == compile_decode
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == mlx_lm_tokens(p, 20), f"r{i}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_normalize_qk_with_a_weight_of_ones_is_mlx_lm_s(dtype, monkeypatch):
    """kiln's normalize_qk (what linear-attention models call on CUDA) returns mlx-lm's
    values bit for bit, its norms given a weight (never MLX's own scalar 1), and routing
    points a model module's normalize_qk at it."""
    import importlib
    import sys

    from mlx_lm.models import gated_delta as module

    from worker_proc.gated_delta_cuda import normalize_qk, route_normalize_qk

    rng = np.random.default_rng(3)
    q, k = (mx.array(rng.standard_normal((2, 3, 4, 128)).astype(np.float32)).astype(dtype)
            for _ in range(2))
    want = module.normalize_qk(q, k, inv_scale=128 ** -0.5, eps=1e-6)
    weights = []
    plain = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm",
                        lambda x, w, eps: weights.append(w) or plain(x, w, eps))
    got = normalize_qk(q, k, inv_scale=128 ** -0.5, eps=1e-6)
    assert len(weights) == 2 and all(w is not None and w.shape == (128,) for w in weights)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and mx.array_equal(g, w).item()
    qwen3_next = importlib.import_module("mlx_lm.models.qwen3_next")
    for model_module in list(sys.modules.values()):  # each restored after the test
        if getattr(model_module, "normalize_qk", None) is module.normalize_qk:
            monkeypatch.setattr(model_module, "normalize_qk", module.normalize_qk)
    assert route_normalize_qk() >= 1 and qwen3_next.normalize_qk is normalize_qk
    assert module.normalize_qk is not normalize_qk  # mlx-lm's own module keeps its own

"""The gated delta rule's CUDA kernel against mlx-lm's ops (GPU only; on the CPU the
routing is not installed and mlx-lm's own path runs)."""

from __future__ import annotations

import mlx.core as mx
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

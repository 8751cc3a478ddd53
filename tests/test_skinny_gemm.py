"""The decode GEMM kernel (worker_proc/skinny_gemm.py): cuBLAS's products where it runs, and
the fast decode block's wiring to it (stood in for on the CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, assert_greedy, stand_in_kernel_path
from tests.test_worker import _eos, _prompts
from worker_proc import skinny_gemm

cuda_only = pytest.mark.skipif(not skinny_gemm.available(),
                               reason="the kernel needs MLX's CUDA backend")


@cuda_only
@pytest.mark.parametrize("rows", [1, 5, 16, 40, 64, 100, 128])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True)])
def test_kernel_matches_matmul(rows, bias, residual):
    rng = np.random.default_rng(rows)
    k, n = 512, 96

    def rand(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(mx.bfloat16)

    x, w = rand(rows, k), rand(n, k, scale=0.05)
    b, r = (rand(n) if bias else None), (rand(rows, n) if residual else None)
    want = x @ w.T
    if b is not None:
        want = mx.addmm(b, x, w.T)
    if r is not None:
        want = mx.addmm(r, x, w.T)
    got = skinny_gemm.gemm(x, w, bias=b, residual=r)
    scale = mx.abs(want.astype(mx.float32)).max().item()
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert got.shape == (rows, n) and got.dtype == mx.bfloat16
    assert err <= scale * 2 ** -7, (err, scale)
    # a decode input's [B, 1, K] shape, as the block passes it: the same rows
    shaped = skinny_gemm.gemm(x.reshape(rows, 1, k), w, bias=b,
                              residual=None if r is None else r.reshape(rows, 1, n))
    assert shaped.shape == (rows, 1, n) and mx.array_equal(shaped.reshape(rows, n), got).item()


def test_sizes_the_kernel_takes():
    assert skinny_gemm.fits(64, 4096, 6144) and skinny_gemm.fits(128, 14336, 4096)
    assert not skinny_gemm.fits(129, 4096, 4096)  # more than 8 row tiles
    assert not skinny_gemm.fits(64, 4000, 4096)  # K not a multiple of 32 x 4 warps
    assert not skinny_gemm.fits(64, 4096, 4100)  # N not a multiple of the warp's columns


@pytest.mark.parametrize("compile_decode", [False, True])
def test_fast_blocks_route_their_gemms_through_the_kernel(tiny_model, tiny_model_dir, oracle,
                                                          monkeypatch, compile_decode):
    """With the kernel on (stood in for on the CPU by the same math as mlx-lm's Linear and
    residual add), the fast block sends its four decode GEMMs to it, and the tokens are
    mlx-lm's."""
    import mlx_lm

    from worker_proc.decode_block import speed_up_decode_blocks
    from worker_proc.fused_projections import fuse_projections

    calls = []

    def stand_in(x, w, bias=None, residual=None):  # noqa: ANN001, ANN202
        calls.append((x.shape[0], residual is not None))
        out = x @ w.T if bias is None else mx.addmm(bias, x, w.T)
        return out if residual is None else residual + out

    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 128)
    monkeypatch.setattr(skinny_gemm, "DTYPES", (mx.float32,))
    monkeypatch.setattr(skinny_gemm, "available", lambda: True)
    monkeypatch.setattr(skinny_gemm, "fits", lambda m, k, n: True)  # the tiny model's sizes
    monkeypatch.setattr(skinny_gemm, "gemm", stand_in)
    stand_in_kernel_path(monkeypatch)
    _, tokenizer = tiny_model
    ours = mlx_lm.load(str(tiny_model_dir))[0]
    fuse_projections(ours)
    speed_up_decode_blocks(ours, residual_in_gemm=False)
    prompts = _prompts(4, [3, 70, 9, 40], ours.args.vocab_size, seed=41)
    engine = InProcessEngine(ours, chunk_size=64, compile_decode=compile_decode, overlap="ahead")
    assert_greedy(engine, prompts, 16, _eos(tokenizer), oracle)
    layers = len(ours.layers)
    assert calls and len(calls) % (4 * layers) == 0  # qkv, o, gate/up, down per layer
    assert sum(residual for _, residual in calls) * 2 == len(calls)

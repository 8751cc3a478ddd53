"""Decode attention over the pool: the split merge on the CPU, the CUDA kernel where it runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from worker_proc.paged_attention import (kernel_available, merge_splits, paged_decode_attention,
                                         reference_decode_attention)


def _case(batch=5, n_q=8, n_kv=2, dim=64, slots=3000, seed=0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, size=batch).astype(np.int32)
    table = np.zeros((batch, int(lengths.max())), dtype=np.int32)
    perm = rng.permutation(np.arange(1, slots))
    used = 0
    for b, n in enumerate(lengths):
        table[b, :n] = perm[used:used + n]
        used += n
    q = mx.array(rng.standard_normal((batch, n_q, 1, dim)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((slots, n_kv, dim)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((slots, n_kv, dim)).astype(np.float32)).astype(dtype)
    return q, k, v, mx.array(table), mx.array(lengths)


def test_merging_splits_equals_one_softmax():
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((3, 10)).astype(np.float32) * 3
    values = rng.standard_normal((10, 4)).astype(np.float32)
    exact = (np.exp(scores - scores.max(-1, keepdims=True))
             / np.exp(scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True)) @ values
    accs, mls = [], []
    for lo, hi in ((0, 4), (4, 10), (10, 10)):  # the last split is empty
        s = scores[:, lo:hi]
        m = s.max(-1) if hi > lo else np.full(3, -np.inf, np.float32)
        p = np.exp(s - m[:, None]) if hi > lo else np.zeros((3, 0), np.float32)
        accs.append(p @ values[lo:hi])
        mls.append(np.stack([m, p.sum(-1)], -1))
    acc = mx.array(np.stack(accs)[None])  # [1, S=3, G=3, D=4]: the 3 score rows are a head group
    ml = mx.array(np.stack(mls)[None])
    np.testing.assert_allclose(np.array(merge_splits(acc, ml))[0], exact, rtol=1e-5, atol=1e-5)


def test_a_single_split_is_just_normalised():
    rng = np.random.default_rng(2)
    acc = mx.array(rng.standard_normal((2, 1, 3, 4)).astype(np.float32))
    ml = mx.array(np.stack([rng.standard_normal((2, 1, 3)), rng.uniform(1, 2, (2, 1, 3))],
                           -1).astype(np.float32))
    np.testing.assert_allclose(np.array(merge_splits(acc, ml)),
                               np.array(acc)[:, 0] / np.array(ml)[:, 0, :, 1:], rtol=1e-6)


def test_reference_matches_per_row_attention():
    q, k, v, table, lengths = _case()
    out = reference_decode_attention(q, k, v, table, lengths, scale=0.125)
    for b in range(q.shape[0]):
        n = int(lengths[b])
        keys = k[table[b, :n]].transpose(1, 0, 2)[None]
        vals = v[table[b, :n]].transpose(1, 0, 2)[None]
        row = mx.fast.scaled_dot_product_attention(q[b:b + 1], keys, vals, scale=0.125)
        np.testing.assert_allclose(np.array(out[b:b + 1]), np.array(row), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("dtype,dim,n_q,n_kv", [(mx.bfloat16, 128, 32, 8), (mx.float16, 64, 8, 8),
                                                (mx.float32, 128, 16, 2)])
def test_cuda_kernel_matches_reference(dtype, dim, n_q, n_kv):
    q, k, v, table, lengths = _case(batch=9, n_q=n_q, n_kv=n_kv, dim=dim, dtype=dtype)
    got = paged_decode_attention(q, k, v, table, lengths, scale=dim ** -0.5)
    want = reference_decode_attention(q, k, v, table, lengths, scale=dim ** -0.5)
    tol = 2e-2 if dtype != mx.float32 else 1e-4
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tol, atol=tol)

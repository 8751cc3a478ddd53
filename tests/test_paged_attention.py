"""Decode attention over the pool: the plain-MLX fallback everywhere, the CUDA kernel where it runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.attention_cases import ragged_slot_table
from worker_proc.decode_backend import GatherDecode, KernelDecode
from worker_proc.paged_prefill import paged_prefill_attention, reference_paged_prefill_attention
from worker_proc.paged_attention import split_kv
from worker_proc.paged_attention import (DEFAULT_STAGES, kernel_available, LatentConfig,
                                         MAX_SPLIT_TOKENS, MIN_SPLIT_TOKENS, MmaConfig, num_splits,
                                         paged_decode_attention, paged_decode_write_attention,
                                         paged_latent_attention, reference_decode_attention,
                                         reference_latent_attention, tensor_cores_available)
from worker_proc.pool_writes import pool_write_in_place


def _case(batch=5, n_q=8, n_kv=2, dim=64, slots=3000, seed=0, dtype=mx.float32, lengths=None):
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = rng.integers(1, 700, size=batch)
    lengths = np.asarray(lengths, dtype=np.int32)
    batch = len(lengths)
    slots = max(slots, int(lengths.sum()) + 1)
    table = ragged_slot_table(lengths, slots, rng)
    q = mx.array(rng.standard_normal((batch, n_q, 1, dim)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((slots, n_kv, dim)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((slots, n_kv, dim)).astype(np.float32)).astype(dtype)
    kv = mx.concatenate([k, v], axis=-1)  # KVPool's layout: a head's keys, then its values
    return q, kv, mx.array(table), mx.array(lengths)


def test_reference_matches_per_row_attention():
    q, kv, table, lengths = _case()
    out = reference_decode_attention(q, kv, table, lengths, scale=0.125)
    k, v = kv[..., :q.shape[-1]], kv[..., q.shape[-1]:]
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
    q, kv, table, lengths = _case(batch=9, n_q=n_q, n_kv=n_kv, dim=dim, dtype=dtype)
    got = paged_decode_attention(q, kv, table, lengths, scale=dim ** -0.5)
    want = reference_decode_attention(q, kv, table, lengths, scale=dim ** -0.5)
    tol = 2e-2 if dtype != mx.float32 else 1e-4
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tol, atol=tol)


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("pool_dtype,kv_dtype,seq", [(mx.bfloat16, mx.bfloat16, 1),
                                                     (mx.bfloat16, mx.bfloat16, 7),
                                                     (mx.float16, mx.float32, 3)])
def test_in_place_pool_write_matches_a_scatter(pool_dtype, kv_dtype, seq):
    """The in-place write stores what KVPool's scatter stores, into the pool's own buffer,
    from keys and values in the model's (strided) layouts; a read that takes its mark sees
    the rows in the same evaluation."""
    from worker_proc.kv_pool import AttentionLayerSpec, KVPool

    rng = np.random.default_rng(4)
    b, h, d = 3, 4, 64
    spec = [AttentionLayerSpec(h, d, d, pool_dtype)]
    ours, theirs = KVPool(spec, 200, KernelDecode()), KVPool(spec, 200, GatherDecode())
    buffer = ours.layers[0]
    # Values as attention layers make them: [B, S, H, D] projections transposed (strided).
    keys = mx.array(rng.standard_normal((b, h, seq, d)).astype(np.float32)).astype(kv_dtype)
    values = mx.array(rng.standard_normal((b, seq, h, d)).astype(np.float32)).astype(
        kv_dtype).transpose(0, 2, 1, 3)
    slots = mx.array(rng.permutation(np.arange(1, 201))[:b * seq].astype(np.int32))
    for pool in (ours, theirs):
        pool.write(0, slots, keys, values)
    got_k, got_v = ours.read(0, slots.reshape(b, seq))
    want_k, want_v = theirs.read(0, slots.reshape(b, seq))
    mx.eval(got_k, got_v, *theirs.landing())
    assert ours.layers[0] is buffer
    np.testing.assert_array_equal(np.array(got_k.astype(mx.float32)), np.array(want_k.astype(mx.float32)))
    np.testing.assert_array_equal(np.array(got_v.astype(mx.float32)), np.array(want_v.astype(mx.float32)))
    np.testing.assert_array_equal(np.array(ours.layers[0].astype(mx.float32)),
                                  np.array(theirs.layers[0].astype(mx.float32)))


def test_splits_fill_the_gpu_within_their_bounds():
    assert num_splits(batch=1, n_kv=8, l_max=20) == 1  # too short to split
    one_row = num_splits(batch=1, n_kv=8, l_max=400)
    assert 1 < one_row <= 400 / MIN_SPLIT_TOKENS + 1  # a lone short row still spreads out
    assert num_splits(batch=128, n_kv=8, l_max=8192) == 8192 // MAX_SPLIT_TOKENS
    assert num_splits(batch=64, n_kv=8, l_max=512) == 1  # no merge for a full batch
    assert num_splits(batch=128, n_kv=8, l_max=100) == 1


@pytest.fixture(params=[{"stages": 0}, {"stages": 4}, {"stages": DEFAULT_STAGES},
                        {"mma": MmaConfig()}],
                ids=["register-prefetch", "staged-4", "staged", "mma"])
def kv_pipeline(request):
    """Every way the kernel brings K/V in (its `stages`: register prefetch, cp.async tiles
    four and the default number ahead, as many as fit) and the tensor-core kernel (where
    it serves the heads: 16-bit pools) give the reference's attention."""
    return request.param


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("lengths", [[1], [31], [400], [4096], [1, 4096, 33, 257],
                                     list(range(1, 640, 10))])
def test_cuda_kernel_every_split_shape(lengths, kv_pipeline):
    q, kv, table, ln = _case(n_q=32, n_kv=8, dim=128, dtype=mx.bfloat16, lengths=lengths)
    got = paged_decode_attention(q, kv, table, ln, scale=128 ** -0.5, **kv_pipeline)
    want = reference_decode_attention(q, kv, table, ln, scale=128 ** -0.5)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("lengths", [[1], [31], [400], [1, 4096, 33, 257], list(range(1, 640, 10))])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_cuda_kernel_attention_sinks(lengths, dtype, kv_pipeline):
    """GPT-OSS's sinks (a logit per query head in the softmax's denominator): the kernel
    as MLX's attention with sinks, also where one split would do."""
    q, kv, table, ln = _case(n_q=16, n_kv=2, dim=64, dtype=dtype, lengths=lengths, seed=11)
    sinks = mx.array(np.random.default_rng(12).normal(0.0, 3.0, 16).astype(np.float32)).astype(dtype)
    got = paged_decode_attention(q, kv, table, ln, scale=64 ** -0.5, sinks=sinks,
                                 **kv_pipeline)
    want = reference_decode_attention(q, kv, table, ln, scale=64 ** -0.5, sinks=sinks)
    tol = 2e-2 if dtype != mx.float32 else 1e-4
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tol, atol=tol)
    plain = reference_decode_attention(q, kv, table, ln, scale=64 ** -0.5)
    assert not np.allclose(np.array(plain.astype(mx.float32)), np.array(want.astype(mx.float32)),
                           atol=tol)  # the sinks matter at these values


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("lengths", [[1], [300], [1, 4096, 33, 257], list(range(1, 640, 10))])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cuda_write_attention_equals_a_write_then_attention(lengths, with_sinks, kv_pipeline):
    """The kernel that stores the step's K/V and attends in one launch leaves the pool as
    the separate in-place write does, bit for bit, and returns its attention's output, with
    the new values strided as a model's transposed projections are (one split and several;
    with GPT-OSS's sinks, which the write-and-attend launch serves too).
    The outputs may differ in the last bit: the compiler contracts multiply-adds into FMAs
    differently in the two kernels (seen: one bf16 ulp in a few elements)."""
    q, kv, table, ln = _case(n_q=32, n_kv=8, dim=128, dtype=mx.bfloat16, lengths=lengths, seed=7)
    rng = np.random.default_rng(8)
    b = q.shape[0]
    keys = mx.array(rng.standard_normal((b, 8, 1, 128)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.standard_normal((b, 1, 8, 128)).astype(np.float32)).astype(
        mx.bfloat16).transpose(0, 2, 1, 3)
    slots = table[mx.arange(b), ln - 1]
    sinks = (mx.array(rng.normal(0.0, 3.0, 32).astype(np.float32)).astype(mx.bfloat16)
             if with_sinks else None)
    separate, fused = kv + 0, kv + 0  # two pools of the same rows
    mx.eval(separate, fused)
    mark = pool_write_in_place(separate, slots, keys, values)
    want = paged_decode_attention(q, separate, table, ln, scale=128 ** -0.5, written=mark,
                                  sinks=sinks, **kv_pipeline)
    got, got_mark = paged_decode_write_attention(q, keys, values, slots, fused, table, ln,
                                                 scale=128 ** -0.5, sinks=sinks,
                                                 **kv_pipeline)
    mx.eval(want, got, got_mark)
    assert got_mark.tolist()[0] == 0  # the mark's first element, which the kernel writes
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2 ** -7, atol=1e-5)
    np.testing.assert_array_equal(np.array(fused.astype(mx.float32)),
                                  np.array(separate.astype(mx.float32)))



@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("warp_tiles", [False, True])
@pytest.mark.parametrize("n_q, n_kv, dim", [(16, 8, 256), (64, 8, 256), (32, 8, 128)])
@pytest.mark.parametrize("lengths", [[1, 4096, 33, 257, 16, 700], list(range(1, 1300, 10))],
                         ids=["6-rows", "130-rows"])
def test_cuda_core_kernel_wide_heads_and_warp_tiles(n_q, n_kv, dim, warp_tiles, lengths):
    """The CUDA-core kernel (256-wide heads take 32 lanes a token, 16 at 2 query heads a KV
    head over 130 rows x 8 KV heads: Gemma 3's 2, and 8 query heads a KV head),
    with its staged tiles copied by the block or a warp's slice each (warp_tiles, the
    default), at one split and several: the reference's attention, read-only and storing
    the step's K/V in the same launch."""
    q, kv, table, ln = _case(n_q=n_q, n_kv=n_kv, dim=dim, dtype=mx.bfloat16, lengths=lengths,
                             seed=dim + n_q)
    got = paged_decode_attention(q, kv, table, ln, scale=dim ** -0.5, warp_tiles=warp_tiles)
    want = reference_decode_attention(q, kv, table, ln, scale=dim ** -0.5)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)
    rng = np.random.default_rng(9)
    b = q.shape[0]
    keys, values = (mx.array(rng.standard_normal((b, n_kv, 1, dim)).astype(np.float32))
                    .astype(mx.bfloat16) for _ in range(2))
    slots = table[mx.arange(b), ln - 1]
    separate, fused = kv + 0, kv + 0
    mx.eval(separate, fused)
    mark = pool_write_in_place(separate, slots, keys, values)
    want = paged_decode_attention(q, separate, table, ln, scale=dim ** -0.5, written=mark,
                                  warp_tiles=warp_tiles)
    got, _ = paged_decode_write_attention(q, keys, values, slots, fused, table, ln,
                                          scale=dim ** -0.5, warp_tiles=warp_tiles)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2 ** -7, atol=1e-5)
    np.testing.assert_array_equal(np.array(fused.astype(mx.float32)),
                                  np.array(separate.astype(mx.float32)))


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("traditional,freqs", [(False, False), (True, False), (False, True)])
def test_cuda_qkv_attention_rotates_q_and_k_as_mx_fast_rope(traditional, freqs, kv_pipeline):
    """From a fused q/k/v projection's output, unrotated, the kernel stores the keys rotated
    as mx.fast.rope rotates them at each row's position (bit for bit, against RoPE and the
    separate in-place write) and attends with q rotated the same way, its output in the
    o projection's layout [B, 1, Hq * D]."""
    from worker_proc.paged_attention import RopeSpec, paged_decode_qkv_attention

    lengths = [1, 300, 33, 257]
    q, kv, table, ln = _case(n_q=32, n_kv=8, dim=128, dtype=mx.bfloat16, lengths=lengths, seed=9)
    b = q.shape[0]
    rng = np.random.default_rng(10)
    qkv = mx.array(rng.standard_normal((b, 1, (32 + 16) * 128)).astype(np.float32)).astype(
        mx.bfloat16)
    heads = qkv.reshape(b, 1, 48, 128).transpose(0, 2, 1, 3)  # [B, 48, 1, D], strided
    spec = RopeSpec(128, traditional, None if freqs else 500000.0, 1.0 if freqs else 0.5,
                    mx.array(np.geomspace(1.0, 4e5, 64).astype(np.float32)) if freqs else None)
    slots = table[mx.arange(b), ln - 1]
    separate, fused = kv + 0, kv + 0
    mx.eval(separate, fused)
    q_rot, keys_rot = (spec.apply(x, ln - 1) for x in (heads[:, :32], heads[:, 32:40]))
    mark = pool_write_in_place(separate, slots, keys_rot, heads[:, 40:])
    want = paged_decode_attention(q_rot, separate, table, ln, scale=128 ** -0.5, written=mark,
                                  **kv_pipeline)
    got, _ = paged_decode_qkv_attention(qkv, 32, spec, slots, fused, table, ln, scale=128 ** -0.5,
                                        **kv_pipeline)
    mx.eval(want, got)
    assert got.shape == (b, 1, 32 * 128)
    np.testing.assert_array_equal(np.array(fused.astype(mx.float32)),
                                  np.array(separate.astype(mx.float32)))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.transpose(0, 2, 1, 3).reshape(b, 1, -1).astype(mx.float32)),
                               rtol=2 ** -7, atol=1e-5)


def test_dense_decode_context_tracks_the_pool_across_steps():
    """Kept blocks (appended to, rebuilt when the batch changes or outgrows them) give the
    gather path's attention at every step."""
    from worker_proc.attention import DenseDecodeContext
    from worker_proc.kv_pool import AttentionLayerSpec, KVPool

    rng = np.random.default_rng(3)
    n_kv, dim, n_q = 2, 16, 4
    pool = KVPool([AttentionLayerSpec(n_kv, dim, dim, mx.float32)], num_slots=4000)
    free = iter(rng.permutation(np.arange(1, 4001)).tolist())
    contexts = {r: [next(free) for _ in range(int(n))] for r, n in zip(range(5), (3, 60, 61, 1, 30))}
    for slots in contexts.values():  # the prompts' K/V
        kv = mx.array(rng.standard_normal((1, n_kv, len(slots), dim)).astype(np.float32))
        pool.write(0, mx.array(slots), kv, kv * 0.5)
    dense = DenseDecodeContext(num_layers=1, budget_bytes=1 << 30,
                               bytes_per_token=KVPool.bytes_per_slot(pool.specs))
    batches = [(0, 1, 2)] * 6 + [(0, 2)] * 3 + [(4, 3, 0)] * 4  # a leaver, then a new mix
    rebuilds = extensions = 0
    for step, rows in enumerate(batches):
        for r in rows:
            contexts[r].append(next(free))
        lengths = np.array([len(contexts[r]) for r in rows])
        table = np.zeros((len(rows), lengths.max()), dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, :lengths[i]] = contexts[r]
        dense.plan(rows, lengths)
        rebuilds += dense._rebuild
        extensions += bool(dense._extend_by) and not dense._rebuild
        new_k = mx.array(rng.standard_normal((len(rows), n_kv, 1, dim)).astype(np.float32))
        write = mx.array(table[np.arange(len(rows)), lengths - 1])
        pool.write(0, write, new_k, new_k * 0.5)
        dense.update(0, pool, mx.array(table), new_k, new_k * 0.5)
        q = mx.array(rng.standard_normal((len(rows), n_q, 1, dim)).astype(np.float32))
        want = reference_decode_attention(q, pool.layers[0], mx.array(table),
                                          mx.array(lengths.astype(np.int32)), scale=0.25)
        np.testing.assert_allclose(np.array(dense.attention(0, q, 0.25)), np.array(want),
                                   rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
    # Rebuilt at the first step, for the leaver and for the new mix; row 2 crossing 64
    # tokens extends the blocks instead; every other step only appends.
    assert rebuilds == 3 and extensions >= 1


def test_dense_decode_context_over_budget_falls_back_to_gathering(tiny_model, oracle):
    """A decode batch whose kept contexts would exceed the budget is served by the
    per-layer gather (no blocks held), with the same tokens."""
    from tests.engine_driver import InProcessEngine

    model, tokenizer = tiny_model
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, model.args.vocab_size, size=n).tolist() for n in (30, 70, 9)]
    engine = InProcessEngine(model)
    dense = engine.runner._dense_decode
    dense._budget = 0  # nothing fits
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 12, sorted(tokenizer.eos_token_ids))
    results = engine.run_until_idle()
    assert not dense.active and all(k is None for k in dense._keys)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == oracle(p, 12)


def test_dense_decode_blocks_are_dropped_with_the_last_request(tiny_model):
    from ipc.messages.to_worker import ForwardBatch
    from tests.engine_driver import InProcessEngine

    model, tokenizer = tiny_model
    engine = InProcessEngine(model)
    dense = engine.runner._dense_decode
    engine.submit("a", [7, 8, 9, 10], 5, [])
    engine.run_until_idle()
    assert dense.active and dense._keys[0] is not None  # kept for a next decode step
    # The scheduler's next plan carries the release (the worker is never told sooner).
    engine.runner.run(ForwardBatch(step=10_000, released=list(engine.runner.requests)))
    assert not dense.active and all(k is None for k in dense._keys)


def test_batched_prefill_layout_masks():
    from worker_proc.attention import ForwardLayout

    table = np.arange(1, 41, dtype=np.int32).reshape(2, 20)
    same = ForwardLayout.prefill(table, np.array([4, 4]), np.array([3, 5]))
    assert same.mask == "causal" and same.offset == 4  # the fused path
    # Row 0's padded positions write to slot 0; real ones to their own slots.
    assert np.array(same.write_slots).tolist() == [5, 6, 7, 0, 0, 25, 26, 27, 28, 29]
    assert np.array(same.read_slots).tolist()[0] == [1, 2, 3, 4, 5, 6, 7, 0, 0]
    mixed = ForwardLayout.prefill(table, np.array([0, 2]), np.array([2, 2]))
    mask = np.array(mixed.mask)[:, 0]
    assert mask[0].tolist() == [[True, False, False, False], [True, True, False, False]]
    assert mask[1].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert np.array(mixed.offset).tolist() == [0, 2]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("mask_kind", ["causal", "array", None, "scores", "head scores"])
def test_unfused_prefill_attention_matches_fused(mask_kind, dtype):
    """The CUDA backend's prefill attention (plain matmuls) means what MLX's fused one does:
    grouped heads, causal aligned to the keys' end, boolean masks, float masks added to
    the scores (one for every head, or one a query head: MLA's RoPE part)."""
    from worker_proc.prefill_attention import unfused_prefill_attention

    rng = np.random.default_rng(7)
    b, n_q, n_kv, s, length, d = (3, 8, 2, 5, 12, 16) if dtype == mx.float32 else (2, 32, 8, 40, 96, 128)
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
               for shape in ((b, n_q, s, d), (b, n_kv, length, d), (b, n_kv, length, d)))
    # Random holes, but every query may see its own position: no row fully masked.
    holes = mx.array(rng.random((b, 1, s, length)) < 0.7) | mx.eye(s, length, k=length - s, dtype=mx.bool_)
    scores = mx.where(holes, mx.array(rng.standard_normal((b, n_q, s, length)).astype(np.float32)),
                      mx.array(mx.finfo(mx.float32).min))
    mask = {"causal": "causal", None: None, "array": holes, "scores": scores[:, :1],
            "head scores": scores}[mask_kind]
    got = unfused_prefill_attention(q, k, v, 0.25, mask).astype(mx.float32)
    # Against float32 math: the bf16 output is within rounding of it.
    q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)


def test_unfused_prefill_attention_honours_sinks():
    """GPT-OSS's sinks on the matmul prefill path: each head's sink logit in its softmax's
    denominator, as MLX's fused attention takes them, causal and with a window mask."""
    from worker_proc.prefill_attention import unfused_prefill_attention

    rng = np.random.default_rng(11)
    b, n_q, n_kv, s, length, d = 2, 8, 2, 6, 14, 16
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((b, n_q, s, d), (b, n_kv, length, d), (b, n_kv, length, d)))
    sinks = mx.array(rng.standard_normal(n_q).astype(np.float32) * 3)
    window = mx.array(np.tril(np.ones((s, length), bool), k=length - s)
                      & ~np.tril(np.ones((s, length), bool), k=length - s - 4))
    for mask in ("causal", window):
        got = unfused_prefill_attention(q, k, v, 0.3, mask, sinks)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=sinks)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


# (1024, 1024): whole buckets after a prefix of several, no padding (the 2048-token chunk
# after 2048 takes the same path, at four times the scores).
@pytest.mark.parametrize("n_new,prefix", [(512, 0), (700, 1024), (1024, 1024), (1500, 0),
                                            (37, 1024)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_bucketed_fused_attention_is_the_unpadded_attention(n_new, prefix, with_sinks):
    """Padding queries and keys at the end to a bucket changes no real query's output:
    causal from the keys' end keeps every padded key after it."""
    from worker_proc.prefill_attention import bucketed_fused_attention, fused_bucket_padding

    rng = np.random.default_rng(n_new + prefix)
    n_q, n_kv, d = 4, 2, 32
    length = prefix + n_new
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((1, n_q, n_new, d), (1, n_kv, length, d), (1, n_kv, length, d)))
    sinks = mx.array(rng.standard_normal(n_q).astype(np.float32)) if with_sinks else None
    pad = fused_bucket_padding(n_new, length, "causal", bucket=512)
    assert pad == -n_new % 512
    got = bucketed_fused_attention(q, k, v, 0.2, pad, sinks)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal", sinks=sinks)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_new,length,rows", [(300, 700, 3), (512, 1024, 1), (260, 260, 2)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_bucketed_masked_attention_is_the_unpadded_attention(n_new, length, rows, with_sinks):
    """Under a boolean mask (rows causal from their own starts, a window), padding queries
    and keys to a bucket changes no real query's output."""
    from worker_proc.prefill_attention import bucketed_masked_attention, masked_bias

    rng = np.random.default_rng(n_new + length + rows)
    n_q, n_kv, d = 4, 2, 16
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((rows, n_q, n_new, d), (rows, n_kv, length, d), (rows, n_kv, length, d)))
    sinks = mx.array(rng.standard_normal(n_q).astype(np.float32)) if with_sinks else None
    starts = rng.integers(0, length - n_new + 1, size=rows)
    pos = starts[:, None] + np.arange(n_new)[None]  # each row's query positions
    keys = np.arange(length)[None, None]
    mask = mx.array(((keys <= pos[:, :, None]) & (keys > pos[:, :, None] - 100))[:, None])
    got = bucketed_masked_attention(q, k, v, 0.3, masked_bias(mask, q.dtype, bucket=256), sinks)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=sinks)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_masked_keys_pad_to_few_sizes_and_at_most_a_bucket_or_a_quarter_more():
    from worker_proc.prefill_attention import key_bucket

    assert [key_bucket(n) for n in (1, 512, 513, 4096, 4097, 5121, 8192, 8193)] == [
        512, 512, 1024, 4096, 5120, 6144, 8192, 10240]
    sizes = {key_bucket(n) for n in range(1, 131073, 37)}
    assert len(sizes) <= 30 and all(s % 512 == 0 for s in sizes)
    assert all(n <= key_bucket(n) < n + max(512, n / 4) for n in range(1, 131073, 37))


def test_masked_bias_is_bounded():
    from worker_proc.prefill_attention import masked_bias_fits

    assert masked_bias_fits(1, 512, 131072)  # mixed traffic's chunk deep in 128k: 128 MiB
    assert not masked_bias_fits(1, 4096, 131072)  # a long chunk there: 1 GiB a layer
    assert masked_bias_fits(8, 300, 8000) and not masked_bias_fits(8, 2048, 16384)


def test_fused_bucket_padding_takes_long_causal_chunks_at_bucket_offsets():
    from worker_proc.prefill_attention import fused_bucket_padding

    assert fused_bucket_padding(2048, 4096, "causal") == 0
    assert fused_bucket_padding(1900, 2048 + 1900, "causal") == 148
    assert fused_bucket_padding(300, 300, "causal") is None  # short and fresh: unfused
    assert fused_bucket_padding(300, 4096 + 300, "causal") == 212  # a long prompt's tail
    assert fused_bucket_padding(1024, 1024 + 700, "causal") is None  # a prefix hit's length
    assert fused_bucket_padding(2048, 2048, mx.ones((2048, 2048), dtype=mx.bool_)) is None
    assert fused_bucket_padding(2048, 2048, None) is None


def test_pooled_forward_matches_mlx_lm_cache():
    """The model over the pool, as the runner drives it (prompts prefilled alone and
    together, then ragged decode steps), gives mlx-lm's own KVCache forward's logits.
    On the CUDA backend this is the paged kernel and the matmul prefill attention inside
    a real model; elsewhere the kept decode contexts."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    from worker_proc.attention import ForwardLayout, build_layer_caches, install_attention_hook
    from worker_proc.kv_pool import KVPool
    from worker_proc.memory import probe_attention_specs

    mx.random.seed(11)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        head_dim=32))
    mx.eval(model.parameters())
    install_attention_hook()
    specs = probe_attention_specs(model)
    pool = KVPool(specs, num_slots=400)
    dense = pool.backend.decode_context(len(specs), 1 << 31, KVPool.bytes_per_slot(specs))
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (7, 19, 19, 3)]
    table = np.zeros((len(prompts), 64), dtype=np.int32)
    free = iter(range(1, 401))
    for row, p in enumerate(prompts):
        table[row, :len(p) + 4] = [next(free) for _ in range(len(p) + 4)]
    theirs = [[KVCache() for _ in model.layers] for _ in prompts]

    def check(ours: mx.array, row: int, tokens: list[int]) -> None:
        want = model(mx.array([tokens]), cache=theirs[row])[0, -1]
        np.testing.assert_allclose(np.array(ours), np.array(want), rtol=2e-4, atol=2e-4)

    # Prompt 0 alone; prompts 1-3 in one forward (two of one length, one shorter).
    out = model(mx.array([prompts[0]]),
                cache=build_layer_caches(pool, ForwardLayout.single(table[0], 0, len(prompts[0]))))
    check(out[0, -1], 0, prompts[0])
    sizes = np.array([len(p) for p in prompts[1:]])
    tokens = np.zeros((3, sizes.max()), dtype=np.int32)
    for i, p in enumerate(prompts[1:]):
        tokens[i, :len(p)] = p
    layout = ForwardLayout.prefill(table[1:], np.zeros(3, dtype=np.int64), sizes)
    out = model(mx.array(tokens), cache=build_layer_caches(pool, layout))
    for i in range(3):
        check(out[i, sizes[i] - 1], i + 1, prompts[i + 1])
    # Three decode steps, every row at its own length.
    lengths = np.array([len(p) for p in prompts])
    for step in range(3):
        nxt = [int(rng.integers(0, 256)) for _ in prompts]
        lengths = lengths + 1
        if dense is not None:
            dense.plan(tuple(range(len(prompts))), lengths)
        layout = ForwardLayout.decode(table, lengths, dense)
        out = model(mx.array(nxt)[:, None], cache=build_layer_caches(pool, layout))
        for row in range(len(prompts)):
            check(out[row, -1], row, [nxt[row]])


def test_unfused_prefill_is_bounded_in_memory():
    """Prefill attention as matmuls materialises [B, H, S, L] float32 scores: a long chunk
    deep into a long context takes the fused path instead."""
    from worker_proc.prefill_attention import unfused_prefill_fits, UNFUSED_SCORES_MAX_BYTES

    assert unfused_prefill_fits((64, 32, 130, 128), 130)  # a burst of 100-word prompts
    assert unfused_prefill_fits((1, 32, 2048, 128), 2048)  # one full chunk
    assert not unfused_prefill_fits((1, 32, 2048, 128), 32768)  # 8 GiB of scores
    assert not unfused_prefill_fits((1, 32, 2048, 128), 4096, copies=2)  # + a float mask
    assert 1 * 32 * 2048 * 4096 * 4 <= UNFUSED_SCORES_MAX_BYTES


def test_unfused_prefill_only_where_cudnn_would_build_per_shape():
    """Only heads that MLX's fused attention hands to cuDNN (bf16/fp16, at most 128 wide)
    take the matmul path; 256-wide heads (Qwen3.5) and float32 keep MLX's fused call."""
    from worker_proc.prefill_attention import fused_builds_per_shape

    assert fused_builds_per_shape(mx.bfloat16, 128, 128)
    assert fused_builds_per_shape(mx.float16, 64, 64)
    assert not fused_builds_per_shape(mx.bfloat16, 256, 256)
    assert not fused_builds_per_shape(mx.bfloat16, 192, 128)  # MLA's q/k heads
    assert not fused_builds_per_shape(mx.float32, 128, 128)


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("stage_kib, stages, warps", [(64, 2, 4), (96, 3, 8), (128, 2, 8)])
@pytest.mark.parametrize("n_q, n_kv, dim", [(32, 8, 128), (16, 8, 256), (64, 8, 64)])
def test_cuda_tensor_core_kernel_with_dynamic_tiles(n_q, n_kv, dim, stage_kib, stages, warps):
    """The tensor-core kernel's tiles in dynamic shared memory (past the static 48 KiB;
    more stages and warps), read-only and write-and-attend: the reference's attention."""
    mma = MmaConfig(stage_bytes=stage_kib * 1024, stages=stages, warps=warps)
    if not mma.fits(mx.bfloat16, mx.bfloat16, dim, n_q // n_kv):
        pytest.skip("does not fit these heads")
    q, kv, table, ln = _case(n_q=n_q, n_kv=n_kv, dim=dim, dtype=mx.bfloat16, seed=dim + stages,
                             lengths=[1, 4096, 33, 257, 16, 700])
    got = paged_decode_attention(q, kv, table, ln, scale=dim ** -0.5, mma=mma)
    want = reference_decode_attention(q, kv, table, ln, scale=dim ** -0.5)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)
    slots = table[mx.arange(q.shape[0]), ln - 1]
    new = kv[slots][:, :, None]  # [B, Hkv, 1, 2D]: the rows already there, written again
    out, _ = paged_decode_write_attention(q, new[..., :dim], new[..., dim:], slots, kv + 0,
                                          table, ln, scale=dim ** -0.5, mma=mma)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("direct, sinks", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("write_new, fused", [(False, False), (True, False), (True, True)])
def test_every_kernel_source_has_its_parts_filled_in(direct, sinks, write_new, fused, staged):
    """The CUDA sources are assembled from named parts on any machine; one left unfilled
    would only fail at NVRTC compile time on a GPU."""
    import re

    from worker_proc import paged_attention as pa

    source = pa._source(direct, write_new, fused, staged, sinks)
    assert ("sinks[" in source) == sinks
    left = set(re.findall(r"\b(PROLOGUE|LENGTH|ROW_SLOTS|SLOT_AT|Q_LOAD|NEW_TOKEN|SKIP_NEW"
                          r"|PIPE_SETUP|PIPE_FETCH|PIPE_NEXT|WRITE)\b", source))
    assert not left
    # The template arguments _attend passes are the ones the body uses.
    for name in ("LANES", "PASSES", "CHUNK_MAX", "D", "G", "HKV"):
        assert re.search(rf"\b{name}\b", source), name
    assert ("kiln_rope<" in source) == fused
    assert ("out_ml" in source) == (not direct)
    assert ("kiln_cp_async16" in source) == staged and ("STAGES" in source) == staged


@pytest.mark.parametrize("direct, sinks", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("write_new, fused", [(False, False), (True, False), (True, True)])
def test_every_tensor_core_kernel_source_has_its_parts_filled_in(direct, sinks, write_new, fused):
    import re

    from worker_proc import paged_attention as pa

    source = pa._mma_source(direct, write_new, fused, sinks)
    assert ("sinks[" in source) == sinks
    left = set(re.findall(r"\b(PROLOGUE|LENGTH|ROW_SLOTS|SLOT_AT|Q_LOAD|NEW_COPY|WRITE)\b", source))
    assert not left
    for name in ("TOKEN_WARPS", "COLUMN_WARPS", "STAGES", "CHUNK_MAX", "D", "G", "HKV"):
        assert re.search(rf"\b{name}\b", source), name
    assert ("kiln_rope<" in source) == fused
    assert ("sm_new" in source) == write_new  # the step's token never read from the pool
    assert ("out_ml" in source) == (not direct)


def test_tensor_core_kernel_takes_16_bit_heads_a_fragment_holds():
    from worker_proc.paged_attention import MmaLayout

    mma = MmaConfig()
    # Warps over tokens as their tiles fit, over columns to four (whole ldmatrix pairs).
    assert [mma.layout(d) for d in (64, 96, 128, 256, 512)] == [
        MmaLayout(4, 1, 2), MmaLayout(2, 2, 2), MmaLayout(2, 2, 2), MmaLayout(1, 4, 2), None]
    assert mma.layout(32) == MmaLayout(4, 1, 2)
    for dim, group in [(128, 4), (128, 8), (128, 16), (64, 8), (256, 2), (96, 12), (128, 1)]:
        assert mma.fits(mx.bfloat16, mx.bfloat16, dim, group), (dim, group)
    assert mma.fits(mx.float16, mx.float16, 128, 4)
    assert not mma.fits(mx.float32, mx.float32, 128, 4)  # fp32 pools: the CUDA-core kernel
    assert not mma.fits(mx.float32, mx.bfloat16, 128, 4)  # q must be the pool's dtype
    assert not mma.fits(mx.bfloat16, mx.bfloat16, 80, 4)  # head sizes: multiples of 32
    assert not mma.fits(mx.bfloat16, mx.bfloat16, 128, 32)  # more rows than a fragment's
    assert not mma.fits(mx.bfloat16, mx.bfloat16, 512, 16)  # MLA's latent: no room


def test_tensor_core_tiles_past_static_shared_memory_go_dynamic():
    """Wider tiles hold more token warps; where the tiles and the rest pass a block's
    static 48 KiB they take the launch's dynamic shared memory (the default's 32 KiB stays
    static: the measured kernel)."""
    from worker_proc import paged_attention as pa

    assert all(MmaConfig().dynamic_bytes(d, 4) == 0 for d in (64, 96, 128, 256))
    assert "extern __shared__" not in pa._mma_source(True, False)
    wide = pa.MMA_WIDE_TILES  # --experiments mma-wide-tiles
    assert wide.layout(128) == pa.MmaLayout(4, 1, 2) and wide.layout(256) == pa.MmaLayout(2, 2, 2)
    assert wide.dynamic_bytes(128, 4) == wide.dynamic_bytes(256, 2) == 64 * 1024
    assert wide.fits(mx.bfloat16, mx.bfloat16, 256, 2)
    source = pa._mma_source(True, True, True, False, dynamic=True)
    assert "extern __shared__" in source and "STAGE_DECL" not in source
    huge = MmaConfig(stage_bytes=256 * 1024, stages=4, warps=8)  # 8 warps x 4 stages of 16
    assert huge.layout(128) == pa.MmaLayout(8, 1, 4)  # rows: past a block's opt-in limit
    assert not huge.fits(mx.bfloat16, mx.bfloat16, 128, 4)
    assert not MmaConfig(stages=1).fits(mx.bfloat16, mx.bfloat16, 128, 4)


def _recording(calls: list, **fields):
    """A stand-in for a custom kernel's call (MLX's mx.fast.cuda_kernel object): records
    `fields` with the launch's template, grid, threads and output shapes in `calls` and
    returns zero outputs of those shapes."""
    def launch(inputs, output_shapes, output_dtypes, grid, threadgroup, template=()):
        calls.append(dict(fields, template=dict(template), grid=grid, threads=threadgroup[0],
                          shapes=output_shapes))
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
    return launch


def test_launches_pick_the_kernel_body_its_template_and_threads(monkeypatch):
    """On any machine, with the kernels replaced by recorders: mma takes the tensor-core
    body at its layout's threads and template where it serves the heads (16-bit), the
    CUDA-core staged body otherwise (fp32); one split writes directly (sinks there),
    several go through the merge."""
    from worker_proc import paged_attention as pa

    launches, merged = [], []

    def recorder(direct, write_new=False, fused=False, staged=False, sinks=False, mma=False,
                 dynamic_bytes=0, warp_tiles=False):
        return _recording(launches, direct=direct, staged=staged, sinks=sinks, mma=mma,
                          dynamic=dynamic_bytes, warp_tiles=warp_tiles)

    monkeypatch.setattr(pa, "_kernel", recorder)
    monkeypatch.setattr(pa, "_merge_kernel", lambda sinks=False: _recording(merged, sinks=sinks))
    q = mx.zeros((2, 32, 1, 128), dtype=mx.bfloat16)
    pool = mx.zeros((100, 8, 256), dtype=mx.bfloat16)
    table, lengths = mx.zeros((2, 50), dtype=mx.int32), mx.array([3, 50], dtype=mx.int32)
    assert pa.paged_decode_attention(q, pool, table, lengths, 0.1, mma=MmaConfig()).shape == q.shape
    last = launches[-1]
    assert last["mma"] and not last["staged"] and last["threads"] == 128  # 2 x 2 warps
    assert (last["template"]["TOKEN_WARPS"], last["template"]["COLUMN_WARPS"]) == (2, 2)
    assert last["grid"] == (2 * 128, 8, 2)
    assert [m["sinks"] for m in merged] == [False]  # two splits, merged
    pa.paged_decode_attention(q.astype(mx.float32), pool.astype(mx.float32), table, lengths,
                              0.1, mma=MmaConfig())
    last = launches[-1]
    assert not last["mma"] and last["staged"] and last["threads"] == 128
    assert "TOKEN_WARPS" not in last["template"] and last["template"]["LANES"] == pa.LANES_PER_TOKEN
    sinks = mx.zeros((32,), dtype=mx.bfloat16)
    full = mx.zeros((64, 8), dtype=mx.int32)
    pa.paged_decode_attention(mx.zeros((64, 32, 1, 128), dtype=mx.bfloat16), pool, full,
                              mx.full((64,), 8, dtype=mx.int32), 0.1, sinks=sinks, mma=MmaConfig())
    assert launches[-1]["direct"] and launches[-1]["sinks"] and launches[-1]["mma"]
    assert launches[-1]["dynamic"] == 0
    pa.paged_decode_attention(q, pool, table, lengths, 0.1, mma=pa.MMA_WIDE_TILES)
    assert launches[-1]["dynamic"] == 64 * 1024 and launches[-1]["template"]["TOKEN_WARPS"] == 4
    # 256-wide heads (Gemma's: CUDA cores by default) take 32 lanes a token, 8 tiles of
    # 4 tokens, each warp copying its own tokens' rows unless the block is asked to.
    wide = mx.zeros((2, 16, 1, 256), dtype=mx.bfloat16)
    wide_pool = mx.zeros((100, 8, 512), dtype=mx.bfloat16)
    pa.paged_decode_attention(wide, wide_pool, table, lengths, 0.1)
    assert launches[-1]["template"]["LANES"] == 32 and launches[-1]["template"]["STAGES"] == 8
    assert launches[-1]["warp_tiles"]
    pa.paged_decode_attention(wide, wide_pool, table, lengths, 0.1, warp_tiles=False)
    assert not launches[-1]["warp_tiles"] and launches[-1]["template"]["LANES"] == 32
    # ... but at 2 query heads a KV head over more than WIDE_HEAD_MAX_ROW_HEADS rows x KV
    # heads (128 x 8) 16 lanes a token (faster there on the H200), with the 4 tiles that
    # fit them.
    rows = mx.zeros((128, 16, 1, 256), dtype=mx.bfloat16)
    pa.paged_decode_attention(rows, wide_pool, mx.zeros((128, 50), dtype=mx.int32),
                              mx.full((128,), 50, dtype=mx.int32), 0.1)
    assert launches[-1]["grid"] == (128, 8, 128)
    assert (launches[-1]["template"]["LANES"], launches[-1]["template"]["STAGES"]) == (16, 4)
    assert pa.lanes_per_token(256, 8, 1024) == pa.lanes_per_token(512, 2, 1024) == 32
    assert pa.lanes_per_token(256, 2, 512) == 32 and pa.lanes_per_token(128, 2, 8) == 16


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("n_q, n_kv, dim, dtype", [
    (32, 8, 128, mx.bfloat16), (16, 1, 128, mx.bfloat16), (64, 8, 128, mx.bfloat16),
    (16, 8, 256, mx.bfloat16), (64, 8, 64, mx.bfloat16), (12, 12, 64, mx.bfloat16),
    (24, 2, 96, mx.float16), (32, 8, 128, mx.float16)])
def test_cuda_tensor_core_kernel_head_shapes(n_q, n_kv, dim, dtype):
    """The tensor-core kernel at every query-head group a fragment holds (1 to 16: the
    upper rows too), head sizes 64 to 256, bf16 and fp16, one split and several."""
    assert MmaConfig().fits(dtype, dtype, dim, n_q // n_kv)
    q, kv, table, ln = _case(n_q=n_q, n_kv=n_kv, dim=dim, dtype=dtype, seed=dim + n_q,
                             lengths=[1, 4096, 33, 257, 16, 17, 700])
    got = paged_decode_attention(q, kv, table, ln, scale=dim ** -0.5, mma=MmaConfig())
    want = reference_decode_attention(q, kv, table, ln, scale=dim ** -0.5)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)
    one = paged_decode_attention(q[:1], kv, table[:1], ln[:1], scale=dim ** -0.5, mma=MmaConfig())
    np.testing.assert_allclose(np.array(one.astype(mx.float32)),
                               np.array(want[:1].astype(mx.float32)), rtol=2e-2, atol=2e-2)


def test_kernel_sources_compile_with_nvcc_and_do_not_spill():
    """Where a CUDA toolkit is installed (no GPU needed), every decode kernel variant (both
    K/V pipelines, the float32 pool of the CUDA tests too), the merge kernel and the q/k
    norm and RoPE kernel (Gemma's heads, a part-warp's), the sandwich-norm kernel and the
    readback ring's copy compile as MLX's NVRTC would compile them, keep their arrays in
    registers (no spill stores) and use at most 128 registers a thread (four blocks of 128
    threads an SM: what the H200 measurements assumed)."""
    import re

    from bench.cuda_kernel_report import (compile_kernels, expert_rows_variants, find_cuda,
                                          merge_variant, moe_variants, qk_norm_variants,
                                          readback_variant, residual_norm_variants, variants)
    from worker_proc import fused_moe
    from worker_proc import paged_attention as pa
    from worker_proc import residual_norm

    cuda = find_cuda()
    if cuda is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    probe = "#include <cuda_bf16.h>\n__global__ void probe(__nv_bfloat16* x) { x[0] = x[1]; }\n"
    if not compile_kernels(cuda, [("probe", probe)])[0].ok:
        pytest.skip(f"the CUDA toolkit at {cuda} cannot compile a bf16 kernel (headers missing)")
    kernels = [k for stages in (0, 4, pa.staged_tiles(128, 2, 4))
               for k in variants("__nv_bfloat16", 128, 4, 8, pa.LANES_PER_TOKEN, pa.PASSES, stages)]
    kernels += variants("float", 64, 4, 2, pa.LANES_PER_TOKEN, pa.PASSES, 4)[:2]
    kernels.append(merge_variant("__nv_bfloat16", 128, 4, 8))
    kernels.append(merge_variant("__nv_bfloat16", 64, 8, 8, sinks=True))
    kernels += qk_norm_variants("__nv_bfloat16", 256, 24) + qk_norm_variants("float", 16, 3)
    kernels += residual_norm_variants("__nv_bfloat16", 3840) + residual_norm_variants("__half", 6144)
    kernels += residual_norm_variants("__nv_bfloat16", 4096)  # the most a 256-thread row holds
    # GPT-OSS's experts (down padded), the most the routing kernel takes, float32's
    kernels += moe_variants("__nv_bfloat16", 32, 4, 2880, 2944)
    kernels += moe_variants("__nv_bfloat16", fused_moe.ROUTE_MAX_EXPERTS, fused_moe.ROUTE_MAX_K,
                            2048, 2048) + moe_variants("float", 4, 2, 64, 64)
    # 4-bit experts' projections: GPT-OSS's gate/up and down (padded)
    kernels += expert_rows_variants(2880, 5760) + expert_rows_variants(2880, 2944)
    kernels.append(readback_variant())  # a step's results into the readback ring
    # The other groups below, compiled in the same nvcc runs as these (each run parses
    # CUDA's headers again: ~1 s): their checks follow.
    def staged(dim: int, group: int) -> list:
        return variants("__nv_bfloat16", dim, group, 8, pa.lanes_per_token(dim, group), pa.PASSES,
                        pa.staged_tiles(dim, 2, group))

    groups: dict[str, list] = {"first": kernels}
    # The default stages for other heads compile within a block's 48 KiB of shared memory:
    # Gemma's 256-wide heads (32 lanes a token: within 128 registers too, four blocks an
    # SM) and 8 query heads a KV head (Llama-3-70B, ~200 registers: fewer blocks an SM)
    # without spills; 16 (Qwen3-235B) with two tiles (its accumulators spill with the
    # register prefetch too).
    groups["wide"] = staged(256, 2)
    # (and at 16 lanes, as launches of more than TARGET_BLOCKS blocks take them: no spills)
    groups["staged"] = staged(128, 8) + staged(256, 8) + variants(
        "__nv_bfloat16", 256, 2, 8, 16, pa.PASSES, pa.staged_tiles(256, 2, 2, lanes=16))
    groups["blocks"] = [k for dim, group in ((256, 2), (128, 4)) for k in variants(
        "__nv_bfloat16", dim, group, 8, pa.lanes_per_token(dim, group), pa.PASSES,
        pa.staged_tiles(dim, 2, group), warp_tiles=False)]  # --experiments block-tiles
    groups["sixteen"] = staged(128, 16)
    # The tensor-core kernels (~110 registers at Llama's heads, four warps a block), also
    # at 16 query heads a KV head (the fragments' upper rows), Gemma's 256-wide heads
    # (~140, columns over four warps), in fp16, and with their tiles in dynamic shared
    # memory.
    mma = (variants("__nv_bfloat16", 128, 4, 8, 0, 0, mma=MmaConfig())
           + variants("__nv_bfloat16", 128, 16, 8, 0, 0, mma=MmaConfig())[:2]
           + variants("__nv_bfloat16", 256, 2, 8, 0, 0, mma=MmaConfig())[:2]
           + variants("__half", 96, 12, 2, 0, 0, mma=MmaConfig())[:2])
    mma += variants("__nv_bfloat16", 128, 4, 8, 0, 0,  # tiles in dynamic shared memory
                    mma=MmaConfig(stage_bytes=96 * 1024, warps=8))[:3]
    assert all(name.endswith("_dyn") for name, _ in mma[-3:])
    # The latent (MLA) kernels: DeepSeek-V3's 128 heads over a 512-wide latent, four and
    # eight warps (~128 and ~100 registers), fp16 at a 64-wide one.
    from bench.cuda_kernel_report import latent_variants, prefill_variants

    mma += (latent_variants("__nv_bfloat16", 512, 128)
            + latent_variants("__nv_bfloat16", 512, 16, LatentConfig(warps=8, stages=3))
            + latent_variants("__half", 64, 4))
    groups["mma"] = mma
    # The paged prefill kernel (full, windowed, with sinks) at Llama's, Gemma 3's (256:
    # ~240 registers, two blocks an SM by its shared memory anyway) and 64-wide heads.
    groups["prefill"] = (prefill_variants("__nv_bfloat16", 128, 4, 8)
                         + prefill_variants("__nv_bfloat16", 256, 2, 8)
                         + prefill_variants("__half", 64, 1, 4))
    # A bf16 Linear's rows through the experts' kernel (64 rows a pass: ~170 registers,
    # two blocks an SM by its shared memory anyway): Llama's q/k/v and Gemma's down.
    from bench.cuda_kernel_report import bf16_linear_rows_variant

    groups["linear"] = [bf16_linear_rows_variant(4096, 6144), bf16_linear_rows_variant(15360, 3840)]
    every = compile_kernels(cuda, [k for group in groups.values() for k in group])
    assert len(every) == sum(map(len, groups.values()))
    compiled, at = {}, 0
    for name, group in groups.items():
        compiled[name], at = every[at:at + len(group)], at + len(group)

    def no_spills(results: list) -> None:
        assert all(r.ok and "0 bytes spill stores" in r.report for r in results), [
            r.name + ":\n" + r.report for r in results if not (r.ok and "0 bytes spill" in r.report)]

    results = compiled["first"]
    failed = [r.name + ":\n" + r.report for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    for r in results:
        assert "0 bytes spill stores" in r.report, (r.name, r.report)
        registers = int(re.search(r"Used (\d+) registers", r.report).group(1))
        assert registers <= 128, (r.name, registers)
        if "residual_norm" in r.name or "add_norm" in r.name:  # a block's threads x registers within 64K
            dim = int(re.search(r"_d(\d+)", r.name).group(1))
            assert registers * residual_norm.block_threads(dim) <= 65536, (r.name, registers)
        if "moe_route" in r.name:  # one block of ROUTE_THREADS, with a margin for NVRTC's
            assert registers * fused_moe.ROUTE_THREADS <= 48 * 1024, (r.name, registers)
    blocks = compiled["blocks"]
    no_spills(compiled["wide"] + compiled["staged"] + blocks)
    for r in compiled["wide"] + blocks[:len(blocks) // 2]:
        assert int(re.search(r"Used (\d+) registers", r.report).group(1)) <= 128, (r.name, r.report)
    assert all(r.ok for r in compiled["sixteen"])
    no_spills(compiled["mma"])
    no_spills(compiled["prefill"])
    no_spills(compiled["linear"])
    # GPUs before sm_80 have no cp.async: the staged default copies at once there.
    assert all(r.ok for r in compile_kernels(cuda, staged(128, 4)[:2], arch="sm_75"))


def _latent_case(heads: int, dim: int, rope: int = 64, dtype=mx.bfloat16, seed: int = 0,
                 lengths=(1, 4096, 33, 257, 16, 17, 700)):
    """An MLA layer's decode inputs: absorbed queries [B, H, 1, D], a pool of rows [latent
    D | RoPE part], and the model's masked RoPE scores as the bias [B, H, 1, L]."""
    q, _, table, ln = _case(n_q=heads, n_kv=1, dim=dim, dtype=dtype, seed=seed, lengths=lengths,
                            slots=1)  # the table's ids within the rows' own slots
    rng = np.random.default_rng(seed + 1)
    slots = int(np.array(ln).sum()) + 1
    pool = mx.array(rng.standard_normal((slots, 1, dim + rope)).astype(np.float32)).astype(dtype)
    bias = mx.array(rng.standard_normal((len(lengths), heads, 1, table.shape[1]))
                    .astype(np.float32)).astype(dtype)
    valid = (mx.arange(table.shape[1])[None] < ln[:, None])[:, None, None, :]
    bias = mx.where(valid, bias, mx.array(mx.finfo(dtype).min, dtype))  # as the model masks
    return q, pool, table, ln, bias


def test_latent_reference_is_attention_over_the_latent_with_the_bias():
    """reference_latent_attention: softmax(scale q . latent + bias) . latent over each
    row's first `length` slots, the RoPE part of the rows unread."""
    q, pool, table, ln, bias = _latent_case(4, 32, rope=8, dtype=mx.float32,
                                            lengths=(3, 40, 1, 17))
    out = reference_latent_attention(q, pool, table, ln, bias, scale=0.3)
    for b in range(q.shape[0]):
        n = int(ln[b])
        latent = pool[table[b, :n]][:, 0, :32]  # [n, D]
        scores = 0.3 * (q[b, :, 0] @ latent.T) + bias[b, :, 0, :n]
        want = mx.softmax(scores, axis=-1) @ latent
        np.testing.assert_allclose(np.array(out[b, :, 0]), np.array(want), rtol=1e-5, atol=1e-5)


def test_latent_launches_cover_the_heads_in_tiles_of_16(monkeypatch):
    """On any machine, with the kernels replaced by recorders: a block a (split, 16 query
    heads, row), the config's warps and dynamic tiles; several splits merged a block a
    (query head, row)."""
    from worker_proc import paged_attention as pa

    launches, merged = [], []
    monkeypatch.setattr(pa, "_latent_kernel", lambda direct, shared_memory: _recording(
        launches, direct=direct, shared=shared_memory))
    monkeypatch.setattr(pa, "_merge_kernel", lambda sinks=False: _recording(merged))
    q = mx.zeros((2, 40, 1, 512), dtype=mx.bfloat16)
    pool = mx.zeros((100, 1, 576), dtype=mx.bfloat16)
    table, ln = mx.zeros((2, 50), dtype=mx.int32), mx.array([3, 50], dtype=mx.int32)
    bias = mx.zeros((2, 40, 1, 50), dtype=mx.bfloat16)
    config = LatentConfig(warps=8, stages=3)
    assert paged_latent_attention(q, pool, table, ln, bias, 0.1, config=config).shape == q.shape
    last = launches[-1]
    splits = num_splits(2, 3, 50)
    assert splits > 1 and not last["direct"] and last["grid"] == (splits * 256, 3, 2)
    assert last["threads"] == 256 and last["shared"] == 3 * 64 * 512 * 2
    assert (last["template"]["H"], last["template"]["D"], last["template"]["WARPS"]) == (40, 512, 8)
    assert last["shapes"][0] == (2, 40, splits, 1, 512)  # a merge block a query head
    assert merged[-1]["template"] == {"T": mx.bfloat16, "D": 512, "G": 1, "HKV": 40}
    assert all(m["grid"][:2] == (128, m["template"]["HKV"]) for m in merged)
    long = mx.zeros((1, 16, 1, 512), dtype=mx.bfloat16)
    paged_latent_attention(long, pool, mx.zeros((1, 40), dtype=mx.int32), ln[:1],
                           bias[:1, :16, :, :40], 0.1)
    assert all(m["grid"][:2] == (128, m["template"]["HKV"]) for m in merged)
    if num_splits(1, 1, 40) == 1:
        assert launches[-1]["direct"] and launches[-1]["grid"] == (128, 1, 1)
    # What the kernel takes: 16-bit queries as the pool stores them, whole ldmatrix pairs
    # of columns a warp.
    assert LatentConfig().fits(mx.bfloat16, mx.bfloat16, 512)
    assert LatentConfig().fits(mx.float16, mx.float16, 64)
    assert not LatentConfig().fits(mx.float32, mx.float32, 512)
    assert not LatentConfig().fits(mx.bfloat16, mx.float16, 512)
    assert not LatentConfig().fits(mx.bfloat16, mx.bfloat16, 32)  # 4 columns a warp
    assert LatentConfig(warps=2).fits(mx.bfloat16, mx.bfloat16, 32)
    assert not LatentConfig(stages=1).fits(mx.bfloat16, mx.bfloat16, 512)
    assert not LatentConfig(warps=1).fits(mx.bfloat16, mx.bfloat16, 16)  # tokens in 16s
    assert LatentConfig().fits(mx.bfloat16, mx.bfloat16, 512, 576)
    assert not LatentConfig().fits(mx.bfloat16, mx.bfloat16, 512, 516)  # rows in 16 bytes


@pytest.mark.skipif(not (kernel_available() and tensor_cores_available()),
                    reason="the latent kernel needs MLX's CUDA backend on sm_80+")
@pytest.mark.parametrize("heads, dim, dtype, config", [
    (16, 512, mx.bfloat16, LatentConfig()), (128, 512, mx.bfloat16, LatentConfig()),
    (20, 512, mx.float16, LatentConfig()), (16, 512, mx.bfloat16, LatentConfig(warps=8)),
    (16, 512, mx.bfloat16, LatentConfig(stages=3)), (4, 64, mx.bfloat16, LatentConfig()),
    (12, 256, mx.bfloat16, LatentConfig(warps=8, stages=3))])
def test_cuda_latent_kernel_matches_reference(heads, dim, dtype, config):
    """The latent kernel: Moonlight's 16 heads and DeepSeek-V3's 128 over a 512-wide
    latent, a partial tile of heads (20), fp16, eight warps, three stages, the tiny
    widened test models' 64; one split and several."""
    q, pool, table, ln, bias = _latent_case(heads, dim, dtype=dtype, seed=heads + dim)
    scale = 192 ** -0.5
    got = paged_latent_attention(q, pool, table, ln, bias, scale, config=config)
    want = reference_latent_attention(q, pool, table, ln, bias, scale)
    # bf16 outputs of a 512-wide latent, P rounded to 16 bits: 3 ulps at |x| ~ 2 (the H200
    # showed up to 0.047 against MLX's call, whose scores are rounded to bf16 themselves).
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=3e-2, atol=5e-2)
    one = paged_latent_attention(q[:1], pool, table[:1], ln[:1], bias[:1], scale, config=config)
    np.testing.assert_allclose(np.array(one.astype(mx.float32)),
                               np.array(want[:1].astype(mx.float32)), rtol=3e-2, atol=5e-2)


def test_no_kernel_reads_a_constant_of_eight_bytes_or_less(monkeypatch):
    """Every kiln kernel gets its constants as template arguments or as arrays wider than
    8 bytes: MLX's CUDA allocator keeps arrays of 8 bytes or less in one managed region
    that the host keeps writing, and a kernel reading one there ran 3-10x slow on the H200
    (docs/benchmarks.md, session 28). Each launch is recorded in place of the kernel
    (batches of 4, so that per-row inputs are 16 bytes or more)."""
    import itertools

    from worker_proc import (gated_delta_cuda, paged_attention, pool_writes, qk_norm_rope,
                             residual_norm)
    from worker_proc.paged_attention import (paged_decode_attention, paged_decode_qkv_attention,
                                             paged_decode_write_attention, paged_latent_attention,
                                             RopeSpec)
    from worker_proc.pool_writes import pool_write_in_place

    launches: list[tuple[str, list[mx.array]]] = []

    def recording_kernel(name, **_):  # noqa: ANN001, ANN202
        def launch(inputs, output_shapes, output_dtypes, **__):  # noqa: ANN001, ANN202
            launches.append((name, list(inputs)))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return launch

    modules = (paged_attention, pool_writes, qk_norm_rope, residual_norm, gated_delta_cuda)

    def clear_kernels() -> None:
        for module in modules:
            for value in vars(module).values():
                if hasattr(value, "cache_clear"):
                    value.cache_clear()

    clear_kernels()
    monkeypatch.setattr(mx.fast, "cuda_kernel", recording_kernel)
    try:
        b, n_q, n_kv, dim = 4, 8, 2, 64
        q = mx.zeros((b, n_q, 1, dim))
        keys = values = mx.zeros((b, n_kv, 1, dim))
        qkv = mx.zeros((b, 1, (n_q + 2 * n_kv) * dim))
        pool = mx.zeros((64, n_kv, 2 * dim))
        table = mx.zeros((b, 16), dtype=mx.int32)
        lengths = mx.full((b,), 5, dtype=mx.int32)
        slots = mx.arange(b, dtype=mx.int32)
        ropes = [RopeSpec(dim, False, 10000.0, 1.0),
                 RopeSpec(dim, True, None, 1.0, mx.ones((dim // 2,)), mscale=1.2)]
        mark = pool_write_in_place(pool, slots, keys, values)
        pool_writes.rows_write_in_place(mx.zeros((8, 4)), slots, mx.zeros((b, 4)), mark)
        for mma, sinks in itertools.product((None, paged_attention.MmaConfig()),
                                            (None, mx.zeros((n_q,)))):
            paged_decode_attention(q, pool, table, lengths, 0.125, mark, sinks, mma=mma)
            paged_decode_write_attention(q, keys, values, slots, pool, table, lengths, 0.125,
                                         mark, sinks, mma=mma)
        long_table = mx.zeros((b, 4096), dtype=mx.int32)  # several splits: the merge too
        paged_decode_attention(q, pool, long_table, lengths, 0.125, mark)
        for rope in ropes:
            paged_decode_qkv_attention(qkv, n_q, rope, slots, pool, long_table, lengths, 0.125)
            for scale in (None, mx.ones((n_q + n_kv, dim))):
                qk_norm_rope.decode_qk_norm_rope(qkv, n_q + n_kv, lengths, scale, 1e-6, rope)
        latent_pool = mx.zeros((64, 1, 576))
        for width in (16, 4096):
            paged_latent_attention(mx.zeros((b, 16, 1, 512)), latent_pool,
                                   mx.zeros((b, width), dtype=mx.int32), lengths,
                                   mx.zeros((b, 16, 1, width)), 0.1, mark)
        x = mx.zeros((b, 1, 128))
        residual_norm.residual_norm(x, x, mx.ones((128,)), 1e-6, mx.ones((128,)))
        gq, gv, g = mx.zeros((b, 1, 2, 32)), mx.zeros((b, 1, 4, 32)), mx.zeros((b, 1, 4))
        gated_delta_cuda.gated_delta_in_pool(gq, gq, gv, g, g, mx.zeros((8, 4, 32, 32)),
                                             slots, mark)
    finally:
        clear_kernels()
    names = {name for name, _ in launches}
    assert len(names) >= 9, names
    small = [(name, a.shape, a.dtype) for name, inputs in launches for a in inputs
             if a.nbytes <= 8]
    assert not small, small


def _prefill_case(n_q: int, n_kv: int, dim: int, starts: list[int], n_new: int,
                  dtype=mx.bfloat16, seed: int = 0):
    """A prefill forward's queries [B, Hq, S, D] at positions starts[b] + 0..S-1, and a
    pool whose rows' contexts (each start + S positions) lie in shuffled slots."""
    rng = np.random.default_rng(seed)
    lengths = [s + n_new for s in starts]
    width = max(lengths)
    slots = 1 + sum(lengths)
    order = 1 + rng.permutation(sum(lengths))
    table = np.zeros((len(starts), width), dtype=np.int32)  # past a row's end: slot 0
    at = 0
    for b, n in enumerate(lengths):
        table[b, :n] = order[at:at + n]
        at += n
    pool = mx.array(rng.standard_normal((slots, n_kv, 2 * dim)).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((len(starts), n_q, n_new, dim)).astype(np.float32)).astype(dtype)
    return q, pool, mx.array(table), mx.array(np.array(starts, dtype=np.int32))


def test_paged_prefill_reference_is_attention_over_each_rows_context():
    """The paged prefill kernel's plain-MLX meaning: each row's queries over its own
    context's K/V (causal from its start, within a window), as mlx-lm's attention over
    that row alone."""
    q, pool, table, starts = _prefill_case(4, 2, 64, [0, 37, 5], 9, dtype=mx.float32)
    for window in (0, 8):
        got = reference_paged_prefill_attention(q, pool, table, starts, 0.125, window=window)
        for b, start in enumerate([0, 37, 5]):
            n = start + 9
            keys, values = split_kv(pool[table[b:b + 1, :n]], 64)
            pos = start + np.arange(9)[:, None]
            t = np.arange(n)[None]
            visible = (t <= pos) & ((t > pos - window) if window else True)
            want = mx.fast.scaled_dot_product_attention(q[b:b + 1], keys, values, scale=0.125,
                                                        mask=mx.array(visible))
            np.testing.assert_allclose(np.array(got[b:b + 1]), np.array(want), atol=1e-5)


@pytest.mark.skipif(not kernel_available(), reason="the CUDA kernel needs MLX's CUDA backend")
@pytest.mark.parametrize("n_q, n_kv, dim, dtype", [(32, 8, 128, mx.bfloat16), (16, 8, 256, mx.bfloat16),
                                                   (8, 8, 64, mx.float16), (12, 4, 128, mx.bfloat16)])
@pytest.mark.parametrize("starts, n_new, width", [([0], 700, 0), ([3584], 512, 0),
                                                  ([0, 1000, 17], 130, 0), ([3796], 300, 0),
                                                  ([0, 1000, 17], 130, 1100)])
@pytest.mark.parametrize("window, sinks", [(0, False), (1024, False), (128, True)])
def test_cuda_paged_prefill_matches_reference(n_q, n_kv, dim, dtype, starts, n_new, width,
                                              window, sinks):
    """The tensor-core prefill kernel against its plain-MLX meaning: query heads a KV head
    from 1 to 4 (and 3), heads of 64, 128 and 256, rows at different starts, windows and
    sinks; a table narrower than the widest row's queries (padding queries past it)."""
    q, pool, table, st = _prefill_case(n_q, n_kv, dim, starts, n_new, dtype=dtype)
    if width:
        table = table[:, :width]
    sink = mx.array(np.linspace(-1, 1, n_q).astype(np.float32)).astype(dtype) if sinks else None
    got = paged_prefill_attention(q, pool, table, st, dim ** -0.5, window=window, sinks=sink)
    want = reference_paged_prefill_attention(q.astype(mx.float32), pool.astype(mx.float32),
                                             table, st, dim ** -0.5, window=window,
                                             sinks=None if sink is None else sink.astype(mx.float32))
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), rtol=3e-2, atol=3e-2)


def test_paged_prefill_padding_queries_past_the_context_stay_finite():
    """A right-padded row's queries past its table (a shared prefill forward's padding)
    attend as one at the last position would, windowed too: finite rows, never 0 / 0
    (their K/V reach the pool's dummy slot, which every other row's masked columns
    multiply by zero)."""
    q, pool, table, starts = _prefill_case(4, 2, 64, [30], 20, dtype=mx.float32)
    narrow = table[:, :40]  # positions 40..49 are padding: past the table
    for window in (0, 4):
        out = reference_paged_prefill_attention(q, pool, narrow, starts, 0.125, window=window)
        assert bool(mx.isfinite(out).all().item())
        at_last = mx.array([39], dtype=mx.int32)
        for i in range(10, 20):
            alone = reference_paged_prefill_attention(q[:, :, i:i + 1], pool, narrow, at_last,
                                                      0.125, window=window)
            np.testing.assert_allclose(np.array(out[:, :, i:i + 1]), np.array(alone), atol=1e-6)


def test_kernel_reports_go_back_to_their_kernels_by_namespace():
    """cuda_kernel_report compiles many kernels in one file, each in namespace k<i>:
    ptxas names them mangled, the namespace's length first, then the function's own
    length, whose digits must not be read as part of i."""
    from bench.cuda_kernel_report import _namespace_index

    assert _namespace_index("_ZN2k110kiln_mergeEPKfS1_Pf") == 1  # k1, then a 10-char name
    assert _namespace_index("_ZN3k1250kiln_read_direct_l16_u1_s4_with_a_long_suffix_EPK") == 12
    assert _namespace_index("_Z10kiln_mergePKf") == 0  # a file of one kernel

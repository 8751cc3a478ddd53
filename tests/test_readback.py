"""A step's results read back through a ring of host-read buffers (worker_proc.readback,
CUDA's default): on the CPU its device copy is stood in for by a host
write of the same words; the CUDA kernel itself is checked where MLX runs on CUDA."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, StandInKernel
from tests.engine_driver import stand_in_readback_copy as host_copy
from worker_proc.readback import MIN_WORDS, ReadbackRing, prefill_mark, reads_back_here


def _parts(rng: np.random.Generator, rows: int, k: int) -> list[np.ndarray]:
    return [rng.integers(0, 1 << 31, rows).astype(np.uint32),
            rng.standard_normal(rows).astype(np.float32),
            rng.integers(-5, 1 << 20, (rows, k)).astype(np.int32),
            rng.standard_normal((rows, k)).astype(np.float32)]


def test_every_part_comes_back_in_its_shape_and_dtype_over_the_ring() -> None:
    ring = ReadbackRing(host_copy, depth=4)
    rng = np.random.default_rng(0)
    # More uses than buffers (each reused), and one past MIN_WORDS (a buffer remade).
    for rows, k in [(3, 2), (64, 5), (1, 1), (128, 20), (7, 3), (MIN_WORDS // 2, 2), (2, 4)]:
        want = _parts(rng, rows, k)
        got = ring.read(ring.land(*(mx.array(p) for p in want)))
        assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_reads_of_earlier_steps_survive_later_landings() -> None:
    """Two steps in flight: the one landed first is read after the next one lands."""
    ring = ReadbackRing(host_copy)
    first = ring.land(mx.array(np.arange(10, dtype=np.int32)))
    second = ring.land(mx.array(np.arange(10, 30, dtype=np.int32)))
    np.testing.assert_array_equal(ring.read(first)[0], np.arange(10))
    np.testing.assert_array_equal(ring.read(second)[0], np.arange(10, 30))


def test_a_read_after_its_buffer_was_reused_is_an_error_not_other_tokens() -> None:
    ring = ReadbackRing(host_copy, depth=2)
    first = ring.land(mx.array(np.arange(4, dtype=np.int32)))
    ring.land(mx.array(np.arange(8, dtype=np.int32)))
    ring.land(mx.array(np.arange(6, dtype=np.int32)))  # first's buffer again
    with pytest.raises(RuntimeError, match="more steps in flight than the readback ring"):
        ring.read(first)


def test_a_copy_that_writes_nothing_is_found_at_start_up() -> None:
    assert reads_back_here(host_copy)
    assert not reads_back_here(lambda dst, src: mx.zeros((1,), dtype=mx.int32))


def test_the_prefill_mark_is_a_one_element_copy_of_the_first_logit() -> None:
    logits = mx.array(np.arange(12, dtype=np.float32).reshape(3, 4) + 0.5)
    mark = prefill_mark(logits)
    assert mark.shape == (1,) and mark.item() == 0.5


def _serve(model: Any, readback: bool) -> dict[str, Any]:
    engine = InProcessEngine(model, backend=StandInKernel(), overlap="ahead", max_running=4,
                             readback=readback)
    rng = np.random.default_rng(7)
    vocab = model.args.vocab_size
    for i in range(6):
        prompt = rng.integers(0, vocab, int(rng.integers(5, 40))).tolist()
        extra = {"logprobs": 3} if i % 2 else {}
        engine.submit(f"r{i}", prompt, 12, [], **extra)
    return engine.run_until_idle()


def test_served_tokens_and_logprobs_are_the_same_read_back_through_the_ring(
        tiny_model: tuple[Any, Any]) -> None:
    model, _ = tiny_model
    plain, ringed = _serve(model, False), _serve(model, True)
    assert plain.keys() == ringed.keys()
    for rid, done in plain.items():
        assert ringed[rid].token_ids == done.token_ids and len(done.token_ids) == 12
        assert ringed[rid].logprobs == done.logprobs
    assert all(plain[f"r{i}"].logprobs for i in (1, 3, 5))


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the copy kernel needs MLX's CUDA backend")
def test_the_cuda_copy_lands_what_the_host_reads() -> None:
    assert reads_back_here()
    ring = ReadbackRing()
    rng = np.random.default_rng(1)
    steps = [ring.land(*(mx.array(p) for p in _parts(rng, rows, 4))) for rows in (64, 3)]
    mx.async_eval(*(s.done for s in steps))
    rng = np.random.default_rng(1)
    for step, rows in zip(steps, (64, 3)):
        for got, want in zip(ring.read(step), _parts(rng, rows, 4)):
            np.testing.assert_array_equal(got, want)

"""Decode steps launched from a thread of the worker's own (worker_proc.launcher, the CUDA
worker's default): served tokens equal mlx-lm's while the worker's thread
builds the next step beside a launch, and a failed launch ends its requests, not the
worker. On the CPU the ring's device copy is stood in for by a lazy copy (LazyStandInRing)."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_driver import InProcessEngine, StandInKernel
from worker_proc.launcher import LaunchThread
from worker_proc.runner import ModelRunner


def test_launched_arrays_compute_and_a_launch_error_is_raised_once(
        launcher: LaunchThread) -> None:
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    out = (a @ a.T).sum()
    seconds = launcher.launch([out]).result()
    n = np.arange(12.0).reshape(3, 4)
    assert seconds >= 0 and out.item() == float((n @ n.T).sum())
    # A stream of this thread's own is one the launch thread cannot run.
    with mx.stream(mx.new_stream(mx.default_device())):
        stranded = a + 1
    failed = launcher.launch([stranded])
    ok = a * 2
    launcher.launch([ok])
    with pytest.raises(RuntimeError, match="no Stream"):
        launcher.quiesce()
    launcher.quiesce()  # raised once; nothing open
    assert isinstance(failed.exception(), RuntimeError)
    np.testing.assert_array_equal(np.asarray(ok), np.arange(12).reshape(3, 4) * 2)


# Decode first with the prompts' forwards spread over two steps (as CUDA's default spreads
# them over eight), small chunks: prefill parts ride in decoding steps.
SPREAD = {"chunk_size": 32, "max_prefill_tokens_while_decoding": 32, "prefill_parts": 2,
          "decode_first_for_all": True}


def _prompts(model: Any) -> list[list[int]]:
    rng = np.random.default_rng(11)
    vocab = model.args.vocab_size
    return [rng.integers(0, vocab, int(rng.integers(5, 60))).tolist() for _ in range(8)]


def _serve(model: Any, launcher: LaunchThread | None, **options: Any
           ) -> tuple[InProcessEngine, dict]:
    """Requests that arrive over time (new ones join decoding ones, some finish early),
    two with logprobs, served with the CUDA path's start-ahead."""
    engine = InProcessEngine(model, backend=StandInKernel(), overlap="ahead", max_running=4,
                             readback=launcher is None, launcher=launcher, **options)
    prompts = _prompts(model)
    for i, prompt in enumerate(prompts[:3]):
        engine.submit(f"r{i}", prompt, 6 + 4 * i, [], **({"logprobs": 2} if i == 1 else {}))
    engine.submit("echo", prompts[0][:30], 3, [], prompt_logprobs=2)
    for _ in range(5):
        engine.step()
    for i, prompt in enumerate(prompts[3:], start=3):
        engine.submit(f"r{i}", prompt, 14, [], **({"logprobs": 3} if i == 6 else {}))
    return engine, engine.run_until_idle()


@pytest.mark.parametrize("options", [{}, SPREAD], ids=["whole", "spread"])
def test_served_tokens_equal_mlx_lm_with_the_launch_thread(
        tiny_model: tuple[Any, Any], oracle: Any, launcher: LaunchThread,
        options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny_model
    plain_engine, plain = _serve(model, None, **options)
    spread_steps = []
    real = ModelRunner._spread_step
    monkeypatch.setattr(ModelRunner, "_spread_step",
                        lambda self, *a: spread_steps.append(1) or real(self, *a))
    engine, threaded = _serve(model, launcher, **options)
    assert threaded.keys() == plain.keys()
    for rid, done in threaded.items():
        assert done.error is None
        assert done.token_ids == plain[rid].token_ids
        assert done.logprobs == plain[rid].logprobs
        assert done.prompt_logprobs == plain[rid].prompt_logprobs
    # The oracle on two of them (the plain engine is itself checked against it elsewhere).
    prompts = _prompts(model)
    assert threaded["r0"].token_ids == oracle(prompts[0], 6)
    assert threaded["r7"].token_ids == oracle(prompts[7], 14)
    # Decode steps went through the thread, and steps were built with one in flight.
    assert launcher.launches > 10 and engine.worker.steps_built_ahead > 10
    assert bool(spread_steps) == bool(options)  # spread parts launched by the thread too


def test_a_failed_launch_ends_its_requests_and_the_worker_serves_on(
        tiny_model: tuple[Any, Any], launcher: LaunchThread,
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = tiny_model
    real = mx.async_eval
    fails = {"left": 1, "seen": 0}

    def flaky(*arrays: mx.array) -> None:
        if threading.current_thread().name == "kiln-launch":
            fails["seen"] += 1
            if fails["seen"] == 8 and fails["left"]:
                fails["left"] -= 1
                raise RuntimeError("injected launch failure")
        real(*arrays)

    monkeypatch.setattr(mx, "async_eval", flaky)
    engine, results = _serve(model, launcher)
    failed = [rid for rid, done in results.items() if done.error]
    assert failed and all("injected launch failure" in results[r].error for r in failed)
    served = [rid for rid, done in results.items() if not done.error]
    assert served, "requests after the failure were served"
    monkeypatch.setattr(mx, "async_eval", real)
    # What the worker serves after it is exact.
    engine.submit("after", [5, 6, 7, 8, 9], 8, [])
    after = engine.run_until_idle()["after"]
    plain_engine = InProcessEngine(model, backend=StandInKernel(), overlap="ahead")
    plain_engine.submit("after", [5, 6, 7, 8, 9], 8, [])
    assert after.error is None and after.token_ids == plain_engine.run_until_idle()["after"].token_ids


def test_the_worker_launches_from_a_thread_on_cuda_unless_told_not() -> None:
    from worker_proc import launch_thread

    assert launch_thread(frozenset(), on_cuda=False) is None
    for arm in ("inline-launch", "array-readback"):
        assert launch_thread(frozenset({arm}), on_cuda=True) is None
    before = mx.default_stream(mx.default_device())
    try:
        thread = launch_thread(frozenset({"wide-cache"}), on_cuda=True)
        assert thread is not None
        assert mx.default_stream(mx.default_device()) == thread.stream
        thread.close()
    finally:
        mx.set_default_stream(before)


def test_check_raises_each_ended_launchs_error_once_oldest_first(
        launcher: LaunchThread) -> None:
    with mx.stream(mx.new_stream(mx.default_device())):
        stranded = mx.ones((2,)) + 1  # on a stream the launch thread cannot run
    first = launcher.launch([stranded], "a prefill forward")
    after = launcher.launch([mx.ones((2,)) * 3], "step 1")
    after.result()
    with pytest.raises(RuntimeError, match="no Stream"):
        launcher.check()
    launcher.check()  # raised once
    assert first.exception() is not None and after.exception() is None

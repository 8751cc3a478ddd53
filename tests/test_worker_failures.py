"""A failure that belongs to some requests ends those requests, not the worker: a request
whose settings the worker cannot serve ends with an error while its batch mates finish
exactly; a step that fails as a whole ends the requests it held, and serving goes on."""

from __future__ import annotations

import logging

import pytest

from tests.engine_driver import InProcessEngine
from tests.test_scheduler import assert_idle_invariant
from tests.test_worker import _prompts


@pytest.mark.parametrize("overlap", [False, True, "ahead"])
@pytest.mark.parametrize("bad", [dict(top_k=2 ** 40), dict(logit_bias={10 ** 9: 1.0}),
                                 dict(logit_bias={3: float("nan")}),
                                 dict(repetition_penalty=1.1, top_k=-(2 ** 33))])
def test_a_request_the_worker_cannot_serve_ends_alone(tiny_model, oracle, overlap, bad):
    model, _ = tiny_model
    prompts = _prompts(4, [30, 5, 70, 12], model.args.vocab_size, seed=50)
    engine = InProcessEngine(model, chunk_size=32, overlap=overlap)
    engine.submit("r0", prompts[0], 10, [])
    engine.step()  # r0 is mid-prefill when the bad one arrives
    engine.submit("bad", prompts[1], 10, [], temperature=1.0, **bad)
    engine.submit("r2", prompts[2], 10, [])
    engine.submit("same", prompts[1], 10, [])  # reads the bad request's cached prompt
    results = engine.run_until_idle()
    assert results["bad"].finish_reason == "error"
    assert "cannot serve" in results["bad"].error and results["bad"].token_ids == []
    for rid, prompt in (("r0", prompts[0]), ("r2", prompts[2]), ("same", prompts[1])):
        assert results[rid].token_ids == oracle(prompt, 10), rid
    assert_idle_invariant(engine.scheduler)


@pytest.mark.parametrize("overlap", [False, True, "ahead"])
def test_a_step_that_fails_ends_its_requests_and_serving_goes_on(tiny_model, oracle,
                                                                 monkeypatch, overlap):
    model, _ = tiny_model
    prompts = _prompts(3, [40, 9, 100], model.args.vocab_size, seed=51)
    engine = InProcessEngine(model, chunk_size=32, overlap=overlap)
    decode = engine.runner._decode
    calls = {"n": 0}

    def failing_decode(*args):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost its mind")
        return decode(*args)

    monkeypatch.setattr(engine.runner, "_decode", failing_decode)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 30, [])
    results = engine.run_until_idle()
    assert calls["n"] >= 3
    failed = [rid for rid, r in results.items() if r.finish_reason == "error"]
    assert failed and all("device lost its mind" in results[rid].error for rid in failed)
    assert engine.runner.requests == {} and engine.worker.owed == type(engine.worker.owed)()
    assert engine.scheduler.cache.total_size == 0  # dropped: it may hold what the step wrote
    # The same engine serves the same prompts again, exactly.
    for i, p in enumerate(prompts):
        engine.submit(f"again{i}", p, 30, [])
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        assert results[f"again{i}"].token_ids == oracle(p, 30)
    assert_idle_invariant(engine.scheduler)


def test_a_token_id_outside_the_vocabulary_fails_its_step_not_the_worker(tiny_model, oracle):
    """The front refuses such ids; one that slipped past must not read outside the
    embedding (or crash the process): its step fails, the next request is served."""
    model, _ = tiny_model
    engine = InProcessEngine(model)
    engine.submit("bad", [7, model.args.vocab_size + 5, 9], 5, [])
    assert engine.run_until_idle()["bad"].finish_reason == "error"
    prompt = _prompts(1, [20], model.args.vocab_size, seed=52)[0]
    engine.submit("good", prompt, 8, [])
    assert engine.run_until_idle()["good"].token_ids == oracle(prompt, 8)
    assert_idle_invariant(engine.scheduler)


def test_a_step_naming_requests_a_failed_step_ended_is_reported_failed_unrun(
        tiny_model, monkeypatch, caplog):
    """Steps the scheduler sent before it learnt of a failure still name the requests the
    failure ended: each is reported failed without running, and the failure is logged
    once (such a step used to fail again on the forgotten requests, a second failure)."""
    import msgspec

    from ipc.messages.to_scheduler import StepResult
    from ipc.messages.to_worker import ForwardBatch

    model, _ = tiny_model
    engine = InProcessEngine(model, chunk_size=32, overlap=False)
    for i, p in enumerate(_prompts(2, [20, 9], model.args.vocab_size, seed=53)):
        engine.submit(f"r{i}", p, 30, [])
    engine.step()  # both prompts prefilled; each step's result waits for the next turn
    engine._turn_scheduler(plan=True)
    (batch,) = engine.to_worker.drain()
    assert isinstance(batch, ForwardBatch) and batch.decode_rids

    def failing_decode(*args):  # noqa: ANN001, ANN202
        raise RuntimeError("device lost its mind")

    monkeypatch.setattr(engine.runner, "_decode", failing_decode)
    stale = msgspec.structs.replace(batch, step=batch.step + 1, new_requests=[])
    with caplog.at_level(logging.INFO, logger="worker_proc"):
        engine.worker.handle(batch)
        engine.worker.handle(stale)
    results = [m for m in engine.to_scheduler.drain() if isinstance(m, StepResult)]
    assert [(r.step, r.failed) for r in results] == [
        (batch.step, "RuntimeError: device lost its mind"),
        (stale.step, "its requests were ended by an earlier failed step")]
    assert [r.getMessage() for r in caplog.records if "step failed" in r.getMessage()] == [
        "a step failed; ending every request the worker holds"]


def test_steps_planned_before_a_failure_was_known_are_not_run(tiny_model, monkeypatch, caplog):
    """After a step failed as a whole, the steps the scheduler planned before it learnt of
    it (ForwardBatch.epoch behind the worker's failures) are reported failed unrun,
    whatever they hold: one admitting a new request beside an ended one, one continuing
    that request, one admitting a fresh request whose prefix hit could read what the
    failed step never wrote. The scheduler ends every request they name. A step planned
    after it learnt (the failed result's epoch) runs, an id reused too."""
    import msgspec

    from ipc.messages.common import SamplingParams
    from ipc.messages.to_scheduler import StepResult
    from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk

    model, _ = tiny_model
    engine = InProcessEngine(model, chunk_size=32, overlap=False)
    prompts = _prompts(3, [20, 9, 60], model.args.vocab_size, seed=55)
    for i, p in enumerate(prompts[:2]):
        engine.submit(f"r{i}", p, 30, [])
    engine.step()
    engine._turn_scheduler(plan=True)
    (batch,) = engine.to_worker.drain()
    decode = engine.runner._decode
    monkeypatch.setattr(engine.runner, "_decode", lambda *args: (_ for _ in ()).throw(
        RuntimeError("device lost its mind")))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)

    def chunk(rid: str, start: int, end: int, sample: bool) -> PrefillChunk:
        return PrefillChunk(rid=rid, start=start, token_ids=prompts[2][start:end],
                            slot_ids=list(range(3000 + start, 3000 + end)), sample=sample)

    admits = msgspec.structs.replace(
        batch, step=batch.step + 1, new_requests=[NewRequest(rid="x", sampling=greedy)],
        prefill=[chunk("x", 0, 32, False)], released=["r1"])
    continues = ForwardBatch(step=batch.step + 2, prefill=[chunk("x", 32, 60, True)])
    hits = ForwardBatch(step=batch.step + 3, new_requests=[NewRequest(
        rid="y", sampling=greedy, prefix_slot_ids=list(range(3000, 3032)))],
        prefill=[chunk("y", 32, 60, True)])
    with caplog.at_level(logging.INFO, logger="worker_proc"):
        for step in (batch, admits, continues, hits):
            engine.worker.handle(step)
    results = [m for m in engine.to_scheduler.drain() if isinstance(m, StepResult)]
    ended = "its requests were ended by an earlier failed step"
    assert [(r.step, r.failed, r.epoch) for r in results] == [
        (batch.step, "RuntimeError: device lost its mind", 1), (admits.step, ended, 1),
        (continues.step, ended, 1), (hits.step, ended, 1)]
    assert [r.getMessage() for r in caplog.records if "step failed" in r.getMessage()] == [
        "a step failed; ending every request the worker holds"]
    assert engine.runner.requests == {}
    # Planned once the failure is known: it runs (the id x reused).
    monkeypatch.setattr(engine.runner, "_decode", decode)
    known = ForwardBatch(step=batch.step + 4, epoch=1,
                         new_requests=[NewRequest(rid="x", sampling=greedy)],
                         prefill=[chunk("x", 0, 60, True)])
    engine.worker.handle(known)
    (result,) = [m for m in engine.to_scheduler.drain() if isinstance(m, StepResult)]
    assert (result.step, result.failed, result.rids) == (known.step, None, ["x"])


def test_a_request_reusing_an_id_a_failure_ended_runs(tiny_model, oracle, monkeypatch):
    """After a step failed as a whole, a new request under the id of one it ended (a
    client's own rid) is served: only steps planned before the failure was known are
    refused unrun (the worker once refused every later step naming the id, each ending
    every request)."""
    model, _ = tiny_model
    engine = InProcessEngine(model, chunk_size=32, overlap=False)
    prompts = _prompts(2, [20, 9], model.args.vocab_size, seed=54)
    engine.submit("x", prompts[0], 30, [])
    engine.step()
    decode = engine.runner._decode

    def failing_decode(*args):  # noqa: ANN001, ANN202
        raise RuntimeError("device lost its mind")

    monkeypatch.setattr(engine.runner, "_decode", failing_decode)
    results = engine.run_until_idle()
    assert results["x"].error is not None
    monkeypatch.setattr(engine.runner, "_decode", decode)
    engine.submit("x", prompts[1], 12, [])
    engine.submit("y", prompts[0], 12, [])
    results = engine.run_until_idle()
    for rid, prompt in (("x", prompts[1]), ("y", prompts[0])):
        assert results[rid].error is None, results[rid].error
        assert results[rid].token_ids == oracle(prompt, 12), rid
    assert_idle_invariant(engine.scheduler)


@pytest.mark.parametrize("overlap", [False, "ahead"])
def test_a_step_that_loses_the_device_ends_its_requests_then_the_worker(tiny_model, monkeypatch,
                                                                         overlap):
    """A CUDA error that poisons the context (every later call fails with it: the H100 in
    session 38, after an out-of-memory step) is not lived through: the failed step's
    requests are ended as for any failure, then the worker raises DeviceLost (its process
    exits and the launcher stops the server) instead of failing every later request."""
    from worker_proc.device_lost import DeviceLost, device_lost

    model, _ = tiny_model
    prompts = _prompts(2, [40, 9], model.args.vocab_size, seed=52)
    engine = InProcessEngine(model, chunk_size=32, overlap=overlap)
    decode = engine.runner._decode
    calls = {"n": 0}
    lost = RuntimeError("cuGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: "
                        "an illegal memory access was encountered")

    def failing_decode(*args):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise lost
        return decode(*args)

    monkeypatch.setattr(engine.runner, "_decode", failing_decode)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 30, [])
    with pytest.raises(DeviceLost, match="illegal memory access"):
        engine.run_until_idle()
    assert not engine.worker.owed and engine.runner.requests == {}  # reported failed first
    # Errors a process lives through stay per-step (an allocation that failed, a bug).
    assert device_lost(lost) and not device_lost(RuntimeError(
        "cudaMallocAsync(&data, size, stream) failed: out of memory"))
    assert not device_lost(RuntimeError("device lost its mind"))

"""Prompt logprobs (completions `echo` with `logprobs`) on the engine: the worker scores
every prompt token against mlx-lm's log-softmax, across prefill chunks, past the prefix
cache, and a request that did not ask pays nothing."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from ipc.messages.common import SamplingParams
from ipc.messages.to_scheduler import PromptLogprobs, StepResult, TokenizedRequest
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from scheduler_proc.request import Req
from tests.engine_driver import InProcessEngine

TOL = 1e-4


def _prompt_reference(model: Any, prompt: list[int]) -> np.ndarray:
    """mlx-lm's log-softmax at every prompt position, [len(prompt), V]."""
    logits = model(mx.array([prompt]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _check_prompt(model: Any, prompt: list[int], entries: list[Any], k: int) -> None:
    ref = _prompt_reference(model, prompt)
    assert len(entries) == len(prompt) - 1
    for pos, lp in enumerate(entries, start=1):
        assert abs(lp.logprob - ref[pos - 1, prompt[pos]]) < TOL, pos
        assert lp.top_ids == np.argsort(-ref[pos - 1])[:k].tolist()
        np.testing.assert_allclose(lp.top_logprobs, ref[pos - 1, lp.top_ids], atol=TOL)


def _prompt(vocab: int, n: int, seed: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(5, vocab, size=n).tolist()


@pytest.mark.parametrize("chunk", [16, 37, 512])
def test_prompt_logprobs_equal_mlx_lm_across_chunks(tiny_model: tuple[Any, Any],
                                                    chunk: int) -> None:
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer.vocab_size, 100)
    engine = InProcessEngine(model, chunk_size=chunk, max_prefill_tokens=chunk)
    engine.submit("a", prompt, 3, [], logprobs=2, prompt_logprobs=2)
    engine.submit("plain", prompt[:50], 3, [])
    out = engine.run_until_idle()
    _check_prompt(model, prompt, out["a"].prompt_logprobs, 2)
    assert out["plain"].prompt_logprobs is None


@pytest.mark.parametrize("chunk", [16, 512])
def test_prompt_logprobs_read_back_through_the_ring_are_the_same(tiny_model: tuple[Any, Any],
                                                                 chunk: int) -> None:
    """The CUDA worker lands a step's prompt logprobs in its readback (after its tokens
    and logprobs; alone for a chunk that samples nothing), stood in for here."""
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer.vocab_size, 100, seed=9)
    outs = []
    for readback in (False, True):
        engine = InProcessEngine(model, chunk_size=chunk, max_prefill_tokens=chunk,
                                 readback=readback)
        engine.submit("a", prompt, 3, [], logprobs=2, prompt_logprobs=3)
        engine.submit("b", prompt[:40], 4, [], prompt_logprobs=0)
        outs.append(engine.run_until_idle())
    plain, ringed = outs
    for rid in ("a", "b"):
        assert ringed[rid].prompt_logprobs == plain[rid].prompt_logprobs
        assert ringed[rid].token_ids == plain[rid].token_ids
        assert ringed[rid].logprobs == plain[rid].logprobs
    _check_prompt(model, prompt, ringed["a"].prompt_logprobs, 3)
    _check_prompt(model, prompt[:40], ringed["b"].prompt_logprobs, 0)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_model: tuple[Any, Any], oracle) -> None:
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer.vocab_size, 60, seed=8)
    engine = InProcessEngine(model, chunk_size=32)
    engine.submit("warm", prompt, 2, [])
    engine.run_until_idle()
    computed = engine.scheduler.counters.computed_prompt_tokens
    engine.submit("scored", prompt, 4, [], prompt_logprobs=0)
    out = engine.run_until_idle()
    # The whole prompt was computed again, although the cache held it.
    assert engine.scheduler.counters.computed_prompt_tokens - computed == len(prompt)
    _check_prompt(model, prompt, out["scored"].prompt_logprobs, 0)
    assert out["scored"].token_ids == oracle(prompt, 4)
    # ... and cached it for later requests, which read it.
    assert engine.scheduler.stats().cache_hit_tokens_total == 0
    engine.submit("later", prompt, 2, [])
    engine.run_until_idle()
    assert engine.scheduler.stats().cache_hit_tokens_total == len(prompt) - 1
    assert engine.scheduler.slots_consistent()


def test_prompt_only_request_generates_nothing(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    prompt = _prompt(tokenizer.vocab_size, 20, seed=2)
    engine = InProcessEngine(model, chunk_size=8)
    engine.submit("zero", prompt, 0, [], prompt_logprobs=1, logprobs=1)
    out = engine.run_until_idle()["zero"]
    assert out.token_ids == [] and out.finish_reason == "length" and out.logprobs == []
    _check_prompt(model, prompt, out.prompt_logprobs, 1)
    assert engine.scheduler.slots_consistent()


def test_one_token_prompt_has_no_entries(tiny_model: tuple[Any, Any]) -> None:
    model, _ = tiny_model
    engine = InProcessEngine(model)
    engine.submit("one", [7], 2, [], prompt_logprobs=3)
    assert engine.run_until_idle()["one"].prompt_logprobs == []


def test_cumulative_logprob_sums_the_sampled_tokens(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    engine = InProcessEngine(model)
    engine.submit("a", _prompt(tokenizer.vocab_size, 9), 6, [], logprobs=0,
                  temperature=1.0, seed=3)
    out = engine.run_until_idle()["a"]
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_a_request_that_does_not_ask_adds_nothing_to_the_step(tiny_model: tuple[Any, Any]) -> None:
    model, _ = tiny_model
    engine = InProcessEngine(model)
    runner = engine.runner
    chunk = PrefillChunk(rid="r", start=0, token_ids=[5, 6, 7], slot_ids=[1, 2, 3], sample=True)
    result = runner.run(ForwardBatch(step=1, new_requests=[NewRequest(
        rid="r", sampling=SamplingParams(temperature=0.0))], prefill=[chunk]))
    assert result.prompt_logprobs == [] and not runner._prompt_logprobs


def test_scheduler_takes_prompt_entries_once_in_order() -> None:
    req = Req.from_message(TokenizedRequest(
        rid="r", input_ids=[1, 2, 3, 4, 5], stop_token_ids=[],
        sampling=SamplingParams(prompt_logprobs=0)))
    scored = PromptLogprobs(rid="r", start=1, logprobs=[-1.0, -2.0], top_k=0)
    req.add_prompt_logprobs(scored.start, scored.entries())
    req.add_prompt_logprobs(scored.start, scored.entries())  # a repeat: ignored
    req.add_prompt_logprobs(4, PromptLogprobs(rid="r", start=4, logprobs=[-4.0],
                                              top_k=0).entries())  # a gap: ignored
    assert [e.logprob for e in req.prompt_logprobs] == [-1.0, -2.0] and req.wants_prompt_logprobs
    req.add_prompt_logprobs(2, PromptLogprobs(rid="r", start=2, logprobs=[-2.0, -3.0, -4.0, -5.0],
                                              top_k=0).entries())
    assert [e.logprob for e in req.prompt_logprobs] == [-1.0, -2.0, -3.0, -4.0]
    assert not req.wants_prompt_logprobs


def test_step_result_prompt_logprobs_round_trip() -> None:
    import msgspec

    result = StepResult(step=2, rids=[], token_ids=[], prompt_logprobs=[
        PromptLogprobs(rid="a", start=3, logprobs=[-0.5, -1.0], top_k=1, top_ids=[4, 5],
                       top_logprobs=[-0.1, -0.2])])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=StepResult)
    assert decoded == result
    (entry_a, entry_b) = decoded.prompt_logprobs[0].entries()
    assert entry_a.top_ids == [4] and entry_b.top_logprobs == [-0.2]


@pytest.mark.parametrize("overlap", [True, "ahead"])
def test_prompt_logprobs_survive_preemption(tiny_model: tuple[Any, Any], oracle,
                                            overlap: bool | str) -> None:
    model, tokenizer = tiny_model
    prompts = [_prompt(tokenizer.vocab_size, 120, seed=30 + i) for i in range(8)]
    engine = InProcessEngine(model, capacity=500, max_running=8, chunk_size=32,
                             max_prefill_tokens=64, overlap=overlap)
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, 40, [], prompt_logprobs=1)
    out = engine.run_until_idle()
    assert engine.scheduler.counters.preemptions > 0
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].token_ids == oracle(p, 40)
        _check_prompt(model, p, out[f"r{i}"].prompt_logprobs, 1)
    assert engine.scheduler.slots_consistent() and not engine.runner._prompt_logprobs

"""Structured output below the HTTP layer: the MLX grammar mask op on fixed logits, the
worker's matchers, the front's validation of constraints, and constrained requests through
the real scheduler and worker on the tiny model (every overlap mode, batch mates,
preemption)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import mlx.core as mx
import msgspec
import numpy as np
import pytest

from ipc.messages.common import SamplingParams
from tests.engine_driver import InProcessEngine
from tests.test_structured_output import SCHEMA
from kiln_common.llguidance_tokenizer import ll_tokenizer
from tokenizer_proc.errors import RequestError
from tokenizer_proc.protocol import ChatCompletionRequest, CompletionRequest, GenerateBody
from worker_proc.grammar import GrammarMatchers
from worker_proc.sampling import (GrammarMask, SamplingBatch, apply_grammar_mask, gumbel_from_bits,
                                  process_logits, sample)


def _packed(allowed: np.ndarray) -> np.ndarray:
    """llguidance's layout for a [G, V] bool array: bit t % 32 of int32 word t // 32."""
    words = (allowed.shape[1] + 31) // 32
    padded = np.zeros((allowed.shape[0], words * 32), dtype=bool)
    padded[:, :allowed.shape[1]] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


# --- the mask op on fixed logits ------------------------------------------------------------


@pytest.mark.parametrize("rows", [[1, 3], [0, 1, 2, 3]])  # some rows, or the whole batch
def test_mask_sets_disallowed_to_minus_inf_and_keeps_the_rest_bit_for_bit(rows) -> None:
    rng = np.random.default_rng(0)
    vocab, tokenizer_vocab = 100, 70  # a model vocab wider than the tokenizer's
    logits = rng.normal(0, 3, size=(4, vocab)).astype(np.float32)
    allowed = rng.random((len(rows), tokenizer_vocab)) < 0.2
    out = np.array(apply_grammar_mask(mx.array(logits), GrammarMask.build(rows, _packed(allowed))))
    for j, row in enumerate(rows):
        full = np.zeros(vocab, dtype=bool)
        full[:tokenizer_vocab] = allowed[j]
        assert np.array_equal(out[row][full], logits[row][full])  # relative logits intact
        assert np.all(out[row][~full] == -np.inf)  # ids past the tokenizer's too
    free = [r for r in range(4) if r not in rows]
    assert np.array_equal(out[free], logits[free])  # unconstrained rows untouched


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=2.0, top_k=5, top_p=0.9, min_p=0.05)])
def test_sampling_never_picks_a_masked_token(settings: dict[str, Any]) -> None:
    rng = np.random.default_rng(1)
    rows, vocab = 64, 50
    # Masked tokens get the highest logits, so only the mask keeps them out.
    allowed = rng.random((rows, vocab)) < 0.1
    allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True
    logits = np.where(allowed, rng.normal(0, 1, (rows, vocab)), 10.0).astype(np.float32)
    params = [SamplingParams(**settings) for _ in range(rows)]
    for step in range(5):
        batch = SamplingBatch.build(params, list(range(rows)), [step] * rows,
                                    grammar=GrammarMask.build(list(range(rows)), _packed(allowed)))
        tokens = np.array(sample(mx.array(logits), batch))
        assert allowed[np.arange(rows), tokens].all()


def test_gumbel_noise_is_finite_in_every_bucket() -> None:
    """The top bucket once rounded to u == 1.0 (noise +inf): a masked token's -inf plus it
    was NaN, and argmax took it."""
    edges = np.array([0, 1, 2**23, 2**24 - 2, 2**24 - 1], dtype=np.uint32)
    noise = np.array(gumbel_from_bits(mx.array(edges)))
    assert np.isfinite(noise).all() and (np.diff(noise) > 0).all()


def test_a_batch_without_grammar_rows_is_processed_as_before() -> None:
    logits = mx.array(np.random.default_rng(2).normal(size=(3, 20)).astype(np.float32))
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 3, [0] * 3, [0] * 3)
    assert batch.grammar is None
    assert np.array_equal(np.array(process_logits(logits, batch)), np.array(logits))


# --- the worker's matchers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def preparer(tiny_model_dir):
    from tokenizer_proc.prepare import RequestPreparer

    return RequestPreparer.load("tiny", str(tiny_model_dir))


@pytest.fixture(scope="module")
def matchers(tiny_model, preparer) -> GrammarMatchers:
    hf = tiny_model[1]._tokenizer
    return GrammarMatchers(lambda: ll_tokenizer(hf, preparer.info.eos_token_ids))


def _allowed_ids(masks: np.ndarray, vocab: int) -> list[list[int]]:
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return [np.nonzero(row)[0].tolist() for row in bits]


def test_a_finished_grammar_allows_only_eos(matchers, preparer, tiny_model) -> None:
    from llguidance import LLMatcher

    tokenizer = tiny_model[1]
    grammar = LLMatcher.grammar_from_regex("ab[0-9]")
    done = matchers.matcher(grammar, tokenizer.encode("ab7"))  # a resumed request
    fresh = matchers.matcher(grammar)
    start, end = _allowed_ids(matchers.fill([fresh, done]), len(tokenizer._tokenizer))
    assert list(preparer.info.eos_token_ids) == end
    assert start and all(tokenizer.decode([t]) in ("a", "ab") for t in start)


def test_matchers_of_one_grammar_are_independent(matchers, tiny_model) -> None:
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_regex("(yes|no)")
    a, b = matchers.matcher(grammar), matchers.matcher(grammar)
    GrammarMatchers.advance(a, tiny_model[1].encode("no")[0])
    assert not np.array_equal(*matchers.fill([a, b]))


# --- the front's validation -----------------------------------------------------------------


def _native(preparer, **sampling: Any):
    return preparer.native(GenerateBody.model_validate(
        {"text": "hi", "sampling_params": sampling}), "r")


def _refused(call, *args: Any, **kwargs: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args, **kwargs)
    assert info.value.status == 400
    return info.value


def test_each_constraint_becomes_a_grammar(preparer) -> None:
    for sampling in (dict(json_schema=SCHEMA), dict(json_schema=json.dumps(SCHEMA)),
                     dict(regex="[a-z]+"), dict(lark='start: "a" | "b"'),
                     dict(ebnf='root ::= "yes" | "no"')):
        assert _native(preparer, **sampling).sampling.grammar, sampling
    chat = preparer.chat(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}}), "r")
    assert chat.sampling.grammar
    completion = preparer.completion(CompletionRequest.model_validate(
        {"prompt": "hi", "response_format": {"type": "json_object"}}), "r")
    assert completion.sampling.grammar
    text = preparer.completion(CompletionRequest.model_validate(
        {"prompt": "hi", "response_format": {"type": "text"}}), "r")
    assert text.sampling.grammar is None


@pytest.mark.parametrize("sampling, param", [
    (dict(regex="a(b"), "sampling_params.regex"),
    (dict(lark="start: missing_rule"), "sampling_params.lark"),
    (dict(ebnf='root ::= "unclosed'), "sampling_params.ebnf"),
    (dict(json_schema={"type": "no-such-type"}), "sampling_params.json_schema"),
    (dict(json_schema='{"type": '), "sampling_params.json_schema"),
    (dict(json_schema="[1, 2]"), "sampling_params.json_schema"),
    (dict(regex="a+", lark='start: "a"'), "sampling_params.lark"),
    (dict(regex="a+", ignore_eos=True), "sampling_params.ignore_eos"),
    (dict(regex="a+", min_new_tokens=2), "sampling_params.min_new_tokens"),
])
def test_bad_constraints_are_refused_with_their_parameter(preparer, sampling, param) -> None:
    assert _refused(_native, preparer, **sampling).param == param


def test_bad_response_formats_are_refused(preparer) -> None:
    def chat(fmt: dict[str, Any]) -> Any:
        return preparer.chat(ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}), "r")

    assert _refused(chat, {"type": "xml"}).param == "response_format.type"
    assert _refused(chat, {"type": "json_schema"}).param == "response_format.json_schema.schema"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    assert _refused(chat, bad).param == "response_format.json_schema.schema"


# --- through the real scheduler and worker ----------------------------------------------


def _engine(tiny_model, matchers, **kwargs: Any) -> InProcessEngine:
    return InProcessEngine(tiny_model[0], grammars=matchers, **kwargs)


def _submit(engine: InProcessEngine, preparer, rid: str, text: str, **sampling: Any) -> None:
    engine.submit_message(preparer.native(GenerateBody.model_validate(
        {"text": text, "sampling_params": sampling}), rid))


@pytest.mark.parametrize("overlap", [True, "ahead", False, "thread"])
def test_constrained_rows_validate_and_greedy_mates_match_mlx_lm(tiny_model, preparer, matchers,
                                                                   oracle, overlap,
                                                                   request) -> None:
    # "thread": started ahead from a launch thread (CUDA's default), the forward of a step
    # with constrained rows handed over before its masks are filled.
    options = ({"overlap": "ahead", "launcher": request.getfixturevalue("launcher")}
               if overlap == "thread" else {"overlap": overlap})
    engine = _engine(tiny_model, matchers, **options)
    tokenizer = tiny_model[1]
    plain = [preparer.text_ids(f"plain prompt {i}", "text") for i in range(3)]
    for i, ids in enumerate(plain):
        engine.submit_message(preparer.native(GenerateBody.model_validate(
            {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}),
            f"plain{i}"))
    for seed in range(4):
        _submit(engine, preparer, f"json{seed}", f"pet {seed}", json_schema=SCHEMA,
                temperature=1.0, seed=seed, max_new_tokens=120)
    _submit(engine, preparer, "regex", "code", regex="[A-Z]{2}-[0-9]{3}", temperature=1.0,
            seed=5, max_new_tokens=20)
    results = engine.run_until_idle()
    for i, ids in enumerate(plain):
        expected = oracle(ids, 24)
        assert results[f"plain{i}"].token_ids == expected
    for seed in range(4):
        r = results[f"json{seed}"]
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(r.token_ids)), SCHEMA)
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", tokenizer.decode(results["regex"].token_ids))


def test_a_preempted_constrained_request_resumes_its_grammar(tiny_model, preparer,
                                                             matchers) -> None:
    """Under a pool too small for everyone, the newest requests are preempted and re-added;
    their matchers must resume after the outputs they have, so the seeded outputs equal an
    unpressured run's."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 1024, 50).tolist() for _ in range(8)]

    def run(capacity: int) -> tuple[dict[str, Any], int]:
        engine = _engine(tiny_model, matchers, capacity=capacity, max_running=8)
        for i, ids in enumerate(prompts):
            # Outputs run to ~55 tokens, beyond what admission expects of max 80 (half):
            # the decode then runs out of slots and preempts.
            engine.submit_message(preparer.native(GenerateBody.model_validate(
                {"input_ids": ids, "sampling_params": dict(
                    json_schema=SCHEMA, temperature=1.0, seed=100 + i, max_new_tokens=80)}),
                f"r{i}"))
        return engine.run_until_idle(), engine.scheduler.counters.preemptions

    relaxed, none = run(8192)
    tight, preemptions = run(600)
    assert none == 0 and preemptions > 0
    for rid, r in relaxed.items():
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(tiny_model[1].decode(r.token_ids)), SCHEMA)
        assert tight[rid].token_ids == r.token_ids, rid


def test_a_grammar_the_worker_cannot_build_ends_its_request_without_killing_it(
        matchers, preparer, tiny_model) -> None:
    """The front validates every grammar, so this is a bug path: the failed matcher
    allows only EOS, and the request ends with "stop" instead of the worker dying."""
    engine = _engine(tiny_model, matchers)
    ok = preparer.native(GenerateBody.model_validate(
        {"text": "x", "sampling_params": {"regex": "[a-z]{2}", "max_new_tokens": 8}}), "bad")
    engine.submit_message(msgspec.structs.replace(ok, sampling=msgspec.structs.replace(
        ok.sampling, grammar="start: missing_rule")))
    _submit(engine, preparer, "good", "y", regex="[a-z]{2}", max_new_tokens=8)
    results = engine.run_until_idle()
    assert (results["bad"].token_ids, results["bad"].finish_reason) == ([], "stop")
    assert len(tiny_model[1].decode(results["good"].token_ids)) == 2

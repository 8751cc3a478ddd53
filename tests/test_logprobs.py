"""Logprobs: the worker's values against mlx-lm's logits, batch independence, the wire
records, and the OpenAI shapes through the real server."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import openai
import pytest

from ipc.messages.common import SamplingParams
from ipc.messages.to_scheduler import StepResult
from tests.engine_driver import Finished, InProcessEngine
from tests.server import Server
from worker_proc.sampling import step_logprobs

pytestmark = pytest.mark.timeout(600)

MODEL = "demo-tiny"
TOL = 1e-4


def _reference(model: Any, prompt: list[int], generated: list[int]) -> np.ndarray:
    """mlx-lm's log-softmax at each generated position, [len(generated), V]."""
    logits = model(mx.array([prompt + generated]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(logprobs[len(prompt) - 1:len(prompt) - 1 + len(generated)])


def _check_against_reference(model: Any, prompt: list[int], done: Finished, k: int) -> None:
    ref = _reference(model, prompt, done.token_ids)
    assert len(done.logprobs) == len(done.token_ids) > 0
    for pos, (token, lp) in enumerate(zip(done.token_ids, done.logprobs)):
        assert abs(lp.logprob - ref[pos, token]) < TOL
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        assert lp.top_ids == np.argsort(-ref[pos])[:k].tolist()
        np.testing.assert_allclose(lp.top_logprobs, ref[pos, lp.top_ids], atol=TOL)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(5, vocab, size=n).tolist() for n in (7, 40, 3, 150)]


def _run(model: Any, requests: dict[str, tuple[list[int], dict[str, Any]]]) -> dict[str, Finished]:
    engine = InProcessEngine(model, chunk_size=64, max_prefill_tokens=128)
    for rid, (prompt, sampling) in requests.items():
        engine.submit(rid, prompt, 12, [], **sampling)
    return engine.run_until_idle()


def test_worker_logprobs_equal_mlx_lm_log_softmax(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    p = _prompts(tokenizer.vocab_size)
    out = _run(model, {
        "greedy": (p[0], {"logprobs": 5}),
        "sampled": (p[1], {"logprobs": 20, "temperature": 1.3, "top_p": 0.8, "seed": 4}),
        "sampled0": (p[2], {"logprobs": 0, "temperature": 0.7, "seed": 9,
                            "repetition_penalty": 1.3}),
        "plain": (p[3], {}),
    })
    _check_against_reference(model, p[0], out["greedy"], 5)
    # Raw distribution: temperature, top-p and penalties do not change the values.
    _check_against_reference(model, p[1], out["sampled"], 20)
    _check_against_reference(model, p[2], out["sampled0"], 0)
    assert out["plain"].logprobs == [] and len(out["plain"].token_ids) == 12


def test_batch_mates_do_not_change_logprobs(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    p = _prompts(tokenizer.vocab_size)
    alone = _run(model, {"a": (p[0], {"logprobs": 3})})["a"]
    mates = {f"m{i}": (prompt, {"logprobs": i, "temperature": 1.0, "seed": i})
             for i, prompt in enumerate(p[1:])}
    batched = _run(model, {"a": (p[0], {"logprobs": 3}), **mates})["a"]
    assert batched.token_ids == alone.token_ids
    for x, y in zip(alone.logprobs, batched.logprobs):
        assert x.top_ids == y.top_ids
        np.testing.assert_allclose([x.logprob, *x.top_logprobs],
                                   [y.logprob, *y.top_logprobs], atol=TOL)


def test_no_row_asking_adds_nothing() -> None:
    logits = mx.random.normal((3, 50))
    tokens = mx.array([1, 2, 3], dtype=mx.int32)
    assert step_logprobs(logits, tokens, [SamplingParams()] * 3) is None
    lp = step_logprobs(logits, tokens, [SamplingParams(), SamplingParams(logprobs=2),
                                        SamplingParams()])
    assert lp is not None and lp.rows == [1] and lp.top_ids.shape == (1, 2)


def test_step_result_logprobs_round_trip() -> None:
    result = StepResult(step=3, rids=["a", "b", "c"], token_ids=[5, 6, 7], logprob_rows=[0, 2],
                        logprobs=[-0.5, -1.5], top_counts=[2, 0], top_ids=[5, 9],
                        top_logprobs=[-0.5, -2.0])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=StepResult)
    assert decoded == result
    by_row = decoded.token_logprobs()
    assert sorted(by_row) == [0, 2]
    assert by_row[0].top_ids == [5, 9] and by_row[2].top_ids == []
    assert by_row[2].logprob == -1.5


# --- OpenAI shapes through the real server ------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = Server(tiny_model_dir, "--max-total-tokens", "8000", "--max-running-requests", "8",
                 "--served-model-name", MODEL, log_path=log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_zmq_client_logprobs_equal_mlx_lm_log_softmax(server, tiny_model) -> None:
    from ipc.client import KilnClient, KilnRequestError

    model, _ = tiny_model
    prompt = _prompts(model.args.vocab_size)[1]
    with KilnClient(server.zmq) as zmq_client:
        whole = zmq_client.generate(input_ids=prompt, max_tokens=8, temperature=0.0, logprobs=3)
        deltas = list(zmq_client.stream(input_ids=prompt, max_tokens=8, temperature=0.0,
                                        logprobs=3))
        with pytest.raises(KilnRequestError, match="logprobs"):
            zmq_client.generate(input_ids=prompt, max_tokens=2, logprobs=21)
        plain = zmq_client.generate(input_ids=prompt, max_tokens=2, temperature=0.0)
    assert plain.logprobs is None
    ref = _reference(model, prompt, whole.token_ids)
    assert len(whole.logprobs) == len(whole.token_ids) == 8
    for pos, (token, lp) in enumerate(zip(whole.token_ids, whole.logprobs)):
        assert abs(lp.logprob - ref[pos, token]) < TOL and len(lp.top_logprobs) == 3
        np.testing.assert_allclose(sorted(lp.top_logprobs, reverse=True),
                                   np.sort(ref[pos])[::-1][:3], atol=TOL)
    streamed = [lp.logprob for d in deltas for lp in d.logprobs or []]
    np.testing.assert_allclose(streamed, [lp.logprob for lp in whole.logprobs], atol=TOL)


HELLO = [{"role": "user", "content": "hello"}]


def _check_chat_entries(content: list[Any], k: int) -> None:
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == k
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert all(entry.logprob <= v + TOL for v in values[:1])


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens - (choice.finish_reason == "stop")
    assert "".join(e.token for e in content) == choice.message.content
    _check_chat_entries(content, 3)
    # Greedy: the sampled token is the most likely one.
    assert all(e.token == e.top_logprobs[0].token for e in content)
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert 0 < len(entries) <= 6 and "".join(e.token for e in entries) == text
    _check_chat_entries(entries, 0)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="once upon", max_tokens=5,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 1 <= len(top) <= 3


def test_completion_logprobs_streamed_match_whole(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "prompt": "once upon", "max_tokens": 5, "temperature": 0,
            "logprobs": 1}
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **args))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [o for p in parts for o in p.text_offset] == whole.text_offset
    np.testing.assert_allclose([v for p in parts for v in p.token_logprobs],
                               whole.token_logprobs, atol=TOL)


def test_completion_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="once upon", max_tokens=3, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=MODEL, prompt="once upon", max_tokens=3,
                                      temperature=0)
    assert r.choices[0].text == "once upon" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="once upon", max_tokens=3,
                                            temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize(("kind", "args", "param"), [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
])
def test_logprobs_validation(client: openai.OpenAI, kind: str, args: dict[str, Any],
                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **args)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **args)
    assert info.value.param == param

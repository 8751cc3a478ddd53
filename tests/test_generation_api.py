"""Issue 4's generation API through the real server: completions `echo` with prompt
logprobs (and max_tokens 0), `best_of`, the native /generate's `n` and logprobs, the ZMQ
client's `n`, and logprobs that follow stop-string trimming. Values are checked against
mlx-lm's log-softmax."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from tests.server import Server

pytestmark = pytest.mark.timeout(600)

MODEL = "demo-tiny"
TOL = 1e-4


def _log_softmax(model: Any, ids: list[int]) -> np.ndarray:
    """mlx-lm's log-softmax at every position of ids, [len(ids), V]."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _prompt(vocab: int, n: int = 24, seed: int = 11) -> list[int]:
    return np.random.default_rng(seed).integers(5, vocab, size=n).tolist()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # Small chunks: a prompt's logprobs come from several prefill chunks.
    srv = Server(tiny_model_dir, "--max-total-tokens", "8000", "--max-running-requests", "8",
                 "--chunked-prefill-size", "16", "--served-model-name", MODEL,
                 log_path=log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def vocab(tiny_model) -> int:
    return tiny_model[0].args.vocab_size


# --- echo with prompt logprobs ------------------------------------------------------------


def _check_echo_logprobs(model: Any, tokenizer: Any, prompt: list[int], choice: Any,
                         k: int) -> None:
    lp = choice.logprobs
    n_prompt = len(prompt)
    ref = _log_softmax(model, prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:n_prompt] == [tokenizer.decode([t]) for t in prompt]
    for pos in range(1, n_prompt):
        assert abs(lp.token_logprobs[pos] - ref[pos - 1, prompt[pos]]) < TOL
        top = lp.top_logprobs[pos]
        best = np.argsort(-ref[pos - 1])[:k]
        # The dict holds the top k and the prompt token itself, keyed by text (so tokens
        # that decode alike, U+FFFD pieces, share a key: those positions are not compared).
        assert len(top) <= k + 1 and top[lp.tokens[pos]] == lp.token_logprobs[pos]
        texts = {tokenizer.decode([t]) for t in [*best, prompt[pos]]}
        if len(texts) == len({*best.tolist(), prompt[pos]}):
            np.testing.assert_allclose(sorted(top.values(), reverse=True)[:k],
                                       ref[pos - 1, best], atol=TOL)
    assert lp.text_offset[:n_prompt] == [sum(len(t) for t in lp.tokens[:i])
                                         for i in range(n_prompt)]


def test_echo_logprobs_cover_the_prompt(client, tiny_model, vocab) -> None:
    model, tokenizer = tiny_model
    prompt = _prompt(vocab, 40)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text.startswith(tokenizer.decode(prompt))
    lp = choice.logprobs
    generated = r.usage.completion_tokens - (choice.finish_reason == "stop")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + generated
    _check_echo_logprobs(model, tokenizer, prompt, choice, 3)
    # The generated tokens' entries follow, as without echo.
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                      temperature=0, logprobs=3)
    np.testing.assert_allclose(lp.token_logprobs[len(prompt):],
                               plain.choices[0].logprobs.token_logprobs, atol=TOL)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_echo_logprobs_streamed_match_whole(client, vocab) -> None:
    prompt = _prompt(vocab, 30, seed=4)
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "echo": True, "logprobs": 1}
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(stream=True, **args))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [t for p in parts for t in p.tokens] == whole.logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == whole.logprobs.text_offset
    streamed = [v for p in parts for v in p.token_logprobs]
    assert streamed[0] is None
    np.testing.assert_allclose(streamed[1:], whole.logprobs.token_logprobs[1:], atol=TOL)


def test_echo_with_max_tokens_zero_returns_the_prompt_only(client, tiny_model, vocab) -> None:
    model, tokenizer = tiny_model
    prompt = _prompt(vocab, 20, seed=6)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=2)
    choice = r.choices[0]
    assert choice.text == tokenizer.decode(prompt) and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt)
    _check_echo_logprobs(model, tokenizer, prompt, choice, 2)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert info.value.param == "max_tokens"


def test_echo_logprobs_with_n_share_the_prompt(client, tiny_model, vocab) -> None:
    model, tokenizer = tiny_model
    prompt = _prompt(vocab, 20, seed=9)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2, seed=5,
                                  echo=True, logprobs=1)
    for choice in r.choices:
        _check_echo_logprobs(model, tokenizer, prompt, choice, 1)


# --- best_of ------------------------------------------------------------------------------


def test_best_of_returns_the_highest_logprob_per_token(client, vocab) -> None:
    prompt = _prompt(vocab, 12, seed=3)
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.0,
            "seed": 21, "extra_body": {"ignore_eos": True}}
    # The same choices, all shown: choice i samples with seed + i either way.
    every = client.completions.create(n=4, logprobs=0, **args)
    means = [np.mean(c.logprobs.token_logprobs) for c in every.choices]
    order = np.argsort(means, kind="stable")[::-1]
    best = client.completions.create(n=2, best_of=4, **args)
    assert [c.text for c in best.choices] == [every.choices[i].text for i in order[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # only used to rank
    assert best.usage.completion_tokens == 4 * 6  # every choice generated counts
    shown = client.completions.create(n=1, best_of=4, logprobs=2, **args).choices[0]
    assert shown.text == every.choices[order[0]].text
    np.testing.assert_allclose(shown.logprobs.token_logprobs,
                               every.choices[order[0]].logprobs.token_logprobs, atol=TOL)


def test_best_of_cannot_stream(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", best_of=2, stream=True)
    assert info.value.param == "best_of"


# --- the native /generate -----------------------------------------------------------------


def test_native_logprobs_equal_mlx_lm(server, tiny_model, vocab) -> None:
    model, tokenizer = tiny_model
    prompt = _prompt(vocab, 25, seed=12)
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 3, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    out = [e[1] for e in meta["output_token_logprobs"]]
    ref = _log_softmax(model, prompt + out)
    assert len(meta["input_token_logprobs"]) == len(prompt) - 3
    for pos, (lp, token, text) in enumerate(meta["input_token_logprobs"], start=3):
        assert token == prompt[pos] and text == tokenizer.decode([token])
        assert abs(lp - ref[pos - 1, token]) < TOL
    for pos, ((lp, token, _), top) in enumerate(zip(meta["output_token_logprobs"],
                                                    meta["output_top_logprobs"])):
        at = len(prompt) - 1 + pos
        assert abs(lp - ref[at, token]) < TOL
        assert [t[1] for t in top] == np.argsort(-ref[at])[:2].tolist()
    # Streamed: each piece carries its own tokens' entries, the first the prompt's.
    pieces = _sse(httpx.post(server.url + "/generate", json={**body, "stream": True},
                             timeout=60).text)
    assert pieces[0]["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
    streamed = [e for p in pieces for e in p["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose([e[0] for e in streamed],
                               [e[0] for e in meta["output_token_logprobs"]], atol=TOL)


def test_native_prompt_only_scores_from_the_start(server, tiny_model, vocab) -> None:
    model, _ = tiny_model
    prompt = _prompt(vocab, 10, seed=13)
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    meta = r["meta_info"]
    assert r["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["input_token_logprobs"][0] == [None, prompt[0], None]
    assert meta["input_top_logprobs"][0] is None
    ref = _log_softmax(model, prompt)
    np.testing.assert_allclose([e[0] for e in meta["input_token_logprobs"][1:]],
                               [ref[i - 1, prompt[i]] for i in range(1, len(prompt))],
                               atol=TOL)


def test_native_n_equals_seeded_single_requests(server, vocab) -> None:
    prompt = _prompt(vocab, 8, seed=14)
    params = {"max_new_tokens": 5, "temperature": 1.0, "seed": 40, "ignore_eos": True}
    many = httpx.post(server.url + "/generate", json={
        "input_ids": prompt, "sampling_params": {**params, "n": 3}}, timeout=60).json()
    singles = [httpx.post(server.url + "/generate", json={
        "input_ids": prompt, "sampling_params": {**params, "seed": 40 + i}},
        timeout=60).json() for i in range(3)]
    assert [m["meta_info"]["index"] for m in many] == [0, 1, 2]
    assert [m["output_ids"] for m in many] == [s["output_ids"] for s in singles]
    streamed = _sse(httpx.post(server.url + "/generate", json={
        "input_ids": prompt, "stream": True, "sampling_params": {**params, "n": 3}},
        timeout=60).text)
    for i in range(3):
        ids = [t for p in streamed if p["meta_info"]["index"] == i for t in p["output_ids"]]
        assert ids == many[i]["output_ids"]


def _sse(text: str) -> list[dict[str, Any]]:
    datas = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_zmq_client_n(server, vocab) -> None:
    from ipc.client import KilnClient

    prompt = _prompt(vocab, 8, seed=15)
    args = {"max_tokens": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    with KilnClient(server.zmq) as zmq_client:
        results = zmq_client.generate(input_ids=prompt, n=3, logprobs=0, **args)
        single = zmq_client.generate(input_ids=prompt, **{**args, "seed": 4})
        deltas = list(zmq_client.stream(input_ids=prompt, n=3, **args))
    assert [r.index for r in results] == [0, 1, 2]
    assert results[1].token_ids == single.token_ids
    assert all(len(r.logprobs) == 4 and r.usage.completion_tokens == 4 for r in results)
    for r in results:
        assert [t for d in deltas if d.index == r.index for t in d.token_ids] == r.token_ids
    assert sum(d.finished for d in deltas) == 3


def _native_prompt_scores(server: Server, body: dict[str, Any], k: int) -> dict[str, Any]:
    """/generate's prompt entries from position 0, with texts, for the ZMQ comparison."""
    full = {**body, "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": 0,
            "return_text_in_logprobs": True}
    return httpx.post(server.url + "/generate", json=full, timeout=60).json()["meta_info"]


def _as_native(entries: list[Any]) -> tuple[list[Any], list[Any]]:
    """The ZMQ client's prompt entries in /generate's [logprob, id, text] triples."""
    tokens = [None if e is None else [e.logprob, e.token_id, e.token] for e in entries]
    tops = [None if e is None else [list(t) for t in zip(e.top_logprobs, e.top_ids,
                                                         e.top_tokens)] for e in entries]
    return tokens, tops


def test_zmq_prompt_logprobs_equal_native_and_mlx_lm(server, tiny_model, vocab) -> None:
    from ipc.client import AsyncKilnClient, KilnClient

    model, _ = tiny_model
    prompt = _prompt(vocab, 40, seed=16)  # over 2 prefill chunks of 16
    k = 3
    args = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    native = _native_prompt_scores(server, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, k)
    with KilnClient(server.zmq) as zmq_client:
        result = zmq_client.generate(input_ids=prompt, prompt_logprobs=k, **args)
        deltas = list(zmq_client.stream(input_ids=prompt, prompt_logprobs=k, **args))
    tokens, tops = _as_native(result.prompt_logprobs)
    # Position 0 has no logprob: None here, [null, id, text] and null natively.
    assert len(tokens) == len(prompt) and tokens[0] is None and tops[0] is None
    assert tokens[1:] == native["input_token_logprobs"][1:]
    assert tops[1:] == native["input_top_logprobs"][1:]
    ref = _log_softmax(model, prompt)
    for pos in range(1, len(prompt)):
        assert tokens[pos][1] == prompt[pos]
        assert abs(tokens[pos][0] - ref[pos - 1, prompt[pos]]) < TOL
        assert [t[1] for t in tops[pos]] == np.argsort(-ref[pos - 1])[:k].tolist()
    assert deltas[0].prompt_logprobs == result.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])

    async def score_text() -> Any:
        async with AsyncKilnClient(server.zmq) as client:
            return await client.generate("once upon a time", prompt_logprobs=0, max_tokens=0)

    scored = asyncio.run(score_text())
    native = _native_prompt_scores(server, {"text": "once upon a time",
                                            "sampling_params": {"max_new_tokens": 0}}, 0)
    assert scored.token_ids == [] and scored.usage.completion_tokens == 0
    assert _as_native(scored.prompt_logprobs)[0][1:] == native["input_token_logprobs"][1:]
    assert scored.finish_reason == "length"


# --- logprobs follow stop-string trimming ----------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_logprobs_stop_with_the_text(client, include: bool) -> None:
    args = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 12,
            "temperature": 0, "logprobs": 0, "extra_body": {"ignore_eos": True}}
    free = client.completions.create(**args).choices[0]
    tokens = free.logprobs.tokens
    # A stop string that starts inside token 4 and runs into token 5.
    start = sum(len(t) for t in tokens[:4]) + len(tokens[4]) // 2
    stop = free.text[start:start + 3]
    assert len(stop) == 3 and free.text.find(stop) == start, "pick another prompt"
    cut = client.completions.create(stop=[stop], **{**args, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": include}}).choices[0]
    end = start + (len(stop) if include else 0)
    assert cut.text == free.text[:end] and cut.finish_reason == "stop"
    # Entries of the tokens whose text starts before the cut: a token cut in part keeps
    # its entry, those wholly past the cut have none.
    kept = sum(1 for offset in free.logprobs.text_offset if offset < end)
    assert cut.logprobs.tokens == tokens[:kept]
    assert cut.logprobs.text_offset == free.logprobs.text_offset[:kept]
    chunks = list(client.completions.create(stream=True, stop=[stop], **{
        **args, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": include}}))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == cut.logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks) == cut.text


def test_best_of_ranks_per_token_and_keeps_order_on_ties() -> None:
    from ipc.messages.common import Usage
    from tokenizer_proc.manager import Collected
    from tokenizer_proc.responses import BestOf

    def result(text: str, total: float | None, tokens: int) -> Collected:
        return Collected(text=text, token_ids=[], finish_reason="length",
                         usage=Usage(prompt_tokens=1, completion_tokens=tokens),
                         logprobs=[], cumulative_logprob=total)

    # Per token, not summed: "long" has the lowest sum but the best mean.
    results = [result("a", -4.0, 2), result("long", -6.0, 6), result("b", -2.0, 1),
               result("none", None, 3)]
    picked = BestOf(3, show_logprobs=False).pick(results)
    assert [r.text for r in picked] == ["long", "a", "b"]
    assert all(r.logprobs is None for r in picked)
    assert BestOf(1, show_logprobs=True).pick(results)[0].logprobs == []


def test_echo_offsets_index_the_echoed_text_past_an_added_bos() -> None:
    """A BOS the tokenizer put before the prompt as sent is not in the echoed text: it
    sits at offset 0 and the prompt's tokens (and the completion's) index the text."""
    from ipc.messages.common import Usage
    from ipc.messages.to_tokenizer import PromptTextLogprobs, TextLogprob
    from tokenizer_proc.manager import Collected
    from tokenizer_proc.responses import CompletionFormat

    prompt = PromptTextLogprobs(first="<|begin_of_text|>", first_id=1,
                                rest=[TextLogprob("Hel", -1.0), TextLogprob("lo", -2.0)])
    done = Collected(text=" you", token_ids=[7], finish_reason="length",
                     usage=Usage(prompt_tokens=3, completion_tokens=1),
                     logprobs=[TextLogprob(" you", -0.5)], prompt_logprobs=prompt)
    whole = CompletionFormat("cmpl-1", "m", echo="Hello").response(done)["choices"][0]
    text, offsets = whole["text"], whole["logprobs"]["text_offset"]
    assert text == "Hello you" and offsets == [0, 0, 3, 5]
    assert [text[o:o + len(t)] for o, t in zip(offsets[1:], whole["logprobs"]["tokens"][1:])] \
        == ["Hel", "lo", " you"]
    streamed = CompletionFormat("cmpl-1", "m", echo="Hello")
    opening = streamed.opening(prompt)[0]["choices"][0]["logprobs"]["text_offset"]
    chunk = streamed.text_chunk(" you", [TextLogprob(" you", -0.5)])
    assert opening + chunk["choices"][0]["logprobs"]["text_offset"] == offsets
    # Without a BOS (the prompt's first token starts the echo) nothing changes.
    plain = PromptTextLogprobs(first="Hel", first_id=5, rest=[TextLogprob("lo", -2.0)])
    opening = CompletionFormat("cmpl-2", "m", echo="Hello").opening(plain)
    assert opening[0]["choices"][0]["logprobs"]["text_offset"] == [0, 3]

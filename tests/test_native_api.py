"""The native API against a scripted engine: /generate (whole and streamed), its
validation, and /abort_request."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.fake_engine import (FakeEngine, Script, endless_script, reject_script,
                               text_script)
from tokenizer_proc.http_api import create_app
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.prepare import RequestPreparer
from worker_proc.demo_model import ensure_demo_model

GENERATE = "/generate"
ABORT = "/abort_request"


@pytest.fixture(scope="module")
def preparer(tmp_path_factory: pytest.TempPathFactory) -> RequestPreparer:
    path = ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))
    return RequestPreparer.load("demo-tiny", str(path))


class Native:
    """An app on a fake engine, with a TestClient."""

    def __init__(self, preparer: RequestPreparer, script: Script) -> None:
        self.engine = FakeEngine(script)
        self.manager = TokenizerManager(self.engine, stats_timeout=5.0)
        self.engine.connect(self.manager)
        self.app = create_app(self.manager, preparer)
        self.http = TestClient(self.app)


@pytest.fixture
def make_api(preparer: RequestPreparer) -> Callable[[Script], Native]:
    return lambda script: Native(preparer, script)


@pytest.fixture
def api(make_api: Callable[[Script], Native]) -> Native:
    return make_api(text_script(["Hel", "lo", " world"]))


def events(text: str) -> list[Any]:
    """The data of each SSE event; '[DONE]' stays a string."""
    datas = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


async def generate_then_abort(app: FastAPI, engine: FakeEngine,
                              body: dict[str, Any]) -> tuple[httpx.Response, dict[str, Any]]:
    """POST /generate with `body["rid"]`, abort it by /abort_request once the engine has
    played its script (on a loaded machine an abort could otherwise overtake the
    outputs); returns the generate response and the abort answer."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        running = asyncio.ensure_future(client.post(GENERATE, json=body))
        while not engine.played(body["rid"]):
            await asyncio.sleep(0.01)
        aborted = (await client.post(ABORT, json={"rid": body["rid"]})).json()
        return await asyncio.wait_for(running, 5), aborted


# --- /generate --------------------------------------------------------------------------


def test_generate_from_text(api: Native, preparer: RequestPreparer) -> None:
    r = api.http.post(GENERATE, json={"text": "hello there"})
    assert r.status_code == 200
    body = r.json()
    (request,) = api.engine.requests()
    assert request.input_ids == preparer.text_ids("hello there", "text")
    assert body == {"text": "Hello world", "output_ids": [10, 11, 12],
                    "meta_info": {"id": request.rid, "finish_reason": "stop",
                                  "prompt_tokens": len(request.input_ids),
                                  "completion_tokens": 3}}
    assert request.rid.startswith("gen-")


def test_generate_from_ids_with_sampling_and_rid(api: Native) -> None:
    r = api.http.post(GENERATE, json={
        "input_ids": [5, 6, 7], "rid": "mine",
        "sampling_params": {"max_new_tokens": 9, "temperature": 0, "top_p": 0.5,
                            "top_k": 4, "seed": 3, "skip_special_tokens": False}})
    assert r.json()["meta_info"]["id"] == "mine"
    (request,) = api.engine.requests()
    s = request.sampling
    assert (request.rid, request.input_ids) == ("mine", [5, 6, 7])
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (9, 0.0, 0.5, 4, 3)
    assert not request.skip_special_tokens


def test_generate_defaults_match_completions(api: Native) -> None:
    api.http.post(GENERATE, json={"input_ids": [5]})
    s = api.engine.requests()[0].sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (16, 1.0, 1.0, 0,
                                                                           None)


def test_generate_stream_sends_deltas(api: Native) -> None:
    r = api.http.post(GENERATE, json={"text": "hi", "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    *chunks, done = events(r.text)
    assert done == "[DONE]"
    assert [c["text"] for c in chunks] == ["Hel", "lo", " world"]
    assert [c["output_ids"] for c in chunks] == [[10], [11], [12]]
    metas = [c["meta_info"] for c in chunks]
    assert [m["finish_reason"] for m in metas] == [None, None, "stop"]
    assert [m["completion_tokens"] for m in metas] == [1, 2, 3]
    assert len({m["id"] for m in metas}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_engine_rejection_is_400(make_api: Callable[[Script], Native], stream: bool) -> None:
    api = make_api(reject_script("no room"))
    r = api.http.post(GENERATE, json={"text": "x", "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["message"] == "no room"


ERROR_CASES = [
    ({}, "text", None),
    ({"text": "x", "input_ids": [5]}, "text", None),
    ({"text": ""}, "text", None),
    ({"text": ["a", "b"]}, "text", None),
    ({"input_ids": []}, "input_ids", None),
    ({"input_ids": [99999]}, "input_ids", None),
    ({"text": "x", "bogus": 1}, "bogus", "unrecognized_argument"),
    ({"text": "x", "rid": ""}, "rid", None),
    ({"text": "x", "stream": "yes"}, "stream", None),
    ({"text": "x", "top_logprobs_num": 2}, "top_logprobs_num", None),
    ({"text": "x", "logprob_start_len": 0}, "logprob_start_len", None),
    ({"text": "x", "return_text_in_logprobs": True}, "return_text_in_logprobs", None),
    ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num", None),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len",
     None),
    ({"text": "x", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len",
     None),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}},
     "sampling_params.max_new_tokens", None),
    ({"text": "x", "sampling_params": {"max_new_tokens": 100000}},
     "sampling_params.max_new_tokens", "context_length_exceeded"),
    ({"input_ids": [5] * 5000}, "input_ids", "context_length_exceeded"),
    ({"text": "x", "sampling_params": {"top_p": 2}}, "sampling_params.top_p", None),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature",
     None),
    ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n", None),
    ({"text": "x", "sampling_params": {"n": 17}}, "sampling_params.n", None),
    ({"text": "x", "sampling_params": {"stop": [""]}}, "sampling_params.stop", None),
    ({"text": "x", "sampling_params": {"min_new_tokens": 99, "max_new_tokens": 3}},
     "sampling_params.min_new_tokens", None),
    ({"text": "x", "sampling_params": {"repetition_penalty": -1}},
     "sampling_params.repetition_penalty", None),
    ({"text": "x", "sampling_params": {"stop_token_ids": [-1]}},
     "sampling_params.stop_token_ids", None),
    ({"text": "x", "sampling_params": {"regex": "a("}}, "sampling_params.regex",
     "invalid_grammar"),
    ({"text": "x", "sampling_params": {"regex": "a+", "ebnf": 'root ::= "a"'}},
     "sampling_params.ebnf", None),
    ({"text": "x", "sampling_params": {"typo": 1}}, "sampling_params.typo",
     "unrecognized_argument"),
]


@pytest.mark.parametrize(("body", "param", "code"), ERROR_CASES)
def test_invalid_generate_is_400_naming_the_param(api: Native, body: dict[str, Any],
                                                  param: str, code: str | None) -> None:
    r = api.http.post(GENERATE, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    assert api.engine.requests() == []


def test_sampling_controls_reach_the_engine(api: Native) -> None:
    params = {"min_new_tokens": 2, "max_new_tokens": 5, "frequency_penalty": 0.5,
              "presence_penalty": 0.25, "repetition_penalty": 1.1, "min_p": 0.05,
              "logit_bias": {"6": 3.0}, "ignore_eos": True, "stop_token_ids": [8]}
    assert api.http.post(GENERATE, json={"text": "x", "sampling_params": params}).status_code == 200
    request = api.engine.requests()[0]
    s = request.sampling
    assert (s.min_tokens, s.frequency_penalty, s.presence_penalty) == (2, 0.5, 0.25)
    assert (s.repetition_penalty, s.min_p, s.logit_bias) == (1.1, 0.05, {6: 3.0})
    assert request.stop_token_ids == [8]


def test_optional_params_pass_at_their_default(api: Native) -> None:
    params = {"n": 1, "stop": [], "repetition_penalty": 1.0, "min_p": 0, "ignore_eos": False}
    r = api.http.post(GENERATE, json={"text": "x", "sampling_params": params,
                                      "return_logprob": False, "logprob_start_len": -1})
    assert r.status_code == 200 and "output_token_logprobs" not in r.json()["meta_info"]


def test_n_fans_out_and_answers_a_list(api: Native) -> None:
    r = api.http.post(GENERATE, json={"text": "x", "rid": "many",
                                      "sampling_params": {"n": 3, "seed": 7}})
    bodies = r.json()
    assert [b["meta_info"]["index"] for b in bodies] == [0, 1, 2]
    assert {b["meta_info"]["id"] for b in bodies} == {"many"}
    assert all(b["text"] == "Hello world" for b in bodies)
    requests = api.engine.requests()
    assert [q.rid for q in requests] == ["many-0", "many-1", "many-2"]
    assert [q.sampling.seed for q in requests] == [7, 8, 9]


def test_n_streams_events_naming_their_index(api: Native) -> None:
    r = api.http.post(GENERATE, json={"text": "x", "stream": True, "sampling_params": {"n": 2}})
    *chunks, done = events(r.text)
    assert done == "[DONE]" and len(chunks) == 6
    for index in (0, 1):
        mine = [c for c in chunks if c["meta_info"]["index"] == index]
        assert "".join(c["text"] for c in mine) == "Hello world"
        assert mine[-1]["meta_info"]["finish_reason"] == "stop"


def test_logprob_fields_reach_the_engine(api: Native) -> None:
    api.http.post(GENERATE, json={"input_ids": [5, 6, 7], "return_logprob": True,
                                  "top_logprobs_num": 3, "logprob_start_len": 1,
                                  "sampling_params": {"max_new_tokens": 0}})
    api.http.post(GENERATE, json={"input_ids": [5, 6, 7], "return_logprob": True})
    scored, plain = (r.sampling for r in api.engine.requests())
    assert (scored.logprobs, scored.prompt_logprobs, scored.max_new_tokens) == (3, 3, 0)
    assert (plain.logprobs, plain.prompt_logprobs) == (0, -1)


# --- /abort_request ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_abort_request_ends_a_running_generate(make_api: Callable[[Script], Native],
                                               stream: bool) -> None:
    api = make_api(endless_script(pieces=2))
    body = {"text": "x", "rid": "long-one", "stream": stream}
    response, aborted = asyncio.run(generate_then_abort(api.app, api.engine, body))
    assert aborted == {"aborted": True} and response.status_code == 200
    if stream:
        *chunks, done = events(response.text)
        assert done == "[DONE]" and chunks[-1]["meta_info"]["finish_reason"] == "abort"
        assert [c["text"] for c in chunks[:2]] == [" w0", " w1"]
    else:
        assert response.json()["meta_info"]["finish_reason"] == "abort"
    assert api.engine.aborted() == ["long-one"] and api.manager.in_flight == 0


def test_abort_of_an_unknown_request_is_200(api: Native) -> None:
    r = api.http.post(ABORT, json={"rid": "nobody"})
    assert r.status_code == 200 and r.json() == {"aborted": False}
    assert api.engine.aborted() == []


def test_abort_needs_a_rid(api: Native) -> None:
    r = api.http.post(ABORT, json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def test_a_rid_in_flight_cannot_be_reused(make_api: Callable[[Script], Native]) -> None:
    api = make_api(endless_script(pieces=1))

    async def body() -> httpx.Response:
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = asyncio.ensure_future(client.post(GENERATE, json={"text": "x",
                                                                      "rid": "same"}))
            while not api.engine.requests():
                await asyncio.sleep(0.01)
            second = await client.post(GENERATE, json={"text": "y", "rid": "same"})
            await client.post(ABORT, json={"rid": "same"})
            await first
            return second

    second = asyncio.run(body())
    assert second.status_code == 400
    assert second.json()["error"]["code"] == "duplicate_request_id"

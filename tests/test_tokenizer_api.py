"""The HTTP API against a scripted engine: shapes, validation, rejections, disconnects,
and the official openai client against a real uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ipc.messages.to_scheduler import TokenizedRequest
from tests.fake_engine import (FakeEngine, Script, counting_script, endless_script,
                                        reject_script, text_script)
from tokenizer_proc.http_api import create_app
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.server import QuietSignalServer
from worker_proc.demo_model import ensure_demo_model

MODEL = "demo-tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def preparer(tmp_path_factory: pytest.TempPathFactory) -> RequestPreparer:
    path = ensure_demo_model(MODEL, cache_root=tmp_path_factory.mktemp("models"))
    return RequestPreparer.load(MODEL, str(path))


class Api:
    """An app wired to a fake engine, with a TestClient."""

    def __init__(self, preparer: RequestPreparer, script: Script | None = None,
                 delay: float = 0.0, stats_timeout: float = 5.0, **engine: Any) -> None:
        self.engine = FakeEngine(script, delay, **engine)
        self.manager = TokenizerManager(self.engine, stats_timeout=stats_timeout)
        self.engine.connect(self.manager)
        self.app = create_app(self.manager, preparer, {"model_name": MODEL})
        self.http = TestClient(self.app)

    def request(self) -> TokenizedRequest:
        (request,) = self.engine.requests()
        return request


@pytest.fixture
def make_api(preparer: RequestPreparer) -> Callable[..., Api]:
    return lambda *args, **kwargs: Api(preparer, *args, **kwargs)


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    return make_api(text_script(["Hel", "lo", " world"]))


def sse_payloads(text: str) -> list[Any]:
    """The data of each SSE event; '[DONE]' stays a string."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


# --- response shapes --------------------------------------------------------------------


def test_completion_shape(api: Api) -> None:
    r = api.http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and abs(body["created"] - time.time()) < 60
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None,
                                "finish_reason": "stop"}]
    prompt_tokens = len(api.request().input_ids)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                             "total_tokens": prompt_tokens + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_shape(api: Api) -> None:
    body = api.http.post(CHAT, json={"model": MODEL, "messages": HELLO}).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "Hello world",
                                            "refusal": None}}]
    assert body["usage"]["completion_tokens"] == 3


def test_completion_stream_with_usage(api: Api) -> None:
    r = api.http.post(COMPLETIONS, json={"prompt": "hi", "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *chunks, usage, done = sse_payloads(r.text)
    assert done == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo", " world", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in chunks + [usage]}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_chat_stream_without_usage(api: Api) -> None:
    r = api.http.post(CHAT, json={"messages": HELLO, "stream": True})
    *chunks, done = sse_payloads(r.text)
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"},
                      {"content": "lo"}, {"content": " world"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_with_usage(api: Api) -> None:
    r = api.http.post(CHAT, json={"messages": HELLO, "stream": True,
                                  "stream_options": {"include_usage": True}})
    *chunks, usage, done = sse_payloads(r.text)
    assert all(c["usage"] is None for c in chunks) and done == "[DONE]"
    assert usage["object"] == "chat.completion.chunk" and usage["choices"] == []
    prompt_tokens = len(api.request().input_ids)
    assert usage["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                              "total_tokens": prompt_tokens + 3,
                              "prompt_tokens_details": {"cached_tokens": 0},
                              "completion_tokens_details": {"reasoning_tokens": 0}}


def test_length_finish_passes_through(make_api: Callable[..., Api]) -> None:
    api = make_api(counting_script(length=10))
    body = api.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}).json()
    assert body["choices"][0]["text"] == " w0 w1"
    assert body["choices"][0]["finish_reason"] == "length"


# --- conversion to the engine's request -------------------------------------------------


@pytest.mark.parametrize("prompt", ["hello world", ["hello world"]])
def test_text_prompt_is_tokenized(api: Api, preparer: RequestPreparer, prompt: Any) -> None:
    api.http.post(COMPLETIONS, json={"prompt": prompt})
    assert api.request().input_ids == preparer.text_ids("hello world", "prompt")


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_prompt_passes_through(api: Api, prompt: Any) -> None:
    api.http.post(COMPLETIONS, json={"prompt": prompt})
    assert api.request().input_ids == [5, 6, 7]


def test_sampling_and_eos_reach_the_engine(api: Api, preparer: RequestPreparer) -> None:
    api.http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 7, "temperature": 0,
                                     "top_p": 0.5, "top_k": -1, "seed": 42,
                                     "skip_special_tokens": False})
    request = api.request()
    s = request.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (7, 0.0, 0.5, 0, 42)
    assert s.greedy and not request.skip_special_tokens
    assert request.stop_token_ids == list(preparer.info.eos_token_ids) == [1, 3]


def test_sampling_controls_reach_the_engine(api: Api, preparer: RequestPreparer) -> None:
    api.http.post(COMPLETIONS, json={
        "prompt": "x", "max_tokens": 9, "min_p": 0.1, "logit_bias": {"5": -100, "7": 2.5},
        "repetition_penalty": 1.3, "frequency_penalty": -0.5, "presence_penalty": 2,
        "min_tokens": 4, "stop_token_ids": [7, 3]})
    api.http.post(CHAT, json={"messages": HELLO, "ignore_eos": True, "stop_token_ids": [9]})
    completion, chat = api.engine.requests()
    s = completion.sampling
    assert (s.min_p, s.logit_bias, s.min_tokens) == (0.1, {5: -100.0, 7: 2.5}, 4)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.3, -0.5, 2.0)
    assert s.uses_penalties and not chat.sampling.uses_penalties
    assert completion.stop_token_ids == [1, 3, 7]  # EOS first, duplicates once
    assert chat.stop_token_ids == [9]  # ignore_eos: only the client's own


@pytest.mark.parametrize(("field", "sent", "expected"), [
    ("top_k", 1023, 1023),
    ("top_k", 1024, 0),  # the whole vocabulary (demo-tiny's 1024): no limit
    ("top_k", 2**31, 0),  # past the worker's int32, which it used to die of
    ("top_k", 2**63, 0),
    ("temperature", 1e-5, 1e-5),
    ("temperature", 1e-6, 0.0),  # colder than float32 logits divide by: greedy
    ("top_p", 1e-300, 1e-8),  # float32 would make it 0, keeping no token at all
    ("top_p", 1e-8, 1e-8),
])
def test_values_past_a_limit_with_a_meaning_are_clamped(api: Api, preparer: RequestPreparer,
                                                        field: str, sent: float,
                                                        expected: float) -> None:
    assert preparer.info.vocab_size == 1024
    r = api.http.post(COMPLETIONS, json={"prompt": "x", field: sent})
    assert r.status_code == 200, r.text
    assert getattr(api.request().sampling, field) == expected


def test_sampling_defaults(api: Api, preparer: RequestPreparer) -> None:
    api.http.post(COMPLETIONS, json={"prompt": "x"})
    api.http.post(CHAT, json={"messages": HELLO})
    api.http.post(CHAT, json={"messages": HELLO, "max_tokens": 9, "max_completion_tokens": 4})
    completion, chat, chat_limited = api.engine.requests()
    assert completion.sampling.max_new_tokens == 16
    assert (completion.sampling.temperature, completion.sampling.top_p) == (1.0, 1.0)
    assert completion.sampling.top_k == 0 and completion.sampling.seed is None
    room = preparer.info.context_len - len(chat.input_ids)
    assert chat.sampling.max_new_tokens == room
    assert chat_limited.sampling.max_new_tokens == 4  # max_completion_tokens wins


def test_chat_template_and_text_parts(api: Api, preparer: RequestPreparer) -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    api.http.post(CHAT, json={"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": parts}]})
    expected = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhel\nlo<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert api.request().input_ids == preparer.text_ids(expected, "messages")


def test_completion_default_shrinks_to_the_room_left(api: Api,
                                                     preparer: RequestPreparer) -> None:
    ctx = preparer.info.context_len
    api.http.post(COMPLETIONS, json={"prompt": [5] * (ctx - 3)})
    assert api.request().sampling.max_new_tokens == 3


# --- refusals ---------------------------------------------------------------------------

ERROR_CASES = [
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 99999]}, "prompt"),
    (COMPLETIONS, {"prompt": [-1]}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    (COMPLETIONS, {"prompt": [5] * 5000}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.1}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": 1e39}, "temperature"),  # float32's inf
    (COMPLETIONS, {"prompt": "x", "temperature": 10**400}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "seed": -1}, "seed"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"bogus": 1}},
     "stream_options.bogus"),
    (COMPLETIONS, {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (COMPLETIONS, {"prompt": "x", "min_p": -0.1}, "min_p"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0.001}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 101}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": -3}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {" 5": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"+5": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"\u0665": 1}}, "logit_bias"),  # Arabic 5
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 10**400}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    (CHAT, {"messages": HELLO, "presence_penalty": 2.01}, "presence_penalty"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                        "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "mood": "sad"}]},
     "messages[0].mood"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": HELLO, "max_tokens": 5000}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
]


@pytest.mark.parametrize(("path", "body", "param"), ERROR_CASES)
def test_invalid_request_is_400_naming_the_param(api: Api, path: str, body: dict[str, Any],
                                                 param: str) -> None:
    r = api.http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and set(error) == {"message", "type", "param", "code"}
    assert api.engine.requests() == []


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1, 2]", b'"text"', b"null",
                                 b"\xff\xfe"])
def test_malformed_body_is_400(api: Api, raw: bytes) -> None:
    for path in (COMPLETIONS, CHAT):
        r = api.http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


DEEP = "[" * 5000 + "]" * 5000  # past json.loads' own recursion limit
HALF_DEEP = "[" * 200 + "]" * 200  # parsed, then refused by json_body's walk
LONE = "\\ud800"  # the JSON escape of a lone surrogate


@pytest.mark.parametrize(("path", "raw", "param"), [
    (COMPLETIONS, f'{{"prompt": "{LONE}"}}', "prompt"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "a{LONE}"}}]}}', "messages[0].content"),
    ("/generate", f'{{"text": "{LONE}"}}', "text"),
    (COMPLETIONS, f'{{"prompt": "x", "stop": ["ok", "{LONE}"]}}', "stop[1]"),
    ("/generate", f'{{"text": "x", "sampling_params": {{"regex": "{LONE}"}}}}',
     "sampling_params.regex"),
    (CHAT, f'{{"messages": [], "logit_bias": {{"{LONE}": 1}}}}', "logit_bias"),
    ("/abort_request", f'{{"rid": "{LONE}"}}', "rid"),
    # A JSON text inside a field, holding the escape itself.
    ("/generate", '{"text": "x", "sampling_params": {"json_schema": '
                  '"{\\"enum\\": [\\"\\\\ud800\\"]}"}}', "sampling_params.json_schema"),
    (COMPLETIONS, '{"prompt": "x", "temperature": NaN}', "temperature"),
    (COMPLETIONS, '{"prompt": "x", "top_p": Infinity}', "top_p"),
    (COMPLETIONS, '{"prompt": "x", "min_p": 1e400}', "min_p"),
    (CHAT, '{"messages": [], "logit_bias": {"5": -Infinity}}', "logit_bias"),
    (COMPLETIONS, f'{{"prompt": {DEEP}}}', None),
    (CHAT, f'{{"messages": {DEEP}}}', None),
    ("/generate", f'{{"text": {DEEP}}}', None),
    ("/abort_request", f'{{"rid": {DEEP}}}', None),
    (COMPLETIONS, f'{{"prompt": {HALF_DEEP}}}', "prompt"),
    ("/generate", f'{{"text": "x", "sampling_params": {{"stop": {HALF_DEEP}}}}}',
     "sampling_params"),
    ("/generate", f'{{"text": "x", "sampling_params": {{"json_schema": "{HALF_DEEP}"}}}}',
     "sampling_params.json_schema"),
    # json.loads reads UTF-16 too, where the escape is other bytes.
    (COMPLETIONS, f'{{"prompt": "{LONE}"}}'.encode("utf-16"), "prompt"),
])
def test_json_python_cannot_pass_on_is_400_naming_the_field(api: Api, path: str,
                                                            raw: str | bytes,
                                                            param: str | None) -> None:
    content = raw.encode() if isinstance(raw, str) else raw
    r = api.http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert api.engine.requests() == []


def test_body_without_json_content_type_is_accepted(api: Api) -> None:
    # curl -d sends application/x-www-form-urlencoded.
    r = api.http.post(COMPLETIONS, content=b'{"prompt": "hi"}',
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200


def test_any_model_name_is_served_by_the_one_model(api: Api) -> None:
    r = api.http.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_unknown_route_has_an_openai_error_body(api: Api) -> None:
    r = api.http.get("/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]


UNSUPPORTED = [
    (COMPLETIONS, "suffix", "end", ""),
    # The legacy spelling of tools; `tools` itself is served (tests/test_tool_calls.py).
    (CHAT, "functions", [{"name": "f"}], []),
    (CHAT, "function_call", {"name": "f"}, "none"),
    (CHAT, "store", True, False),  # stored completions are not kept here
]


@pytest.mark.parametrize(("path", "name", "value", "default"), UNSUPPORTED)
def test_unsupported_parameter_refused_unless_default(api: Api, path: str, name: str,
                                                      value: Any, default: Any) -> None:
    base = {"prompt": "x"} if path == COMPLETIONS else {"messages": HELLO}
    r = api.http.post(path, json={**base, name: value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_parameter"
    assert name in error["message"]
    assert api.http.post(path, json={**base, name: default}).status_code == 200


def test_metadata_fields_are_accepted(api: Api) -> None:
    r = api.http.post(CHAT, json={"messages": HELLO, "user": "u1", "store": False,
                                  "metadata": {"k": "v"}, "parallel_tool_calls": True})
    assert r.status_code == 200


# --- engine-side errors -----------------------------------------------------------------

KV_FULL = "request needs more KV slots than the server has"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_rejection_is_400(make_api: Callable[..., Api], path: str, stream: bool) -> None:
    api = make_api(reject_script(KV_FULL))
    base = {"prompt": "x"} if path == COMPLETIONS else {"messages": HELLO}
    r = api.http.post(path, json={**base, "stream": stream})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == KV_FULL
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_engine_error_mid_stream_is_an_error_event(make_api: Callable[..., Api]) -> None:
    def script(request: TokenizedRequest) -> list[Any]:
        first = text_script(["a"])(request)[0]
        failed = reject_script("worker failed")(request)[0]
        return [type(first)(rid=first.rid, text="a", token_ids=[10]), failed]

    api = make_api(script)
    r = api.http.post(COMPLETIONS, json={"prompt": "x", "stream": True})
    *events, done = sse_payloads(r.text)
    assert done == "[DONE]" and events[-1]["error"]["message"] == "worker failed"


# --- aborts -----------------------------------------------------------------------------


async def _call_asgi(app: FastAPI, path: str, body: dict[str, Any],
                     disconnect_after: float) -> list[dict[str, Any]]:
    """Drive the app directly: the client disconnects `disconnect_after` seconds in."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "server": ("test", 80),
             "client": ("test", 1), "headers": [(b"content-type", b"application/json")]}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_the_request(make_api: Callable[..., Api], stream: bool) -> None:
    api = make_api(endless_script(pieces=1))
    sent = asyncio.run(_call_asgi(api.app, COMPLETIONS, {"prompt": "x", "stream": stream},
                                  disconnect_after=0.2))
    (request,) = api.engine.requests()
    assert api.engine.aborted() == [request.rid]
    assert api.manager.in_flight == 0
    if stream:  # headers went out with the first output, before the disconnect
        assert sent[0]["status"] == 200


# OpenAI's schemas: the finish reasons a chat completion and a completion may report.
CHAT_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}
COMPLETION_REASONS = {"stop", "length", "content_filter"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), [(COMPLETIONS, {"prompt": "x"}),
                                            (CHAT, {"messages": HELLO})])
def test_an_aborted_request_reports_length(make_api: Callable[..., Api], path: str,
                                           body: dict[str, Any], stream: bool) -> None:
    api = make_api(endless_script(pieces=2))

    async def run_then_abort() -> httpx.Response:
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            running = asyncio.ensure_future(client.post(path, json={**body, "stream": stream}))
            while not api.engine.requests():
                await asyncio.sleep(0.01)
            aborted = await client.post("/abort_request", json={"rid": api.request().rid})
            assert aborted.json() == {"aborted": True}
            return await asyncio.wait_for(running, 5)

    r = asyncio.run(run_then_abort())
    assert r.status_code == 200
    choices = ([c for e in sse_payloads(r.text)[:-1] for c in e["choices"]] if stream
               else r.json()["choices"])
    reasons = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    # Cut short, never "stop" (a whole answer) nor the engine's own "abort".
    assert reasons == ["length"]
    assert set(reasons) <= (CHAT_REASONS if path == CHAT else COMPLETION_REASONS)


def test_finished_request_is_not_aborted(api: Api) -> None:
    api.http.post(COMPLETIONS, json={"prompt": "x", "stream": True})
    api.http.post(COMPLETIONS, json={"prompt": "x"})
    assert api.engine.aborted() == [] and api.manager.in_flight == 0


# --- other routes -----------------------------------------------------------------------


def test_models_health_and_server_info(api: Api, preparer: RequestPreparer) -> None:
    models = api.http.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == preparer.info.context_len
    assert api.http.get("/health").status_code == 200
    info = api.http.get("/get_server_info").json()
    assert info["model_name"] == MODEL and info["scheduler"]["capacity_slots"] == 1024


def test_health_is_503_until_the_engine_answers(make_api: Callable[..., Api]) -> None:
    assert make_api(stats=None).http.get("/health").status_code == 503


def test_server_info_without_scheduler_answer_is_503(make_api: Callable[..., Api]) -> None:
    api = make_api(stats=None, stats_timeout=0.1)
    r = api.http.get("/get_server_info")
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


# --- a real server and the official openai client ---------------------------------------


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Run the app on uvicorn in a thread, on an ephemeral port of 127.0.0.1."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = QuietSignalServer(uvicorn.Config(app, log_config=None, lifespan="off"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _local_port(response: httpx.Response) -> int:
    """The client-side port of the connection that carried the response."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_bad_bodies_and_a_500_leave_the_keep_alive_connection_usable(
        make_api: Callable[..., Api], preparer: RequestPreparer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    api = make_api(text_script(["Hel", "lo"]))
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    lone = rb'{"messages": [{"role": "user", "content": "\ud800"}]}'
    with serving(api.app) as url, httpx.Client(base_url=url, timeout=10) as client:
        answers = [client.post(COMPLETIONS, content=deep), client.post(CHAT, content=lone)]
        assert [r.status_code for r in answers] == [400, 400]
        assert answers[1].json()["error"]["param"] == "messages[0].content"

        def broken(*args: Any) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(preparer, "completion", broken)
        failed = client.post(COMPLETIONS, json={"prompt": "hi"})
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error"
        monkeypatch.undo()
        served = client.post(COMPLETIONS, json={"prompt": "hi"})
        assert served.status_code == 200 and served.json()["choices"][0]["text"] == "Hello"
        # One connection carried them all: the 500 did not close it under the next request.
        assert len({_local_port(r) for r in [*answers, failed, served]}) == 1


@pytest.fixture
def live(make_api: Callable[..., Api]) -> Iterator[tuple[Api, openai.OpenAI]]:
    api = make_api(text_script(["Hel", "lo", " world"]), delay=0.01)
    with serving(api.app) as url:
        yield api, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_openai_client_completions(live: tuple[Api, openai.OpenAI]) -> None:
    _, client = live
    result = client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    assert result.choices[0].text == "Hello world"
    assert result.choices[0].finish_reason == "stop" and result.usage.completion_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt="hi", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_openai_client_chat(live: tuple[Api, openai.OpenAI]) -> None:
    _, client = live
    result = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
    assert result.choices[0].message.content == "Hello world"
    assert result.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_sees_errors(live: tuple[Api, openai.OpenAI]) -> None:
    _, client = live
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", n=2, best_of=3, stream=True)
    assert info.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert info.value.param == "messages"


def test_real_disconnect_mid_stream_aborts(make_api: Callable[..., Api]) -> None:
    api = make_api(endless_script(pieces=2), delay=0.01)
    with serving(api.app) as url:
        with httpx.stream("POST", f"{url}{COMPLETIONS}",
                          json={"prompt": "x", "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.monotonic() + 5
        while not api.engine.aborted() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert api.engine.aborted() == [api.request().rid]


class _HeldTokenizer:
    """The real tokenizer, except that encoding a text containing HOLD waits until the
    test releases it: a long prompt's tokenization, as long as the test needs."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        if "HOLD" in text:
            self.started.set()
            self.release.wait(10)
        return self._inner.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_prompt_being_tokenized_does_not_stall_other_streams(preparer: RequestPreparer) -> None:
    held = _HeldTokenizer(preparer._tokenizer)
    api = Api(RequestPreparer(held, preparer.info), counting_script(length=400), delay=0.01)
    with serving(api.app) as url:
        with httpx.stream("POST", f"{url}{COMPLETIONS}", timeout=30,
                          json={"prompt": "x", "max_tokens": 400, "stream": True}) as a:
            lines = a.iter_lines()
            next(lines)
            answers: list[httpx.Response] = []
            b = threading.Thread(target=lambda: answers.append(httpx.post(
                f"{url}{COMPLETIONS}", json={"prompt": "HOLD", "max_tokens": 2}, timeout=30)))
            b.start()
            try:
                assert held.started.wait(10)
                # While B's prompt is in the tokenizer, A's tokens keep coming (tokenizing
                # on the event loop, they would wait for the release, 10 s).
                start = time.monotonic()
                for _ in range(20):
                    next(lines)
                assert time.monotonic() - start < 5
            finally:
                held.release.set()
                b.join(30)
    assert answers and answers[0].status_code == 200


# --- /tokenize, /detokenize, /v1/models/{id} ------------------------------------------------


def test_tokenize_gives_the_ids_each_route_feeds_the_model(api: Api) -> None:
    """A prompt's ids are /v1/completions', a chat's /v1/chat/completions' (what the
    engine was sent); detokenize gives the text back; the card names the context."""
    api.http.post(COMPLETIONS, json={"prompt": "Hello there", "max_tokens": 1})
    sent = api.engine.requests()[-1].input_ids
    r = api.http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there",
                                        "return_token_strs": True}).json()
    assert r["tokens"] == sent and r["count"] == len(sent) and r["max_model_len"] > 0
    assert len(r["token_strs"]) == len(sent)
    api.http.post(CHAT, json={"messages": HELLO, "max_tokens": 1})
    chat = api.engine.requests()[-1].input_ids
    r = api.http.post("/tokenize", json={"messages": HELLO}).json()
    assert r["tokens"] == chat and r["token_strs"] is None
    bare = api.http.post("/tokenize", json={"messages": HELLO,
                                           "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat[:bare["count"]] and bare["count"] < len(chat)
    text = api.http.post("/detokenize", json={"tokens": sent}).json()["prompt"]
    assert text.endswith("Hello there")
    for body, param in (({"prompt": "x", "messages": HELLO}, "prompt"), ({}, "prompt"),
                        ({"prompt": "x", "tools": []}, "tools")):
        refused = api.http.post("/tokenize", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    bad = api.http.post("/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_models_retrieve_the_served_one_and_404_others(api: Api) -> None:
    listed = api.http.get("/v1/models").json()["data"][0]
    assert api.http.get(f"/v1/models/{listed['id']}").json() == listed
    missing = api.http.get("/v1/models/other/model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert api.http.get("/v1/models/").json()["data"] == [listed]


def test_cache_hints_are_taken_and_a_retention_promise_refused(api: Api) -> None:
    ok = api.http.post(CHAT, json={"messages": HELLO, "prompt_cache_key": "k",
                                   "prompt_cache_retention": "in-memory"})
    assert ok.status_code == 200
    refused = api.http.post(CHAT, json={"messages": HELLO, "prompt_cache_retention": "24h"})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "prompt_cache_retention"


def test_fields_sdks_fill_in_are_taken_at_the_values_honoured(api: Api) -> None:
    """What OpenAI SDKs and frameworks send by default passes; a value this server cannot
    honour is refused by name, never dropped."""
    ok = api.http.post(CHAT, json={"messages": HELLO, "service_tier": "auto",
                                   "verbosity": "medium", "modalities": ["text"],
                                   "safety_identifier": "u-1", "user": "u-1"})
    assert ok.status_code == 200, ok.text
    for field, value in (("service_tier", "flex"), ("verbosity", "low"),
                         ("modalities", ["text", "audio"])):
        refused = api.http.post(CHAT, json={"messages": HELLO, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field

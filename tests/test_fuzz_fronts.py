"""Every field of every request route, fuzzed: /v1/completions, /v1/chat/completions, the
native /generate and /abort_request over HTTP, and the ZMQ front's GenerateRequest.

Each field gets wrong types, huge and negative integers, NaN and Infinity, empty and
huge strings and lists, lone surrogates and deep nesting. Every answer must be a 2xx or
a 4xx with an OpenAI error body naming that field, never a 5xx; whatever is accepted
must reach the engine in a shape the worker takes (int32 top_k and ids, float32-finite
floats, msgpack-encodable); and the front must keep serving. The values are a fixed list
plus a seeded sample per field, so a run is the same few seconds every time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import msgspec
import pytest
from pydantic import BaseModel

from ipc.codec import Decoder, encode
from ipc.messages.client import ClientToServer, GenerateOutput, GenerateRequest
from ipc.messages.to_scheduler import TokenizedRequest
from tests.fake_engine import FakeEngine, counting_script
from tokenizer_proc.client_front import ClientFront
from tokenizer_proc.errors import param_path
from tokenizer_proc.http_api import create_app
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.protocol import (ChatCompletionRequest, CompletionRequest, GenerateBody,
                                     NativeSamplingParams)
from worker_proc.demo_model import ensure_demo_model

SEED = 20261216
SAMPLED_PER_FIELD = 12  # drawn from SAMPLED on top of CORE, for each field
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

# Placeholders the encoders replace by raw JSON text no Python encoder writes (json.dumps
# recurses and fails at depth 5000; a plain 1e400 is decoded as inf).
VERY_DEEP = "@@very-deep@@"
HUGE_EXPONENT = "@@huge-exponent@@"
RAW = {VERY_DEEP: "[" * 5000 + "]" * 5000, HUGE_EXPONENT: "1e400"}


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


# Every field gets these...
CORE: list[Any] = [
    None, True, 0, -1, 2**31, 2**63, 10**400, float("nan"), float("inf"), "", "\ud800",
    [], {}, nested(200), VERY_DEEP,
]
# ... and a seeded sample of these.
SAMPLED: list[Any] = [
    False, 1, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**64, -2**31 - 1, -2**63 - 1,
    0.5, -0.5, 1e-300, 1e308, -1e308, float("-inf"), HUGE_EXPONENT,
    "x", "16", "a\udfffb", "x" * 100_000, "{\"type\": \"object\"}",
    [5], [-1], [2**31], [2**63], ["x"], [""], [None], [float("nan")], [5] * 20_000,
    ["s"] * 1000, [[]], {"5": 1}, {"5": float("nan")}, {"-1": 1}, {"a": None},
    {"type": "text"}, {"type": "json_object"}, {"include_usage": True},
]


def values_for(name: str, sampled: int = SAMPLED_PER_FIELD) -> list[Any]:
    """CORE plus `sampled` of SAMPLED, the same for a field in every run."""
    rng = random.Random(f"{SEED}:{name}")
    return CORE + rng.sample(SAMPLED, sampled)


def json_bytes(body: dict[str, Any]) -> bytes:
    """The body as a client might send it: Python's json, NaN, Infinity and \\ud800
    escapes included, and the raw placeholders spliced in."""
    text = json.dumps(body, allow_nan=True)
    for placeholder, raw in RAW.items():
        text = text.replace(json.dumps(placeholder), raw)
    return text.encode()


Place = tuple[str | int, ...]


def with_value(base: dict[str, Any], path: Place, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(base)
    parent: Any = body
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    return body


# --- what may reach the engine ----------------------------------------------------------


def check_worker_safe(request: TokenizedRequest, vocab: int, context: int) -> None:
    """What the worker and the wire take: msgpack-encodable, ids and top_k in the int32
    vocabulary, seeds in int64, every float finite in float32, lengths in the context."""
    encode(request)  # raises on an int past 64 bits or a string that is not UTF-8
    s = request.sampling
    ids = [*request.input_ids, *request.stop_token_ids, *s.logit_bias]
    assert all(0 <= t < vocab for t in ids), ids[:10]
    assert 0 <= s.top_k < vocab <= INT32_MAX
    assert s.seed is None or 0 <= s.seed < 2**63
    floats = [s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.frequency_penalty,
              s.presence_penalty, *s.logit_bias.values()]
    assert all(math.isfinite(f) and abs(f) <= FLOAT32_MAX for f in floats), floats
    assert s.temperature == 0 or s.temperature >= 1e-5
    assert 1e-8 <= s.top_p <= 1 and 0 <= s.min_p <= 1 and s.repetition_penalty >= 0.01
    assert 0 <= s.min_tokens <= s.max_new_tokens
    assert len(request.input_ids) + s.max_new_tokens <= context
    assert -1 <= s.logprobs <= 20 and -1 <= s.prompt_logprobs <= 20


# --- HTTP -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """A fuzzed place in a body, and what the route's base body needs around it (a
    message list for messages[1], a response_format for its type, ...)."""

    path: Place
    around: tuple[tuple[str, Any], ...] = ()
    without: str | None = None  # a base field it stands in for (input_ids for text)

    @property
    def name(self) -> str:
        return param_path(self.path) or ""

    def base(self, route_base: dict[str, Any]) -> dict[str, Any]:
        base = {**copy.deepcopy(route_base), **copy.deepcopy(dict(self.around))}
        if self.without is not None:
            del base[self.without]
        return base


def top_level(model: type[BaseModel], *under: str) -> list[Field]:
    """Every field of a request model (under `under` in the body), as clients spell it."""
    names = [info.alias or name for name, info in model.model_fields.items()]
    return [Field((*under, name)) for name in names]


@dataclass(frozen=True)
class Route:
    """A POST route, a valid body, and the fields fuzzed in it."""

    path: str
    base: dict[str, Any]
    fields: tuple[Field, ...]

    def bodies(self) -> Iterator[tuple[str, bytes]]:
        """(fuzzed field's name, raw body) for every field and value."""
        for field in self.fields:
            base = field.base(self.base)
            for value in values_for(f"{self.path}:{field.name}"):
                yield field.name, json_bytes(with_value(base, field.path, value))


USER = {"role": "user", "content": "hello"}
TEXT_FORMAT = ("response_format", {"type": "text"})

ROUTES = [
    Route("/v1/completions", {"prompt": "hello", "max_tokens": 4}, (
        *top_level(CompletionRequest),
        Field(("prompt", 0), (("prompt", ["hello"]),)),
        Field(("prompt", 0, 0), (("prompt", [[5, 6]]),)),
        Field(("stream_options", "include_usage"),
              (("stream", True), ("stream_options", {"include_usage": True}))),
        Field(("response_format", "type"), (TEXT_FORMAT,)),
        Field(("response_format", "json_schema"), (("response_format",
                                                     {"type": "json_schema"}),)))),
    Route("/v1/chat/completions", {"messages": [USER], "max_tokens": 4}, (
        *top_level(ChatCompletionRequest),
        *(Field(("messages", 0, key)) for key in ("role", "content", "name")),
        Field(("messages", 0)),
        Field(("messages", 1), (("messages", [USER, USER]),)),
        Field(("messages", 0, "content", 0, "text"),
              (("messages", [{"role": "user", "content": [{"type": "text", "text": "a"}]}]),)),
        Field(("response_format", "json_schema", "schema"), (("response_format", {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),)),
        Field(("logit_bias", "5"), (("logit_bias", {"5": 1}),)),
        Field(("metadata", "k"), (("metadata", {"k": "v"}),)))),
    Route("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}}, (
        *(f if f.path != ("input_ids",) else Field(f.path, without="text")
          for f in top_level(GenerateBody)),
        *top_level(NativeSamplingParams, "sampling_params"),
        Field(("input_ids", 0), (("input_ids", [5, 6]),), without="text"),
        Field(("sampling_params", "stop", 0), (("sampling_params", {"stop": ["a"]}),)),
        Field(("sampling_params", "json_schema", "type"),
              (("sampling_params", {"json_schema": {"type": "object"}}),)))),
    Route("/abort_request", {"rid": "nobody"}, (Field(("rid",)), Field(("other",)))),
]


@pytest.fixture(scope="module")
def preparer(tmp_path_factory: pytest.TempPathFactory) -> RequestPreparer:
    path = ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))
    return RequestPreparer.load("demo-tiny", str(path))


def assert_error_body(answer: Any, field: str) -> None:
    """An OpenAI error body naming the fuzzed field: as its param, a part of it or the
    field holding it ('prompt' for prompt[0]), or in its message ("Give exactly one of
    'text' and 'input_ids'"); a body too deep to parse at all names none."""
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    param = error["param"]
    if param is None or _within(param, field) or _within(field, param):
        return
    assert f"'{field.split('.')[-1]}'" in error["message"], (field, error)


def _within(inner: str, outer: str) -> bool:
    """inner is outer or a place inside it ("a.b[0]" within "a.b")."""
    return inner == outer or inner.startswith((f"{outer}.", f"{outer}["))


@dataclass
class Tally:
    sent: int = 0
    accepted: int = 0
    refused: int = 0


async def fuzz_route(app: Any, route: Route) -> Tally:
    """Every body of the route through the app in-process (httpx's ASGI transport: a
    fraction of TestClient's per-request cost); then a plain request, still served."""
    tally = Tally()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://fuzz") as http:
        for field, raw in route.bodies():
            r = await http.post(route.path, content=raw,
                                headers={"content-type": "application/json"})
            tally.sent += 1
            assert r.status_code < 500, (route.path, field, raw[:200], r.text[:300])
            if r.status_code >= 400:
                tally.refused += 1
                assert_error_body(r.json(), field)
            else:
                tally.accepted += 1
        r = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " w0 w1"
    return tally


@pytest.mark.parametrize("route", ROUTES, ids=[r.path for r in ROUTES])
def test_every_field_of_every_http_route(preparer: RequestPreparer, route: Route) -> None:
    engine = FakeEngine(counting_script(3))
    manager = TokenizerManager(engine, stats_timeout=1.0)
    engine.connect(manager)

    tally = asyncio.run(fuzz_route(create_app(manager, preparer), route))

    info = preparer.info
    for request in engine.requests():
        check_worker_safe(request, info.vocab_size, info.context_len)
    assert manager.in_flight == 0
    # Some values refused and some accepted: all 400s would mean the base body was wrong.
    assert tally.refused > 0 and tally.accepted > 0, tally


# --- ZMQ --------------------------------------------------------------------------------


GENERATE_FIELDS = [name for name in GenerateRequest.__struct_fields__ if name != "request_id"]


def zmq_frames() -> Iterator[tuple[str, bytes]]:
    """(field, msgpack frame) for every GenerateRequest field and value that msgpack can
    carry at all (no ints past 64 bits, no surrogates). Every value, not a sample: most
    frames fail to decode, which costs next to nothing."""
    for field in GENERATE_FIELDS:
        for i, value in enumerate(values_for(f"zmq:{field}", len(SAMPLED))):
            if isinstance(value, str) and value in RAW:
                continue  # JSON text tricks; msgpack has no such spelling
            message = {"type": "GenerateRequest", "request_id": f"{field}-{i}",
                       "prompt": "hello", "max_tokens": 4, field: value}
            if field == "input_ids":
                del message["prompt"]
            try:
                yield field, msgspec.msgpack.encode(message)
            except (OverflowError, UnicodeEncodeError, RecursionError):
                continue


@dataclass
class ZmqTally:
    sent: int = 0
    undecodable: int = 0  # refused by the codec, before any validation
    accepted: int = 0
    refused: int = 0


class InProcessFront:
    """The ZMQ front without its socket: frames go through the real codec and
    ClientFront, replies are collected, the engine is scripted."""

    def __init__(self, preparer: RequestPreparer) -> None:
        self.engine = FakeEngine(counting_script(3))
        self.manager = TokenizerManager(self.engine, stats_timeout=1.0)
        self.engine.connect(self.manager)
        self._replies: list[GenerateOutput] = []
        self._front = ClientFront(self.manager, preparer, self._reply)
        self._decoder: Decoder[ClientToServer] = Decoder(ClientToServer, "fuzz")

    async def _reply(self, identity: bytes, message: Any) -> None:
        self._replies.append(message)

    async def ask(self, frame: bytes) -> tuple[ClientToServer, list[GenerateOutput]] | None:
        """The decoded message and its final replies, once all are sent; None when the
        frame does not decode."""
        message = self._decoder.decode(frame)
        if message is None:
            return None
        self._replies.clear()
        await self._front.handle(b"client", message)  # raises what validation let escape
        await self._front.wait_replies()
        return message, [r for r in self._replies if r.finished]


def frame(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"type": "GenerateRequest", "request_id": "r",
                                   "prompt": "hello", "max_tokens": 4, **fields})


async def fuzz_zmq(front: InProcessFront) -> ZmqTally:
    tally = ZmqTally()
    for field, raw in zmq_frames():
        tally.sent += 1
        answer = await front.ask(raw)
        if answer is None:
            tally.undecodable += 1
            continue
        message, finals = answer
        assert finals, (field, message)
        if finals[0].error is not None:
            tally.refused += 1
            # A ZMQ error is a message only: it must name the field itself.
            assert len(finals) == 1 and field in finals[0].error, (field, finals)
        else:
            tally.accepted += 1
            assert all(r.error is None for r in finals)
            n = message.n if isinstance(message, GenerateRequest) else 1
            assert sorted(r.index for r in finals) == list(range(n))
    answer = await front.ask(frame(max_tokens=2))  # still serving
    assert answer is not None and [(r.text, r.error) for r in answer[1]] == [(" w0 w1", None)]
    return tally


def test_every_field_of_the_zmq_generate_request(preparer: RequestPreparer,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    front = InProcessFront(preparer)
    tally = asyncio.run(fuzz_zmq(front))
    info = preparer.info
    for request in front.engine.requests():
        check_worker_safe(request, info.vocab_size, info.context_len)
    assert front.manager.in_flight == 0
    assert tally.refused > 0 and tally.accepted > 0 and tally.undecodable > 0, tally
    failures = [r for r in caplog.records
                if r.levelno >= logging.ERROR and r.name.startswith("tokenizer_proc")]
    assert failures == []


@pytest.mark.parametrize(("fields", "named"), [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e39}, "temperature"),  # inf in the worker's float32
    ({"repetition_penalty": 1e-30}, "repetition_penalty"),  # logits / 1e-30 overflow
    ({"top_p": float("inf")}, "top_p"),
    ({"seed": 2**64 - 1}, "seed"),
    ({"input_ids": [2**63], "prompt": None}, "input_ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"json_schema": {"items": nested(200)}}, "json_schema"),
    ({"json_schema": {"type": "number", "maximum": float("nan")}}, "json_schema"),
])
def test_zmq_values_that_decode_but_cannot_run_are_refused_by_name(
        preparer: RequestPreparer, fields: dict[str, Any], named: str) -> None:
    front = InProcessFront(preparer)
    answer = asyncio.run(front.ask(frame(**fields)))
    assert answer is not None  # decodable: the codec let it through
    (final,) = answer[1]
    assert final.error is not None and f"'{named}'" in final.error, final
    assert front.engine.requests() == []


def test_zmq_top_k_past_the_vocabulary_is_no_limit(preparer: RequestPreparer) -> None:
    front = InProcessFront(preparer)
    answer = asyncio.run(front.ask(frame(top_k=2**63 - 1, temperature=0.7)))
    assert answer is not None and answer[1][0].error is None
    (request,) = front.engine.requests()
    assert request.sampling.top_k == 0  # was 2**63 - 1, which the worker's int32 dies of

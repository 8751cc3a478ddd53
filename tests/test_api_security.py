"""Security basics: the API key (HTTP and ZMQ), the request size cap, the refusal of
models that need remote code; and one end-to-end check against the real server."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
import zmq
import zmq.asyncio
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.datastructures import Headers

import launch
from ipc.channel import AsyncRouter
from ipc.client import AsyncKilnClient, KilnClient, KilnRequestError
from ipc.codec import encode
from ipc.config import ServerConfig
from ipc.messages.client import ClientToServer, GenerateRequest
from ipc.messages.to_scheduler import GetStats
from tests.fake_engine import FakeEngine, counting_script
from tests.server import ROOT, Server
from tokenizer_proc.client_front import ClientFront
from tokenizer_proc.http_api import create_app
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.remote_code import (UntrustedModelError, check_remote_code,
                                        remote_code_reasons)
from tokenizer_proc.security import ApiKey, bearer_token
from tokenizer_proc.server import serve_clients
from worker_proc.demo_model import ensure_demo_model

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def preparer(tmp_path_factory: pytest.TempPathFactory) -> RequestPreparer:
    path = ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))
    return RequestPreparer.load("demo-tiny", str(path))


class Guarded:
    """An app on a fake engine, built with the given config (API key, size cap)."""

    def __init__(self, preparer: RequestPreparer, config: ServerConfig) -> None:
        self.engine = FakeEngine(counting_script(3))
        self.manager = TokenizerManager(self.engine, stats_timeout=5.0)
        self.engine.connect(self.manager)
        self.app = create_app(self.manager, preparer, {"model_name": "demo-tiny"}, config)
        self.http = TestClient(self.app)


@pytest.fixture
def make_app(preparer: RequestPreparer) -> Callable[..., Guarded]:
    return lambda **config: Guarded(preparer, ServerConfig(**config))


def routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, docs included."""
    out = []
    for route in app.routes:
        methods = route.methods if isinstance(route, APIRoute) else {"GET"}
        out += [(m, route.path) for m in sorted(methods) if m != "HEAD"]
    return out


# --- the key itself ---------------------------------------------------------------------


def test_api_key_comparison() -> None:
    key = ApiKey(KEY)
    assert key.required and key.accepts(KEY)
    assert not key.accepts(None) and not key.accepts("") and not key.accepts(KEY + "x")
    assert not key.accepts(KEY[:-1])
    anyone = ApiKey("")
    assert not anyone.required and anyone.accepts(None) and anyone.accepts("whatever")


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER  abc ", "abc"),
    ("Basic abc", None), ("abc", None), ("", None)])
def test_bearer_token_parsing(header: str, token: str | None) -> None:
    assert bearer_token(Headers({"authorization": header})) == token


# --- HTTP -------------------------------------------------------------------------------


def test_every_route_but_health_needs_the_key(make_app: Callable[..., Guarded]) -> None:
    api = make_app(api_key=KEY)
    served = routes(api.app)
    assert ("POST", "/generate") in served and ("GET", "/metrics") in served
    for method, path in served + [("GET", "/no/such/route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = api.http.request(method, path, headers=headers, json={"prompt": "x"})
            if path == "/health":
                assert r.status_code == 200
                continue
            assert r.status_code == 401, (method, path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            if path.startswith("/v1/messages"):  # Anthropic's routes answer in its format
                assert r.json()["type"] == "error" and error["type"] == "authentication_error"
                continue
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert set(error) == {"message", "type", "param", "code"}
    # Only /health's readiness query reached the engine.
    assert all(isinstance(m, GetStats) for m in api.engine.sent)


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/models", None), ("GET", "/get_server_info", None), ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": "x"}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/generate", {"text": "x"}), ("POST", "/abort_request", {"rid": "r"}),
    ("GET", "/health", None)])
def test_the_right_key_is_let_in(make_app: Callable[..., Guarded], method: str, path: str,
                                 body: dict[str, Any] | None) -> None:
    api = make_app(api_key=KEY)
    r = api.http.request(method, path, headers=GOOD, json=body)
    assert r.status_code == 200, r.text


def test_without_a_key_configured_nothing_is_asked(make_app: Callable[..., Guarded]) -> None:
    api = make_app()
    assert api.http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert api.http.get("/metrics").status_code == 200


def test_streaming_passes_the_guard(make_app: Callable[..., Guarded]) -> None:
    api = make_app(api_key=KEY)
    r = api.http.post("/v1/completions", headers=GOOD, json={"prompt": "x", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


# --- request size -----------------------------------------------------------------------


def test_declared_oversized_body_is_413_before_reading(make_app: Callable[..., Guarded]) -> None:
    api = make_app(max_request_bytes=200)
    r = api.http.post("/v1/completions", json={"prompt": "x" * 300})
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "200 bytes" in error["message"]
    assert api.engine.sent == []
    assert api.http.post("/v1/completions", json={"prompt": "x" * 100}).status_code == 200


def test_streamed_oversized_body_is_413(make_app: Callable[..., Guarded]) -> None:
    api = make_app(max_request_bytes=200)
    chunks = [b'{"prompt": "', b"x" * 150, b"x" * 150, b'"}']
    # A generator body goes out chunked: no Content-Length, so the bytes are counted.
    r = api.http.post("/v1/completions", content=iter(chunks))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert api.engine.sent == []


def test_size_check_comes_after_the_key(make_app: Callable[..., Guarded]) -> None:
    api = make_app(api_key=KEY, max_request_bytes=10)
    assert api.http.post("/generate", json={"text": "x" * 50}).status_code == 401
    assert api.http.post("/generate", json={"text": "x" * 50},
                         headers=GOOD).status_code == 413


def test_config_refuses_a_zero_cap() -> None:
    with pytest.raises(ValueError, match="max-request-bytes"):
        ServerConfig(max_request_bytes=0)


# --- ZMQ --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _with_zmq_front(preparer: RequestPreparer, server_key: str,
                          use: Callable[[str], Any], max_message_bytes: int = -1) -> Any:
    """Serve a ClientFront (fake engine) on a TCP port while `use(address)` runs."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    router: AsyncRouter[ClientToServer] = AsyncRouter(address, ClientToServer,
                                                      max_message_bytes=max_message_bytes)
    engine = FakeEngine(counting_script(3))
    manager = TokenizerManager(engine, stats_timeout=1.0)
    engine.connect(manager)
    front = ClientFront(manager, preparer, router.send, ApiKey(server_key))
    serving = asyncio.ensure_future(serve_clients(router, front))
    try:
        return await use(address), engine
    finally:
        serving.cancel()
        router.close()


def test_zmq_client_with_a_wrong_key_gets_errors(preparer: RequestPreparer) -> None:
    async def use(address: str) -> list[str]:
        errors = []
        for key in (None, "wrong"):
            async with AsyncKilnClient(address, api_key=key, timeout=5) as client:
                with pytest.raises(KilnRequestError, match="API key") as info:
                    await client.generate("hello", max_tokens=2)
                errors.append(str(info.value))
                with pytest.raises(KilnRequestError, match="API key"):
                    await client.server_stats()
                with pytest.raises(KilnRequestError, match="API key"):
                    async for _ in client.stream("hello"):
                        pass
        return errors

    errors, engine = asyncio.run(_with_zmq_front(preparer, KEY, use))
    assert len(errors) == 2 and engine.sent == []


def test_zmq_client_with_the_right_key_is_served(preparer: RequestPreparer) -> None:
    async def use(address: str) -> tuple[str, int]:
        async with AsyncKilnClient(address, api_key=KEY, timeout=5) as client:
            result = await client.generate("hello", max_tokens=2)
            stats = await client.server_stats()
            return result.text, stats.capacity_slots

    (text, capacity), _ = asyncio.run(_with_zmq_front(preparer, KEY, use))
    assert text == " w0 w1" and capacity == 1024


def test_zmq_client_refuses_a_request_over_the_limit(preparer: RequestPreparer) -> None:
    async def use(address: str) -> str:
        async with AsyncKilnClient(address, timeout=5, max_request_bytes=1000) as client:
            with pytest.raises(KilnRequestError, match="over the server.s limit of 1000"):
                await client.generate("x" * 1000, max_tokens=2)
            return (await client.generate("hello", max_tokens=2)).text

    text, engine = asyncio.run(_with_zmq_front(preparer, "", use, max_message_bytes=1000))
    assert text == " w0 w1" and len(engine.sent) == 1  # only the small one got through


def test_zmq_endpoint_drops_an_oversized_message_unread(preparer: RequestPreparer) -> None:
    """A client that ignores the limit loses its message (and connection), not the
    server its memory; other clients are still served."""
    big = encode(GenerateRequest(request_id="big", prompt="x" * 5000, max_tokens=2))

    async def use(address: str) -> tuple[bool, str]:
        rogue = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(address)
        try:
            await rogue.send(big)
            answered = await rogue.poll(500) != 0
        finally:
            rogue.close()
        async with AsyncKilnClient(address, timeout=5) as client:
            return answered, (await client.generate("hello", max_tokens=2)).text

    (answered, text), engine = asyncio.run(
        _with_zmq_front(preparer, "", use, max_message_bytes=len(big) - 1))
    assert not answered and text == " w0 w1" and len(engine.sent) == 1


# --- remote code ------------------------------------------------------------------------


def _model_dir(root: Path, config: dict[str, Any],
               tokenizer_config: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return root


AUTO_MAP = {"AutoConfig": "configuration_x.XConfig",
            "AutoModelForCausalLM": "modeling_x.XForCausalLM"}


def test_auto_map_model_is_refused_without_the_flag(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", {"model_type": "llama", "auto_map": AUTO_MAP})
    with pytest.raises(UntrustedModelError) as info:
        check_remote_code(model, trusted=False)
    message = str(info.value)
    assert "auto_map" in message and "--trust-remote-code" in message
    check_remote_code(model, trusted=True)  # allowed with the flag


@pytest.mark.parametrize(("config", "tokenizer_config", "needle"), [
    ({"model_type": "no-such-architecture"}, None, "model_type 'no-such-architecture'"),
    ({"model_type": "llama", "model_file": "my_model.py"}, None, "my_model.py"),
    ({"model_type": "llama"}, {"auto_map": {"AutoTokenizer": ["tok.T", None]}},
     "tokenizer_config.json"),
])
def test_other_remote_code_reasons(tmp_path: Path, config: dict[str, Any],
                                   tokenizer_config: dict[str, Any] | None,
                                   needle: str) -> None:
    reasons = remote_code_reasons(_model_dir(tmp_path / "m", config, tokenizer_config))
    assert len(reasons) == 1 and needle in reasons[0]


def test_ordinary_models_need_no_remote_code(tmp_path: Path) -> None:
    demo = ensure_demo_model("demo-tiny", cache_root=tmp_path / "cache")
    assert remote_code_reasons(demo) == []
    # mlx-lm's own remapping: "mistral" is built by its llama module.
    assert remote_code_reasons(_model_dir(tmp_path / "m", {"model_type": "mistral"})) == []
    # A tokenizer class without an auto_map is one of transformers' own (as the README says).
    named = _model_dir(tmp_path / "t", {"model_type": "llama"},
                       {"tokenizer_class": "LlamaTokenizerFast"})
    assert remote_code_reasons(named) == []


def test_a_model_type_mlx_lm_ships_is_checked_without_importing_mlx_lm(tmp_path: Path) -> None:
    """The launcher's check finds mlx-lm's own module for a plain model_type on disk (the
    package's import is most of the launcher's start-up); remapped and unknown types, and
    names that are not identifiers, still go through mlx-lm's lookup."""
    model = _model_dir(tmp_path / "m", {"model_type": "qwen3"})
    probe = ("import sys; from tokenizer_proc.remote_code import remote_code_reasons as r; "
             f"from pathlib import Path; print(r(Path({str(model)!r})), 'mlx_lm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["[]", "False"], done.stderr
    traversal = remote_code_reasons(_model_dir(tmp_path / "t", {"model_type": "../models/llama"}))
    assert len(traversal) == 1 and "'../models/llama'" in traversal[0]


def test_launcher_refuses_a_remote_code_model(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", {"model_type": "llama", "auto_map": AUTO_MAP})
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--model", str(model)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--trust-remote-code" in done.stderr and "auto_map" in done.stderr


def test_launcher_reads_the_key_from_the_environment(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_dir(tmp_path / "m", {"model_type": "llama"})
    monkeypatch.setattr(launch, "setup_logging", lambda *args: None)
    monkeypatch.setattr(launch, "make_run_dir", lambda: str(tmp_path / "run"))
    monkeypatch.setenv(launch.API_KEY_ENV, "from-env")
    assert launch.config_from_args(["--model", str(model)]).api_key == "from-env"
    assert launch.config_from_args(["--model", str(model), "--api-key", "flag"]).api_key == "flag"
    assert "from-env" not in repr(launch.config_from_args(["--model", str(model)]))
    trusted = launch.config_from_args(["--model", str(model), "--trust-remote-code"])
    assert trusted.trust_remote_code


# --- end to end: the real server with --api-key -----------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("keyed") / "server.log"
    srv = Server(tiny_model_dir, "--api-key", "secret", "--max-total-tokens", "4000",
                 log_path=log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.mark.timeout(300)
def test_real_server_with_an_api_key(keyed_server: Server) -> None:
    url = keyed_server.url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
    result = client.completions.create(model="demo-tiny", prompt="hello", max_tokens=5,
                                       temperature=0)
    assert result.usage.completion_tokens >= 1 and result.choices[0].finish_reason
    with KilnClient(keyed_server.zmq, api_key="secret", timeout=60) as zmq_client:
        assert zmq_client.generate("hello", max_tokens=3).usage.completion_tokens >= 1
    with KilnClient(keyed_server.zmq, api_key="wrong", timeout=60) as zmq_client:
        with pytest.raises(KilnRequestError):
            zmq_client.generate("hello", max_tokens=3)
    scrape = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer secret"}).text
    values = {s.name: s.value for f in text_string_to_metric_families(scrape)
              for s in f.samples}
    assert values["kiln_generation_tokens_total"] >= 2
    assert values["kiln_prompt_tokens_total"] > 0
    assert values["kiln_kv_slots_capacity"] > 0


def test_anthropic_clients_send_the_key_as_x_api_key(make_app: Callable[..., Guarded]) -> None:
    api = make_app(api_key=KEY)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert api.http.post("/v1/messages/count_tokens", json=body,
                         headers={"x-api-key": KEY}).status_code == 200
    assert api.http.post("/v1/messages/count_tokens", json=body,
                         headers={"x-api-key": "wrong"}).status_code == 401

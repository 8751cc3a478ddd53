"""The tokenizer process end to end, with the test playing launcher and scheduler:
ready report, a stats round trip, SIGINT and SIGTERM ignored, and the launcher's stop
signal's graceful shutdown."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ipc.channel import Receiver, Sender
from ipc.client import KilnClient, KilnRequestError
from ipc.config import ServerConfig
from ipc.messages.to_launcher import LauncherMessage, ProcessReady
from ipc.messages.to_scheduler import (AbortRequest, GetStats, SchedulerMessage,
                                       TokenizedRequest)
from ipc.messages.to_tokenizer import BatchText, EngineDead, StatsReply, TextOutput
from ipc.process import STOP_SIGNAL
from tokenizer_proc import run_tokenizer
from tests.fake_engine import FAKE_STATS
from worker_proc.demo_model import ensure_demo_model

SHUTDOWN_TIMEOUT = 1.5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeScheduler:
    """The scheduler's and detokenizer's sockets, driven by hand."""

    def __init__(self, config: ServerConfig) -> None:
        self.inbox: Receiver[Any] = Receiver(config.scheduler_endpoint, SchedulerMessage)
        self.outbox = Sender(config.tokenizer_endpoint)

    def expect(self, kind: type, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self.inbox.recv(timeout_ms=100)
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def emit(self, rid: str, text: str, finished: bool = False) -> None:
        output = TextOutput(rid=rid, text=text, token_ids=[10], finished=finished,
                            finish_reason="stop" if finished else None)
        self.outbox.send(BatchText(outputs=[output]))

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


@pytest.fixture
def config(tmp_path: Path) -> ServerConfig:
    model = ensure_demo_model("demo-tiny", cache_root=tmp_path / "cache")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    return ServerConfig(model="demo-tiny", model_path=str(model), port=_free_port(),
                        zmq_port=_free_port(), run_dir=str(run_dir),
                        shutdown_timeout=SHUTDOWN_TIMEOUT, log_level="info")


@pytest.fixture
def process(config: ServerConfig) -> Iterator[multiprocessing.Process]:
    launcher: Receiver[Any] = Receiver(config.launcher_endpoint, LauncherMessage)
    child = multiprocessing.get_context("spawn").Process(target=run_tokenizer, args=(config,))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not isinstance(launcher.recv(timeout_ms=200), ProcessReady):
            assert child.is_alive() and time.monotonic() < deadline, "never became ready"
        yield child
    finally:
        launcher.close()
        if child.is_alive():
            child.kill()
        child.join(5)


def _stream(url: str, body: dict[str, Any]) -> list[str]:
    """POST a streaming request; the SSE data lines received (until the server closes)."""
    lines: list[str] = []
    try:
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            lines.extend(line for line in response.iter_lines() if line)
    except httpx.HTTPError:
        lines.append("<connection closed>")
    return lines


def test_serves_then_shuts_down_gracefully(config: ServerConfig,
                                           process: multiprocessing.Process) -> None:
    base = f"http://{config.host}:{config.port}"
    scheduler = FakeScheduler(config)
    pool = ThreadPoolExecutor(4)
    try:
        health = pool.submit(httpx.get, f"{base}/health", timeout=10)
        query = scheduler.expect(GetStats)  # health asks the engine: answer as it would
        scheduler.outbox.send(StatsReply(query_id=query.query_id, stats=FAKE_STATS))
        assert health.result(10).status_code == 200
        _check_stats_round_trip(base, scheduler, pool)

        # Two HTTP streams and a ZMQ request in flight, each past its first output.
        body = {"prompt": "hi", "stream": True}
        finishing = pool.submit(_stream, f"{base}/v1/completions", body)
        rid_finishing = scheduler.expect(TokenizedRequest).rid
        scheduler.emit(rid_finishing, "a")
        stuck = pool.submit(_stream, f"{base}/v1/completions", body)
        rid_stuck = scheduler.expect(TokenizedRequest).rid
        scheduler.emit(rid_stuck, "b")
        client = KilnClient(config.client_endpoint, timeout=30)
        zmq_result: Future[Any] = pool.submit(client.generate, "hi")
        rid_zmq = scheduler.expect(TokenizedRequest).rid

        for sig in (signal.SIGINT, signal.SIGTERM):  # the launcher's business, not ours
            os.kill(process.pid, sig)
        time.sleep(0.3)
        assert process.is_alive()

        started = time.monotonic()
        os.kill(process.pid, STOP_SIGNAL)
        time.sleep(0.2)
        scheduler.emit(rid_finishing, "c", finished=True)  # finishes within the grace period
        aborted = {scheduler.expect(AbortRequest).rid, scheduler.expect(AbortRequest).rid}
        process.join(SHUTDOWN_TIMEOUT + 10)

        assert process.exitcode == 0
        assert time.monotonic() - started >= SHUTDOWN_TIMEOUT - 0.1
        assert aborted == {rid_stuck, rid_zmq}
        assert _texts_and_reasons(finishing.result(5)) == [("a", None), ("c", None),
                                                            ("", "stop")]
        # Aborted at the deadline, the stream still ends properly, saying so ("length":
        # OpenAI's schema has no "abort", see responses.openai_finish_reason).
        assert _texts_and_reasons(stuck.result(5)) == [("b", None), ("", "length")]
        assert zmq_result.result(5).finish_reason == "abort"
        client.close()
    finally:
        pool.shutdown(wait=False)
        scheduler.close()


def _texts_and_reasons(lines: list[str]) -> list[tuple[str, str | None]]:
    assert lines[-1] == "data: [DONE]", lines
    choices = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines[:-1]]
    return [(c["text"], c["finish_reason"]) for c in choices]


def _check_stats_round_trip(base: str, scheduler: FakeScheduler,
                            pool: ThreadPoolExecutor) -> None:
    info = pool.submit(httpx.get, f"{base}/get_server_info", timeout=10)
    query = scheduler.expect(GetStats)
    scheduler.outbox.send(StatsReply(query_id=query.query_id, stats=FAKE_STATS))
    body = info.result(10).json()
    assert body["scheduler"]["capacity_slots"] == FAKE_STATS.capacity_slots
    assert body["model_name"] == "demo-tiny" and body["context_length"] == 4096


def _timed(work: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(when it returned, by time.monotonic, and what it returned or raised)."""
    try:
        result = work(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        result = exc
    return time.monotonic(), result


def test_engine_dead_answers_every_waiting_client_at_once(
        config: ServerConfig, process: multiprocessing.Process) -> None:
    """The launcher's EngineDead: a health probe, an SSE stream, a whole-response request
    and a ZMQ request, all waiting on an engine that will never answer, get their errors
    at once; a request coming after it is a 503; then the stop signal takes no grace."""
    base = f"http://{config.host}:{config.port}"
    scheduler = FakeScheduler(config)  # it never answers: the engine behind it is dead
    pool = ThreadPoolExecutor(4)
    client = KilnClient(config.client_endpoint, timeout=30)
    try:
        health = pool.submit(_timed, httpx.get, f"{base}/health", timeout=10)
        scheduler.expect(GetStats)
        streaming = pool.submit(_timed, _stream, f"{base}/v1/completions",
                                {"prompt": "hi", "stream": True})
        scheduler.emit(scheduler.expect(TokenizedRequest).rid, "a")
        whole = pool.submit(_timed, httpx.post, f"{base}/v1/completions",
                            json={"prompt": "hi"}, timeout=10)
        scheduler.expect(TokenizedRequest)
        zmq_call = pool.submit(_timed, client.generate, "hi")
        scheduler.expect(TokenizedRequest)

        launcher = Sender(config.tokenizer_endpoint)
        launcher.send(EngineDead(reason="The engine stopped: its worker died."))
        told = time.monotonic()
        answers = {"health": health.result(10), "sse": streaming.result(10),
                   "whole": whole.result(10), "zmq": zmq_call.result(10)}
        assert max(at for at, _ in answers.values()) - told < 1.0, answers
        assert answers["health"][1].status_code == 503
        *_, error, done = answers["sse"][1]
        assert json.loads(error.removeprefix("data: "))["error"]["message"] == \
            "The engine stopped: its worker died." and done == "data: [DONE]"
        assert answers["whole"][1].status_code == 503
        assert answers["whole"][1].json()["error"]["type"] == "server_error"
        assert isinstance(answers["zmq"][1], KilnRequestError)
        assert "worker died" in str(answers["zmq"][1])
        late = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert late.status_code == 503 and "worker died" in late.json()["error"]["message"]

        stopping = time.monotonic()
        os.kill(process.pid, STOP_SIGNAL)
        process.join(10)
        assert process.exitcode == 0 and time.monotonic() - stopping < 1.5
        launcher.close()
    finally:
        client.close()
        pool.shutdown(wait=False)
        scheduler.close()

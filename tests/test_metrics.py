"""Observability of the front: the Prometheus series on plain data and through /metrics,
the per-request debug line and the periodic throughput line."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ipc.messages.common import SamplingParams, SchedulerStats
from ipc.messages.to_scheduler import TokenizedRequest
from ipc.messages.to_tokenizer import TextOutput
from tests.fake_engine import (FAKE_STATS, FakeEngine, Script, counting_script,
                               endless_script, reject_script)
from tests.test_native_api import generate_then_abort
from tokenizer_proc.http_api import create_app
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.metrics import RequestMetrics, cache_hit_rate
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.server import log_throughput
from worker_proc.demo_model import ensure_demo_model

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def preparer(tmp_path_factory: pytest.TempPathFactory) -> RequestPreparer:
    path = ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))
    return RequestPreparer.load("demo-tiny", str(path))


def samples(exposition: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by (name, sorted labels)."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scrape: dict[Any, float], name: str, **labels: str) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


class Clock:
    """A hand-driven monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def out(rid: str, ids: list[int], finished: bool = False, **kw: Any) -> TextOutput:
    return TextOutput(rid=rid, text="x", token_ids=ids, finished=finished, **kw)


# --- RequestMetrics on plain data -------------------------------------------------------


def test_latencies_and_counters_of_one_request() -> None:
    clock = Clock()
    metrics = RequestMetrics(clock)
    metrics.submitted("a", prompt_tokens=7)
    clock.now += 0.25  # time to first token
    metrics.output(out("a", [1]))
    clock.now += 0.04
    metrics.output(out("a", [2, 3]))  # two tokens in one output: two gaps of 0.02
    clock.now += 0.01
    metrics.output(out("a", [4], finished=True, finish_reason="length"))
    scrape = samples(metrics.exposition())
    assert value(scrape, "kiln_prompt_tokens_total") == 7
    assert value(scrape, "kiln_generation_tokens_total") == 4
    assert value(scrape, "kiln_time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(scrape, "kiln_inter_token_latency_seconds_count") == 3
    assert value(scrape, "kiln_inter_token_latency_seconds_sum") == pytest.approx(0.05)
    # Edges a few ms apart: the 10 ms gap and the two of 20 ms fall in buckets of their own.
    assert value(scrape, "kiln_inter_token_latency_seconds_bucket", le="0.008") == 0
    assert value(scrape, "kiln_inter_token_latency_seconds_bucket", le="0.0125") == 1
    assert value(scrape, "kiln_inter_token_latency_seconds_bucket", le="0.0175") == 1
    assert value(scrape, "kiln_inter_token_latency_seconds_bucket", le="0.025") == 3
    assert value(scrape, "kiln_e2e_request_latency_seconds_sum") == pytest.approx(0.3)
    assert value(scrape, "kiln_requests_finished_total", finish_reason="length") == 1


def test_aborted_and_failed_requests_are_counted_apart() -> None:
    metrics = RequestMetrics(Clock())
    metrics.submitted("gone", 3)
    metrics.output(out("gone", [1]))
    metrics.aborted("gone")
    metrics.aborted("never-submitted")
    metrics.submitted("refused", 3)
    metrics.output(TextOutput(rid="refused", text="", token_ids=[], finished=True,
                              error="too long"))
    scrape = samples(metrics.exposition())
    assert value(scrape, "kiln_requests_aborted_total") == 1
    assert value(scrape, "kiln_requests_failed_total") == 1
    assert value(scrape, "kiln_e2e_request_latency_seconds_count") == 0
    # The refused prompt was never computed; the aborted one was.
    assert value(scrape, "kiln_prompt_tokens_total") == 3


def test_scheduler_series_come_from_the_latest_stats() -> None:
    metrics = RequestMetrics()
    scrape = samples(metrics.exposition())
    assert value(scrape, "kiln_kv_slots_capacity") == 0  # no stats yet
    stats = msgspec.structs.replace(
        FAKE_STATS, running_requests=3, waiting_requests=2, used_slots=100,
        prompt_tokens_total=1000, computed_prompt_tokens_total=250)
    if "preemptions_total" in SchedulerStats.__struct_fields__:
        stats = msgspec.structs.replace(stats, preemptions_total=4)
    metrics.set_scheduler_stats(stats)
    scrape = samples(metrics.exposition())
    assert value(scrape, "kiln_num_requests_running") == 3
    assert value(scrape, "kiln_num_requests_waiting") == 2
    assert value(scrape, "kiln_kv_slots_used") == 100
    assert value(scrape, "kiln_kv_slots_capacity") == 1024
    assert value(scrape, "kiln_cache_hit_rate") == pytest.approx(0.75)
    assert value(scrape, "kiln_preemptions_total") == getattr(stats, "preemptions_total", 0)


def test_cache_hit_rate_is_zero_without_prompts() -> None:
    assert cache_hit_rate(None) == 0.0
    assert cache_hit_rate(FAKE_STATS) == 0.0


def test_each_app_has_its_own_registry() -> None:
    first, second = RequestMetrics(), RequestMetrics()
    first.submitted("a", 5)
    first.output(out("a", [1], finished=True, finish_reason="stop"))
    assert value(samples(first.exposition()), "kiln_prompt_tokens_total") == 5
    assert value(samples(second.exposition()), "kiln_prompt_tokens_total") == 0


# --- logging ----------------------------------------------------------------------------


def test_one_debug_line_per_ended_request(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    metrics = RequestMetrics(clock)
    metrics.submitted("r1", 4)
    clock.now += 0.5
    metrics.output(out("r1", [1, 2], finished=True, finish_reason="stop"))
    with caplog.at_level(logging.DEBUG, logger="tokenizer_proc.metrics"):
        metrics.submitted("r2", 4)
        clock.now += 1.0
        metrics.output(out("r2", [1], finished=True, finish_reason="length"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "r2" in line and "prompt 4" in line and "completion 1" in line
    assert "finish length" in line and "ttft 1.000 s" in line and "e2e 1.000 s" in line


def test_throughput_line_covers_the_window() -> None:
    clock = Clock()
    metrics = RequestMetrics(clock)
    assert not metrics.had_traffic()
    metrics.submitted("a", 40)
    metrics.output(out("a", [1, 2, 3, 4]))
    clock.now += 4.0
    stats = msgspec.structs.replace(FAKE_STATS, running_requests=1, waiting_requests=2)
    line = metrics.throughput_line(stats)
    assert "running 1, waiting 2" in line
    assert "prompt 10.0 tok/s" in line and "generation 1.0 tok/s" in line
    assert metrics.window.generation_tokens == 0  # a new window
    assert "running ?, waiting ?" in metrics.throughput_line(None)


def test_throughput_is_logged_periodically_only_with_traffic(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> list[str]:
        engine = FakeEngine(counting_script(3))
        manager = TokenizerManager(engine)
        engine.connect(manager)
        logging_task = asyncio.ensure_future(log_throughput(manager, 0.05))
        await asyncio.sleep(0.12)  # idle: nothing to say
        idle = [r for r in caplog.records if "throughput" in r.getMessage()]
        stream = await manager.submit(TokenizedRequest(
            rid="busy", input_ids=[5, 6], sampling=SamplingParams(), stop_token_ids=[1]))
        await stream.collect()
        await asyncio.sleep(0.12)
        logging_task.cancel()
        assert idle == []
        return [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="tokenizer_proc.server"):
        lines = asyncio.run(body())
    assert len(lines) == 1 and "running 0, waiting 0" in lines[0]
    assert "generation" in lines[0]


# --- through the HTTP API ---------------------------------------------------------------


class MetricsApi:
    """An app on a fake engine; `scrape()` parses GET /metrics."""

    def __init__(self, preparer: RequestPreparer, script: Script, **engine: Any) -> None:
        self.engine = FakeEngine(script, **engine)
        self.manager = TokenizerManager(self.engine, stats_timeout=5.0)
        self.engine.connect(self.manager)
        self.http = TestClient(create_app(self.manager, preparer))

    def scrape(self) -> dict[Any, float]:
        r = self.http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return samples(r.text)


@pytest.fixture
def make_api(preparer: RequestPreparer) -> Callable[..., MetricsApi]:
    return lambda script=None, **engine: MetricsApi(preparer, script or counting_script(4),
                                                   **engine)


def test_counters_move_as_requests_run(make_api: Callable[..., MetricsApi]) -> None:
    api = make_api()
    before = api.scrape()
    assert value(before, "kiln_generation_tokens_total") == 0
    for stream in (False, True):
        r = api.http.post(COMPLETIONS, json={"prompt": "hello there", "stream": stream})
        assert r.status_code == 200
    after = api.scrape()
    prompt = sum(len(req.input_ids) for req in api.engine.requests())
    assert value(after, "kiln_prompt_tokens_total") == prompt
    assert value(after, "kiln_generation_tokens_total") == 8
    assert value(after, "kiln_requests_finished_total", finish_reason="stop") == 2
    assert value(after, "kiln_time_to_first_token_seconds_count") == 2
    assert value(after, "kiln_e2e_request_latency_seconds_count") == 2
    assert value(after, "kiln_inter_token_latency_seconds_count") == 6
    assert value(after, "kiln_kv_slots_capacity") == FAKE_STATS.capacity_slots


def test_aborts_and_rejections_through_http(make_api: Callable[..., MetricsApi]) -> None:
    api = make_api(reject_script("no room"))
    assert api.http.post(COMPLETIONS, json={"prompt": "x"}).status_code == 400
    assert value(api.scrape(), "kiln_requests_failed_total") == 1

    api = make_api(endless_script(pieces=1))
    body = {"text": "x", "stream": True, "rid": "r1"}
    _, aborted = asyncio.run(generate_then_abort(api.http.app, api.engine, body))
    assert aborted == {"aborted": True}
    assert value(api.scrape(), "kiln_requests_aborted_total") == 1
    assert value(api.scrape(), "kiln_requests_finished_total", finish_reason="abort") == 0


def test_scrape_survives_a_silent_scheduler(make_api: Callable[..., MetricsApi],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tokenizer_proc.http_api._SCRAPE_STATS_TIMEOUT_S", 0.05)
    api = make_api(stats=None)
    assert value(api.scrape(), "kiln_num_requests_running") == 0

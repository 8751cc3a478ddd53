"""The launcher's failure paths through all four processes: a child killed while serving
(every client hears of it within 2 s, then the launcher exits non-zero), and a model the
engine cannot serve (refused in the launcher's own last line)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest

from tests.server import Server

pytestmark = pytest.mark.timeout(300)

# Long enough that nothing finishes before the kill (demo-tiny's context is 4,096).
LONG = {"max_tokens": 3500, "ignore_eos": True, "temperature": 0}
DEADLINE_S = 2.0


@dataclass
class Heard:
    """What one client got after the kill, and when (time.monotonic)."""

    at: float
    what: Any


async def _sse(url: str, streaming: asyncio.Event) -> Heard:
    """A streamed completion's data lines after its first chunk, up to the end."""
    body = {"model": "x", "prompt": "a long story", "stream": True, **LONG}
    lines: list[str] = []
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                if not streaming.is_set():
                    streaming.set()
                    continue
                lines.append(line)
    return Heard(time.monotonic(), lines)


async def _whole(url: str) -> Heard:
    body = {"model": "x", "prompt": "another story", **LONG}
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(url + "/v1/completions", json=body)
    return Heard(time.monotonic(), response)


async def _zmq(address: str) -> Heard:
    from ipc.client import AsyncKilnClient

    async with AsyncKilnClient(address, timeout=30) as client:
        try:
            result: Any = await client.generate("a third story", **LONG)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            result = exc
    return Heard(time.monotonic(), result)


async def _running(url: str, count: int) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            info = (await http.get(url + "/get_server_info")).json()
            if info["scheduler"]["running_requests"] >= count:
                return
            await asyncio.sleep(0.05)


async def _kill_under_clients(srv: Server, role: str) -> tuple[float, dict[str, Heard]]:
    streaming = asyncio.Event()
    clients = {"sse": asyncio.ensure_future(_sse(srv.url, streaming)),
               "whole": asyncio.ensure_future(_whole(srv.url)),
               "zmq": asyncio.ensure_future(_zmq(srv.zmq))}
    await asyncio.wait_for(streaming.wait(), 30)
    await asyncio.wait_for(_running(srv.url, 3), 30)
    srv.child(f"kiln:{role}").send_signal(signal.SIGKILL)
    killed = time.monotonic()
    heard = await asyncio.wait_for(asyncio.gather(*clients.values()), 20)
    return killed, dict(zip(clients, heard))


@pytest.mark.parametrize("role", ["worker", "scheduler", "detokenizer"])
def test_every_client_hears_of_a_killed_child_within_2_s(tiny_model_dir, tmp_path, role):
    """kill -9 of a child behind the front, with an SSE stream, a whole-response request
    and a ZMQ request generating: the stream gets an error event then [DONE], the
    request a 503 with an error body, the ZMQ call raises, each within 2 s; then the
    launcher exits non-zero."""
    from ipc.client import KilnRequestError

    srv = Server(tiny_model_dir, "--max-total-tokens", "12000",
                 log_path=tmp_path / "log").wait_ready()
    try:
        killed, heard = asyncio.run(_kill_under_clients(srv, role))
        print(f"\nkill -9 {role}: " + ", ".join(f"{name} {h.at - killed:.3f} s"
                                              for name, h in heard.items()))
        for name, h in heard.items():
            assert h.at - killed < DEADLINE_S, (name, h.at - killed)
        *_, error, done = heard["sse"].what
        assert f"{role} died" in json.loads(error.removeprefix("data: "))["error"]["message"]
        assert done == "data: [DONE]"
        response = heard["whole"].what
        assert response.status_code == 503, response.text
        assert f"{role} died" in response.json()["error"]["message"]
        assert isinstance(heard["zmq"].what, KilnRequestError), heard["zmq"].what
        assert f"{role} died" in str(heard["zmq"].what)
        assert srv.proc.wait(15) == 1
    finally:
        srv.stop()


# --- a model the engine cannot page -----------------------------------------------------


@pytest.mark.timeout(300)
def test_a_model_it_cannot_page_is_served_on_its_own_caches(tiny_model_dir, tmp_path):
    """DeepSeek-V4.1 keeps a cache of its own kind (window, compressed groups, index keys)
    in every layer, which kiln's pool cannot hold: the start-up log says so, and the
    server runs it on mlx-lm's own caches, a set a request: concurrent requests, prompts
    in several chunks, get mlx_lm.generate's tokens; a prompt sent again hits no cache."""
    from tests.test_families import (SMALL_SERVER, assert_served_as_mlx_lm, mlx_lm_tokens,
                                      model_dir_and_prompts, served_greedy)

    model_dir, model, prompts = model_dir_and_prompts(
        "deepseek_v41", tiny_model_dir, tmp_path / "deepseek-v41", 600, (3, 40, 90, 17))
    srv = Server(model_dir, *SMALL_SERVER, log_path=tmp_path / "log").wait_ready()
    try:
        assert_served_as_mlx_lm(srv, model, prompts, 16)
        assert served_greedy(srv, [prompts[2]], 16)[0] == mlx_lm_tokens(model, prompts[2], 16)
        assert srv.stats()["cache_hit_tokens_total"] == 0
        log = srv.log_tail(20000)
        assert ("not paged (layers 0-1: LayerCache: not supported yet): served through "
                "mlx-lm's own caches") in log, log
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_a_model_it_cannot_serve_is_refused_in_the_launchers_last_line(tiny_model_dir,
                                                                       tmp_path):
    """The reason is the launcher's own last line (here a flag for kiln's pool beside a
    model on its own caches, naming its layer kind); no traceback; every child stops when
    told (the front too, though health probes were waiting on the engine as it failed),
    and the exit code is 1."""
    from tests.families import write_model_dir

    model = write_model_dir("deepseek_v41", tiny_model_dir, tmp_path / "deepseek-v41")
    srv = Server(model, "--fast-decode-blocks", "on", log_path=tmp_path / "log")
    while srv.proc.poll() is None:  # probes, as a load balancer would send them
        try:
            httpx.get(srv.url + "/health", timeout=1.0)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    log = srv.log_tail(20000)
    srv.stop()
    assert srv.proc.returncode == 1
    assert log.rstrip().splitlines()[-1].endswith(
        f"launcher: cannot serve {model}: --fast-decode-blocks on: this model runs on "
        "mlx-lm's own caches, not kiln's pool (layers 0-1: LayerCache: not supported yet)"), log
    assert "Traceback" not in log and "did not stop" not in log, log


# --- the stacks signal ------------------------------------------------------------------


def test_sigusr2_to_the_group_logs_every_process_stack_and_changes_nothing(tiny_model_dir,
                                                                          tmp_path):
    """kill -USR2 to the server's process group: the launcher and each child write their
    threads' stacks to the log (a frame of each one's package: where a slow start or a
    stuck step waits), and nothing else happens: every process of the group (multiprocessing's
    resource tracker too) lives on and the server answers."""
    srv = Server(tiny_model_dir, log_path=tmp_path / "log", own_group=True).wait_ready()
    try:
        group = [psutil.Process(srv.proc.pid), *srv.children()]
        assert any("resource_tracker" in " ".join(p.cmdline()) for p in group)
        before = srv.log_path.stat().st_size
        os.killpg(srv.proc.pid, signal.SIGUSR2)
        wanted = ["launch.py", "tokenizer_proc", "scheduler_proc", "worker_proc",
                  "detokenizer_proc"]
        deadline = time.monotonic() + 10
        while True:
            dumped = srv.log_path.read_bytes()[before:].decode(errors="replace")
            missing = [w for w in wanted if f"{os.sep}{w}" not in dumped]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not missing, (missing, dumped[-3000:])
        time.sleep(0.5)
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group), [
            (" ".join(p.cmdline())[:60], p.status()) for p in group]
        body = {"model": "x", "prompt": "still here", "max_tokens": 4, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log_tail()


# --- a start-up that goes quiet --------------------------------------------------------


class _Quiet:
    """A launcher inbox on which nothing arrives."""

    def recv(self, timeout_ms: int | None = None) -> None:
        time.sleep((timeout_ms or 0) / 1000)


class _Running:
    exitcode = None


def test_a_quiet_start_up_is_told_about_then_times_out(monkeypatch, caplog, tmp_path):
    """A child silent for _STILL_STARTING_S: the launcher logs that it is still waiting
    (whom, and how to see where), again after as long, then gives up at --ready-timeout
    with the waited-for child in its last line."""
    import launch
    from ipc.config import ServerConfig

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # no kernel compiles to tell of
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setattr(launch, "_STILL_STARTING_S", 0.3)
    supervisor = launch.Supervisor(ServerConfig(ready_timeout=1.0))
    supervisor.children = {"worker": _Running()}
    with caplog.at_level("INFO", logger="launcher"):
        assert not supervisor.wait_ready(_Quiet())
    still = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
    assert len(still) >= 2, still
    assert "waiting for worker" in still[0] and "SIGUSR2" in still[0]
    assert supervisor.failure == "start-up timed out after 1s waiting for worker"


def test_a_start_up_timed_out_in_kernel_compiles_says_so(monkeypatch, tmp_path):
    """The last line of a start-up that timed out while MLX compiled CUDA kernels into
    kiln's cache says how many, and that the next start resumes from them."""
    import launch
    from ipc.config import ServerConfig

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    cache = tmp_path / "mlx-kernels" / "0.32.4-sm_90"
    cache.mkdir(parents=True)
    (cache / "gather_bool_uint32_1.ptx").write_bytes(b"old")
    old = time.time() - 3600
    os.utime(cache / "gather_bool_uint32_1.ptx", (old, old))  # an earlier start's

    class Compiling(_Quiet):
        def recv(self, timeout_ms=None):
            for tile in (16, 32):  # the worker's MLX compiling, as seen on disk
                (cache / f"qmm_sm80_tn_bfloat16_m{tile}_b4_g32_mxfp4.ptx").write_bytes(b"new")
            return super().recv(timeout_ms)

    supervisor = launch.Supervisor(ServerConfig(ready_timeout=1.0))
    supervisor.children = {"worker": _Running()}
    assert not supervisor.wait_ready(Compiling())
    assert supervisor.failure.startswith("start-up timed out after 1s waiting for worker (MLX "
                                         "compiled 2 CUDA kernel modules meanwhile")
    assert "the next start resumes from them" in supervisor.failure
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "elsewhere"))  # the user's: none
    assert launch.kernel_compiles_since(0.0) == ""

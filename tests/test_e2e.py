"""End to end through all four processes: HTTP (official openai client) and ZMQ client."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time

import httpx
import numpy as np
import openai
import psutil
import pytest

from tests.oracle import divergence_off_a_tie
from tests.server import Server

pytestmark = pytest.mark.timeout(600)

MODEL = "demo-tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = Server(tiny_model_dir, "--max-total-tokens", "20000", "--chunked-prefill-size", "128",
                 "--max-prefill-tokens", "512", "--max-running-requests", "16",
                 # the step pipeline across processes (auto leaves it off on the CPU)
                 "--overlap", "on", "--served-model-name", MODEL, log_path=log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return tiny_model[1]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    lengths = [1, 600, 3, 129, 40, 257, 8, 512, 77, 200, 16, 350, 64, 2, 450, 31]
    return [rng.integers(5, vocab, size=n).tolist() for n in lengths]


MAX_TOKENS = [48, 20, 64, 5, 33, 1, 60, 12, 40, 25, 64, 9, 30, 50, 16, 44]


def _wait_idle(server: Server, timeout: float = 20.0) -> dict:
    """Wait until nothing runs, then check that every slot is free or cached."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if stats["running_requests"] == 0 and stats["waiting_requests"] == 0:
            assert stats["slots_consistent"], stats
            assert stats["free_slots"] + stats["cached_slots"] == stats["capacity_slots"], stats
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def _flush(server: Server) -> dict:
    r = httpx.post(server.url + "/flush_cache", timeout=10)
    assert r.status_code == 200
    return r.json()["scheduler"]


def test_16_concurrent_http_requests_match_mlx_lm(server, tiny_model, oracle, tokenizer):
    prompts = _prompts(tiny_model[0].args.vocab_size)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def one(p, m):
        return await client.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0)

    async def all_of_them():
        return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, MAX_TOKENS)))

    responses = asyncio.run(all_of_them())
    for p, m, r in zip(prompts, MAX_TOKENS, responses):
        expected = oracle(p, m)
        assert r.choices[0].text == tokenizer.decode(expected), f"prompt of {len(p)} tokens"
        assert r.usage.completion_tokens in (len(expected), len(expected) + 1)
        assert r.usage.prompt_tokens == len(p)
        assert r.choices[0].finish_reason == ("length" if len(expected) == m else "stop")
    _wait_idle(server)
    assert _flush(server)["free_slots"] == server.stats()["capacity_slots"]


def test_16_concurrent_zmq_requests_match_mlx_lm(server, tiny_model, oracle):
    from ipc.client import AsyncKilnClient

    prompts = _prompts(tiny_model[0].args.vocab_size)

    async def all_of_them():
        client = AsyncKilnClient(server.zmq)
        try:
            return await asyncio.gather(*(
                client.generate(input_ids=p, max_tokens=m, temperature=0.0)
                for p, m in zip(prompts, MAX_TOKENS)))
        finally:
            client.close()

    for p, m, r in zip(prompts, MAX_TOKENS, asyncio.run(all_of_them())):
        assert r.token_ids == oracle(p, m)


def test_concurrent_prompts_sharing_prefixes_match_mlx_lm(server, tiny_model, oracle, tokenizer):
    """20 greedy completions of 1 to 2,100 token ids arriving together, pairs sharing 1,
    8, 64 or 300 first tokens, a prompt repeated and one a prefix of another: prefix hits
    taken while their owners are still prefilled in the same busy steps change nothing."""
    vocab = tiny_model[0].args.vocab_size
    rng = np.random.default_rng(61)
    lengths = [1, 2100, 20, 64, 513, 1024, 8, 300, 700, 90, 5, 1500, 40, 333, 900, 12,
               640, 1200, 256, 77]
    prompts = [rng.integers(5, vocab, size=n).tolist() for n in lengths]
    for owner, sharer, shared in ((2, 3, 1), (6, 4, 8), (3, 5, 64), (7, 8, 300),
                                  (13, 14, 300), (16, 17, 64)):
        prompts[sharer][:shared] = prompts[owner][:shared]
    prompts[19] = list(prompts[9])  # the same prompt twice
    prompts[10] = prompts[11][:5]  # a prefix of another
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def all_of_them():
        return await asyncio.gather(*(
            client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
            for p in prompts))

    responses = asyncio.run(all_of_them())
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert r.choices[0].text == tokenizer.decode(oracle(p, 12)), f"prompt {i} ({len(p)} tokens)"
    _wait_idle(server)


def test_streamed_text_equals_non_streamed_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about café culture in 日本 🙂"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=80, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_multibyte_utf8_streams_intact(server, tiny_model, oracle, tokenizer):
    """Pick prompts whose greedy output contains multi-byte characters; every streamed
    delta is whole characters and the deltas join to the full decode."""
    rng = np.random.default_rng(11)
    vocab = tiny_model[0].args.vocab_size
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    checked = 0
    for _ in range(40):
        prompt = rng.integers(5, vocab, size=12).tolist()
        expected = tokenizer.decode(oracle(prompt, 64))
        if not any(ord(ch) > 127 and ch != "\ufffd" for ch in expected):
            continue
        deltas = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=64, temperature=0, stream=True)]
        assert "".join(deltas) == expected
        final_replacements = expected.count("\ufffd")
        assert sum(d.count("\ufffd") for d in deltas) == final_replacements
        checked += 1
        if checked == 3:
            break
    assert checked >= 1, "no prompt produced multi-byte output"


def test_abort_mid_stream_frees_kv_slots(server):
    before = server.stats()["aborted_requests_total"]
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 3000, "temperature": 0.8,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert server.stats()["used_slots"] > 0
    stats = _wait_idle(server)
    assert stats["aborted_requests_total"] == before + 1
    assert _flush(server)["used_slots"] == 0


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "max_tokens": 5}),  # no prompt
    ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 5}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "five"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100000}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}),
])
def test_invalid_requests_get_4xx_and_server_keeps_serving(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", timeout=30,
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_malformed_json_is_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_models_and_health(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.stats()["prefill_chunk_tokens"] == 128  # --chunked-prefill-size
    models = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_process_titles(server):
    # setproctitle pads the title with spaces to the original command line's length.
    titles = sorted(" ".join(p.cmdline()).strip() for p in server.children()
                    if " ".join(p.cmdline()).startswith("kiln:"))
    assert titles == ["kiln:detokenizer", "kiln:scheduler", "kiln:tokenizer", "kiln:worker"]


# -- lifecycle: each test owns a server ------------------------------------------------------

def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_kill_9_of_the_worker_takes_the_server_down(tiny_model_dir, tmp_path):
    srv = Server(tiny_model_dir, "--max-total-tokens", "4000", log_path=tmp_path / "log").wait_ready()
    pids = [p.pid for p in srv.children()]
    srv.child("kiln:worker").send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    code = srv.proc.wait(10)
    assert code != 0 and time.monotonic() - t0 < 5.0
    assert _gone(pids, 5.0)
    assert "worker died (killed by SIGKILL)" in srv.log_tail()
    srv.stop()


@pytest.mark.parametrize("whole_group", [False, True])
def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_model_dir, tmp_path, whole_group):
    """SIGTERM to the launcher, or to the server's whole process group (as `kill --
    -PGID` or systemd's default KillMode sends it): in-flight requests still finish, every
    process exits and the launcher returns 0, no child reported dead."""
    srv = Server(tiny_model_dir, "--max-total-tokens", "4000", log_path=tmp_path / "log",
                 own_group=whole_group).wait_ready()
    pids = [p.pid for p in srv.children()]
    body = {"model": "x", "prompt": "hello", "max_tokens": 200, "temperature": 0.0}

    async def request_then_signal():
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(http.post(srv.url + "/v1/completions", json=body))
            await asyncio.sleep(0.5)
            if whole_group:
                os.killpg(srv.proc.pid, signal.SIGTERM)
            else:
                srv.proc.send_signal(signal.SIGTERM)
            return await task

    resp = asyncio.run(request_then_signal())
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert srv.proc.wait(30) == 0
    assert _gone(pids, 5.0)
    assert "died" not in srv.log_tail(20000)
    srv.stop()


def test_help_describes_every_flag():
    import subprocess
    import sys

    from tests.server import ROOT

    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    for flag in ["--model", "--host", "--port", "--max-running-requests", "--chunked-prefill-size",
                 "--max-prefill-tokens", "--max-prefill-tokens-while-decoding", "--mem-fraction",
                 "--max-total-tokens", "--log-level"]:
        assert flag in out


def test_children_exit_when_the_launcher_is_killed(tiny_model_dir, tmp_path):
    """kill -9 of the launcher: every child exits, and the run directory (its socket
    files) goes with them."""
    run_root = tempfile.mkdtemp(prefix="kiln-test-")  # short: ipc:// paths are capped
    try:
        srv = Server(tiny_model_dir, "--max-total-tokens", "4000", log_path=tmp_path / "log",
                     env={"XDG_RUNTIME_DIR": run_root}).wait_ready()
        pids = [p.pid for p in srv.children()]
        assert len(pids) >= 4
        assert len(os.listdir(run_root)) == 1  # this server's run directory
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        assert _gone(pids, 5.0)
        assert os.listdir(run_root) == []
        srv.stop()
    finally:
        shutil.rmtree(run_root, ignore_errors=True)


def test_a_killed_zmq_client_has_its_request_aborted(server):
    """A KilnClient process killed mid-stream says nothing; its request is aborted once
    its connection closes, not left generating to max_tokens."""
    import subprocess
    import sys

    from tests.server import ROOT

    before = server.stats()["aborted_requests_total"]
    script = ("import sys, time\n"
              "from ipc.client import KilnClient\n"
              "deltas = KilnClient(sys.argv[1]).stream('a long story', max_tokens=3500,\n"
              "                                        ignore_eos=True, temperature=0)\n"
              "next(deltas)\n"
              "print('streaming', flush=True)\n"
              "time.sleep(60)\n")
    client = subprocess.Popen([sys.executable, "-c", script, server.zmq], cwd=ROOT,
                              stdout=subprocess.PIPE)
    try:
        assert client.stdout.readline() == b"streaming\n"
        assert server.stats()["running_requests"] == 1
        client.kill()
        killed = time.monotonic()
        client.wait(10)
        while server.stats()["running_requests"]:
            assert time.monotonic() - killed < 3.0, "the request still runs"
            time.sleep(0.05)
        print(f"\nkill -9 of a streaming ZMQ client: aborted within "
              f"{time.monotonic() - killed:.3f} s")
        assert server.stats()["aborted_requests_total"] == before + 1
    finally:
        client.kill()
        client.wait(10)


def test_second_chat_turn_hits_the_cache_and_usage_says_so(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    _flush(server)
    turn1 = [{"role": "system", "content": "You are a terse assistant. " * 20},
             {"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=20,
                                           temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And three more?"}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=20,
                                            temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    stats = _wait_idle(server)
    assert stats["cache_hit_tokens_total"] >= first.usage.prompt_tokens


def test_flush_cache_through_the_zmq_client(server):
    from ipc.client import KilnClient

    with KilnClient(server.zmq) as client:
        client.generate("fill the cache with something", max_tokens=4, temperature=0)
        assert client.server_stats().cached_slots > 0
        stats = client.server_stats(flush_cache=True)
        assert stats.cached_slots == 0 and stats.free_slots == stats.capacity_slots


def test_memory_pressure_through_all_processes_stays_exact(tiny_model_dir, tiny_model, oracle,
                                                          tmp_path):
    """A pool far below the working set: requests are preempted and resumed across the real
    step pipeline (sockets, overlap three steps deep), and every output still equals
    mlx-lm's, with the model's projections fused (--fuse-projections) and its blocks' fast
    decode call (--fast-decode-blocks) against mlx-lm's own modules."""
    from ipc.client import AsyncKilnClient

    srv = Server(tiny_model_dir, "--max-total-tokens", "1200", "--max-running-requests", "24",
                 "--chunked-prefill-size", "128", "--fuse-projections", "on",
                 "--fast-decode-blocks", "on", "--overlap", "on", "--steps-in-flight", "3",
                 log_path=tmp_path / "log").wait_ready()
    try:
        rng = np.random.default_rng(31)
        prompts = [rng.integers(5, tiny_model[0].args.vocab_size, size=200).tolist()
                   for _ in range(24)]

        async def all_of_them():
            async with AsyncKilnClient(srv.zmq) as client:
                return await asyncio.gather(*(
                    client.generate(input_ids=p, max_tokens=60, temperature=0.0)
                    for p in prompts))

        # Fused matmuls need not round as mlx-lm's separate ones: equal up to near-ties.
        eos = sorted(tiny_model[1].eos_token_ids)
        for p, r in zip(prompts, asyncio.run(all_of_them())):
            assert divergence_off_a_tie(tiny_model[0], p, r.token_ids, oracle(p, 60), eos) is None
        stats = _wait_idle(srv)
        assert stats["preemptions_total"] > 0
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_the_prefix_bench_sees_a_follow_up_hit_where_the_cold_prompt_missed(server):
    """bench/prefix_cache.py's TTFT pairs, as the H200 runs them: after a flush the prompt
    reads nothing cached, the same prompt plus 16 tokens reads all of it (the usage's
    cached_tokens), over one client."""
    from bench.prefix_cache import measure_ttft

    vocab = httpx.get(server.url + "/get_server_info", timeout=10).json()["vocab_size"]
    t = measure_ttft(server.url, 300, vocab, reps=1)
    assert t["cold_cached_tokens"] == [0] and t["hit"], t
    assert 0 < t["cached_ttft_ms"] and 0 < t["cold_ttft_ms"]

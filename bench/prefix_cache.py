"""Prefix-cache benchmark: TTFT of a follow-up request whose prompt extends a cached one
versus the cold prompt, and a shared-system-prompt workload with the radix cache on and off.

    python bench/prefix_cache.py --model demo --prefix-tokens 4000 [--json out.json]
    python bench/prefix_cache.py --model DIR --out $OUT --json $OUT/prefix_cache.json

Starts kiln on 127.0.0.1 (twice: with and without --disable-radix-cache), measures, stops
it, and prints a table. The follow-up request is the cold prompt plus 16 new tokens (a
next turn), so a model with recurrent layers hits too: its cache serves a hit only where
the worker kept a snapshot of the recurrent state, at a previous prompt's end (and at
prompt chunk ends), not at any shared prefix. Each request's `cached_tokens` (usage) says
whether it hit; `hit` is false when a follow-up read fewer than the cold prompt's tokens.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import serving  # noqa: E402
from bench.h200_compare import (ServerRun, exit_on_sigterm, start_server, stop_server,  # noqa: E402
                                wait_ready)
from tests.server import free_port_pair  # noqa: E402

FOLLOW_UP_TOKENS = 16


@dataclass(frozen=True)
class FirstToken:
    """One streamed 1-token completion: seconds to its first chunk, and the prompt tokens
    the server says came from its prefix cache."""

    seconds: float
    cached_tokens: int


def start_kiln(model_dir: str, extra: list[str], log: Path, timeout: float,
               env: dict[str, str] | None = None) -> ServerRun:
    """kiln in its own process group (stop_server ends all its processes), answering;
    `env`: more environment for it."""
    port = free_port_pair()
    cmd = [sys.executable, "launch.py", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), *extra]
    print(f"starting kiln: {' '.join(cmd)}", flush=True)
    server = start_server("kiln", cmd, port, log, env=env)
    try:
        wait_ready(server, model_dir, timeout)
    except BaseException:
        stop_server(server)
        raise
    return server


def first_token(client: httpx.Client, url: str, prompt: list[int]) -> FirstToken:
    """A 1-token greedy completion, streamed with its usage, over a client made
    beforehand: making one (httpx builds an SSL context) took ~36 ms on the CPU VM, more
    than the server's own path, and `httpx.stream` makes one a call."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    seconds, cached = None, None
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if seconds is None and data.get("choices"):
                # The token's chunk, even when its text is empty (a partial UTF-8 piece).
                seconds = time.perf_counter() - t0
            if data.get("usage"):
                cached = data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    if seconds is None or cached is None:
        raise RuntimeError("the stream carried no token or no usage")
    return FirstToken(seconds, cached)


def measure_ttft(url: str, prefix_tokens: int, vocab: int, reps: int) -> dict[str, Any]:
    """Cold: a random prompt after a cache flush; warm: that prompt plus FOLLOW_UP_TOKENS
    more. One unreported round first, so first-use kernel compiles are not timed."""
    rng = np.random.default_rng(0)
    cold: list[FirstToken] = []
    warm: list[FirstToken] = []
    with httpx.Client() as client:
        for rep in range(reps + 1):
            prompt = rng.integers(5, vocab, size=prefix_tokens).tolist()
            client.post(url + "/flush_cache", timeout=60).raise_for_status()
            c = first_token(client, url, prompt)
            w = first_token(client, url,
                            prompt + rng.integers(5, vocab, size=FOLLOW_UP_TOKENS).tolist())
            if rep:
                cold.append(c)
                warm.append(w)
    cold_s = statistics.median(t.seconds for t in cold)
    warm_s = statistics.median(t.seconds for t in warm)
    warm_cached = [t.cached_tokens for t in warm]
    return {"prefix_tokens": prefix_tokens, "follow_up_tokens": FOLLOW_UP_TOKENS,
            "cold_ttft_ms": round(cold_s * 1e3, 1), "cached_ttft_ms": round(warm_s * 1e3, 1),
            "speedup": round(cold_s / warm_s, 2),
            "cold_cached_tokens": [t.cached_tokens for t in cold],
            "warm_cached_tokens": warm_cached, "hit": min(warm_cached) >= prefix_tokens}


def shared_prompt_workload(url: str, model_dir: str, args: argparse.Namespace) -> dict:
    return serving.main(["--url", url, "--model", model_dir, "--concurrency",
                         str(args.concurrency), "--num-requests", str(args.num_requests),
                         "--shared-prefix-words", str(args.shared_prefix_words),
                         "--input-words", "20", "--output-tokens", str(args.output_tokens)])


def run_server(cache_on: bool, model_dir: str,
               args: argparse.Namespace) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """One kiln, radix cache on or off: the shared-prompt workload with the scheduler's
    prompt and cache counters after it, and (cache on) the TTFT pairs before it; with
    --ttft-only the pairs alone (no workload: None)."""
    extra = ["--max-total-tokens", str(args.max_total_tokens), *args.kiln_args.split()]
    if not cache_on:
        extra.append("--disable-radix-cache")
    log = args.out / f"prefix_cache_{'on' if cache_on else 'off'}.log"
    server = start_kiln(model_dir, extra, log, args.ready_timeout)
    try:
        # The ids the server takes: its tokenizer's, which a bench model's embedding (cut
        # to config.json's vocab_size) may outnumber.
        vocab = httpx.get(server.url + "/get_server_info", timeout=10).json()["vocab_size"]
        ttft = measure_ttft(server.url, args.prefix_tokens, vocab, args.reps) if cache_on else None
        if args.ttft_only:
            return None, ttft
        run = shared_prompt_workload(server.url, model_dir, args)
        stats = httpx.get(server.url + "/get_server_info", timeout=10).json()["scheduler"]
    finally:
        stop_server(server)
    workload = {"output_tok_s": run["output_tok_s"], "requests_s": run["requests_s"],
                "ttft_p50_ms": run["ttft_ms"]["p50"], "failed": run["failed"],
                "prompt_tokens": stats["prompt_tokens_total"],
                "computed_prompt_tokens": stats["computed_prompt_tokens_total"],
                "cache_hit_tokens": stats["cache_hit_tokens_total"],
                "state_snapshots": stats["state_snapshots"]}
    return workload, ttft


def report(result: dict[str, Any]) -> str:
    t = result["ttft"]
    lines = [f"TTFT of a cached {t['prefix_tokens']}-token prompt + {t['follow_up_tokens']} new "
             f"tokens: {t['cached_ttft_ms']} ms, cold: {t['cold_ttft_ms']} ms ({t['speedup']}x); "
             f"cached tokens read {t['warm_cached_tokens']}"
             + ("" if t["hit"] else "  NOT A FULL HIT")]
    for label in ("cache_on", "cache_off"):
        if label not in result:  # --ttft-only
            continue
        r = result[label]
        lines.append(f"shared prompt, {label:<9}: {r['output_tok_s']:>8} out tok/s, TTFT p50 "
                     f"{r['ttft_p50_ms']} ms, computed {r['computed_prompt_tokens']} of "
                     f"{r['prompt_tokens']} prompt tokens ({r['cache_hit_tokens']} hit), "
                     f"{r['failed']} failed")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="demo", help="a demo preset or a model directory")
    p.add_argument("--prefix-tokens", type=int, default=4000, help="the cold prompt's length")
    p.add_argument("--reps", type=int, default=3, help="cold / follow-up pairs (medians)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--shared-prefix-words", type=int, default=600)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=200000, help="kiln's KV pool, slots")
    p.add_argument("--kiln-args", default="", help="extra launch.py flags")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="where the server logs go")
    p.add_argument("--json", default="")
    p.add_argument("--ttft-only", action="store_true",
                   help="only the cold / follow-up TTFT pairs (one server, no shared-prompt "
                        "workload, no cache-off server)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # a timeout still stops the server
    args = parse_args(argv)
    from launch import resolve_model

    model_dir = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": args.model}
    for cache_on in (True,) if args.ttft_only else (True, False):
        workload, ttft = run_server(cache_on, model_dir, args)
        if workload is not None:
            result["cache_on" if cache_on else "cache_off"] = workload
        if ttft is not None:
            result["ttft"] = ttft
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print("\n" + report(result))


if __name__ == "__main__":
    main()

"""Serving benchmark for any OpenAI-compatible server (ours or mlx_lm.server).

    python bench/serving.py --url http://127.0.0.1:8000 --concurrency 16 --num-requests 64 \
        --input-words 100 --output-tokens 64 [--ignore-eos] [--json out.json]

    # a sweep: one JSON with a list of results, and a plot against concurrency
    python bench/serving.py --url http://127.0.0.1:8000 --model /path/to/model \
        --concurrency 1,16,64,128 --num-requests 4,16,64,128 --label kiln \
        --json sweep.json --plot sweep.png

Streams `/v1/completions` with `stream_options.include_usage`, at a fixed concurrency or
at a Poisson request rate (still capped by the concurrency), greedy by default, and reports
output tokens/s, requests/s, and TTFT, inter-token (between text chunks), time per output
token ((e2e - TTFT) / (tokens - 1), which chunking does not skew) and end-to-end latency
percentiles (milliseconds) as JSON. With one concurrency the JSON is that level's result;
with several it is a sweep document {"label", "url", "model", "settings", "results": [...]},
which `bench/plot.py` draws (several servers' sweeps overlaid). Before each level a warm-up
runs that level's concurrency with a few tokens, so first-use kernel compiles are not timed.
A request whose connection the server drops before answering is re-sent (--retries).

The client is aiohttp: with httpx's connection pool at 128 streams the client itself took
seconds to get a burst of requests out (2 cores: handler entries spread over 4.5 s; a
raw-socket client's over 0.06 s), which the TTFT of the server under test then carried.

`ignore_eos` is sent only with --ignore-eos: mlx_lm.server ignores unknown fields, but kiln
refuses the field until it implements it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there been one all we their has would when if "
          "so no will more out up into do any about time them some could than its over only new "
          "model token cache batch server kernel memory latency stream prefix").split()


def make_prompts(n: int, words: int, seed: int, shared_prefix_words: int = 0,
                 spread: float = 0.2) -> list[str]:
    """n prompts of words * (1 +- spread) words each (uniform), after a shared prefix."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(shared_prefix_words))
    prompts = []
    for _ in range(n):
        k = max(1, int(words * rng.uniform(1 - spread, 1 + spread)))  # varied, as real traffic
        body = " ".join(rng.choice(_WORDS) for _ in range(k))
        prompts.append(f"{prefix} {body}" if prefix else body)
    return prompts


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run sends, apart from its prompt."""

    url: str
    model: str
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False

    def body(self, prompt: str | list[int]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


@dataclass
class RequestRecord:
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    # perf_counter() when it was sent and of each text chunk, to place the gaps in time
    # (bench/mixed_traffic.py splits them before and during a burst).
    sent_at: float = 0.0
    chunk_at: list[float] = field(default_factory=list)
    error: str | None = None
    retries: int = 0  # re-sends after the connection failed before any response


class _NoResponse(Exception):
    """The connection broke before the server sent a status line: safe to send again."""


async def one_request(http: aiohttp.ClientSession, spec: RequestSpec, prompt: str | list[int],
                      retries: int = 0, rec: RequestRecord | None = None) -> RequestRecord:
    """Stream one completion. A request the server never answered (mlx_lm.server's listen
    backlog of 5 resets connections when many arrive at once) is sent again, up to
    `retries` times; its TTFT and latency still count from the first attempt. `rec`: a
    record to fill in, for a caller that watches the stream while it comes."""
    rec = rec if rec is not None else RequestRecord()
    start = rec.sent_at = time.perf_counter()
    for attempt in range(retries + 1):
        try:
            await _stream_once(http, spec, prompt, rec, start)
            break
        except _NoResponse as exc:
            rec.error = repr(exc.__cause__)
            if attempt < retries:
                rec.retries += 1
                await asyncio.sleep(0.05 * 2 ** attempt)
    rec.latency = time.perf_counter() - start
    return rec


async def _stream_once(http: aiohttp.ClientSession, spec: RequestSpec, prompt: str | list[int],
                       rec: RequestRecord, start: float) -> None:
    rec.error, answered = None, False
    try:
        async with http.post(spec.url + "/v1/completions", json=spec.body(prompt)) as resp:
            answered = True
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            await _read_events(resp, rec, start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        # Retry only a request the server never took in; a slow one is not re-sent.
        if answered or isinstance(exc, asyncio.TimeoutError):
            rec.error = repr(exc)
        else:
            raise _NoResponse from exc


async def _read_events(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
    """Timestamps of the text chunks of an SSE completion stream, and its usage."""
    last, chunks = start, 0
    async for raw in resp.content:  # one line at a time
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data.get("usage"):
            rec.output_tokens = data["usage"]["completion_tokens"]
        if not data.get("choices") or not data["choices"][0].get("text"):
            continue
        now = time.perf_counter()
        if chunks == 0:
            rec.ttft = now - start
        else:
            rec.itls.append(now - last)
        rec.chunk_at.append(now)
        last = now
        chunks += 1
    rec.output_tokens = rec.output_tokens or chunks


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.array(values) * 1000.0
    return {f"p{q}": round(float(np.percentile(a, q)), 2) for q in (50, 90, 99)}


@dataclass(frozen=True)
class Level:
    """One point of a sweep."""

    concurrency: int
    num_requests: int


async def run_requests(http: aiohttp.ClientSession, spec: RequestSpec, prompts: list[str],
                       concurrency: int, request_rate: float, seed: int,
                       retries: int) -> tuple[list[RequestRecord], float]:
    """Send every prompt (at most `concurrency` in flight); the records and the wall time."""
    sem = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(seed)

    async def limited(p: str) -> RequestRecord:
        async with sem:
            return await one_request(http, spec, p, retries)

    t0 = time.perf_counter()
    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(limited(p)))
        if request_rate > 0:
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - t0


def summarize(records: list[RequestRecord], elapsed: float, level: Level,
              args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "url": args.url, "concurrency": level.concurrency, "request_rate": args.request_rate,
        "num_requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "retries": sum(r.retries for r in records),
        "input_words": args.input_words, "length_spread": args.length_spread,
        "shared_prefix_words": args.shared_prefix_words,
        "output_tokens_per_request": args.output_tokens,
        "duration_s": round(elapsed, 3), "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / elapsed, 2), "requests_s": round(len(ok) / elapsed, 3),
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itls]),
        "tpot_ms": percentiles([_tpot(r) for r in ok if r.output_tokens > 1]),
        "e2e_ms": percentiles([r.latency for r in ok]),
    }


def _tpot(rec: RequestRecord) -> float:
    """Mean time per output token after the first: unlike ITL it does not depend on how
    the server groups tokens into stream chunks."""
    return (rec.latency - rec.ttft) / (rec.output_tokens - 1)


async def warm_up(http: aiohttp.ClientSession, level: Level, seed: int,
                  args: argparse.Namespace) -> None:
    """The level's batch size at a few tokens a request: first-use compiles land here."""
    n = min(level.concurrency, level.num_requests)
    prompts = make_prompts(n, args.input_words, seed, args.shared_prefix_words, args.length_spread)
    spec = RequestSpec(args.url, args.model, args.warmup_tokens, args.temperature, False)
    await run_requests(http, spec, prompts, level.concurrency, 0.0, seed, args.retries)


async def run_level(http: aiohttp.ClientSession, level: Level, index: int,
                    args: argparse.Namespace) -> dict[str, Any]:
    # Each level (and its warm-up) has its own prompts, so a server's prefix cache cannot
    # answer one level from an earlier level's requests.
    seed = args.seed + 1000 * index
    if args.warmup:
        await warm_up(http, level, seed + 1, args)
    prompts = make_prompts(level.num_requests, args.input_words, seed, args.shared_prefix_words,
                           args.length_spread)
    spec = RequestSpec(args.url, args.model, args.output_tokens, args.temperature,
                       args.ignore_eos)
    records, elapsed = await run_requests(http, spec, prompts, level.concurrency,
                                          args.request_rate, seed, args.retries)
    return summarize(records, elapsed, level, args)


def _skipped(level: Level, reason: str) -> dict[str, Any]:
    return {"concurrency": level.concurrency, "num_requests": level.num_requests,
            "skipped": reason}


async def run_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every level in turn; levels not started within --max-seconds are marked skipped."""
    levels = plan_levels(args.concurrency, args.num_requests)
    most = max(level.concurrency for level in levels) + 8
    connector = aiohttp.TCPConnector(limit=most, limit_per_host=most)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    deadline = time.monotonic() + args.max_seconds
    results = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        for i, level in enumerate(levels):
            if time.monotonic() > deadline:
                results.append(_skipped(level, f"--max-seconds {args.max_seconds} reached"))
                continue
            results.append(await run_level(http, level, i, args))
            r = results[-1]
            print(f"[{args.label or args.url}] concurrency {level.concurrency}: "
                  f"{r['output_tok_s']} out tok/s, {r['failed']} failed, {r['retries']} retries",
                  file=sys.stderr, flush=True)
    return results


def plan_levels(concurrency: list[int], num_requests: list[int]) -> list[Level]:
    if len(num_requests) not in (1, len(concurrency)):
        raise ValueError("--num-requests takes one value or one per concurrency level")
    counts = num_requests * len(concurrency) if len(num_requests) == 1 else num_requests
    return [Level(c, n) for c, n in zip(concurrency, counts)]


def sweep_document(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    settings = {k: getattr(args, k) for k in (
        "input_words", "shared_prefix_words", "output_tokens", "request_rate", "temperature",
        "ignore_eos", "warmup", "seed")}
    return {"label": args.label or args.url, "url": args.url, "model": args.model,
            "settings": settings, "results": results}


def int_list(text: str) -> list[int]:
    """argparse type: a comma list of positive integers (also used by bench/one_batch.py)."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected a comma list of positive integers")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default="default",
                   help="the request's model field (mlx_lm.server loads what it names)")
    p.add_argument("--label", default="", help="name of this server in the sweep JSON and plot")
    p.add_argument("--concurrency", type=int_list, default=[16],
                   help="requests in flight; a comma list makes a sweep")
    p.add_argument("--num-requests", type=int_list, default=[64],
                   help="requests per level: one value, or one per concurrency level")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals per second; 0 = all at once")
    p.add_argument("--input-words", type=int, default=100,
                   help="words per prompt, varied by --length-spread")
    p.add_argument("--length-spread", type=float, default=0.2,
                   help="prompt lengths uniform in input-words * (1 +- this)")
    p.add_argument("--shared-prefix-words", type=int, default=0,
                   help="words of one prefix shared by every prompt")
    p.add_argument("--output-tokens", type=int, default=64, help="max_tokens per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before each level, run its concurrency once with a few tokens")
    p.add_argument("--warmup-tokens", type=int, default=8, help="max_tokens of warm-up requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--retries", type=int, default=5,
                   help="re-sends of a request whose connection broke before any response")
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="levels not started by then are skipped")
    p.add_argument("--json", default="", help="also write the result here")
    p.add_argument("--plot", default="", help="PNG of the sweep (needs matplotlib)")
    args = p.parse_args(argv)
    if len(args.num_requests) not in (1, len(args.concurrency)):
        p.error("--num-requests takes one value or one per concurrency level")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = asyncio.run(run_sweep(args))
    doc = results[0] if len(results) == 1 else sweep_document(results, args)
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.plot:
        from bench.plot import plot_sweeps

        plot_sweeps([sweep_document(results, args)], Path(args.plot))
    return doc


if __name__ == "__main__":
    main()

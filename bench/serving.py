"""Serving benchmark for any OpenAI-compatible server (ours or mlx_lm.server).

    python bench/serving.py --url http://127.0.0.1:8000 --concurrency 16 --num-requests 64 \
        --input-words 100 --output-tokens 64 [--ignore-eos] [--json out.json]

Streams `/v1/completions` with `stream_options.include_usage`, at a fixed concurrency or
at a Poisson request rate, and reports output tokens/s, requests/s, and TTFT,
inter-token and end-to-end latency percentiles as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there been one all we their has would when if "
          "so no will more out up into do any about time them some could than its over only new "
          "model token cache batch server kernel memory latency stream prefix").split()


def make_prompts(n: int, words: int, seed: int, shared_prefix_words: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(shared_prefix_words))
    prompts = []
    for _ in range(n):
        k = max(1, int(words * rng.uniform(0.8, 1.2)))  # varied lengths, as real traffic
        body = " ".join(rng.choice(_WORDS) for _ in range(k))
        prompts.append(f"{prefix} {body}" if prefix else body)
    return prompts


@dataclass
class RequestRecord:
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int, ignore_eos: bool) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    rec = RequestRecord()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
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
                last = now
                chunks += 1
    except httpx.HTTPError as exc:
        rec.error = repr(exc)
    rec.latency = time.perf_counter() - start
    rec.output_tokens = rec.output_tokens or chunks
    return rec


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.array(values) * 1000.0
    return {f"p{q}": round(float(np.percentile(a, q)), 2) for q in (50, 90, 99)}


async def run(args: argparse.Namespace) -> dict:
    prompts = make_prompts(args.num_requests, args.input_words, args.seed, args.shared_prefix_words)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        if args.warmup:
            await asyncio.gather(*(one_request(http, args.url, args.model, p, 8, False)
                                   for p in prompts[:min(4, len(prompts))]))
        sem = asyncio.Semaphore(args.concurrency)
        rng = np.random.default_rng(args.seed)

        async def limited(p: str) -> RequestRecord:
            async with sem:
                return await one_request(http, args.url, args.model, p, args.output_tokens,
                                         args.ignore_eos)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate > 0:
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        records = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "url": args.url, "concurrency": args.concurrency, "request_rate": args.request_rate,
        "num_requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "input_words": args.input_words, "output_tokens_per_request": args.output_tokens,
        "duration_s": round(elapsed, 3), "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / elapsed, 2), "requests_s": round(len(ok) / elapsed, 3),
        "ttft_ms": _pcts([r.ttft for r in ok]), "itl_ms": _pcts([x for r in ok for x in r.itls]),
        "e2e_ms": _pcts([r.latency for r in ok]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=0.0, help="Poisson rate; 0 = all at once")
    p.add_argument("--input-words", type=int, default=100)
    p.add_argument("--shared-prefix-words", type=int, default=0)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default="", help="also write the result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()

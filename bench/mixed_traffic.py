"""Mixed traffic: steady decoding streams, and a burst of long prompts arriving mid-run.

    LD_PRELOAD=$VENV/lib/libmkl_rt.so.3 python bench/mixed_traffic.py --model demo \
        --arms 32,default,off --kiln-args="--max-total-tokens 40000"    # CPU, small sizes
    PARTS=mixed OUT=$OUT bash bench/h200_session.sh    # the H200: 32 streams, 64 x 4096 tokens

For each arm (a `--max-prefill-tokens-while-decoding` value; `default`: the server's own;
`off`: no decode first, one budget for every step, no spread),
and for each of `--variants` (more launch flags: A/B runs on one machine, in one call),
it starts kiln on 127.0.0.1, warms it up, then
1. opens the steady streams: short prompts, long outputs;
2. once every stream has its first token, waits --steady-seconds and sends the burst's
   long prompts at once;
3. waits for every request to end (ignore_eos: each makes its max_tokens, so every arm
   does the same work), and stops the server.

Per arm it reports the steady streams' inter-token gaps (between text chunks, ms) before
the burst, during it (gaps ending between the burst's sending and its last prompt's first
token, i.e. while its prompts are prefilled) and after; the burst's TTFT; and output
tokens/s over the whole run; and every stream's gaps as the server's HTTP front sent
them during the burst (its /metrics histogram read at the burst's sending and at its
prefill's end): set against the client's, what the client itself adds. The target of
issue 20 reads off as `p99_ratio` (ITL p99 during / before) <= 2 with `output_tok_s` not
below the one-budget arm's. On a CPU a step's fair share of prefill is far smaller than
a GPU's (the demo model prefills ~1.5k tokens/s there: 512 tokens are ~300 ms beside a
10-15 ms decode step), hence an arm of 32.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
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

from bench import serving  # noqa: E402
from bench.h200_compare import exit_on_sigterm, stop_server  # noqa: E402
from bench.prefix_cache import start_kiln  # noqa: E402

DEFAULT_ARM = "default"
OFF_ARM = "off"  # one budget for every step: --max-prefill-tokens' default, whole forwards


@dataclass(frozen=True)
class Workload:
    """What one arm serves; every arm serves the same prompts."""

    steady: list[list[int]]
    burst: list[list[int]]
    steady_output: int
    burst_output: int
    steady_seconds: float


def prompt_ids(model_dir: Path, n: int, length: int, seed: int,
               spread: float = 0.0) -> list[list[int]]:
    """n distinct random prompts of `length` ids (each length * (1 +- spread), uniform),
    none a special token (so neither the prefix cache nor an early EOS changes the work)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    allowed = np.array([i for i in range(tok.get_vocab_size()) if i not in special])
    rng = np.random.default_rng(seed)
    sizes = [max(1, int(length * rng.uniform(1 - spread, 1 + spread))) if spread else length
             for _ in range(n)]
    return [rng.choice(allowed, size=size).tolist() for size in sizes]


def make_workload(model_dir: Path, args: argparse.Namespace, seed: int) -> Workload:
    return Workload(prompt_ids(model_dir, args.steady_streams, args.steady_prompt_tokens, seed),
                    prompt_ids(model_dir, args.burst_requests, args.burst_prompt_tokens, seed + 1,
                               args.burst_length_spread),
                    args.steady_output_tokens, args.burst_output_tokens, args.steady_seconds)


@dataclass
class Timeline:
    """Records of one measured run, and when the burst was sent."""

    steady: list[serving.RequestRecord]
    burst: list[serving.RequestRecord]
    started: float
    burst_sent: float
    ended: float
    burst_prompt_tokens: int = 0  # the burst's prompts' tokens, all of them
    # The server's inter-token histogram (its /metrics, at the HTTP front) when the burst
    # was sent and once its prompts all had their first token: {upper edge s: count}.
    front_at_burst: dict[float, float] = field(default_factory=dict)
    front_prefilled: dict[float, float] = field(default_factory=dict)

    @property
    def burst_prefilled(self) -> float:
        """When the last burst prompt got its first token: its prompts are all computed."""
        return max(r.sent_at + r.ttft for r in self.burst)


async def _all_streaming(records: list[serving.RequestRecord], tasks: list[asyncio.Task]) -> None:
    """Until every stream has its first token (or has ended: a failure, or a short one)."""
    while not all(r.chunk_at or t.done() for r, t in zip(records, tasks)):
        await asyncio.sleep(0.01)


ITL_SERIES = "kiln_inter_token_latency_seconds"


async def front_itl(http: aiohttp.ClientSession, url: str) -> dict[float, float]:
    """The server's inter-token histogram as cumulative counts by upper edge (s)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {float(s.labels["le"]): s.value
            for family in text_string_to_metric_families(text) if family.name == ITL_SERIES
            for s in family.samples if s.name == ITL_SERIES + "_bucket"}


def histogram_percentiles(before: dict[float, float], after: dict[float, float]) -> dict:
    """p50/p90/p99 (ms) of what a cumulative histogram counted between two reads, linear
    within a bucket (the +Inf bucket's at its lower edge)."""
    edges = sorted(after)
    counts = [after[e] - before.get(e, 0.0) for e in edges]
    if not counts or counts[-1] <= 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    out = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        want = q * counts[-1]
        i = next(i for i, c in enumerate(counts) if c >= want)
        lo, below = (edges[i - 1], counts[i - 1]) if i else (0.0, 0.0)
        hi = edges[i] if edges[i] != float("inf") else lo
        share = (want - below) / (counts[i] - below) if counts[i] > below else 1.0
        out[name] = round(1000 * (lo + share * (hi - lo)), 2)
    return out


async def _front_once_prefilled(http: aiohttp.ClientSession, url: str,
                                burst: list[serving.RequestRecord], tasks: list[asyncio.Task],
                                into: dict[float, float]) -> None:
    await _all_streaming(burst, tasks)
    into.update(await front_itl(http, url))


async def run_mixed(url: str, workload: Workload, timeout: float) -> Timeline:
    """The steady streams, then the burst mid-run; returns once every request ended."""
    n = len(workload.steady) + len(workload.burst)
    connector = aiohttp.TCPConnector(limit=n + 8, limit_per_host=n + 8)
    steady_spec = serving.RequestSpec(url, "default", workload.steady_output, ignore_eos=True)
    burst_spec = serving.RequestSpec(url, "default", workload.burst_output, ignore_eos=True)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        started = time.perf_counter()
        steady = [serving.RequestRecord() for _ in workload.steady]
        tasks = [asyncio.create_task(serving.one_request(http, steady_spec, p, rec=r))
                 for p, r in zip(workload.steady, steady)]
        await _all_streaming(steady, tasks)
        await asyncio.sleep(workload.steady_seconds)
        at_burst = await front_itl(http, url)
        burst_sent = time.perf_counter()
        burst = [serving.RequestRecord() for _ in workload.burst]
        burst_tasks = [asyncio.create_task(serving.one_request(http, burst_spec, p, rec=r))
                       for p, r in zip(workload.burst, burst)]
        prefilled: dict[float, float] = {}
        watch = asyncio.create_task(_front_once_prefilled(http, url, burst, burst_tasks,
                                                          prefilled))
        records = await asyncio.gather(*tasks, *burst_tasks)
        await watch
    return Timeline(steady, list(records[len(steady):]), started, burst_sent, time.perf_counter(),
                    sum(map(len, workload.burst)), at_burst, prefilled)


def gaps_between(records: list[serving.RequestRecord], start: float, end: float) -> list[float]:
    """The inter-chunk gaps (s) of these streams that end inside (start, end]."""
    return [b - a for r in records for a, b in zip(r.chunk_at, r.chunk_at[1:])
            if start < b <= end]


def summarize(t: Timeline) -> dict[str, Any]:
    records = t.steady + t.burst
    failed = [r.error for r in records if r.error is not None]
    first_all = max((r.chunk_at[0] for r in t.steady if r.chunk_at), default=t.burst_sent)
    before = serving.percentiles(gaps_between(t.steady, first_all, t.burst_sent))
    during_gaps = gaps_between(t.steady, t.burst_sent, t.burst_prefilled)
    during = serving.percentiles(during_gaps)
    out_tokens = sum(r.output_tokens for r in records if r.error is None)
    return {
        "failed": len(failed), "errors": sorted(set(failed))[:3],
        "itl_before_ms": before, "itl_during_ms": during,
        "itl_after_ms": serving.percentiles(gaps_between(t.steady, t.burst_prefilled, t.ended)),
        # Every stream's gaps as the server's HTTP front sent them, from the burst's
        # sending to its prefill's end: set against the client's, the client's own share.
        "front_itl_during_ms": histogram_percentiles(t.front_at_burst, t.front_prefilled),
        "p99_ratio": round(during["p99"] / before["p99"], 2) if before["p99"] else None,
        "p50_ratio": round(during["p50"] / before["p50"], 2) if before["p50"] else None,
        "gaps_during": len(during_gaps),
        # Streams that ended before the burst was prefilled leave the "during" window.
        "steady_ended_during_burst": sum(not r.chunk_at or r.chunk_at[-1] < t.burst_prefilled
                                         for r in t.steady),
        "burst_ttft_ms": serving.percentiles([r.ttft for r in t.burst]),
        "burst_prefill_s": round(t.burst_prefilled - t.burst_sent, 3),
        # Prompt tokens computed per second from the burst's sending to its last first
        # token (with no steady streams: the server's prefill rate for a wave of prompts).
        "burst_prefill_tok_s": round(t.burst_prompt_tokens / (t.burst_prefilled - t.burst_sent)),
        "duration_s": round(t.ended - t.started, 3), "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / (t.ended - t.started), 2),
    }


async def warm_up(url: str, model_dir: Path, args: argparse.Namespace) -> None:
    """The run's shapes at a few tokens each, so first-use compiles are not timed; other
    prompts than the run's, so the prefix cache holds none of the run's."""
    warm = Workload(prompt_ids(model_dir, args.steady_streams, args.steady_prompt_tokens, 99),
                    prompt_ids(model_dir, 2, args.burst_prompt_tokens, 98), 8, 2, 0.0)
    await run_mixed(url, warm, args.timeout)


def arm_flags(arm: str) -> list[str]:
    if arm == DEFAULT_ARM:
        return []
    if arm == OFF_ARM:
        return ["--max-prefill-tokens-while-decoding", "8192", "--prefill-spread", "1"]
    return ["--max-prefill-tokens-while-decoding", arm]


@dataclass(frozen=True)
class Arm:
    """One server of the run: a decoding budget (an --arms value) and a variant's flags."""

    budget: str
    variant: str = ""
    index: int = 0  # the variant's place in --variants (names its log)

    @property
    def label(self) -> str:
        return f"{self.budget} {self.variant}".strip()

    @property
    def flags(self) -> list[str]:
        words = self.variant.split()
        return [*arm_flags(self.budget), *words[len(_settings(words)):]]

    @property
    def env(self) -> dict[str, str]:
        """The NAME=value words a variant starts with, as a shell command line's: the
        server's environment (MLX reads its CUDA launch settings, such as
        MLX_MAX_OPS_PER_BUFFER, once per process)."""
        return dict(w.split("=", 1) for w in _settings(self.variant.split()))

    @property
    def log_name(self) -> str:
        return f"mixed_{self.budget}" + (f"_v{self.index}" if self.variant else "") + ".log"


def _settings(words: list[str]) -> list[str]:
    """The NAME=value words leading `words`."""
    def is_setting(word: str) -> bool:
        name, eq, _ = word.partition("=")
        return bool(eq) and name.isidentifier()
    return list(itertools.takewhile(is_setting, words))


def arms_of(arms: str, variants: str) -> list[Arm]:
    """Every budget under every variant (';'-joined flag strings; empty: none), variant
    by variant, so a variant's arms run back to back."""
    flags = [v.strip() for v in variants.split(";")] if variants.strip() else [""]
    return [Arm(budget, variant, i) for i, variant in enumerate(flags)
            for budget in arms.split(",")]


def run_arm(arm: Arm, model_dir: Path, workload: Workload, args: argparse.Namespace) -> dict:
    server = start_kiln(str(model_dir), [*args.kiln_args.split(), *arm.flags],
                        args.out / arm.log_name, args.ready_timeout, env=arm.env)
    try:
        asyncio.run(warm_up(server.url, model_dir, args))
        result = {"arm": arm.label, "flags": arm.flags, "env": arm.env,
                  **summarize(asyncio.run(run_mixed(server.url, workload, args.timeout)))}
    finally:
        stop_server(server)
    print(f"[{arm.label}] {table_row(result)}", file=sys.stderr, flush=True)
    return result


def table_row(r: dict[str, Any]) -> str:
    b, d, ttft = r["itl_before_ms"], r["itl_during_ms"], r["burst_ttft_ms"]
    return (f"{r['arm']:>8} | {b['p50']:7.1f} {b['p99']:7.1f} | {d['p50']:7.1f} {d['p99']:7.1f}"
            f" | {r['p99_ratio']!s:>5} | {ttft['p50']:8.0f} {ttft['p99']:8.0f} |"
            f" {r['burst_prefill_tok_s']:>11} | {r['output_tok_s']:9.1f} | {r['failed']}")


def report(results: list[dict[str, Any]]) -> str:
    head = ("     arm | ITL before p50 p99 | ITL during p50 p99 | p99 x | burst TTFT p50 p99 |"
            " prefill t/s | out tok/s | failed")
    lines = [head, *map(table_row, results)]
    lines += [f"{r['arm']:>8}: the server's front, every stream's gaps during the burst, p50 "
              f"{f['p50']} p90 {f['p90']} p99 {f['p99']} ms (from /metrics)"
              for r in results if (f := r.get("front_itl_during_ms"))]
    base = results[-1]["output_tok_s"]
    if len(results) > 1 and base:
        lines += [f"out tok/s, {r['arm']} / {results[-1]['arm']}: {r['output_tok_s'] / base:.3f}"
                  for r in results[:-1]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="demo", help="a demo preset or a model directory")
    p.add_argument("--arms", default=f"{DEFAULT_ARM},{OFF_ARM}",
                   help="comma list of --max-prefill-tokens-while-decoding values, each served "
                        f"by its own server ({DEFAULT_ARM}: no flag; {OFF_ARM}: 8192, "
                        "--max-prefill-tokens' default, and --prefill-spread 1: one budget "
                        "for every step); the last is the baseline of the throughput ratios")
    p.add_argument("--steady-streams", type=int, default=8)
    p.add_argument("--steady-prompt-tokens", type=int, default=32)
    p.add_argument("--steady-output-tokens", type=int, default=800,
                   help="enough to outlast the burst's prefill in every arm (see "
                        "steady_ended_during_burst)")
    p.add_argument("--steady-seconds", type=float, default=3.0,
                   help="steady decoding measured before the burst is sent")
    p.add_argument("--burst-requests", type=int, default=8)
    p.add_argument("--burst-prompt-tokens", type=int, default=1024)
    p.add_argument("--burst-output-tokens", type=int, default=16)
    p.add_argument("--burst-length-spread", type=float, default=0.0,
                   help="burst prompts of --burst-prompt-tokens * (1 +- this) tokens: their "
                        "last chunks then end anywhere, as real prompts' do")
    p.add_argument("--kiln-args", default="", help="extra launch.py flags for every arm")
    p.add_argument("--variants", default="",
                   help="';'-joined launch.py flags, each a variant every arm runs under "
                        "(e.g. ';--experiments mixed-forward': as is, then with that flag); "
                        "NAME=value words leading a variant are its server's environment")
    p.add_argument("--prime", action="store_true",
                   help="first start and stop a kiln server that is not measured (prime())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="where the server logs go")
    p.add_argument("--json", default="", help="also write the results here")
    return p.parse_args(argv)


def prime(model_dir: Path, args: argparse.Namespace) -> None:
    """Start kiln once and stop it, measuring nothing: the first kiln server on a fresh
    machine ran slower (bench/h200_compare.py's prime), which would weigh on the first
    arm alone."""
    t0 = time.monotonic()
    stop_server(start_kiln(str(model_dir), args.kiln_args.split(), args.out / "mixed_prime.log",
                           args.ready_timeout))
    print(f"primed the machine with a kiln server in {time.monotonic() - t0:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # a timeout still stops the server
    args = parse_args(argv)
    from launch import resolve_model

    model_dir = Path(resolve_model(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    workload = make_workload(model_dir, args, args.seed)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "json")}
    if args.prime:
        prime(model_dir, args)
    results: list[dict[str, Any]] = []
    for arm in arms_of(args.arms, args.variants):
        results.append(run_arm(arm, model_dir, workload, args))
        doc = {"model": args.model, "settings": settings, "results": results}
        if args.json:  # after every arm: a run stopped by a time limit keeps the arms done
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if not args.json:
        print(json.dumps(doc, indent=2))
    print(report(results), flush=True)
    return results


if __name__ == "__main__":
    main()

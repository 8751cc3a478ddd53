"""Prefix-cache benchmark: TTFT with a cached long prefix versus cold, and a
shared-system-prompt workload with the radix cache on and off.

    python bench/prefix_cache.py --model demo --prefix-tokens 4000 [--json out.json]

Starts kiln on 127.0.0.1 (twice: with and without --disable-radix-cache), measures, stops
it, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import serving  # noqa: E402
from tests.server import free_port_pair, wait_until  # noqa: E402


def start_server(model_dir: str, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "launch.py", "--model", model_dir, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/get_server_info", timeout=2).status_code == 200, proc,
               300.0, f"server (see {log})")
    return proc


def ttft(url: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token of a 1-token greedy completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def measure_ttft(url: str, prefix_tokens: int, vocab: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    cold, warm = [], []
    for _ in range(reps):
        prefix = rng.integers(5, vocab, size=prefix_tokens).tolist()
        httpx.post(url + "/flush_cache", timeout=60)
        cold.append(ttft(url, prefix + rng.integers(5, vocab, size=16).tolist()))
        warm.append(ttft(url, prefix + rng.integers(5, vocab, size=16).tolist()))
    return {"prefix_tokens": prefix_tokens, "cold_ttft_ms": round(statistics.median(cold) * 1e3, 1),
            "cached_ttft_ms": round(statistics.median(warm) * 1e3, 1),
            "speedup": round(statistics.median(cold) / statistics.median(warm), 2)}


def shared_prompt_workload(url: str, model_dir: str, args: argparse.Namespace) -> dict:
    return serving.main(["--url", url, "--model", model_dir, "--concurrency",
                         str(args.concurrency), "--num-requests", str(args.num_requests),
                         "--shared-prefix-words", str(args.shared_prefix_words),
                         "--input-words", "20", "--output-tokens", str(args.output_tokens)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--prefix-tokens", type=int, default=4000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--shared-prefix-words", type=int, default=600)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--json", default="")
    args = p.parse_args()

    from launch import resolve_model

    model_dir = resolve_model(args.model)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": args.model}
    for label, extra in (("cache_on", []), ("cache_off", ["--disable-radix-cache"])):
        port = free_port_pair()
        proc = start_server(model_dir, port, ["--max-total-tokens", "200000", *extra],
                            out_dir / f"prefix_{label}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            if label == "cache_on":
                result["ttft"] = measure_ttft(url, args.prefix_tokens, vocab, args.reps)
            run = shared_prompt_workload(url, model_dir, args)
            stats = httpx.get(url + "/get_server_info", timeout=10).json()["scheduler"]
            result[label] = {"output_tok_s": run["output_tok_s"], "requests_s": run["requests_s"],
                             "ttft_p50_ms": run["ttft_ms"]["p50"],
                             "prompt_tokens": stats["prompt_tokens_total"],
                             "computed_prompt_tokens": stats["computed_prompt_tokens_total"]}
        finally:
            proc.terminate()
            proc.wait(30)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    t = result["ttft"]
    print(f"\nTTFT with a cached {t['prefix_tokens']}-token prefix: {t['cached_ttft_ms']} ms, "
          f"cold: {t['cold_ttft_ms']} ms ({t['speedup']}x)")
    for label in ("cache_on", "cache_off"):
        r = result[label]
        print(f"shared prompt, {label:<9}: {r['output_tok_s']:>8} out tok/s, TTFT p50 "
              f"{r['ttft_p50_ms']} ms, computed {r['computed_prompt_tokens']} of "
              f"{r['prompt_tokens']} prompt tokens")


if __name__ == "__main__":
    main()

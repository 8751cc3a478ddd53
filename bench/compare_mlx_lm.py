"""Run the serving benchmark against kiln and mlx_lm.server side by side, same model.

    python bench/compare_mlx_lm.py --model demo-tiny --concurrency 16 --output-tokens 64

Starts both servers on 127.0.0.1, waits for them, runs `bench/serving.py`'s workload on each
in turn (greedy, identical prompts, so both produce the same tokens), prints a table and
writes the JSON results under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import serving  # noqa: E402
from tests.server import free_port_pair, wait_until  # noqa: E402


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    wait_until(lambda: httpx.get(url + "/v1/models", timeout=2).status_code == 200, proc,
               timeout, url, interval=0.5)


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _bench(url: str, model_dir: str, args: argparse.Namespace) -> dict:
    # mlx_lm.server loads whatever the request's "model" names: give both the directory.
    return serving.main(["--url", url, "--model", model_dir,
                         "--concurrency", str(args.concurrency),
                         "--num-requests", str(args.num_requests),
                         "--input-words", str(args.input_words),
                         "--output-tokens", str(args.output_tokens)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo-tiny")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-words", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--kiln-args", default="", help="extra launch.py flags")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--tag", default="",
                   help="write compare_mlx_lm_TAG.json instead of compare_mlx_lm.json (which "
                        "each untagged run replaces)")
    args = p.parse_args()

    from launch import resolve_model

    model_dir = resolve_model(args.model)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    kiln_port, mlx_port = free_port_pair(), free_port_pair() + 2
    servers = {
        "kiln": [sys.executable, "launch.py", "--model", model_dir, "--port", str(kiln_port),
                 *args.kiln_args.split()],
        "mlx_lm.server": [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir,
                          "--port", str(mlx_port), "--decode-concurrency",
                          str(max(32, args.concurrency)), "--prompt-concurrency",
                          str(args.concurrency)],
    }
    for name, cmd in servers.items():
        port = kiln_port if name == "kiln" else mlx_port
        url = f"http://127.0.0.1:{port}"
        proc = _start(cmd, out / f"{name}.log")
        try:
            _wait(url, proc)
            results[name] = _bench(url, model_dir, args)
        finally:
            proc.terminate()
            proc.wait(30)
    ratio = results["kiln"]["output_tok_s"] / max(results["mlx_lm.server"]["output_tok_s"], 1e-9)
    summary = {"model": args.model, "kiln_args": args.kiln_args, "results": results,
               "kiln_over_mlx_lm": round(ratio, 3)}
    name = f"compare_mlx_lm_{args.tag}.json" if args.tag else "compare_mlx_lm.json"
    (out / name).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{'server':<16}{'out tok/s':>12}{'TTFT p50 ms':>14}{'ITL p50 ms':>12}{'failed':>8}")
    for name, r in results.items():
        print(f"{name:<16}{r['output_tok_s']:>12}{r['ttft_ms']['p50']:>14}{r['itl_ms']['p50']:>12}"
              f"{r['failed']:>8}")
    print(f"kiln / mlx_lm.server output tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()

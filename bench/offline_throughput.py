"""Offline throughput: kiln's engine in one process versus mlx-lm's BatchGenerator.

    python bench/offline_throughput.py --model demo-tiny --num-prompts 32 --input-len 128 \
        --output-len 64 [--json out.json]

Both engines get the same N random-token prompts at once, decode greedily with no EOS stop
(each request makes exactly --output-len tokens) and are timed from submission to the last
token. kiln runs its scheduler and model runner directly (bench/engine_loop.py), with no
sockets or HTTP, by default through the server's overlapped step loops (--no-overlap: one
step at a time). Prints both tokens/s figures and their ratio, and whether the two engines
produced the same tokens; writes the same as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.engine_loop import EngineLoop, EngineSizes, load_model  # noqa: E402

# Ids below this are the demo tokenizers' special tokens; real vocabularies do not care.
_FIRST_PROMPT_ID = 10


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    seed: int

    def prompts(self, vocab_size: int, salt: int = 0) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, salt])
        ids = rng.integers(_FIRST_PROMPT_ID, vocab_size, size=(self.num_prompts, self.input_len))
        return ids.tolist()


@dataclass
class EngineRun:
    engine: str
    seconds: float
    output_tokens: int
    output_tok_s: float
    steps: int  # forward steps (kiln) or generator calls (mlx-lm)
    # Each engine's own split of its time (kiln: steps with / without prompt tokens;
    # mlx-lm: BatchGenerator's prompt and decode counters).
    prefill_s: float | None
    decode_s: float | None


def run_kiln(model: Any, prompts: list[list[int]], output_len: int,
             args: argparse.Namespace) -> tuple[EngineRun, list[list[int]]]:
    n, longest = len(prompts), max(len(p) for p in prompts)
    # The server's pool is sized by memory, and off the CUDA kernel the decode path keeps
    # the batch's context in dense blocks within half the pool's bytes (DenseDecodeContext).
    # A pool just big enough for these requests would put every decode step on the
    # per-layer gather that the server takes only for batches over that budget: 4x room.
    sizes = EngineSizes(capacity=4 * n * (longest + output_len + 16), max_running=n,
                        max_context=longest + output_len + 1, chunk_size=args.chunk_size,
                        max_prefill_tokens=args.max_prefill_tokens)
    loop = EngineLoop(model, sizes)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        loop.submit(f"r{i}", p, output_len)
    steps = loop.run_until_idle(max_steps=n * (longest + output_len) + 16, overlap=args.overlap)
    seconds = time.perf_counter() - start
    if loop.errors():
        raise RuntimeError(f"kiln rejected requests: {loop.errors()[:3]}")
    tokens = [loop.outputs[f"r{i}"].token_ids for i in range(n)]
    # With two steps in flight a step's time is not its own: no split then.
    split = (None, None) if args.overlap else (loop.clock.prefill_s, loop.clock.decode_s)
    name = "kiln (overlap)" if args.overlap else "kiln"
    return _summary(name, seconds, tokens, steps, *split), tokens


def run_mlx_lm(model: Any, prompts: list[list[int]], output_len: int,
               args: argparse.Namespace) -> tuple[EngineRun, list[list[int]]]:
    from mlx_lm.generate import BatchGenerator

    # No stop tokens: every sequence ends at max_tokens. The whole workload is one batch.
    gen = BatchGenerator(model, max_tokens=output_len, stop_tokens=None,
                         completion_batch_size=len(prompts),
                         prefill_batch_size=args.prefill_batch_size,
                         prefill_step_size=args.prefill_step_size)
    start = time.perf_counter()
    with gen.stats() as stats:
        uids = gen.insert(prompts, [output_len] * len(prompts))
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        calls = 0
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid].append(r.token)
            calls += 1
            if calls > len(prompts) * (output_len + 1):
                raise RuntimeError("BatchGenerator did not finish in the expected steps")
    seconds = time.perf_counter() - start
    gen.close()
    tokens = [out[uid] for uid in uids]
    return _summary("mlx_lm.BatchGenerator", seconds, tokens, calls, stats.prompt_time,
                    stats.decode_time), tokens


def _summary(engine: str, seconds: float, tokens: list[list[int]], steps: int,
             prefill_s: float | None, decode_s: float | None) -> EngineRun:
    total = sum(len(t) for t in tokens)
    return EngineRun(engine, round(seconds, 4), total, round(total / seconds, 2), steps,
                     _round(prefill_s), _round(decode_s))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _check_lengths(name: str, tokens: list[list[int]], output_len: int) -> None:
    short = [i for i, t in enumerate(tokens) if len(t) != output_len]
    if short:
        raise RuntimeError(f"{name}: {len(short)} requests did not make {output_len} tokens")


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float | int]:
    """How far the two engines' greedy outputs agree (identical in float32 on the CPU)."""
    same_requests = sum(x == y for x, y in zip(a, b))
    prefix = [_common_prefix(x, y) for x, y in zip(a, b)]
    return {"identical_requests": same_requests, "requests": len(a),
            "mean_common_prefix_tokens": round(float(np.mean(prefix)), 2)}


def _common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    for u, v in zip(x, y):
        if u != v:
            break
        n += 1
    return n


_RUNNERS = {"kiln": run_kiln, "mlx_lm": run_mlx_lm}


def model_dtype(model: Any) -> str:
    from mlx.utils import tree_flatten

    return str(tree_flatten(model.parameters())[0][1].dtype)


def measure(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    work = Workload(args.num_prompts, args.input_len, args.output_len, args.seed)
    prompts = work.prompts(model.args.vocab_size)
    runs: dict[str, EngineRun] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name in args.engines.split(","):
        runner = _RUNNERS[name]
        if args.warmup:  # same batch, other prompts, few tokens: first-use compiles land here
            runner(model, work.prompts(model.args.vocab_size, salt=1), min(4, args.output_len),
                   args)
        runs[name], tokens[name] = runner(model, prompts, args.output_len, args)
        _check_lengths(name, tokens[name], args.output_len)
        gc.collect()
        mx.clear_cache()
    result: dict[str, Any] = {"workload": asdict(work), "dtype": model_dtype(model),
                              "device": str(mx.default_device()),
                              "runs": {k: asdict(v) for k, v in runs.items()}}
    if len(runs) == 2:
        a, b = (runs[k] for k in ("kiln", "mlx_lm"))
        result["kiln_over_mlx_lm"] = round(a.output_tok_s / max(b.output_tok_s, 1e-9), 3)
        result["agreement"] = _agreement(tokens["kiln"], tokens["mlx_lm"])
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'engine':<24}{'seconds':>10}{'out tokens':>12}{'out tok/s':>12}{'steps':>8}"
          f"{'prefill s':>11}{'decode s':>10}")
    for r in result["runs"].values():
        print(f"{r['engine']:<24}{r['seconds']:>10.3f}{r['output_tokens']:>12}"
              f"{r['output_tok_s']:>12.1f}{r['steps']:>8}{_cell(r['prefill_s'], 11)}"
              f"{_cell(r['decode_s'], 10)}")
    if "kiln_over_mlx_lm" in result:
        ag = result["agreement"]
        print(f"kiln / mlx-lm output tokens/s: {result['kiln_over_mlx_lm']:.2f}x; identical "
              f"outputs: {ag['identical_requests']}/{ag['requests']} requests")


def _cell(value: float | None, width: int) -> str:
    return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="demo-tiny", help="model directory or demo preset name")
    p.add_argument("--num-prompts", type=int, default=32, help="requests submitted at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--engines", default="kiln,mlx_lm", help="which to run, in this order")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="kiln: the server's two-steps-in-flight loops (off: one step at a "
                        "time, which also splits kiln's time into prefill and decode)")
    p.add_argument("--chunk-size", type=int, default=2048, help="kiln: prefill chunk size")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="kiln: prompt tokens per step")
    p.add_argument("--prefill-batch-size", type=int, default=8,
                   help="mlx-lm: prompts prefilled together")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="mlx-lm: prefill chunk")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run each engine once on other prompts with a few tokens first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the result here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    if set(args.engines.split(",")) - set(_RUNNERS):
        p.error(f"--engines takes a comma list of {', '.join(_RUNNERS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, path = load_model(args.model)
    result = {"model": str(path), **measure(model, args)}
    text = json.dumps(result, indent=2)
    print(text)
    print_table(result)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()

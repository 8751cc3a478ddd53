"""Step latency of kiln's model runner: one decode step by batch size and context length,
and one prefill by prompt length.

    python bench/one_batch.py --model demo-tiny --batch-sizes 1,8,32,64,128 \
        --contexts 128,512,2048 [--repeats 5] [--json out.json]

For each context length L it times a prefill of L tokens (one request, batch of one), then
for each batch size B fills B requests with L prompt tokens and times decode-only steps
(every row at context about L): the median of --repeats steps after --warmup steps. Steps go
through the scheduler and `ModelRunner.run`, whose result is read back with `.tolist()`, so
each time covers completed device work. Prints two tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.engine_loop import EngineLoop, EngineSizes, load_model  # noqa: E402
from bench.serving import int_list as _int_list  # noqa: E402

_FIRST_PROMPT_ID = 10  # skip the demo tokenizers' special ids


@dataclass(frozen=True)
class Cell:
    """One measurement: decode at batch B (or prefill when batch is 0) and context L."""

    kind: str  # "decode" or "prefill"
    batch: int
    context: int
    median_ms: float | None
    min_ms: float | None
    tok_s: float | None
    skipped: str | None = None


class StepTimer:
    """Drives an EngineLoop and times the steps that match what is being measured."""

    def __init__(self, loop: EngineLoop, vocab_size: int, seed: int) -> None:
        self.loop = loop
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self._next_id = 0

    def _prompt(self, length: int) -> list[int]:
        return self.rng.integers(_FIRST_PROMPT_ID, self.vocab_size, size=length).tolist()

    def _submit(self, length: int, max_tokens: int) -> str:
        rid = f"b{self._next_id}"
        self._next_id += 1
        self.loop.submit(rid, self._prompt(length), max_tokens)
        return rid

    def prefill_ms(self, context: int, runs: int) -> list[float]:
        """Times of single-request prefills of `context` tokens (first token included)."""
        times = []
        for _ in range(runs):
            self._submit(context, max_tokens=1)
            batch = self.loop.plan()
            if batch is None or len(batch.prefill) != 1 or batch.decode_rids:
                raise RuntimeError("expected a step holding exactly one whole prefill")
            times.append(self._timed(batch))
        self.loop.run_until_idle(max_steps=4)
        return times

    def decode_ms(self, batch_size: int, context: int, runs: int) -> list[float]:
        """Times of decode-only steps of `batch_size` requests at about `context` tokens."""
        budget = self.loop.scheduler.limits.max_prefill_tokens
        prefill_steps = -(-batch_size * context // budget) + 1
        rids = [self._submit(context, max_tokens=prefill_steps + runs + 2)
                for _ in range(batch_size)]
        times: list[float] = []
        for _ in range(prefill_steps + runs + 2):
            batch = self.loop.plan()
            if batch is None:
                break
            if batch.prefill or len(batch.decode_rids) != batch_size:
                self.loop.execute(batch)  # still filling the batch: not timed
                continue
            times.append(self._timed(batch))
            if len(times) == runs:
                break
        for rid in rids:
            self.loop.abort(rid)
        if len(times) < runs:
            raise RuntimeError(f"only {len(times)} decode-only steps at batch {batch_size}")
        return times

    def _timed(self, batch: Any) -> float:
        start = time.perf_counter()
        self.loop.execute(batch)  # ends in .tolist(): the device work is done
        return (time.perf_counter() - start) * 1e3


def make_cell(kind: str, batch: int, context: int, times: list[float], warmup: int) -> Cell:
    kept = times[warmup:]
    median = statistics.median(kept)
    tokens = context if kind == "prefill" else batch
    return Cell(kind, batch, context, round(median, 3), round(min(kept), 3),
                round(tokens / median * 1e3, 1))


def build_loop(model: Any, batch_sizes: list[int], contexts: list[int],
               steps: int, max_prefill_tokens: int) -> EngineLoop:
    longest, widest = max(contexts), max(batch_sizes)
    # Room for the widest batch at the longest context while it fills, decodes and drains.
    extra = steps + widest + 4
    sizes = EngineSizes(capacity=widest * (longest + extra) + longest, max_running=widest + 1,
                        max_context=longest + extra, chunk_size=longest,
                        max_prefill_tokens=max(longest, max_prefill_tokens))
    return EngineLoop(model, sizes)


def measure(model: Any, args: argparse.Namespace) -> list[Cell]:
    loop = build_loop(model, args.batch_sizes, args.contexts, args.warmup + args.repeats,
                      args.max_prefill_tokens)
    timer = StepTimer(loop, model.args.vocab_size, args.seed)
    deadline = time.monotonic() + args.max_seconds
    runs = args.warmup + args.repeats
    cells: list[Cell] = []
    for context in args.contexts:
        plan = [("prefill", 1)] + [("decode", b) for b in args.batch_sizes]
        for kind, batch in plan:
            if time.monotonic() > deadline:
                cells.append(Cell(kind, batch, context, None, None, None, "time limit"))
                continue
            times = (timer.prefill_ms(context, runs) if kind == "prefill"
                     else timer.decode_ms(batch, context, runs))
            cells.append(make_cell(kind, batch, context, times, args.warmup))
            print(f"{kind:>7} batch {batch:>4} context {context:>5}: "
                  f"{cells[-1].median_ms:.2f} ms", file=sys.stderr, flush=True)
    return cells


def _fmt(value: float | None, width: int) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"


def print_tables(cells: list[Cell], batch_sizes: list[int], contexts: list[int]) -> None:
    by_key = {(c.kind, c.batch, c.context): c for c in cells}
    head = "".join(f"{'ctx ' + str(c):>12}" for c in contexts)
    print(f"\ndecode step, ms (median)\n{'batch':<8}{head}")
    for b in batch_sizes:
        row = "".join(_fmt(by_key[("decode", b, c)].median_ms, 12) for c in contexts)
        print(f"{b:<8}{row}")
    print(f"\ndecode output tok/s\n{'batch':<8}{head}")
    for b in batch_sizes:
        row = "".join(_fmt(by_key[("decode", b, c)].tok_s, 12) for c in contexts)
        print(f"{b:<8}{row}")
    print(f"\nprefill of one prompt\n{'':<8}{head}")
    print(f"{'ms':<8}" + "".join(_fmt(by_key[("prefill", 1, c)].median_ms, 12) for c in contexts))
    print(f"{'tok/s':<8}" + "".join(_fmt(by_key[("prefill", 1, c)].tok_s, 12) for c in contexts))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="demo-tiny", help="model directory or demo preset name")
    p.add_argument("--batch-sizes", type=_int_list, default=_int_list("1,8,32,64,128"))
    p.add_argument("--contexts", type=_int_list, default=_int_list("128,512,2048"))
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each cell")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per cell (median)")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="prompt tokens per step while a batch fills")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="cells not started by then are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the cells here")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1:
        p.error("--warmup must be >= 0 and --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, path = load_model(args.model)
    cells = measure(model, args)
    result = {"model": str(path), "warmup": args.warmup, "repeats": args.repeats,
              "cells": [asdict(c) for c in cells]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print_tables(cells, args.batch_sizes, args.contexts)
    return result


if __name__ == "__main__":
    main()

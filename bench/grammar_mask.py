"""What structured output costs per step: the host's mask fill for B constrained rows, and
the extra latency of a decode step whose rows all follow a JSON schema over one whose rows
are free (same model, batch, seeds).

    LD_PRELOAD=$VENV/lib/libmkl_rt.so.3 python bench/grammar_mask.py --model demo \
        --batch 1,16,64 --steps 48 --repeats 5

Rows are kept mid-grammar: a matcher whose grammar has finished (it would only allow EOS,
a cheap mask) is replaced by a fresh one, so the numbers are those of rows still writing
JSON. The mask fill uses the worker's own `GrammarMatchers.fill` (llguidance's parallel
fill for more than one row); the step latency runs the worker's `WorkerLoop` on a
`ModelRunner` with hand-made plans, as the server would, without the scheduler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this tree's modules, not an installed copy's
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.engine_loop import load_model  # noqa: E402
from ipc.messages.common import SamplingParams  # noqa: E402
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk, SyncSteps  # noqa: E402
from kiln_common.llguidance_tokenizer import ll_tokenizer  # noqa: E402
from kiln_common.model_info import load_model_info  # noqa: E402
from tokenizer_proc.constraints import Constraint, GrammarCompiler  # noqa: E402
from worker_proc import WorkerLoop  # noqa: E402
from worker_proc.grammar import GrammarMatchers  # noqa: E402
from worker_proc.kv_pool import KVPool  # noqa: E402
from worker_proc.memory import probe_attention_specs  # noqa: E402
from worker_proc.runner import ModelRunner  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "species": {"enum": ["cat", "dog", "axolotl", "parrot"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
        "owner": {"type": "object", "properties": {"name": {"type": "string"},
                                                   "phone": {"type": "string",
                                                             "pattern": "^[0-9-]{7,15}$"}},
                  "required": ["name"]},
    },
    "required": ["name", "species", "age", "notes", "owner"],
    "additionalProperties": False,
}
PROMPT_LEN = 16


@dataclass(frozen=True)
class Fixture:
    model: Any
    grammar: str
    matchers: GrammarMatchers


def load_fixture(name: str) -> Fixture:
    import mlx_lm

    model, path = load_model(name)
    _, tokenizer = mlx_lm.load(str(path))
    hf = tokenizer._tokenizer
    info = load_model_info(name, str(path), hf)

    def make() -> Any:
        return ll_tokenizer(hf, info.eos_token_ids)

    grammar = GrammarCompiler(make).compile(Constraint("json_schema", SCHEMA, "schema"))
    return Fixture(model, grammar, GrammarMatchers(make))


# --- host mask fill ---------------------------------------------------------------------


def fill_times(fx: Fixture, batch: int, steps: int, seed: int = 0) -> list[float]:
    """Seconds per `fill` of `batch` rows, each row then taking a random allowed token
    (what a random model under the mask does)."""
    rng = np.random.default_rng(seed)
    rows = [fx.matchers.matcher(fx.grammar) for _ in range(batch)]
    vocab = fx.matchers.tokenizer.vocab_size
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        masks = fx.matchers.fill(rows)
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, m in enumerate(rows):
            if m.is_stopped():
                rows[i] = fx.matchers.matcher(fx.grammar)
            else:
                GrammarMatchers.advance(m, int(rng.choice(np.nonzero(bits[i])[0])))
    return times


# --- the in-graph mask op ---------------------------------------------------------------


def sample_ms(batch: int, vocab: int, masked: bool, reps: int = 50) -> float:
    """Median milliseconds of `sample` on [batch, vocab] logits (temperature 1), with every
    row masked (a random half of the tokens allowed) or none."""
    import mlx.core as mx

    from worker_proc.sampling import GrammarMask, SamplingBatch, sample

    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(batch, vocab)).astype(np.float32))
    words = rng.integers(-2**31, 2**31, size=(batch, (vocab + 31) // 32), dtype=np.int64)
    mask = GrammarMask.build(list(range(batch)), words.astype(np.int32)) if masked else None
    times = []
    for i in range(reps + 3):
        params = SamplingBatch.build([SamplingParams()] * batch, list(range(batch)), [i] * batch,
                                     grammar=mask)
        start = time.perf_counter()
        mx.eval(sample(logits, params))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[3:])


# --- step latency -----------------------------------------------------------------------


class _Discard:
    def send(self, message: object) -> None:
        pass


class _Plans:
    """Hand-made step plans: one prefill step, then decode steps over fresh slots."""

    def __init__(self, batch: int) -> None:
        self.rids = [f"r{i}" for i in range(batch)]
        self.step = 0
        self.next_slot = 1

    def slots(self, n: int) -> list[int]:
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return out

    def prefill(self, sampling: list[SamplingParams]) -> ForwardBatch:
        self.step += 1
        chunks = [PrefillChunk(rid=rid, start=0, token_ids=[5 + i] * PROMPT_LEN,
                               slot_ids=self.slots(PROMPT_LEN), sample=True)
                  for i, rid in enumerate(self.rids)]
        return ForwardBatch(step=self.step, prefill=chunks, new_requests=[
            NewRequest(rid=rid, sampling=sp) for rid, sp in zip(self.rids, sampling)])

    def decode(self) -> ForwardBatch:
        self.step += 1
        return ForwardBatch(step=self.step, decode_rids=self.rids,
                            decode_slots=self.slots(len(self.rids)))


def _refresh_finished(runner: ModelRunner, fx: Fixture) -> None:
    # Between steps, with nothing in flight: a finished grammar starts over (see module doc).
    for state in runner.requests.values():
        if state.matcher is not None and state.matcher.is_stopped():
            state.matcher = fx.matchers.matcher(fx.grammar)


def step_ms(fx: Fixture, batch: int, steps: int, constrained: bool, overlap: bool) -> float:
    """Mean wall milliseconds per decode step of `batch` rows (temperature 1, seeded)."""
    capacity = batch * (PROMPT_LEN + steps + 8) + 1
    runner = ModelRunner(fx.model, KVPool(probe_attention_specs(fx.model), capacity), batch,
                         PROMPT_LEN + steps + 8, fx.matchers)
    loop = WorkerLoop(runner, _Discard(), overlap=overlap)
    grammar = fx.grammar if constrained else None
    plans = _Plans(batch)
    loop.handle(plans.prefill([SamplingParams(temperature=1.0, seed=i, grammar=grammar,
                                              max_new_tokens=steps + 4)
                               for i in range(batch)]))
    for _ in range(4):  # warm: compile this batch size's graphs
        loop.handle(plans.decode())
    loop.handle(SyncSteps())
    total = 0.0
    for _ in range(steps):
        if constrained and not loop.in_flight:
            _refresh_finished(runner, fx)
        start = time.perf_counter()
        loop.handle(plans.decode())
        total += time.perf_counter() - start
    start = time.perf_counter()
    loop.handle(SyncSteps())
    total += time.perf_counter() - start
    return 1e3 * total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    fx = load_fixture(args.model)
    print(f"model {args.model}: tokenizer vocab {fx.matchers.tokenizer.vocab_size}, "
          f"mask {fx.matchers.words} int32 words per row")
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        fills = fill_times(fx, batch, args.steps)
        vocab = fx.model.args.vocab_size
        row = {"batch": batch, "fill_ms_median": 1e3 * statistics.median(fills),
               "fill_ms_p90": 1e3 * sorted(fills)[int(0.9 * (len(fills) - 1))],
               "sample_free_ms": sample_ms(batch, vocab, masked=False),
               "sample_masked_ms": sample_ms(batch, vocab, masked=True)}
        for overlap in (False, True):
            # Alternated and repeated: the 2-core VM's noise is larger than the effect.
            free, held = [], []
            for _ in range(args.repeats):
                free.append(step_ms(fx, batch, args.steps, constrained=False, overlap=overlap))
                held.append(step_ms(fx, batch, args.steps, constrained=True, overlap=overlap))
            key = "overlap" if overlap else "plain"
            row[f"{key}_free_ms"] = statistics.median(free)
            row[f"{key}_json_ms"] = statistics.median(held)
        results.append(row)
        print(f"B={batch:3d}  fill median {row['fill_ms_median']:.3f} ms (p90 "
              f"{row['fill_ms_p90']:.3f})  sample op {row['sample_free_ms']:.3f} -> "
              f"{row['sample_masked_ms']:.3f} ms  step plain {row['plain_free_ms']:.2f} -> "
              f"{row['plain_json_ms']:.2f} ms  overlap {row['overlap_free_ms']:.2f} -> "
              f"{row['overlap_json_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "steps": args.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Where one decode step's time goes: kiln's model runner against mlx-lm's plain loop, with
parts of kiln's step switched off to attribute the difference.

    python bench/step_breakdown.py --model DIR [--batch-sizes 1,64] [--context 256]
    python bench/step_breakdown.py --layers 32      # a narrow random llama, any machine

For each batch size: the host time to build one step's graph, and the time of one whole
step run synchronously (build, start, wait), median of --steps. Variants of kiln's step:
as served; paged attention replaced by returning the queries (its cost); the pool write
skipped (the scatter's cost); mlx-lm's own model call over its KVCache, all rows one
length, no mask (the bare-loop floor). The variants compute wrong tokens: timing only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from ipc.messages.common import SamplingParams
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from worker_proc.attention import PooledKVCache
from worker_proc.kv_pool import KVPool
from worker_proc.memory import probe_attention_specs
from worker_proc.runner import ModelRunner


def narrow_llama(layers: int) -> Any:
    args = llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=layers,
                           intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4,
                           rms_norm_eps=1e-5, vocab_size=1024, head_dim=32)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


def kiln_step_ms(model: Any, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(median host build ms, median synchronous step ms) over `steps` decode steps."""
    pool = KVPool(probe_attention_specs(model), batch * (context + steps + 4) + 1)
    runner = ModelRunner(model, pool, max_requests=batch, max_context=context + steps + 4)
    rids = [f"r{i}" for i in range(batch)]
    slot = iter(range(1, pool.num_slots + 1))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=steps + 2)
    runner.run(ForwardBatch(step=0, new_requests=[NewRequest(rid=r, sampling=greedy) for r in rids],
                            prefill=[PrefillChunk(rid=r, start=0, token_ids=[1] * context, sample=True,
                                                  slot_ids=[next(slot) for _ in range(context)])
                                     for r in rids]))
    build, whole = [], []
    for step in range(1, steps + 1):
        plan = ForwardBatch(step=step, decode_rids=rids, decode_slots=[next(slot) for _ in rids])
        t0 = time.perf_counter()
        pending = runner.build(plan)
        t1 = time.perf_counter()
        runner.start(pending)
        runner.finish(pending)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        whole.append(t2 - t0)
    del runner, pool
    return statistics.median(build[2:]) * 1e3, statistics.median(whole[2:]) * 1e3


def mlx_lm_step_ms(model: Any, batch: int, context: int, steps: int) -> tuple[float, float]:
    cache = [KVCache() for _ in model.layers]
    mx.eval(model(mx.ones((batch, context), dtype=mx.int32), cache=cache))
    y = mx.ones((batch, 1), dtype=mx.int32)
    build, whole = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        whole.append(t2 - t0)
    return statistics.median(build[2:]) * 1e3, statistics.median(whole[2:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model directory (default: a narrow random llama)")
    p.add_argument("--layers", type=int, default=32, help="narrow llama's layer count")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if args.model:
        import mlx_lm

        model, _ = mlx_lm.load(args.model)
    else:
        model = narrow_llama(args.layers)
    no_attention = lambda self, queries, scale: queries  # noqa: E731
    no_write = lambda self, layer, slots, keys, values: None  # noqa: E731
    variants = {
        "kiln": lambda b: kiln_step_ms(model, b, args.context, args.steps),
        "kiln, no attention": lambda b: _with(PooledKVCache, "paged_attention", no_attention,
                                              lambda: kiln_step_ms(model, b, args.context, args.steps)),
        "kiln, no pool write": lambda b: _with(KVPool, "write", no_write,
                                               lambda: kiln_step_ms(model, b, args.context, args.steps)),
        "mlx-lm loop": lambda b: mlx_lm_step_ms(model, b, args.context, args.steps),
    }
    print(f"{'batch':>6}  {'variant':<22}{'build ms':>10}{'step ms':>10}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for name, run in variants.items():
            build, whole = run(b)
            print(f"{b:>6}  {name:<22}{build:>10.2f}{whole:>10.2f}", flush=True)


def _with(obj: Any, name: str, value: Any, run: Any) -> tuple[float, float]:
    with patched(obj, name, value):
        return run()


if __name__ == "__main__":
    main()

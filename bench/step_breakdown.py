"""Where one decode step's time goes: kiln's model runner against mlx-lm's plain loop, with
parts of kiln's step switched off to attribute the difference.

    python bench/step_breakdown.py --model DIR [--batch-sizes 1,64] [--context 256]
    python bench/step_breakdown.py --layers 32      # a narrow random llama, any machine

For each batch size, medians over --steps of the host phases of a step: building the
graph, starting it (`mx.async_eval`: on MLX's CUDA backend this launches the kernels),
waiting for a result, and the whole step. Variants of kiln's step, each run alone: as
served; paged attention replaced by returning the queries (its cost); the pool write
skipped (the write's cost). mlx-lm's own model call over its KVCache (all rows one
length, no mask), run alone. Then both pipelined, two steps in flight as kiln's worker and
mlx-lm's generate loop run them: there "step" is the steady-state time per step; on the
CUDA kernel path also kiln's compiled decode forward (its default there), pipelined. The
"fused" variants run a second copy of the model with its q/k/v and gate/up projections
fused (worker_proc/fused_projections.py, as `--fuse-projections` serves it); the others
run mlx-lm's modules as loaded. "splits <= 256" caps the decode kernel's stretch of a row
per block at 256 tokens (the default before 1024: a merge kernel at large batches too);
"separate write" stores decode K/V with their own kernel, not inside the attention
kernel (the decode backend's write_in_attention off). "fast blocks" adds
worker_proc/decode_block.py's call (--fast-decode-blocks) to the fused copy, and "rope in
kernel" its RoPE applied by the attention kernel (the backend's rope_in_kernel); "1 + weight
every call" is the served copy with Gemma-style norms as mlx-lm runs them (no
worker_proc/offset_norms.py). The "no ..."
variants compute wrong tokens: timing only.

--prefill-batches times one step prefilling that many fresh prompts: kiln's runner on the
model as loaded and mlx-lm's call over its KVCache; on the CUDA kernel path also the
served model (fused, fast blocks) and, on it, forwards of up to 8,192 tokens instead of
PREFILL_FORWARD_TOKENS, MLX's fused (cuDNN) attention at every forward's own shapes, and
no pool write; the prefill steps add the served model with every prefill attention
unfused (before long causal chunks went bucketed to cuDNN), and with masked forwards
unfused (--experiments unfused-masked-prefill; before they went bucketed to cuDNN too).

--prefill-steps times prefill steps as a long-prompt server meets them (fresh 4,096
tokens; four 2,048-token chunks of different requests; a 2,048 chunk after a cached 2,048
prefix; eight 256-token chunks after prefixes of different lengths; a 4,096-token prompt
in two 2,048 chunks, the cold prompt's TTFT; sixteen fresh prompts of 50-150 tokens in
two steps, as a serving wave meets them; the 64-stream sweep's wave step, 54 fresh prompts
of 65-195 tokens): the host's graph building apart from the
launch (`mx.async_eval`, which starts each prefill forward as it is built) and the waits,
by the runner's own clock (as the worker logs them), against mlx-lm's model call over its
own caches for the same chunks. A hybrid's requests get state rows, its cached prefixes
state snapshots (of no particular contents: timing only). Each scenario runs
--prefill-runs times on one runner: the first run meets its shapes cold. --build-only
times the graph building alone, evaluating nothing: what a CPU can measure of a GPU-sized
step (the graph does not depend on the weights' widths: `--heads 32,8,128` gives the
narrow llama an 8B's head layout).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import pstats
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this tree's modules, not an installed copy's
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from ipc.messages.common import SamplingParams  # noqa: E402
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk  # noqa: E402
from mlx_lm.models import gated_delta as gated_delta_module  # noqa: E402
from worker_proc import decode_backend, paged_attention  # noqa: E402
from worker_proc.gated_delta_cuda import install_gated_delta_kernel, uses_gated_delta  # noqa: E402
from worker_proc import runner as runner_module  # noqa: E402
from worker_proc.attention import PooledKVCache  # noqa: E402
from worker_proc.depthwise_conv import replace_depthwise_convs  # noqa: E402
from worker_proc.fused_projections import fuse_projections  # noqa: E402
from worker_proc.decode_backend import DecodeBackend, choose_decode_backend  # noqa: E402
from worker_proc.kv_pool import KVPool  # noqa: E402
from worker_proc.memory import probe_attention_specs, raise_cuda_graph_budgets  # noqa: E402
from worker_proc.model_rewrites import rewrite_for_serving  # noqa: E402
from worker_proc.paged_attention import kernel_available  # noqa: E402
from worker_proc.runner import ModelRunner  # noqa: E402
from tests.engine_driver import StandInKernel  # noqa: E402


def served_model(model: Any, summed_norms: bool = True) -> Any:
    """The model as the server decodes with it on this backend (the worker's rewrites,
    worker_proc/model_rewrites.py): projections fused, fast decode blocks (residual adds
    in GEMMs, quantized experts padded and short convolutions rewritten where the CUDA
    kernel runs), offset norms' 1 + weight made once (summed_norms). In place."""
    on_cuda = kernel_available()
    rewrite_for_serving(model, on_cuda=on_cuda, fuse=True, fast_blocks=True,
                        pad_experts=on_cuda, sum_norms=summed_norms)
    return model


def narrow_llama(layers: int, heads: tuple[int, int, int] = (16, 4, 32)) -> Any:
    """A random llama of narrow widths: hidden 512, MLP 1024, vocabulary 1024; heads:
    query heads, KV heads, head size."""
    n_q, n_kv, head_dim = heads
    args = llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=layers,
                           intermediate_size=1024, num_attention_heads=n_q,
                           num_key_value_heads=n_kv, rms_norm_eps=1e-5, vocab_size=1024,
                           head_dim=head_dim)
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


def _runner(model: Any, batch: int, context: int, steps: int, compile_decode: bool = False,
            prompt: int = 0) -> tuple[ModelRunner, list[str], Iterator[int]]:
    """A runner whose `batch` requests have prefilled `context` tokens each (and room for
    two more of `prompt` tokens: _Prompts)."""
    runner, rids, slot, prefill = _empty_runner(model, batch, context, steps, compile_decode, prompt)
    runner.run(prefill)
    return runner, rids, slot


# --pool-slots: a served pool's size (0: three times what the batch needs). It matters on
# CUDA: MLX ends a CUDA graph once its inputs pass a size budget, and a served pool's
# layer alone is over it (the decode kernel reads the whole layer), so a server commits a
# graph every layer where a small pool lets several layers share one.
POOL_SLOTS = 0
# Recurrent state rows of a hybrid's pool (--state-rows; at least the batch): a served
# pool's (--max-running-requests) makes each layer's state array that many rows.
STATE_ROWS = 0
# The decode backend the runners get (None: the device's, as served); A/B variants set it.
BACKEND: DecodeBackend | None = None


def _empty_runner(model: Any, batch: int, context: int, steps: int, compile_decode: bool = False,
                  prompt: int = 0) -> tuple[ModelRunner, list[str], Iterator[int], ForwardBatch]:
    """A runner with room for `batch` requests (and two of `prompt` tokens), and the step
    that prefills the `batch`."""
    # Three times what the batch needs, as a server's pool is larger than its batch: the
    # kept decode contexts of the fallback path may use half the pool's size.
    slots = max(POOL_SLOTS, 3 * batch * (context + steps + 4) + 1) + 2 * prompt
    specs = probe_attention_specs(model)
    # A hybrid's recurrent layers keep a state row per request; a server has more rows
    # than its batch (--max-running-requests), the pool's state arrays as large.
    rows = max(STATE_ROWS, batch) if KVPool.state_bytes_per_request(specs) else 0
    pool = KVPool(specs, slots, BACKEND, state_rows=rows)
    runner = ModelRunner(model, pool, max_requests=batch + (2 if prompt else 0),
                         max_context=max(context + steps + 4, prompt), compile_decode=compile_decode)
    rids = [f"r{i}" for i in range(batch)]
    slot = iter(range(1, pool.num_slots + 1))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=steps + 2)
    # Each row its own random prompt: rows of one prompt decode one token each step, and
    # an MoE then routes the whole batch to one top-k (served steps spread over experts).
    vocab = getattr(getattr(model, "args", None), "vocab_size", 256)
    tokens = np.random.default_rng(0).integers(1, min(vocab, 4096), size=(batch, context))
    prefill = ForwardBatch(step=0, new_requests=[NewRequest(rid=r, sampling=greedy) for r in rids],
                           prefill=[PrefillChunk(rid=r, start=0, token_ids=tokens[i].tolist(),
                                                 sample=True,
                                                 slot_ids=[next(slot) for _ in range(context)])
                                    for i, r in enumerate(rids)])
    return runner, rids, slot, prefill


class _Prompts:
    """Long prompts prefilled `chunk` tokens a step beside the decode rows, as a burst of
    prompts meets a decoding batch (the mixed-traffic bench's steps): each prompt `length`
    tokens, the next one started when one ends, their slots two ranges from `first_slot`
    on, taken in turn. spread > 1: as a served decode-first step spreads its prefill
    (ForwardBatch.parts), a piece of spread * chunk tokens run a share of the blocks a
    step over `spread` steps."""

    def __init__(self, chunk: int, length: int, first_slot: int, spread: int = 1) -> None:
        self.chunk, self.length, self.first_slot, self.spread = chunk, length, first_slot, spread
        self.number, self.start, self.part = 0, 0, 0

    def step_plan(self, step: int, rids: list[str], slots: list[int]) -> ForwardBatch:
        """Step `step`: the decode rows and the current prompt's next chunk, or the next
        part of the piece an earlier step started."""
        if self.part:
            plan = ForwardBatch(step=step, decode_rids=rids, decode_slots=slots,
                                parts=self.spread, parts_from=self.part, parts_to=self.part + 1)
            self.part = (self.part + 1) % self.spread
            return plan
        rid = f"prompt{self.number}"
        new = [NewRequest(rid=rid, sampling=SamplingParams(temperature=0.0, max_new_tokens=1))
               ] if self.start == 0 else []
        released = [f"prompt{self.number - 1}"] if self.start == 0 and self.number else []
        size = min(self.chunk * self.spread, self.length - self.start)
        base = self.first_slot + (self.number % 2) * self.length + self.start
        chunk = PrefillChunk(rid=rid, start=self.start, token_ids=[1] * size,
                             sample=self.start + size == self.length,
                             slot_ids=list(range(base, base + size)))
        self.start += size
        if self.start == self.length:
            self.number, self.start = self.number + 1, 0
        self.part = 1 % self.spread
        return ForwardBatch(step=step, new_requests=new, prefill=[chunk], released=released,
                            decode_rids=rids, decode_slots=slots, parts=self.spread)


def kiln_step_ms(model: Any, batch: int, context: int, steps: int,
                 pipelined: bool = False, compile_decode: bool = False,
                 profile: cProfile.Profile | None = None,
                 before_step: Callable[[int], None] | None = None,
                 chunk: int = 0, prompt: int = 4096, spread: int = 1) -> Timings:
    """Decode steps: build, start (async_eval), wait. Alone, each step is waited for before
    the next; pipelined, as the worker's start-ahead loop (no scheduler or sockets), step
    N+1 is built and half started before N is waited for, so step ms is the steady state
    (the wait for N counts as "wait"). profile: a profiler to run around each step's
    build; before_step: called with each step's number (1, 2, ...) before its build.
    chunk > 0: each step also prefills that many tokens of `prompt`-token prompts, in
    pieces of spread * chunk tokens run over `spread` steps (_Prompts)."""
    runner, rids, slot = _runner(model, batch, context, steps, compile_decode,
                                 prompt if chunk else 0)
    prompts = (_Prompts(chunk, prompt, runner.pool.num_slots + 1 - 2 * prompt, spread)
               if chunk else None)
    t = Timings(pool_mb=runner.pool.nbytes / 1e6)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    in_flight = None
    for step in range(1, steps + 1):
        if before_step is not None:
            before_step(step)
        slots = [next(slot) for _ in rids]
        plan = (prompts.step_plan(step, rids, slots) if prompts is not None
                else ForwardBatch(step=step, decode_rids=rids, decode_slots=slots))
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        pending = runner.build(plan)
        if profile is not None:
            profile.disable()
        t1 = time.perf_counter()
        if pipelined:  # the worker's start-ahead order (WorkerLoop._run_ahead)
            runner.start_head()
            waiting = 0.0
            if in_flight is not None:
                w0 = time.perf_counter()
                runner.finish(in_flight)
                waiting = time.perf_counter() - w0
            runner.start(pending)
            in_flight = pending
            # Launch and wait interleave: the wait is moved to the end of the step.
            t3 = time.perf_counter()
            t2 = t3 - waiting
        else:
            runner.start(pending)
            t2 = time.perf_counter()
            runner.finish(pending)
            t3 = time.perf_counter()
        t.add(t0, t1, t2, t3)
        t.charge_clock(runner.clock)
    if in_flight is not None:
        runner.finish(in_flight)
    # A step whose pool writes copy the pool instead of updating it in place shows here.
    t.over_mb = (mx.get_peak_memory() - base) / 1e6
    return t


def mlx_lm_step_ms(model: Any, batch: int, context: int, steps: int,
                   pipelined: bool = False) -> Timings:
    """mlx-lm's model over its KVCache, greedy; pipelined as mlx-lm's generate loop (the
    next step queued with async_eval before the last one's tokens are read)."""
    # A hybrid's own cache kinds (ArraysCache beside KVCache), as mlx-lm serves it.
    cache = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    mx.eval(model(mx.ones((batch, context), dtype=mx.int32), cache=cache))
    y = mx.ones((batch, 1), dtype=mx.int32)
    t = Timings()
    previous = None
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        if not pipelined:
            mx.eval(y)
        elif previous is not None:
            previous.tolist()
        previous = y
        t.add(t0, t1, t2, time.perf_counter())
    return t


def prefill_ms(model: Any, batch: int, prompt: int, kiln: bool, repeats: int = 3) -> tuple[float, float]:
    """One step prefilling `batch` fresh prompts of `prompt` tokens, until its tokens are
    back: kiln's runner (shared padded forwards, as served) or mlx-lm's model over a
    batch KVCache. The first run (a shape not seen before: what a server meets with
    ragged prompts) and the fastest of `repeats` after it."""
    times = []
    for _ in range(repeats + 1):
        if kiln:  # the pool's allocation is not timed
            runner, _, _, prefill = _empty_runner(model, batch, prompt, 1)
        t0 = time.perf_counter()
        if kiln:
            runner.run(prefill)
        else:
            cache = [KVCache() for _ in model.layers]
            logits = model(mx.ones((batch, prompt), dtype=mx.int32), cache=cache)[:, -1, :]
            mx.argmax(logits, axis=-1).tolist()
        times.append(time.perf_counter() - t0)
    return times[0] * 1e3, min(times[1:]) * 1e3


@dataclass
class Timings:
    """Per-step host phases: build the graph, start it (async_eval), wait for a result."""

    build: list[float] = field(default_factory=list)
    launch: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    pool_mb: float = 0.0  # kiln's: the KV pool's size
    over_mb: float = 0.0  # kiln's: peak memory during the steps over what was held before

    def add(self, t0: float, t1: float, t2: float, t3: float) -> None:
        self.build.append(t1 - t0)
        self.launch.append(t2 - t1)
        self.wait.append(t3 - t2)
        self.step.append(t3 - t0)

    def charge_clock(self, clock: Any) -> None:
        """Move the last step's prefill launches and waits (a ForwardClock: prefill
        forwards start as they are built) from its build to its launch and wait."""
        self.build[-1] -= clock.start + clock.wait
        self.launch[-1] += clock.start
        self.wait[-1] += clock.wait

    def medians_ms(self) -> list[float]:
        # The first steps pay one-off costs (kernel compilation, allocations).
        return [statistics.median(x[2:]) * 1e3 for x in (self.build, self.launch, self.wait, self.step)]


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk of a scenario's step: request index, first position, tokens. A
    request's first chunk at start > 0 follows a cached prefix of that many tokens."""

    request: int
    start: int
    size: int


# Steps of Chunks; the label says what a server meets them as.
PREFILL_STEPS: dict[str, tuple[str, tuple[tuple[Chunk, ...], ...]]] = {
    "fresh4096": ("1 x 4096, fresh", ((Chunk(0, 0, 4096),),)),
    "4x2048": ("4 x 2048 of 4 requests, fresh", (tuple(Chunk(i, 0, 2048) for i in range(4)),)),
    "2048after2048": ("2048 after a cached 2048", ((Chunk(0, 2048, 2048),),)),
    "8x256mixed": ("8 x 256 after prefixes 256..2048",
                   (tuple(Chunk(i, 256 * (i + 1), 256) for i in range(8)),)),
    "4096chunked": ("4096 in 2 steps of 2048 (TTFT)", ((Chunk(0, 0, 2048),), (Chunk(0, 2048, 2048),))),
    # A long prompt's late chunks under the decode-first budget (512 tokens a step, or
    # 128 spread over 8 steps): few queries a row against a long cached context.
    "1024after3072": ("1024 after a cached 3072", ((Chunk(0, 3072, 1024),),)),
    "256after3840": ("256 after a cached 3840", ((Chunk(0, 3840, 256),),)),
    "2x512late": ("2 x 512 after prefixes 2048, 3072", ((Chunk(0, 2048, 512), Chunk(1, 3072, 512)),)),
    # A wave of 100-word prompts varied +-50%, as the serving sweep sends them: fresh
    # shapes nearly every step.
    "16x50to150": ("16 x 50..150 fresh, 2 steps", (
        tuple(Chunk(i, 0, 50 + (i * 37) % 101) for i in range(8)),
        tuple(Chunk(i, 0, 50 + (i * 53) % 101) for i in range(8, 16)))),
    # The sweep's 64-stream wave as the scheduler admits it: one step of the 54 prompts
    # that fit --max-prefill-tokens (8,192), 100 words +-50% (~65-195 tokens) each.
    "54x65to195": ("54 x 65..195 fresh, one step", (
        tuple(Chunk(i, 0, 65 + (i * 37) % 131) for i in range(54)),)),
}


@dataclass
class StepPhases:
    """One run of a scenario's steps, each phase summed over them (seconds)."""

    build: float = 0.0  # graph building alone
    launch: float = 0.0  # mx.async_eval: the prefill forwards', then the step's
    wait: float = 0.0  # for earlier forwards, then for the step's tokens
    step: float = 0.0

    def add(self, build: float, launch: float, wait: float, step: float) -> None:
        self.build += build
        self.launch += launch
        self.wait += wait
        self.step += step


def _scenario_plans(steps: tuple[tuple[Chunk, ...], ...], snapshots: bool = False
                    ) -> tuple[list[ForwardBatch], int, int]:
    """The scenario's step plans; how many requests and the longest context. Request i
    holds slots 1 + i * context ..; each samples after its last chunk. snapshots: a
    cached prefix starts from state snapshot i + 1 (a hybrid's recurrent layers)."""
    chunks = [c for step in steps for c in step]
    n_req = 1 + max(c.request for c in chunks)
    context = max(c.start + c.size for c in chunks)
    last = {c.request: c for c in chunks}
    seen: set[int] = set()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    plans = []
    for number, step in enumerate(steps, start=1):
        new = [c for c in step if c.request not in seen]
        seen.update(c.request for c in new)
        base = {c.request: 1 + c.request * context for c in step}
        plans.append(ForwardBatch(
            step=number,
            new_requests=[NewRequest(rid=f"p{c.request}", sampling=greedy,
                                     prefix_slot_ids=list(range(base[c.request], base[c.request] + c.start)),
                                     state_snapshot=c.request + 1 if snapshots and c.start else 0)
                          for c in new],
            prefill=[PrefillChunk(rid=f"p{c.request}", start=c.start, token_ids=[1] * c.size,
                                  sample=c is last[c.request],
                                  slot_ids=list(range(base[c.request] + c.start,
                                                      base[c.request] + c.start + c.size)))
                     for c in step]))
    return plans, n_req, context


PrefillRun = Callable[[], StepPhases]  # one run of a scenario's steps, on kept state


def kiln_prefill(model: Any, steps: tuple[tuple[Chunk, ...], ...], build_only: bool,
                 **runner_args: Any) -> PrefillRun:
    """A runner for the scenario; each call runs its steps once on it (its traces and
    caches kept from run to run). build_only: nothing is evaluated (each forward's
    launch is skipped, the pool put back after each run)."""
    specs = probe_attention_specs(model)
    # A hybrid's requests need state rows, and a cached prefix the snapshot of its state
    # (its contents do not matter to the timing).
    states = KVPool.state_bytes_per_request(specs) > 0
    plans, n_req, context = _scenario_plans(steps, snapshots=states)
    pool = KVPool(specs, n_req * context + 1, BACKEND, state_rows=n_req if states else 0,
                  snapshots=n_req if states else 0)
    runner = ModelRunner(model, pool, max_requests=n_req, max_context=context, **runner_args)
    evaluated = list(pool.layers)

    def run() -> StepPhases:
        with patched(ModelRunner, "_launch_prefill", lambda self, *_: None) if build_only else _nothing():
            phases = _kiln_prefill_run(runner, plans, build_only)
        runner.reset()
        if build_only:
            pool.layers = list(evaluated)
        return phases

    return run


def _kiln_prefill_run(runner: ModelRunner, plans: list[ForwardBatch], build_only: bool) -> StepPhases:
    phases = StepPhases()
    for plan in plans:
        t0 = time.perf_counter()
        pending = runner.build(plan)
        t1 = time.perf_counter()
        clock = runner.clock
        if not build_only:
            runner.start(pending)
        t2 = time.perf_counter()
        if not build_only:
            runner.finish(pending)
        t3 = time.perf_counter()
        phases.add(t1 - t0 - clock.start - clock.wait, clock.start + t2 - t1,
                   clock.wait + t3 - t2, t3 - t0)
        # Untimed: freeing a graph never evaluated (--build-only) takes time of its own.
        del pending
    return phases


def mlx_lm_prefill(model: Any, steps: tuple[tuple[Chunk, ...], ...], build_only: bool) -> PrefillRun:
    """The same chunks through mlx-lm's model call over its own caches (make_prompt_cache:
    each layer's kind; a cached prefix run through the model beforehand, untimed), each
    step's chunks built, then evaluated together."""

    def run() -> StepPhases:
        caches: dict[int, list[Any]] = {}
        phases = StepPhases()
        for step in steps:
            for c in step:
                if c.request not in caches:
                    caches[c.request] = _prefilled(model, c.start, build_only)
            t0 = time.perf_counter()
            logits = [model(mx.ones((1, c.size), dtype=mx.int32), cache=caches[c.request])[:, -1]
                      for c in step]
            tokens = [mx.argmax(x, axis=-1) for x in logits]
            t1 = time.perf_counter()
            if not build_only:
                mx.async_eval(tokens)
            t2 = time.perf_counter()
            if not build_only:
                [t.tolist() for t in tokens]
            phases.add(t1 - t0, t2 - t1, time.perf_counter() - t2, time.perf_counter() - t0)
            del logits, tokens  # untimed, as kiln's (_kiln_prefill_run)
        return phases

    return run


def _prefilled(model: Any, tokens: int, build_only: bool) -> list[Any]:
    """mlx-lm's caches for the model after `tokens` prefix tokens (with --build-only the
    prefix's graph is built, not evaluated)."""
    caches = make_prompt_cache(model)
    for start in range(0, tokens, 2048):
        model(mx.ones((1, min(2048, tokens - start)), dtype=mx.int32), cache=caches)
        if not build_only:
            mx.eval([c.state for c in caches])
    return caches


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def print_prefill_steps(variants: dict[str, Callable[[tuple], PrefillRun]], names: list[str],
                        runs: int, build_only: bool) -> None:
    """For each scenario, its variants' runs interleaved (A B A B ...: the host's speed
    drifts), then for each variant the graph build of its first run (cold shapes), of
    the second, and the median and least of the rest; with evaluation, the launch, wait
    and whole steps' medians over the rest."""
    print(f"\nprefill steps, ms a run of the scenario's steps (cold: the first run, then the "
          f"second; median and min over the rest){', graph build only' if build_only else ''}")
    print(f"{'scenario':<34}{'variant':<34}{'cold':>8}{'2nd':>9}{'build':>8}{'min':>8}"
          + ("" if build_only else f"{'launch':>10}{'wait':>10}{'step':>10}"))
    for name in names:
        label, steps = PREFILL_STEPS[name]
        made = {v: _attempt(f"{label:<34}{v:<34}", lambda: make(steps)) for v, make in variants.items()}
        results: dict[str, list[StepPhases]] = {v: [] for v, run in made.items() if run is not None}
        for _ in range(runs):
            for variant in list(results):
                _settle()
                try:
                    results[variant].append(made[variant]())
                except Exception as exc:  # noqa: BLE001 - reported, the others go on
                    print(f"{label:<34}{variant:<34}failed: {type(exc).__name__}: {exc}", flush=True)
                    del results[variant]
        for variant, phases in results.items():
            print(_prefill_line(f"{label:<34}{variant:<34}", phases, build_only), flush=True)
        del made, results
        gc.collect()
        mx.clear_cache()


def _settle() -> None:
    """Before a timed run, untimed: the garbage of the run before it collected, and the
    first allocation after its graphs were freed made (on the CPU machine, after a
    replayed graph that was never evaluated, that allocation took 1-3 ms, whichever
    variant ran next; cause not found)."""
    gc.collect()
    np.empty(4096)


def _prefill_line(label: str, runs: list[StepPhases], build_only: bool) -> str:
    rest = runs[2:] or runs[-1:]

    def median(key: str) -> float:
        return statistics.median(getattr(r, key) for r in rest) * 1e3

    line = (f"{label}{runs[0].build * 1e3:>8.1f} {runs[min(1, len(runs) - 1)].build * 1e3:>8.1f}"
            f"{median('build'):>8.2f}{min(r.build for r in rest) * 1e3:>8.2f}")
    if not build_only:
        line += f"{median('launch'):>10.2f}{median('wait'):>10.2f}{median('step'):>10.2f}"
    return line


def _patching(obj: Any, name: str, value: Any,
              make: Callable[[tuple], PrefillRun]) -> Callable[[tuple], PrefillRun]:
    """A prefill variant made, and each of its runs run, with obj.name patched to value."""
    def made(steps: tuple) -> PrefillRun:
        with patched(obj, name, value):
            run = make(steps)

        def patched_run() -> StepPhases:
            with patched(obj, name, value):
                return run()

        return patched_run

    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model directory (default: a narrow random llama)")
    p.add_argument("--layers", type=int, default=32, help="narrow llama's layer count")
    p.add_argument("--heads", default="16,4,32",
                   help="narrow llama's query heads, KV heads and head size (an 8B's: 32,8,128)")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill-batches", default="",
                   help="also time one prefill step of this many prompts (e.g. 1,16,64)")
    p.add_argument("--prompt", type=int, default=130, help="prompt length for --prefill-batches")
    p.add_argument("--prefill-steps", default="",
                   help=f"also time these prefill step scenarios, ','-joined, or 'all' "
                        f"({', '.join(PREFILL_STEPS)})")
    p.add_argument("--prefill-runs", type=int, default=6,
                   help="runs of each prefill scenario on one runner (the first meets its shapes cold)")
    p.add_argument("--prefill-variants", default="",
                   help="prefill-step variant names to time, joined by ';' (default: all)")
    p.add_argument("--build-only", action="store_true",
                   help="prefill steps: time the graph building alone, evaluate nothing")
    p.add_argument("--profile-batch", type=int, default=0,
                   help="then profile the builds of kiln's pipelined steps at this batch size "
                        "(cProfile, top functions by own time)")
    p.add_argument("--variants", default="",
                   help="variant names to time, joined by ';' (default: all)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant this many times, interleaved (A B A B ...), and "
                        "print medians over the rounds with the step's spread: the H200 "
                        "host's speed drifts +-25%% within minutes, so a single pass "
                        "compares variants run at different speeds")
    p.add_argument("--state-rows", type=int, default=0,
                   help="a hybrid's recurrent state rows (a server's --max-running-requests); "
                        "default the batch")
    p.add_argument("--pool-slots", type=int, default=0,
                   help="KV pool size in slots, e.g. a server's (its log's 'KV pool: N "
                        "slots'); default three times what the batch needs")
    args = p.parse_args()
    global POOL_SLOTS, STATE_ROWS
    POOL_SLOTS, STATE_ROWS = args.pool_slots, args.state_rows
    # As the worker serves (before any GPU work); for every variant, the mlx-lm loop too.
    # MLX's own budgets: set MLX_MAX_MB_PER_BUFFER / MLX_MAX_OPS_PER_BUFFER to its defaults.
    print("CUDA graph budgets:", raise_cuda_graph_budgets() or "not on CUDA")

    def load() -> Any:
        if args.model:
            import mlx_lm

            return mlx_lm.load(args.model)[0]
        mx.random.seed(0)
        q, kv, dim = (int(x) for x in args.heads.split(","))
        return narrow_llama(args.layers, (q, kv, dim))

    model = load()
    if uses_gated_delta(model) and install_gated_delta_kernel():  # as the worker serves it
        print("gated delta rule: kiln's CUDA kernel")
    if kernel_available() and replace_depthwise_convs(model):  # as the worker serves it
        print("short convolutions: shifted multiply-adds")  # (served_model rewrites its copies)
    # Further copies of the model, each made at its first use.
    @functools.cache
    def fused_model() -> Any:  # q/k/v and gate/up fused (the "fused" variants)
        copy = load()
        fuse_projections(copy)
        return copy

    @functools.cache
    def fast_model() -> Any:  # as served: fused, fast decode blocks ("fast blocks")
        return served_model(load())

    @functools.cache
    def unsummed_model() -> Any:  # as served, but adding 1 + weight every call
        return served_model(load(), summed_norms=False)

    this = sys.modules[__name__]
    served = choose_decode_backend(probe_attention_specs(model))
    # The kernel without its store-in-attention (the "no ... write" and "separate write"
    # variants); elsewhere the backend as served.
    separate_write = replace(served, write_in_attention=False) if served.compiles else served
    def no_attention(self, queries, scale, sinks=None):  # noqa: ANN001, ANN202
        # The step's K/V dropped too (the kernel would have stored them), so the
        # forward's check that every layer stored its K/V holds.
        self.take_unwritten()
        return queries
    no_write = lambda self, layer, slots, keys, values: None  # noqa: E731
    n, c = args.steps, args.context
    variants = {
        "kiln": lambda b: kiln_step_ms(model, b, c, n),
        "kiln, no attention": lambda b: _with(PooledKVCache, "paged_attention", no_attention,
                                              lambda: kiln_step_ms(model, b, c, n)),
        "kiln, no pool write": lambda b: _with(KVPool, "write", no_write, lambda: _with(
            this, "BACKEND", separate_write, lambda: kiln_step_ms(model, b, c, n))),
        "mlx-lm loop": lambda b: mlx_lm_step_ms(model, b, c, n),
        "kiln, pipelined": lambda b: kiln_step_ms(model, b, c, n, pipelined=True),
        "mlx-lm loop, pipelined": lambda b: mlx_lm_step_ms(model, b, c, n, pipelined=True),
        "kiln, fused, pipelined": lambda b: kiln_step_ms(fused_model(), b, c, n, pipelined=True),
    }
    if KVPool.state_bytes_per_request(probe_attention_specs(model)):  # a hybrid's recurrent layers
        no_state_write = lambda self, layer, index, rows, value: None  # noqa: E731

        def no_recurrence(q, k, v, g, beta, state=None, mask=None):  # noqa: ANN001, ANN202
            b, _, _, dk = q.shape
            hv, dv = v.shape[-2:]
            kept = mx.zeros((b, hv, dv, dk), dtype=mx.float32) if state is None else state
            return v.astype(q.dtype), kept

        variants["kiln, no state write"] = lambda b: _with(
            KVPool, "write_state", no_state_write, lambda: kiln_step_ms(model, b, c, n, pipelined=True))
        variants["kiln, no recurrence"] = lambda b: _with(
            gated_delta_module, "gated_delta_ops", no_recurrence,
            lambda: kiln_step_ms(model, b, c, n, pipelined=True))
    kernel_path = served.compiles  # the served decode path is the kernel's
    if kernel_path:  # compiled decode's only path
        def compiled(m: Any, b: int) -> Timings:  # as served there: compiled, pipelined
            return kiln_step_ms(m, b, c, n, pipelined=True, compile_decode=True)

        variants["kiln, compiled, pipelined"] = lambda b: compiled(model, b)
        variants["kiln, compiled, fused, pipelined"] = lambda b: compiled(fused_model(), b)
        variants["kiln, compiled, fused, fast blocks"] = lambda b: compiled(fast_model(), b)
        variants["kiln, compiled, served, 1 + weight every call"] = lambda b: compiled(
            unsummed_model(), b)
        variants["kiln, compiled, fast blocks, unfused MoE"] = lambda b: _with(
            this, "BACKEND", replace(served, moe_kernels=False), lambda: compiled(fast_model(), b))
        variants["kiln, compiled, fast blocks, rope in kernel"] = lambda b: _with(
            this, "BACKEND", replace(served, rope_in_kernel=True), lambda: compiled(fast_model(), b))
        variants["kiln, compiled, splits <= 256"] = lambda b: _with(
            paged_attention, "MAX_SPLIT_TOKENS", 256, lambda: compiled(model, b))
        variants["kiln, compiled, separate write"] = lambda b: _with(
            this, "BACKEND", separate_write, lambda: compiled(model, b))
    if args.variants:
        variants = _chosen(p, variants, args.variants)
    spread = args.rounds > 1
    print(f"{'batch':>6}  {'variant':<44}{'build ms':>10}{'launch ms':>11}{'wait ms':>9}{'step ms':>9}"
          + (f"{'step min-max':>15}" if spread else "") + f"{'pool MB':>9}{'peak+ MB':>10}")
    for b in (int(x) for x in args.batch_sizes.split(",") if x):
        rounds: dict[str, list[Timings]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, run in variants.items():
                timings = _attempt(f"{b:>6}  {name:<44}", lambda: run(b))
                if timings is not None:
                    rounds[name].append(timings)
        for name, runs in rounds.items():
            if not runs:
                continue
            medians = [t.medians_ms() for t in runs]
            build, launch, wait, step = (statistics.median(m[i] for m in medians) for i in range(4))
            steps = [m[3] for m in medians]
            extent = f"{min(steps):>8.2f}-{max(steps):<6.2f}" if spread else ""
            last = runs[-1]
            memory = f"{last.pool_mb:>9.0f}{max(t.over_mb for t in runs):>10.0f}" if last.pool_mb else ""
            print(f"{b:>6}  {name:<44}{build:>10.2f}{launch:>11.2f}{wait:>9.2f}{step:>9.2f}"
                  f"{extent}{memory}", flush=True)
    if args.profile_batch:
        profile = cProfile.Profile()
        kiln_step_ms(model, args.profile_batch, c, n, pipelined=True, compile_decode=kernel_path,
                     profile=profile)
        print(f"\nbuild of kiln's pipelined {'compiled ' if kernel_path else ''}steps at batch "
              f"{args.profile_batch}, {n} steps (cProfile; its overhead inflates Python-heavy "
              "entries):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    if args.prefill_batches:
        prefill_variants = {
            "kiln": lambda b, n: prefill_ms(model, b, n, kiln=True),
            "mlx-lm": lambda b, n: prefill_ms(model, b, n, kiln=False),
        }
        if kernel_path:  # served: fused projections and fast blocks
            prefill_variants.update({
                "kiln, served model": lambda b, n: prefill_ms(fast_model(), b, n, kiln=True),
                "kiln, served, forwards <= 8192": lambda b, n: _with(
                    runner_module, "PREFILL_FORWARD_TOKENS", 8192,
                    lambda: prefill_ms(fast_model(), b, n, kiln=True)),
                "kiln, served, fused attention": lambda b, n: _with(
                    decode_backend, "unfused_prefill_fits", lambda *_: False,
                    lambda: prefill_ms(fast_model(), b, n, kiln=True)),
                "kiln, served, no pool write": lambda b, n: _with(
                    KVPool, "write", no_write, lambda: prefill_ms(fast_model(), b, n, kiln=True)),
            })
        print(f"\nprefill, {args.prompt}-token prompts (+1 a batch size), ms: first (a shape not "
              "seen before) / best of 3")
        print(f"{'prompts':>8}  {'variant':<44}{'first':>9}{'best':>9}")
        for i, b in enumerate(int(x) for x in args.prefill_batches.split(",")):
            prompt = args.prompt + i  # a length no earlier row used
            for name, run in prefill_variants.items():
                label = f"{b:>8}  {name:<44}"
                times = _attempt(label, lambda: run(b, prompt))
                if times is not None:
                    print(f"{label}{times[0]:>9.1f}{times[1]:>9.1f}", flush=True)
    if args.prefill_steps:
        names = list(PREFILL_STEPS) if args.prefill_steps == "all" else args.prefill_steps.split(",")
        unknown = [n for n in names if n not in PREFILL_STEPS]
        if unknown:
            p.error(f"unknown prefill steps {unknown}; known: {list(PREFILL_STEPS)}")
        only = args.build_only

        def kiln(m: Callable[[], Any], **runner_args: Any) -> Callable[[tuple], PrefillRun]:
            return lambda steps: kiln_prefill(m(), steps, only, **runner_args)

        # As served, prefill forwards are built eagerly (--compile-prefill replays traces).
        step_variants: dict[str, Callable[[tuple], PrefillRun]] = {
            "kiln": kiln(lambda: model),
            "kiln, compiled prefill": kiln(lambda: model, compile_prefill=True),
            "mlx-lm": lambda steps: mlx_lm_prefill(model, steps, only),
        }
        if kernel_path:  # as served: fused projections and fast blocks
            step_variants["kiln, served model"] = kiln(fast_model)
            step_variants["kiln, served, compiled prefill"] = kiln(fast_model, compile_prefill=True)
            step_variants["kiln, served, fused attention"] = _patching(
                decode_backend, "unfused_prefill_fits", lambda *_: False, kiln(fast_model))
            step_variants["kiln, served, unfused attention"] = _patching(
                this, "BACKEND", replace(served, bucketed_prefill=False), kiln(fast_model))
            step_variants["kiln, served, unfused masked attention"] = _patching(
                this, "BACKEND", replace(served, bucketed_masked=False), kiln(fast_model))
            step_variants["kiln, served, unpaged prefill"] = _patching(  # --experiments unpaged-prefill
                this, "BACKEND", replace(served, paged_prefill=False), kiln(fast_model))
            step_variants["kiln, served, paged short rows"] = _patching(  # --experiments paged-short-rows
                this, "BACKEND", replace(served, paged_short_rows=True), kiln(fast_model))
            step_variants["kiln, served, paged prefill, any length"] = _patching(  # no cuDNN limit
                this, "BACKEND", replace(served, paged_short_rows=True, paged_prefill_max_queries=None),
                kiln(fast_model))
        else:  # CUDA's prefill attention (unfused), stood in for on this device
            for compiles in (False, True):
                step_variants["kiln, CUDA's prefill attention" + (", compiled" if compiles else "")] = (
                    _patching(this, "BACKEND", StandInKernel(),
                              kiln(lambda: model, compile_prefill=compiles)))
        if args.prefill_variants:
            step_variants = _chosen(p, step_variants, args.prefill_variants)
        print_prefill_steps(step_variants, names, args.prefill_runs, only)


def _chosen(p: argparse.ArgumentParser, variants: dict[str, Any], names: str) -> dict[str, Any]:
    """The variants named (';'-joined), in that order."""
    wanted = [v.strip() for v in names.split(";")]
    unknown = [v for v in wanted if v not in variants]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(variants)}")
    return {v: variants[v] for v in wanted}


def _attempt(label: str, run: Callable[[], Any]) -> Any:
    """run()'s result, or None after printing the label and its error: one failing
    variant (a kernel that does not compile) must not cost a device call the others.
    Then the runner it made is freed: its compiled step and pool sit in reference cycles,
    and two served-size pools do not fit beside the weights."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - any failure is reported the same way
        print(f"{label}failed: {type(exc).__name__}: {exc}", flush=True)
        return None
    finally:
        gc.collect()
        mx.clear_cache()


def _with(obj: Any, name: str, value: Any, run: Any) -> tuple[float, float]:
    with patched(obj, name, value):
        return run()


if __name__ == "__main__":
    main()

"""Random schedules over every architecture family, longer than CI can afford: a
differential soak, not a timing.

`tests/test_schedules.py` draws random schedules (shared prefixes, chunk edges inside and
across them, tight pools that preempt, arrivals while others decode, overlap, compiled
prefill, decode-first budgets) and checks every request's greedy tokens against mlx-lm's
for its prompt alone, for the tiny llama and five windowed, hybrid or MLA families, a
few seeds each. This runs the same schedules for every family of `tests/families.py` (the
attention families, the recurrent ones, the models served on their own caches), on each
of the worker's paths:

- plain: the device's own backend (on the CPU, the dense-context fallback Metal takes),
  the model as the worker loads it there (offset norms summed once, rows placed);
- kernel: the CUDA path with its kernels stood in for by their plain-MLX meaning
  (`tests.engine_driver.StandInKernel`): projections fused, fast decode blocks, decode
  replayed from compiled traces, a lone prompt chunk padded as CUDA pads it (to a
  multiple of 16 here; every path below but plain too);
- in place: the CUDA path's in-place pool (`StandInInPlaceKernels`), eager decode;
- paged prefill: the kernel path with `--experiments paged-short-rows` (prefill attention
  read from the pool, `worker_proc/paged_prefill.py`, stood in for, also for heads the
  stood-in cuDNN takes), on the family's model with heads of 64 (the kernel takes 64 to
  256) where its config takes a head size
  (the kernel's calls are counted: 0 where it never serves the family's layers);
- wide heads: the kernel path's defaults on the family's model with heads of 256, which
  the stood-in cuDNN does not take (Gemma's): every prefill attention, fresh prompts
  too, through the paged prefill kernel (stood in for; its calls counted);
- mixed forward: the kernel path with `--experiments mixed-forward` (a step's lone prompt
  chunk in its decode rows' forward, padded with scratch-slot rows where MLPs are dense),
  where every block can run it (ModelRunner.mixes_rows: llama, qwen3, qwen3_moe among the
  families; the forwards are counted, and elsewhere the runner keeps the two forwards
  apart, so this is the kernel path again);
- readback ring: the kernel path with the CUDA worker's readback ring (a step's tokens and
  logprobs read back through `worker_proc.readback.ReadbackRing`, its device copy stood in
  for by a host write);
- launch thread: the kernel path with the CUDA worker's launch thread (decode steps
  launched from a thread of their own while the next one is built; its ring's copy a lazy stand-in,
  tests.engine_driver.LazyStandInRing). The thread's stream is this process's default
  from its first such schedule on.

With `--eos`, every request stops at a token some of the schedule's mlx-lm outputs hold
(mlx-lm's tokens then end before it). With `--sampled`, requests draw seeded sampling
settings (temperature, top-p, top-k, min-p, penalties): a seeded request's tokens do not
depend on what it is batched with, so each is compared with the same request served
alone on the same path. With `--aborts`, a share of each schedule's requests is aborted
at a random step after it arrives (the rest of the seed's draws unchanged): the others
must still get their tokens, an aborted one a prefix of them. Every schedule must end
with the scheduler idle and every slot back; a request admission refuses (more than a
tight pool could ever hold) is counted apart, any other error fails.

A mismatch names the family, path and seed (`--families F --paths P --seeds S` replays
it) and the first token that differs. Exit status 1 on any mismatch or error.

    python bench/schedule_soak.py --seeds 0-9 --aborts 0.3 --eos --minutes 60
    python bench/schedule_soak.py --families gemma3_text,qwen3_next --paths kernel --seeds 7
    python bench/schedule_soak.py --families gpt_oss,qwen3_moe --experts-mxfp4 --seeds 0-99
    python bench/schedule_soak.py --families gpt_oss,qwen3_moe --paths kernel --bf16-expert-rows
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from tests.engine_driver import (Finished, InProcessEngine,  # noqa: E402
                                 StandInInPlaceKernels, StandInKernel)
from worker_proc.fused_moe import reference_route  # noqa: E402
from tests.families import FAMILIES, RECURRENT_FAMILIES, UNPAGED, VOCAB, build  # noqa: E402
from tests.test_families import mlx_lm_tokens  # noqa: E402
from tests.test_scheduler import assert_idle_invariant  # noqa: E402
from tests.test_schedules import Schedule, draw_schedule  # noqa: E402
from worker_proc.launcher import LaunchThread  # noqa: E402
from worker_proc.model_rewrites import rewrite_for_serving  # noqa: E402

PATHS = ("plain", "kernel", "in place", "paged prefill", "wide heads", "mixed forward",
         "readback ring", "launch thread")
# Heads of the paths that reach the paged prefill kernel: 64 with short rows sent there too
# (the stood-in cuDNN takes them), 256 as Gemma's (cuDNN does not: every prefill, fresh
# prompts too, through the kernel by default).
HEAD_DIMS = {"paged prefill": 64, "wide heads": 256}


@dataclass
class Outcome:
    family: str
    path: str
    seed: int
    problems: list[str]
    preempted: bool
    hit: bool
    seconds: float
    kernel_calls: int  # the paged prefill kernel's (stood in for), or the mixed forwards
    aborted: int  # requests aborted before they finished
    refused: int  # requests admission refused (more than the pool could ever hold)
    expert_rows: int = 0  # expert_rows calls (stood in for; a compiled path counts its traces)


@functools.cache
def _takes_head_dim(family: str, head_dim: int) -> bool:
    import mlx.core as mx

    try:
        model = build(family, as_served=False, head_dim=head_dim)
        mx.eval(model(mx.array([[5, 6]])))  # heads wider than the model: none (RWKV-7)
    except (ValueError, TypeError, AssertionError):  # its head size follows from others
        return False
    return True


def overrides(family: str, path: str) -> dict[str, Any]:
    """Config values the path changes: heads the paged prefill kernel takes, where the
    family's model builds with them."""
    head_dim = HEAD_DIMS.get(path)
    if head_dim and _takes_head_dim(family, head_dim):
        return {"head_dim": head_dim}
    return {}


class CountingStandIn(StandInKernel):
    """The stood-in kernel path, counting the paged prefill kernel's calls."""

    calls = 0

    def _paged_prefill(self, *args):  # noqa: ANN002, ANN202
        CountingStandIn.calls += 1
        return super()._paged_prefill(*args)


class SortingStandIn(StandInKernel):
    """The stood-in kernel path routing as the CUDA kernel does: pairs sorted by expert at
    any count (mlx-lm sorts from 64), so steps of as many pairs as experts reach
    expert_rows (stood in for; its calls counted). Rows are computed one by one either
    way: mlx-lm's tokens."""

    rows_calls = 0

    def _route_experts(self, logits, routing, bias):  # noqa: ANN001, ANN202
        return reference_route(logits, routing, bias, sort=True)

    def _expert_rows(self, *args):  # noqa: ANN002, ANN202
        SortingStandIn.rows_calls += 1
        return super()._expert_rows(*args)


def quantize_experts(model: Any) -> Any:
    """The model's mixture-of-experts projections (mlx-lm's SwitchLinear) as GPT-OSS ships
    them: MXFP4, groups of 32 (what the CUDA worker's expert_rows kernel takes)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    return model


def served_model(family: str, path: str, experts_mxfp4: bool = False) -> Any:
    """The family's tiny model as the worker would load it for this path."""
    # Rows placed at their own positions (give_rows_their_positions).
    model = build(family, **overrides(family, path))
    if experts_mxfp4:
        quantize_experts(model)
    kernel = path != "plain"  # the CUDA defaults: fused projections, fast decode blocks
    rewrite_for_serving(model, on_cuda=False, fuse=kernel, fast_blocks=kernel, pad_experts=False)
    return model


# The CUDA path pads a lone prompt chunk to a multiple of runner.TAIL_MULTIPLE (256): here
# of a size the schedules' short chunks cross.
SOAK_TAIL_MULTIPLE = 16


def engine_options(path: str, own_caches: bool, sort_routes: bool = False,
                   dense_rows: bool = False) -> dict[str, Any]:
    if own_caches:
        return {"own_caches": True}
    cuda = {"pad_tails": SOAK_TAIL_MULTIPLE}
    if path == "kernel":
        sorting = sort_routes or dense_rows
        return {"backend": SortingStandIn(dense_expert_rows=dense_rows) if sorting
                else StandInKernel(), "compile_decode": True, **cuda}
    if path == "in place":
        return {"backend": StandInInPlaceKernels(), **cuda}
    if path == "paged prefill":
        return {"backend": CountingStandIn(paged_short_rows=True), "compile_decode": True, **cuda}
    if path == "wide heads":
        return {"backend": CountingStandIn(), "compile_decode": True, **cuda}
    if path == "mixed forward":
        return {"backend": StandInKernel(mixed_forward=True), "compile_decode": True, **cuda}
    if path == "readback ring":
        return {"backend": StandInKernel(), "compile_decode": True, "readback": True, **cuda}
    if path == "launch thread":
        return {"backend": StandInKernel(), "compile_decode": True, "launcher": _launcher(),
                **cuda}
    return {}


@functools.cache
def _launcher() -> LaunchThread:
    """The process's launch thread, its stream everyone's default from now on."""
    thread = LaunchThread()
    mx.set_default_stream(thread.stream)
    return thread


def draw_aborts(seed: int, schedule: Schedule, share: float) -> dict[int, int]:
    """Request index -> the engine step at which it is aborted (from its arrival on)."""
    rng = random.Random(seed * 7919 + 1)
    return {i: arrival + rng.randrange(0, 24) for i, arrival in enumerate(schedule.arrivals)
            if rng.random() < share}


def run(model: Any, schedule: Schedule, aborts: dict[int, int], eos: list[int],
        sampling: list[dict[str, Any]] | None = None,
        only: int | None = None) -> tuple[InProcessEngine, dict[str, Finished]]:
    """run_schedule's loop, every request stopping at `eos`, request i aborted at step
    aborts[i] (if not finished by then) and sampled with sampling[i] (None: greedy);
    only: that request alone, nothing else submitted."""
    engine = InProcessEngine(model, max_context=2048, **schedule.engine)
    engine.aborted = 0  # requests aborted before they finished
    events = sorted([(a, 0, i) for i, a in enumerate(schedule.arrivals)]
                    + [(step, 1, i) for i, step in aborts.items()])
    step = 0
    for at, kind, i in events:
        while step < at:
            engine.step()
            step += 1
        if only is not None and i != only:
            continue
        if kind == 0:
            engine.submit(f"r{i}", schedule.prompts[i], schedule.max_tokens[i], eos,
                          **(sampling[i] if sampling else {}))
        elif engine.results[f"r{i}"].finish_reason is None:
            engine.abort(f"r{i}")
            engine.aborted += 1
    return engine, engine.run_until_idle()


def draw_sampling(seed: int, n: int) -> list[dict[str, Any]]:
    """Each request's seeded sampling settings: temperatures, top-p / top-k / min-p
    filters and penalties, one draw a request."""
    rng = random.Random(seed * 104729 + 3)
    choices = [{"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9},
               {"temperature": 0.7, "top_k": 20}, {"temperature": 1.2, "min_p": 0.05},
               {"temperature": 0.9, "repetition_penalty": 1.3},
               {"temperature": 0.9, "frequency_penalty": 0.5, "presence_penalty": 0.3},
               {"temperature": 0.0}]
    return [{**rng.choice(choices), "seed": rng.randrange(1 << 31)} for _ in range(n)]


def common_token(wants: list[list[int]]) -> list[int]:
    """A stop token some of the requests meet: the commonest after each one's first."""
    counts = Counter(t for want in wants for t in want[1:])
    return [counts.most_common(1)[0][0]] if counts else []


def stopped(tokens: list[int], eos: list[int]) -> list[int]:
    """mlx_lm.generate's tokens with a stop token: up to it, without it."""
    at = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:at]


def soak_one(family: str, path: str, seed: int, oracles: dict, memo: dict,
             abort_share: float = 0.0, with_eos: bool = False,
             sampled: bool = False, experts_mxfp4: bool = False,
             dense_rows: bool = False) -> Outcome:
    t0 = time.monotonic()
    own_caches = family in UNPAGED
    model = served_model(family, path, experts_mxfp4)
    schedule: Schedule = draw_schedule(seed, VOCAB)
    options = engine_options(path, own_caches, sort_routes=experts_mxfp4, dense_rows=dense_rows)
    if own_caches:  # no prefill traces, no kernel path on mlx-lm's own caches
        schedule.engine["compile_prefill"] = False
    if path == "in place":  # in-place stand-ins write Python objects: no traces
        schedule.engine["compile_prefill"] = False
    schedule.engine.update(options)
    problems: list[str] = []
    changed = overrides(family, path)
    if str(changed) not in oracles:  # mlx-lm as mlx_lm.generate runs it
        oracle = build(family, as_served=False, **changed)
        oracles[str(changed)] = quantize_experts(oracle) if experts_mxfp4 else oracle
    oracle = oracles[str(changed)]
    wants = []
    for prompt, n in zip(schedule.prompts, schedule.max_tokens):
        key = (str(changed), tuple(prompt), n)
        if key not in memo:
            memo[key] = mlx_lm_tokens(oracle, prompt, n)
        wants.append(memo[key])
    eos = common_token(wants) if with_eos else []
    CountingStandIn.calls = 0
    SortingStandIn.rows_calls = 0
    aborts = draw_aborts(seed, schedule, abort_share) if abort_share else {}
    sampling = draw_sampling(seed, len(schedule.prompts)) if sampled else None
    engine, outputs = run(model, schedule, aborts, eos, sampling)
    if sampling:  # seeded draws promise each request its tokens alone on this path
        wants = []
        for i in range(len(schedule.prompts)):
            _, alone = run(model, schedule, {}, eos, sampling, only=i)
            wants.append(alone[f"r{i}"].token_ids)
    refused = 0
    for i, (prompt, n) in enumerate(zip(schedule.prompts, schedule.max_tokens)):
        result = outputs[f"r{i}"]
        if result.error and "the server has only" in result.error:
            refused += 1  # admission's clear refusal: a tight pool can never hold it
            continue
        if result.error:
            problems.append(f"r{i}: {result.error}")
            continue
        got, want = result.token_ids, (wants[i] if sampling else stopped(wants[i], eos))
        if i in aborts and got == want[:len(got)]:
            continue  # aborted: what it got before the abort is mlx-lm's
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                      min(len(got), len(want)))
            problems.append(f"r{i} (prompt {len(prompt)}, {n} tokens): first difference at "
                            f"token {at}: {got[at:at + 4]} != {want[at:at + 4]}")
    try:
        assert_idle_invariant(engine.scheduler)
    except AssertionError as exc:
        problems.append(f"idle invariant: {exc}")
    return Outcome(family, path, seed, problems, engine.scheduler.counters.preemptions > 0,
                   engine.scheduler.counters.cache_hit_tokens > 0, time.monotonic() - t0,
                   engine.runner.mixed_forwards if path == "mixed forward"
                   else CountingStandIn.calls, engine.aborted, refused, SortingStandIn.rows_calls)


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    everything = [*FAMILIES, *RECURRENT_FAMILIES, *UNPAGED]
    p.add_argument("--families", default="", help=f"','-joined (default: all {len(everything)})")
    p.add_argument("--paths", default=",".join(PATHS), help=f"','-joined: {', '.join(PATHS)}")
    p.add_argument("--seeds", default="1000-1002", help="e.g. 0-9 or 3,7")
    p.add_argument("--aborts", type=float, default=0.0, metavar="SHARE",
                   help="abort this share of each schedule's requests at random steps")
    p.add_argument("--eos", action="store_true",
                   help="every request stops at a token some of the schedule's outputs hold")
    p.add_argument("--sampled", action="store_true",
                   help="seeded sampling (temperatures, filters, penalties): each request's "
                        "tokens against the same request served alone on the same path")
    p.add_argument("--experts-mxfp4", action="store_true",
                   help="the mixture-of-experts families' experts quantized to MXFP4 (served "
                        "and oracle); the kernel path routes as the CUDA kernel does (pairs "
                        "always sorted), so its 4-bit experts reach expert_rows (stood in for)")
    p.add_argument("--bf16-expert-rows", action="store_true",
                   help="the kernel path as --experiments bf16-expert-rows serves: unquantized "
                        "experts' projections of sorted steps through expert_rows (stood in "
                        "for; the float32 experts standing for bf16 ones), pairs always sorted")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop starting new schedules after this long (0: no limit)")
    args = p.parse_args()
    families = args.families.split(",") if args.families else everything
    unknown = set(families) - set(everything)
    if unknown:
        p.error(f"unknown families: {', '.join(sorted(unknown))}")
    paths = [x.strip() for x in args.paths.split(",")]
    if set(paths) - set(PATHS):
        p.error(f"paths are {', '.join(PATHS)}")
    seeds = parse_seeds(args.seeds)
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else float("inf")
    failed, runs, preempted, hits = 0, 0, 0, 0
    for seed in seeds:  # seeds outermost: a time limit still sees every family
        for family in families:
            oracles: dict = {}
            memo: dict = {}
            for path in (["plain"] if family in UNPAGED else paths):
                if time.monotonic() > deadline:
                    break
                runs += 1
                try:
                    out = soak_one(family, path, seed, oracles, memo, args.aborts, args.eos,
                                   args.sampled, args.experts_mxfp4, args.bf16_expert_rows)
                except Exception:  # noqa: BLE001 - a soak reports every failure and goes on
                    failed += 1
                    print(f"ERROR {family} [{path}] seed {seed}\n{traceback.format_exc()}", flush=True)
                    continue
                preempted += out.preempted
                hits += out.hit
                status = "MISMATCH" if out.problems else "ok"
                print(f"{status:8s} {family:22s} [{path}] seed {seed} ({out.seconds:.1f} s"
                      f"{', preempted' if out.preempted else ''}{', prefix hits' if out.hit else ''}"
                      f"{f', {out.kernel_calls} paged prefill calls' if path in HEAD_DIMS else ''}"
                      f"{f', {out.kernel_calls} mixed forwards' if path == 'mixed forward' else ''}"
                      f"{f', {out.aborted} aborted' if out.aborted else ''}"
                      f"{f', {out.refused} refused' if out.refused else ''}"
                      f"{f', {out.expert_rows} expert_rows calls' if out.expert_rows else ''})",
                      flush=True)
                for problem in out.problems:
                    print(f"         {problem}", flush=True)
                failed += bool(out.problems)
    print(f"{runs} schedules, {failed} failed; {preempted} preempted, {hits} with prefix hits")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

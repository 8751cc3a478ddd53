"""Where a served decode step's device time goes: CUPTI's record of every kernel.

    python bench/device_timeline.py --model DIR --batch-sizes 1,64,128
    python bench/device_timeline.py --check    # anywhere: the report on made-up records

On MLX's CUDA backend, with cupti-python (and libcupti) importable. The lent H200 has no
registry: download the wheels here (next to MLX's, see ../shared/gpu/README.md), carry
them in a call of their own right after the install call, and install them:

    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_25_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        --no-deps -d .dev/gpu_c cupti-python==13.0.1 nvidia-cuda-cupti==13.0.85 \
        cuda-bindings cuda-pathfinder pyelftools
    # (newer cupti-python, 13.4, imports pyelftools; leaving it out failed a whole call)
    # on the device, into a folder of their own (into ~/site, nvidia-cuda-cupti's
    # nvidia/cu13 replaces the one holding the CUDA headers MLX compiles kernels with):
    #   python3 -m pip install -q --no-index --no-deps --target ~/site_c .dev/gpu_c/*.whl
    #   export PYTHONPATH=$PYTHONPATH:~/site_c LD_LIBRARY_PATH=~/site_c/nvidia/cu13/lib

For each batch size it
runs the served model (fused projections, fast decode blocks, compiled, pipelined as the
worker's start-ahead loop: bench/step_breakdown.kiln_step_ms), lets the warm-up steps
pass, then records every kernel the device runs over the measured steps (CUPTI's
concurrent-kernel activity, which includes the kernels of CUDA graphs). It prints, per
step: the device's span, the time some kernel ran (busy) and the idle gaps between
kernels by size (short gaps are a graph's launch latency; long ones, the device waiting
for the host to submit work), then the kernels by kind and the costliest by name.

The host-side figures beside it (step ms from the same loop) say whether the step is
host- or device-bound; this says what the device's share is made of.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Kernel kinds by name, first match wins (cuBLAS's GEMMs carry their tile shapes in the
# name; MLX's own kernels their op's name; kiln's custom ones a kiln_ prefix).
KINDS = (
    ("attention (kiln)", re.compile(r"kiln_paged")),
    ("attention (cuDNN, MLX sdpa)", re.compile(r"cudnn|sdpa|fmha|flash", re.I)),
    ("gemm (cuBLAS)", re.compile(r"gemm|gemv|cutlass|xmma|cublas|nvjet|sm\d\d_", re.I)),
    ("rms_norm", re.compile(r"rms", re.I)),
    ("rope", re.compile(r"rope", re.I)),
    ("copy", re.compile(r"copy", re.I)),
    ("reduce / argmax", re.compile(r"reduce|arg_?max|arg_?reduce", re.I)),
    ("gather / scatter", re.compile(r"gather|scatter|take|index", re.I)),
)
GAP_BINS_US = (2.0, 10.0, 50.0)  # idle gaps: <2 us, 2-10, 10-50, >=50


@dataclass
class KernelRecord:
    start_ns: int
    end_ns: int
    name: str


@dataclass
class TimelineReport:
    batch: int
    steps: int
    kernels_per_step: float
    span_ms: float  # first kernel's start to last kernel's end, a step
    busy_ms: float  # some kernel running, a step
    gaps_us: dict[str, float] = field(default_factory=dict)  # idle time a step, by gap size
    gap_counts: dict[str, float] = field(default_factory=dict)  # gaps a step, by size
    kinds: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind: (count, us) a step
    top: list[tuple[str, float, float]] = field(default_factory=list)  # name, count, us a step
    # Kernels that ran once a step (the step's own work, not a layer's: embedding, masks,
    # sampling), costliest first: where a step's first reads of host-written inputs show.
    once: list[tuple[str, float]] = field(default_factory=list)  # name, us a step


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other (elementwise, compiled)"


def _gap_bin(gap_us: float) -> str:
    low = 0.0
    for high in GAP_BINS_US:
        if gap_us < high:
            return f"{low:g}-{high:g} us"
        low = high
    return f">={low:g} us"


def analyse(records: list[KernelRecord], batch: int, steps: int, top: int = 10) -> TimelineReport:
    """Per-step figures from the kernels of `steps` steps. Kernels that overlap (several
    streams) count once in busy time; gaps are the times no kernel ran."""
    records = sorted(records, key=lambda r: r.start_ns)
    span = records[-1].end_ns - records[0].start_ns
    busy, gaps = 0, defaultdict(float)
    gap_counts: dict[str, int] = defaultdict(int)
    covered_to = records[0].start_ns
    for r in records:
        if r.start_ns > covered_to:
            gap_us = (r.start_ns - covered_to) / 1e3
            size = _gap_bin(gap_us)
            gaps[size] += gap_us
            gap_counts[size] += 1
        busy += max(0, r.end_ns - max(r.start_ns, covered_to))
        covered_to = max(covered_to, r.end_ns)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        us = (r.end_ns - r.start_ns) / 1e3
        for table, key in ((kinds, kind_of(r.name)), (names, r.name)):
            table[key][0] += 1
            table[key][1] += us
    order = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    once = sorted(((name, us / steps) for name, (n, us) in names.items() if n == steps),
                  key=lambda kv: -kv[1])[:top]
    return TimelineReport(
        batch=batch, steps=steps, kernels_per_step=len(records) / steps,
        span_ms=span / 1e6 / steps, busy_ms=busy / 1e6 / steps,
        gaps_us={k: v / steps for k, v in sorted(gaps.items())},
        gap_counts={k: v / steps for k, v in sorted(gap_counts.items())},
        kinds={k: (n / steps, us / steps) for k, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
        top=[(name, n / steps, us / steps) for name, (n, us) in order], once=once)


def readable(names: list[str]) -> list[str]:
    """C++ kernel names demangled by c++filt where the machine has it (as they are if not)."""
    import shutil
    import subprocess

    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    return lines if out.returncode == 0 and len(lines) == len(names) else names


def print_report(r: TimelineReport, host_step_ms: float | None = None,
                 host: Any = None) -> None:
    """host: the loop's bench.step_breakdown.Timings, for its phases' medians."""
    if host is not None:
        build, launch, wait, _ = (statistics.median(x[-r.steps:]) * 1e3
                                  for x in (host.build, host.launch, host.wait, host.step))
        phases = f" (build {build:.2f}, launch {launch:.2f}, wait {wait:.2f})"
    else:
        phases = ""
    host = (f"; host loop's step {host_step_ms:.2f} ms{phases}"
            if host_step_ms is not None else "")
    print(f"\nbatch {r.batch}: {r.steps} steps traced{host}\n"
          f"  device span {r.span_ms:.2f} ms a step, busy {r.busy_ms:.2f} ms "
          f"({100 * r.busy_ms / r.span_ms:.0f}%), {r.kernels_per_step:.0f} kernels a step")
    print("  idle gaps a step: " + ", ".join(
        f"{k}: {r.gap_counts[k]:.1f} gaps, {v:.0f} us" for k, v in r.gaps_us.items()))
    print(f"  {'kind':<32}{'kernels':>9}{'us a step':>11}{'us each':>9}")
    for kind, (n, us) in r.kinds.items():
        print(f"  {kind:<32}{n:>9.1f}{us:>11.0f}{us / n:>9.1f}")
    print(f"  {'costliest kernels':<72}{'a step':>7}{'us':>8}")
    for (_, n, us), name in zip(r.top, readable([name for name, _, _ in r.top])):
        print(f"  {name[:70]:<72}{n:>7.1f}{us:>8.0f}")
    if r.once:
        heading = "once a step (the step's own kernels)"
        print(f"  {heading:<79}{'us':>8}")
        for (_, us), name in zip(r.once, readable([name for name, _ in r.once])):
            print(f"  {name[:70]:<79}{us:>8.1f}")


class KernelTrace:
    """CUPTI's concurrent-kernel activity, collected into KernelRecords. On from the start
    (before MLX makes its first CUDA graph: kernels of graphs instantiated before tracing
    was on may go unrecorded); `restart` drops what came before a measurement."""

    def __init__(self) -> None:
        from cupti import cupti  # cupti-python; needs libcupti (nvidia-cuda-cupti)

        self._cupti = cupti
        self.records: list[KernelRecord] = []
        kernel = cupti.ActivityKind.CONCURRENT_KERNEL

        def requested() -> tuple[int, int]:
            return 8 * 1024 * 1024, 0  # buffer bytes; 0: as many records as fit

        def completed(activities: list) -> None:
            for a in activities:
                if a.kind == kernel:
                    self.records.append(KernelRecord(a.start, a.end, a.name))

        cupti.activity_register_callbacks(requested, completed)
        cupti.activity_enable(kernel)

    def restart(self) -> None:
        """Forget every kernel so far (call with the device idle)."""
        self._cupti.activity_flush_all(1)
        self.records.clear()

    def take(self) -> list[KernelRecord]:
        """Every kernel since the last restart (call with the device idle)."""
        self._cupti.activity_flush_all(1)
        return list(self.records)


def _made_up_records() -> list[KernelRecord]:
    """Two steps of three kernels with known gaps, for --check."""
    out, t = [], 0
    for _ in range(2):
        for name, dur, gap in (("sm90_xmma_gemm_bf16", 30_000, 1_000),
                               ("kiln_paged_write_decode_direct", 10_000, 5_000),
                               ("rms_norm_kernel", 2_000, 60_000)):
            out.append(KernelRecord(t, t + dur, name))
            t += dur + gap
    return out


def _check() -> None:
    r = analyse(_made_up_records(), batch=1, steps=2)
    # Busy 42 us a step; gaps 1 + 5 us a step, and one 60 us gap between the two steps.
    assert round(r.busy_ms * 1e3) == 42 and r.kernels_per_step == 3
    assert r.gaps_us == {"0-2 us": 1.0, "2-10 us": 5.0, ">=50 us": 30.0}, r.gaps_us
    assert r.kinds["gemm (cuBLAS)"] == (1.0, 30.0) and r.kinds["attention (kiln)"] == (1.0, 10.0)
    assert [name for name, _ in r.once] == ["sm90_xmma_gemm_bf16", "kiln_paged_write_decode_direct",
                                            "rms_norm_kernel"] and r.once[0][1] == 30.0
    print_report(r)
    print("\ncheck: ok")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model directory (the 8B-shaped bench model)")
    p.add_argument("--batch-sizes", default="1,64,128")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--warmup", type=int, default=12, help="steps before tracing starts")
    p.add_argument("--steps", type=int, default=16, help="steps traced")
    p.add_argument("--chunks", default="0", help="comma-separated prefill chunk sizes: "
                   "each step also prefills that many tokens of --prompt-token prompts "
                   "(a burst's prompts beside the decode rows; 0: decode only)")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--spread", type=int, default=1, help="with --chunks: pieces of this "
                   "many chunks, each run a share of the blocks a step over this many steps "
                   "(the served decode-first spread, --prefill-spread; 1: whole)")
    p.add_argument("--experiments", default="", help="the decode backend's --experiments "
                   "names (e.g. mixed-forward: each step's chunk rides in the decode forward)")
    p.add_argument("--prefill-bucket", type=int, default=0, help="the backend's prefill "
                   "bucket (0: its default; a served decode-first budget under 512 sets it)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", default="", help="also write the reports here")
    p.add_argument("--check", action="store_true", help="only check the report's arithmetic")
    args = p.parse_args()
    if args.check:
        _check()
        return

    import mlx.core as mx
    import mlx_lm

    import bench.step_breakdown as step_breakdown
    from bench.step_breakdown import kiln_step_ms, served_model
    from worker_proc.decode_backend import choose_decode_backend
    from worker_proc.memory import probe_attention_specs
    from worker_proc.memory import raise_cuda_graph_budgets
    from worker_proc.paged_attention import kernel_available

    if not kernel_available():
        sys.exit("needs MLX's CUDA backend (the served decode path)")
    print("CUDA graph budgets:", raise_cuda_graph_budgets())
    trace = KernelTrace()
    model = served_model(mlx_lm.load(args.model)[0])
    if args.experiments or args.prefill_bucket:
        step_breakdown.BACKEND = choose_decode_backend(
            probe_attention_specs(model),
            frozenset(n for n in args.experiments.split(",") if n),
            **({"prefill_bucket": args.prefill_bucket} if args.prefill_bucket else {}))
        print("decode backend:", step_breakdown.BACKEND)
    reports: list[dict[str, Any]] = []
    runs = [(int(b), int(c)) for b in args.batch_sizes.split(",") for c in args.chunks.split(",")]
    for batch, chunk in runs:
        def before_step(step: int) -> None:
            if step == args.warmup + 1:
                mx.synchronize()  # the warm-up's kernels stay out of the record
                trace.restart()

        timings = kiln_step_ms(model, batch, args.context, args.warmup + args.steps,
                               pipelined=True, compile_decode=True, before_step=before_step,
                               chunk=chunk, prompt=args.prompt, spread=args.spread)
        mx.synchronize()
        records = trace.take()
        if not records:
            print(f"\nbatch {batch}, chunk {chunk}: CUPTI recorded no kernels")
            continue
        host_ms = statistics.median(timings.step[args.warmup:]) * 1e3
        report = analyse(records, batch, args.steps, args.top)
        if chunk:
            print(f"\nprefilling {chunk} tokens a step beside the decode rows"
                  + (f" (pieces of {chunk * args.spread} over {args.spread} steps)"
                     if args.spread > 1 else ""))
        print_report(report, host_ms, timings)
        reports.append({**asdict(report), "chunk": chunk, "spread": args.spread,
                        "host_step_ms": host_ms})
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()

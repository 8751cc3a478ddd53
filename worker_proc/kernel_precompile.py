"""MLX's quantized GEMM modules for a model's layers, compiled side by side before the
warm-up needs them.

On CUDA, MLX compiles its tiled quantized GEMMs with NVRTC the first time a process calls
them: one module per activation dtype, format and tile of rows, 25-72 s each on one CPU
core, one after another in the warm-up (a quantized GPT-OSS's first start spent 7
minutes or more in them: docs/benchmarks.md, session 46). The modules land in MLX's
kernel cache (worker_proc.kernel_cache), where a later process reads them back. So the
worker first runs each of its quantized layer shapes at each tile of rows in a process of
its own, many at once, and lets the warm-up find the cache full. Nothing here predicts
MLX's module names (they change between MLX versions): each process makes the MLX call
the served layer makes (quantized_matmul on a step's rows as one matrix, or gather_qmm
on rows sorted by expert), at the layer's shape, and MLX picks its kernel as it would
mid-serving. A shape whose compile fails costs nothing but its time: the warm-up
compiles what is missing as before.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Rows a call gets: the tiles MLX 0.32.4 compiled modules for (m16, m32, m64 in their
# names, session 46); a single row took a matrix-vector kernel built into MLX. Other row
# counts meet one of these tiles or a built-in kernel.
ROW_TILES = (16, 32, 64)
# Experts a case builds: MLX's module names carry no expert count (session 46's
# gather_qmm_rhs_sm80_..._m64_b4_g32_mxfp4), so a few stand in for the model's.
CASE_EXPERTS = 4
# The cases' deadline, all of them: several waves of the longest measured compile (72 s)
# on a host of fewer cores than cases; what is left at it falls to the warm-up.
CASE_TIMEOUT_S = 600.0


@dataclass(frozen=True, order=True)
class QuantizedCase:
    """One quantized layer shape at one tile of rows: what one process calls."""

    inputs: int
    outputs: int
    bits: int
    group_size: int
    mode: str
    biases: bool
    dtype: str  # the activations', e.g. "bfloat16"
    experts: int  # 0: a Linear layer; else a mixture's experts (rows sorted by expert)
    rows: int

    def describe(self) -> str:
        what = f"{self.experts} experts" if self.experts else "linear"
        return (f"{what} {self.inputs}x{self.outputs} {self.mode} {self.bits}-bit/"
                f"{self.group_size} {self.dtype}, {self.rows} rows")


def quantized_cases(model: Any) -> list[QuantizedCase]:
    """Every quantized Linear and expert layer shape of the model, at each tile of rows,
    once each (as served: after the worker's rewrites, fused projections included)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from worker_proc.attention import model_dtype

    dtype = str(model_dtype(model)).removeprefix("mlx.core.")  # the activations'
    cases: set[QuantizedCase] = set()
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            experts = 0
        elif isinstance(module, QuantizedSwitchLinear):
            experts = min(module["weight"].shape[0], CASE_EXPERTS)
        else:
            continue
        outputs = module["weight"].shape[-2]
        inputs = module["scales"].shape[-1] * module.group_size
        biases = module.get("biases") is not None
        for rows in ROW_TILES:
            cases.add(QuantizedCase(inputs, outputs, module.bits, module.group_size,
                                    module.mode, biases, dtype, experts, rows))
    return sorted(cases)


def run_case(case: QuantizedCase) -> float:
    """In a process of its own: the layer's quantized matmul at the case's rows, as the
    served layer calls it, evaluated (MLX compiles the kernels it picks, or reads them
    from its cache). Zero weights, quantized here: no random draw of a large layer's
    floats. Seconds it took."""
    import mlx.core as mx

    t0 = time.monotonic()
    dtype = getattr(mx, case.dtype)
    shape = ((case.experts,) if case.experts else ()) + (case.outputs, case.inputs)
    weight, scales, *biases = mx.quantize(mx.zeros(shape, dtype=dtype),
                                          group_size=case.group_size, bits=case.bits,
                                          mode=case.mode)
    if bool(biases) != case.biases:
        raise ValueError(f"{case.describe()}: the format's biases are not the model's")
    bias = biases[0] if biases else None
    options = dict(transpose=True, group_size=case.group_size, bits=case.bits, mode=case.mode)
    if case.experts:
        # mlx-lm's SwitchGLU past its sorting threshold: one row a (token, expert) pair,
        # the pairs sorted by expert (QuantizedSwitchLinear's call).
        x = mx.zeros((case.rows, 1, case.inputs), dtype=dtype)
        indices = mx.sort(mx.arange(case.rows, dtype=mx.uint32) % case.experts)
        out = mx.gather_qmm(x, weight, scales, bias, rhs_indices=indices,
                            sorted_indices=True, **options)
    else:  # a step's rows as one matrix (quantized_rows.RowsQuantizedLinear's call)
        out = mx.quantized_matmul(mx.zeros((case.rows, case.inputs), dtype=dtype), weight,
                                  scales=scales, biases=bias, **options)
    mx.eval(out)
    return time.monotonic() - t0


def marker_name(cases: list[QuantizedCase], mlx_version: str) -> str:
    """The cache directory's file that says these cases were compiled there."""
    digest = hashlib.sha256(repr((mlx_version, [astuple(c) for c in cases])).encode())
    return f"kiln-precompiled-{digest.hexdigest()[:16]}"


@dataclass
class PrecompileResult:
    """What precompile did: its cases, those that failed (described), how long it took."""

    cases: int
    failed: list[str]
    seconds: float
    skipped: bool  # the marker said every case was compiled before


def precompile(cases: list[QuantizedCase], cache_dir: Path, mlx_version: str,
               workers: int, run: Callable[[QuantizedCase], float] = run_case,
               timeout_s: float = CASE_TIMEOUT_S,
               starting: Callable[[int], None] = lambda processes: None) -> PrecompileResult:
    """Runs every case in `workers` processes at once (spawned: a fresh MLX each), unless
    cache_dir holds the marker of this case list (`starting` is told how many processes
    run, when they do); writes the marker when all succeeded.
    A case that fails, or is not done timeout_s after the first began, is reported, never
    raised (its process is stopped): the warm-up compiles what it left."""
    marker = cache_dir / marker_name(cases, mlx_version)
    if not cases or marker.exists():
        return PrecompileResult(len(cases), [], 0.0, skipped=bool(cases))
    t0 = time.monotonic()
    failed: list[str] = []
    processes = max(1, min(workers, len(cases)))
    starting(processes)
    with multiprocessing.get_context("spawn").Pool(processes=processes) as pool:
        pending = [(case, pool.apply_async(run, (case,))) for case in cases]
        deadline = time.monotonic() + timeout_s
        for case, result in pending:
            try:
                result.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - any failure leaves the case to the warm-up
                failed.append(f"{case.describe()}: {type(exc).__name__}: {exc}"[:300])
        # Leaving the block terminates the processes, one still compiling among them.
    if not failed:
        try:
            marker.write_text("\n".join(c.describe() for c in cases) + "\n")
        except OSError as exc:  # an unwritable cache: the next start runs them again (fast)
            logger.warning("cannot mark the precompiled kernels in %s: %s", cache_dir, exc)
    return PrecompileResult(len(cases), failed, time.monotonic() - t0, skipped=False)


def default_workers() -> int:
    """Processes at once: one a CPU core (each compile is single-threaded), at most 16
    (each holds a CUDA context, a few hundred MB of GPU memory)."""
    return max(1, min(16, os.cpu_count() or 1))


def compile_quantized_kernels(model: Any, cache_dir: Path, say: Callable[[str], None],
                              workers: int = 0) -> PrecompileResult | None:
    """The worker's step: the model's quantized cases compiled into cache_dir, side by
    side, unless done there before (None: nothing ran). Reports through `say`."""
    import mlx.core as mx

    cases = quantized_cases(model)

    def starting(processes: int) -> None:
        say(f"compiling MLX's quantized GEMM kernels for {len(cases)} layer shapes and tiles "
            f"of rows in {processes} processes at once (their first use on this machine; "
            f"kept in {cache_dir} for later starts)")

    result = precompile(cases, cache_dir, mx.__version__, workers or default_workers(),
                        starting=starting)
    if not cases or result.skipped:
        return None
    if result.failed:
        say(f"{len(result.failed)} of {len(cases)} quantized kernel cases did not compile "
            f"ahead (the warm-up compiles them), in {result.seconds:.1f}s; first: "
            f"{result.failed[0]}")
    else:
        say(f"compiled the quantized kernels of {len(cases)} cases in {result.seconds:.1f}s")
    return result

"""MLX's quantized GEMM kernels compiled side by side before the warm-up
(worker_proc.kernel_precompile): which cases a model gives, that each runs in a process of
its own and the cache is marked, and that failures and hangs cost only their time. On
the CPU MLX compiles nothing: the processes run the same calls, quickly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ipc.config import ServerConfig
from worker_proc.kernel_precompile import (ROW_TILES, QuantizedCase, marker_name, precompile,
                                           quantized_cases)


def _mxfp4_gpt_oss():
    from mlx_lm.utils import quantize_model

    from tests.families import build

    model = build("gpt_oss")
    quantize_model(model, {}, 32, 4, mode="mxfp4")  # as mlx_lm.convert: its router at 8 bits
    return model


def test_a_models_cases_are_its_quantized_shapes_at_each_tile_of_rows():
    cases = quantized_cases(_mxfp4_gpt_oss())
    shapes = {(c.inputs, c.outputs, c.mode, c.bits, c.biases, c.experts) for c in cases}
    assert len(cases) == len(shapes) * len(ROW_TILES)  # every shape once at each tile
    assert {c.rows for c in cases} == set(ROW_TILES)
    assert {c.dtype for c in cases} == {"float32"}
    # The router as mlx-lm's convert leaves it (8-bit affine, with biases); MXFP4 layers
    # have none; the experts' two projections, 4 of them each (the family's count).
    assert (64, 4, "affine", 8, True, 0) in shapes
    assert all(not s[4] for s in shapes if s[2] == "mxfp4")
    assert {(s[0], s[1]) for s in shapes if s[5]} == {(64, 96), (96, 64)}
    assert {s[5] for s in shapes if s[5]} == {4}


def test_an_unquantized_model_has_no_cases():
    from tests.families import build

    assert quantized_cases(build("llama")) == []


def test_every_case_runs_in_processes_and_a_second_start_skips_them(tmp_path):
    cases = quantized_cases(_mxfp4_gpt_oss())[:6]
    first = precompile(cases, tmp_path, "0.0", workers=2)
    assert (first.failed, first.skipped) == ([], False)
    assert (tmp_path / marker_name(cases, "0.0")).exists()
    again = precompile(cases, tmp_path, "0.0", workers=2)
    assert again.skipped and again.seconds == 0.0
    # Another MLX version or another case list is not marked.
    assert not (tmp_path / marker_name(cases, "0.1")).exists()
    assert not (tmp_path / marker_name(cases[:5], "0.0")).exists()


def fail_at_32_rows(case: QuantizedCase) -> float:
    """A stand-in for run_case (module level: the spawned processes import it)."""
    if case.rows == 32:
        raise RuntimeError("NVRTC failed")
    return 0.0


def sleep_on_64_rows(case: QuantizedCase) -> float:
    if case.rows == 64:
        time.sleep(120)
    return 0.0


def _cases() -> list[QuantizedCase]:
    return [QuantizedCase(64, 128, 4, 32, "mxfp4", False, "float32", 0, rows)
            for rows in ROW_TILES]


def test_a_failing_case_is_reported_and_leaves_the_cache_unmarked(tmp_path):
    result = precompile(_cases(), tmp_path, "0.0", workers=3, run=fail_at_32_rows)
    assert len(result.failed) == 1 and "32 rows" in result.failed[0]
    assert "NVRTC failed" in result.failed[0]
    assert not list(tmp_path.iterdir())  # the next start tries again


def test_a_case_past_the_deadline_is_stopped_not_waited_for(tmp_path):
    t0 = time.monotonic()
    # Room for the other two cases' spawns on a loaded CI machine: all three cases of a
    # fast stand-in take 0.6 s idle, 1.8 s beside four busy processes on two cores.
    result = precompile(_cases(), tmp_path, "0.0", workers=3, run=sleep_on_64_rows,
                        timeout_s=6.0)
    assert time.monotonic() - t0 < 60  # not the case's 120 s
    assert len(result.failed) == 1 and "64 rows" in result.failed[0]
    assert not list(tmp_path.iterdir())


def test_asking_for_it_where_nothing_compiles_is_refused():
    from worker_proc import build_worker
    from worker_proc.layer_kinds import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="--parallel-kernel-compiles on"):
        build_worker(ServerConfig(model_path=str(Path("/nonexistent")),
                                  parallel_kernel_compiles="on"))


def test_the_worker_compiles_a_quantized_models_kernels_once(tiny_model_dir, tmp_path):
    """The worker's start (as on CUDA, given a kernel cache): the quantized demo model's
    cases compiled before the warm-up, reported; the next start finds them marked."""
    from mlx_lm import convert

    from worker_proc import _build_worker

    quantized = tmp_path / "q"
    convert(str(tiny_model_dir), mlx_path=str(quantized), quantize=True, q_group_size=32,
            q_bits=4)
    cache = tmp_path / "kernels"
    cache.mkdir()
    config = ServerConfig(model_path=str(quantized))
    for start in range(2):
        lines: list[str] = []
        _build_worker(config, lines.append, kernels=cache)
        compiled = [line for line in lines if "quantized kernels of" in line]
        assert len(compiled) == (1 if start == 0 else 0), lines
    assert len(list(cache.glob("kiln-precompiled-*"))) == 1
    # Off: nothing runs, even with the marker gone.
    for marker in cache.glob("kiln-precompiled-*"):
        marker.unlink()
    lines = []
    _build_worker(ServerConfig(model_path=str(quantized), parallel_kernel_compiles="off"),
                  lines.append, kernels=cache)
    assert not any("quantized GEMM kernels" in line for line in lines)

"""MLX's just-in-time CUDA kernels kept across starts (worker_proc.kernel_cache): where
they go, and the start-up lines that tell a first start's minutes of compiles from a hang.
The directory logic and the reports run on the CPU; that MLX reads the variable is MLX's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import mlx.core as mx

from worker_proc.kernel_cache import (ENV, CompileCount, CompileWatch, compiled_modules,
                                      kernel_cache_dir, keep_kernels)


def _module(directory: Path, name: str) -> None:
    """A module's files as MLX writes them (a name past 245 characters is cut into
    folders of 245 and a file of the rest)."""
    parts = [name[i:i + 245] for i in range(0, len(name), 245)]
    path = directory.joinpath(*parts[:-1], parts[-1] + ".ptx")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF")
    path.with_suffix(".txt").write_text("kernel\tmangled\n")


def test_the_users_directory_is_kept_else_one_per_mlx_version_and_gpu(tmp_path):
    assert kernel_cache_dir({ENV: "/fast/disk"}, tmp_path, "0.32.4", "sm_90") == (
        Path("/fast/disk"), False)
    path, chosen = kernel_cache_dir({}, tmp_path, "0.32.4", "sm_90")
    assert chosen and path == tmp_path / "mlx-kernels" / "0.32.4-sm_90"
    assert kernel_cache_dir({ENV: ""}, tmp_path, "0.32.4", "sm_80")[0].name == "0.32.4-sm_80"


def test_keep_kernels_sets_the_variable_mlx_reads_unless_the_user_did(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    path = keep_kernels(tmp_path)
    assert os.environ[ENV] == str(path) and path.is_dir()
    assert path.parent == tmp_path / "mlx-kernels" and path.name.startswith(mx.__version__ + "-")
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert keep_kernels(tmp_path / "other") == tmp_path / "mine"
    assert os.environ[ENV] == str(tmp_path / "mine") and not (tmp_path / "other").exists()


def test_compiles_since_the_start_are_counted_and_named(tmp_path):
    _module(tmp_path, "gather_bfloat16_int32_1")  # from an earlier start
    count = CompileCount.start(tmp_path)
    assert count.poll() is None
    assert "every one this start used was compiled before" in count.summary()
    _module(tmp_path, "qmm_sm80_tn_bfloat16_m16_b4_g32_mxfp4")
    line = count.poll()
    assert line.startswith("MLX compiled 1 CUDA kernel modules so far")
    assert "qmm_sm80_tn_bfloat16_m16_b4_g32_mxfp4)" in line and str(tmp_path) in line
    assert count.poll() is None  # nothing new: nothing said
    long_name = "G" + "V2IBroadcastAB" * 40  # a fused graph's name, split into folders
    time.sleep(0.01)
    _module(tmp_path, long_name)
    assert long_name + ".ptx" in compiled_modules(tmp_path) and len(compiled_modules(tmp_path)) == 3
    line = count.poll()
    assert line.startswith("MLX compiled 2 CUDA kernel modules so far (latest G")
    assert long_name[:80] + "...)" in line and long_name not in line
    assert count.summary().startswith("MLX compiled 2 CUDA kernel modules during start-up")


def test_the_watch_reports_from_its_thread_while_the_caller_is_busy(tmp_path):
    lines: list[str] = []
    said = threading.Event()

    def report(line: str) -> None:
        lines.append(line)
        said.set()

    with CompileWatch(tmp_path, report, every_s=0.0, poll_s=0.05) as watch:
        _module(tmp_path, "qmm_naive_tn_aligned_bfloat16_m64_b4_g32_mxfp4")
        assert said.wait(10.0), "no report within 10 s"
    assert lines == [lines[0]] and "1 CUDA kernel modules so far" in lines[0]
    assert not watch._thread.is_alive()


def test_a_failing_report_does_not_end_the_watch(tmp_path):
    calls = []
    second = threading.Event()

    def report(line: str) -> None:
        calls.append(line)
        if len(calls) == 1:
            raise OSError("log closed")
        second.set()

    with CompileWatch(tmp_path, report, every_s=0.0, poll_s=0.05):
        _module(tmp_path, "a")
        deadline = time.monotonic() + 10.0
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        _module(tmp_path, "b")
        assert second.wait(10.0)
    assert len(calls) == 2

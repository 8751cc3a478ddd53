"""MLX's just-in-time CUDA kernels kept across starts (worker_proc.kernel_cache): where
they go, and the start-up lines that tell a first start's minutes of compiles from a hang.
The directory logic and the reports run on the CPU; that MLX reads the variable is MLX's."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from worker_proc.kernel_cache import (ENV, CompileCount, CompileWatch, complete,
                                      compiled_modules, drop_incomplete, kernel_cache_dir,
                                      keep_kernels)


def _cubin(claimed: int = 1000) -> bytes:
    """A 64-bit little-endian ELF laid out as NVRTC's cubins are: header, contents, the
    section table, then the program table (offsets at 0x20 and 0x28, entry sizes and
    counts at 0x36). claimed: the bytes its section says it holds (1000 are there)."""
    body, sections, segments = 1000, 3, 2
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    sh_off = 64 + body
    ph_off = sh_off + 64 * sections
    struct.pack_into("<QQ", header, 0x20, ph_off, sh_off)
    struct.pack_into("<HHHH", header, 0x36, 56, segments, 64, sections)
    table = bytearray(64 * sections)
    struct.pack_into("<IIQQQQ", table, 64, 0, 1, 0, 0, 64, claimed)  # contents from 64
    struct.pack_into("<IIQQQQ", table, 128, 0, 8, 0, 0, 64, 10**9)  # .bss: no bytes
    programs = bytearray(56 * segments)
    struct.pack_into("<IIQQQQ", programs, 0, 1, 0, 64, 0, 0, body)
    return bytes(header) + b"\x00" * body + bytes(table) + bytes(programs)


def _module(directory: Path, name: str, code: bytes | None = None,
            kernels: str = "kernel\tmangled\n") -> Path:
    """A module's files as MLX writes them (a name past 245 characters is cut into
    folders of 245 and a file of the rest)."""
    parts = [name[i:i + 245] for i in range(0, len(name), 245)]
    path = directory.joinpath(*parts[:-1], parts[-1] + ".ptx")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_cubin() if code is None else code)
    path.with_suffix(".txt").write_text(kernels)
    path.with_suffix(".cu").write_text("// source")
    return path


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


def test_a_directory_that_cannot_be_made_leaves_mlx_its_own(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    (tmp_path / "file").write_text("not a folder")
    assert keep_kernels(tmp_path / "file") is None
    assert ENV not in os.environ
    assert "cannot keep MLX's compiled CUDA kernels" in caplog.text


def test_compiles_since_the_start_are_counted_and_named(tmp_path):
    _module(tmp_path, "gather_bfloat16_int32_1")  # from an earlier start
    count = CompileCount.start(tmp_path)
    assert count.poll() is None
    assert count.summary() == ("MLX compiled no CUDA kernel module during start-up "
                               f"(its cache: {tmp_path})")
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


def test_modules_cut_short_are_dropped_before_mlx_reads_them(tmp_path, monkeypatch):
    whole = _module(tmp_path, "qmm_sm80_tn_bfloat16_m64_b4_g32_mxfp4")
    cut = _module(tmp_path, "qmm_naive_tn_aligned_bfloat16_m64_b4_g32_mxfp4", _cubin()[:-10])
    unlisted = _module(tmp_path, "gather_int32_uint32_1", kernels="")
    half_listed = _module(tmp_path, "gather_bool_uint32_1", kernels="kernel\tmang")
    ptx_text = _module(tmp_path, "scatter_float32_int32_Assign_1", b".version 8.0\n")
    long_cut = _module(tmp_path, "G" + "V2IAddAB" * 60, _cubin()[:100])
    past_end = _module(tmp_path, "gather_uint8_int32_1", _cubin(claimed=5000))
    assert [complete(m) for m in (whole, cut, unlisted, half_listed, ptx_text, long_cut,
                                  past_end)] == [True, False, False, False, True, False, False]
    monkeypatch.setenv(ENV, str(tmp_path))
    assert keep_kernels(tmp_path / "unused") == tmp_path
    assert sorted(compiled_modules(tmp_path)) == [
        "qmm_sm80_tn_bfloat16_m64_b4_g32_mxfp4.ptx", "scatter_float32_int32_Assign_1.ptx"]
    assert not cut.with_suffix(".txt").exists() and not cut.with_suffix(".cu").exists()
    assert drop_incomplete(tmp_path) == []


def test_a_real_cubin_is_whole_and_any_cut_of_it_is_not(tmp_path):
    """nvcc's own ELF (NVRTC writes the same kind) where a CUDA toolkit is installed."""
    import subprocess

    from bench.cuda_kernel_report import find_cuda

    cuda = find_cuda()
    if cuda is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n')
    subprocess.run([str(cuda / "bin" / "nvcc"), "-cubin", "-arch=sm_90a", "-o",
                    str(tmp_path / "k.cubin"), str(source)], check=True, timeout=120)
    code = (tmp_path / "k.cubin").read_bytes()
    module = _module(tmp_path / "cache", "twice", code)
    assert complete(module)
    for cut in (1, 8, 64, len(code) // 2, len(code) - 64):
        module.write_bytes(code[:-cut])
        assert not complete(module), cut


def test_an_incomplete_module_that_cannot_be_removed_is_named_not_fatal(tmp_path, monkeypatch,
                                                                        caplog):
    cut = _module(tmp_path, "qmm_naive_tn_aligned_bfloat16_m16_b4_g32_mxfp4", _cubin()[:-1])

    def refuse(self, missing_ok=False):  # as on a cache another user owns
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    assert drop_incomplete(tmp_path) == []
    assert cut.exists() and "cannot remove the incomplete kernel module" in caplog.text

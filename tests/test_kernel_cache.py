"""A compiled kernel module cut short in MLX's disk cache (a process stopped while writing
it) no longer stops every later server: the worker deletes it and MLX compiles it again,
at start-up (the warm-up runs again) and while serving (the next step recompiles)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from tests.engine_driver import InProcessEngine
from tests.test_scheduler import assert_idle_invariant
from tests.test_worker import _prompts
from worker_proc import kernel_cache

SHORT = "custom_kernel_kiln_paged_write_bfloat16_t_128_2bb5f19515766784"
# MLX's own message for a module that does not load (its load log was empty).
FAILURE = f"Failed to load compiled {SHORT} kernel: ."


def plant(directory: Path, module: str) -> list[Path]:
    """A module's files as MLX leaves them, the module itself cut short."""
    files = kernel_cache.module_files(module, directory)
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF" if path.suffix == ".ptx" else b"x")
    return files


def test_the_cache_is_where_mlx_keeps_it():
    assert kernel_cache.cache_dir({"MLX_PTX_CACHE_DIR": "/c", "TMPDIR": "/t"}) == Path("/c")
    version = mx.__version__
    assert kernel_cache.cache_dir({"TMP": "/x", "TEMP": "/y"}) == Path("/x/mlx", version, "ptx")
    assert kernel_cache.cache_dir({}) == Path("/tmp/mlx", version, "ptx")


def test_a_long_module_name_is_cut_into_directories_as_mlx_does(tmp_path):
    name = "k" * 245
    assert kernel_cache.module_files(name, tmp_path)[0] == tmp_path / (name + ".ptx")
    longer = "a" * 245 + "b" * 245 + "c" * 3
    assert kernel_cache.module_files(longer, tmp_path) == [
        tmp_path / ("a" * 245) / ("b" * 245) / ("ccc" + suffix) for suffix in (".ptx", ".txt", ".cu")]


def test_only_the_named_modules_files_are_deleted(tmp_path):
    broken, other = plant(tmp_path, SHORT), plant(tmp_path, "custom_kernel_other")
    assert kernel_cache.forget_unloadable_module(RuntimeError("out of memory"), tmp_path) == []
    assert kernel_cache.forget_unloadable_module(RuntimeError(FAILURE), tmp_path) == broken
    assert not any(p.exists() for p in broken) and all(p.exists() for p in other)
    assert kernel_cache.forget_unloadable_module(RuntimeError(FAILURE), tmp_path) == []


def test_a_run_is_repeated_once_per_module_that_did_not_load(tmp_path):
    plant(tmp_path, SHORT)
    plant(tmp_path, "second")
    failures = [RuntimeError(FAILURE), RuntimeError("Failed to load compiled second kernel: .")]
    resets = []

    def run() -> str:
        if failures:
            raise failures.pop(0)
        return "warm"

    assert kernel_cache.healing_cached_modules(run, lambda: resets.append(1), tmp_path) == "warm"
    assert resets == [1, 1]

    # A module that fails again once compiled afresh is no cache problem: raised.
    plant(tmp_path, SHORT)

    def always() -> None:
        plant(tmp_path, SHORT)  # MLX compiled and wrote it again; it still does not load
        raise RuntimeError(FAILURE)

    with pytest.raises(RuntimeError, match="Failed to load compiled"):
        kernel_cache.healing_cached_modules(always, lambda: None, tmp_path)
    # Any other failure, or one whose module is not cached: raised at once.
    for exc in (ValueError("bad"), RuntimeError("Failed to load compiled absent kernel: .")):
        calls = []

        def failing(exc: Exception = exc) -> None:
            calls.append(1)
            raise exc

        with pytest.raises(type(exc)):
            kernel_cache.healing_cached_modules(failing, lambda: None, tmp_path)
        assert calls == [1]


def test_start_up_warms_up_again_after_deleting_a_module_that_did_not_load(
        tiny_model_dir, tmp_path, monkeypatch):
    from ipc.config import ServerConfig
    from worker_proc import build_runner, warm_up

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    files = plant(tmp_path, SHORT)
    real, calls = warm_up.warm_up, []

    def warm_up_once_failing(runner, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 1:
            real(runner, *args, **kwargs)  # requests run, then the kernel's first use fails
            raise RuntimeError(FAILURE)
        return real(runner, *args, **kwargs)

    monkeypatch.setattr(warm_up, "warm_up", warm_up_once_failing)
    runner = build_runner(ServerConfig(model_path=str(tiny_model_dir), max_running_requests=2))
    assert len(calls) == 2 and not any(p.exists() for p in files)
    assert runner.requests == {}


def test_a_step_failing_on_a_cached_module_deletes_it_and_serving_goes_on(
        tiny_model, oracle, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    files = plant(tmp_path, SHORT)
    model, _ = tiny_model
    engine = InProcessEngine(model, chunk_size=32, overlap=False)
    decode, calls = engine.runner._decode, []

    def failing_decode(*args):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(FAILURE)
        return decode(*args)

    monkeypatch.setattr(engine.runner, "_decode", failing_decode)
    prompt = _prompts(1, [20], model.args.vocab_size, seed=54)[0]
    engine.submit("r0", prompt, 6, [])
    assert engine.run_until_idle()["r0"].finish_reason == "error"
    assert not any(p.exists() for p in files)
    engine.submit("r1", prompt, 6, [])
    assert engine.run_until_idle()["r1"].token_ids == oracle(prompt, 6)
    assert_idle_invariant(engine.scheduler)

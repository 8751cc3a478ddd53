"""Shared fixtures: the tiny random-weight model every layer of tests uses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# MLX runs float32 GEMMs (two or more rows) in TF32 on CUDA by default while one-row GEMVs
# stay full float32, so a batched forward and mlx-lm's one-row reference differ by ~1e-3
# there. The tests compare against that reference, so they ask for full float32.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker_proc.demo_model import ensure_demo_model

    root = os.environ.get("KILN_TEST_CACHE") or tmp_path_factory.mktemp("kiln-cache")
    return ensure_demo_model("demo-tiny", cache_root=Path(root))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def oracle(tiny_model: tuple[Any, Any]) -> Callable[[list[int], int], list[int]]:
    """Memoised mlx-lm greedy output for (prompt ids, max_tokens)."""
    from tests.oracle import mlx_lm_greedy

    model, tokenizer = tiny_model
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in memo:
            memo[key] = mlx_lm_greedy(model, tokenizer, prompt_ids, max_tokens)
        return memo[key]

    return run


@pytest.fixture
def launcher() -> Iterator[Any]:
    """A launch thread (worker_proc.launcher) whose stream is this thread's default while
    the test runs."""
    import mlx.core as mx

    from worker_proc.launcher import LaunchThread

    before = mx.default_stream(mx.default_device())
    thread = LaunchThread()
    mx.set_default_stream(thread.stream)
    try:
        yield thread
    finally:
        mx.set_default_stream(before)
        thread.close()

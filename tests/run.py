"""Run the test suite: `python tests/run.py [pytest args]`.

On Linux x86-64 with the `mkl` wheel installed (a test dependency), MLX's CPU backend is
given MKL's BLAS through LD_PRELOAD, which makes the float32 model tests many times faster
than MLX's bundled reference BLAS. LD_PRELOAD only works from process start, hence this
wrapper re-executing pytest.

The tests spread over up to two processes (pytest-xdist), unless the arguments choose
(`-n 0` runs them in this one): half the suite's time is servers starting and waiting on
their children, which overlaps well with another process's model tests. Spread so, each
process (and every server a test starts) gets one BLAS thread unless MKL_NUM_THREADS or
OMP_NUM_THREADS says otherwise.

MLX's CPU JIT compiles each fused kernel with g++ the first time any process meets it
(~330 kernels over the suite, ~1 s each from an empty cache): the suite's processes get a
g++ that reads MLX's preamble header precompiled (tests/mlx_jit.py), ~5x faster a kernel.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def find_mkl() -> str | None:
    for lib_dir in (Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"):
        hits = sorted(lib_dir.glob("libmkl_rt.so*"))
        if hits:
            return str(hits[0])
    return None


def main() -> None:
    env = dict(os.environ)
    mkl = find_mkl() if sys.platform.startswith("linux") else None
    if mkl and mkl not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (mkl, env.get("LD_PRELOAD")) if p)
    root = Path(__file__).resolve().parent.parent
    os.chdir(root)
    sys.path.insert(0, str(root))
    from tests.mlx_jit import path_with_gxx

    env["PATH"] = path_with_gxx(env.get("PATH", os.defpath))
    given = sys.argv[1:]
    spread = [] if any(a.startswith(("-n", "--numprocesses")) for a in given) else [
        "-n", str(min(2, os.cpu_count() or 1))]
    # Work stealing: a worker out of tests takes the other's pending ones, so a run of the
    # slow (tens of seconds) tests near the end does not leave one core idle.
    if spread and not any(a.startswith("--dist") for a in given):
        spread += ["--dist", "worksteal"]
    # One BLAS thread a process when the workers take a core each: the tiny test models'
    # matmuls gain nothing from more, while MKL's extra threads spin against the other
    # worker's (the suite ~20% faster on 2 cores: docs/benchmarks.md, session 47).
    if spread:
        for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
            env.setdefault(name, "1")
    args = [sys.executable, "-m", "pytest", *spread, *given]
    os.execve(sys.executable, args, env)


if __name__ == "__main__":
    main()

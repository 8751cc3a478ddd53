"""MLX's CPU JIT made cheaper for tests that must start from an empty kernel cache.

MLX's CPU backend compiles each fused kernel with `g++ -std=c++17 -O3 -Wall -fPIC
-shared -I <mlx/include> kernel.cpp`, each source opening with
`#include "mlx/backend/cpu/compiled_preamble.h"`: parsing that header is ~0.65 s of a
compile's ~0.75 s, paid again by every kernel. GCC takes a precompiled `<header>.gch`
found in an include directory ahead of the header itself, so a `g++` on PATH that puts a
directory holding one first makes each compile ~0.2 s. The kernels' code, their library
names and which of them get compiled are MLX's as before: only the header's parsing is
shared. Were the flags below ever other than MLX's, GCC would ignore the .gch (it checks)
and parse the header as before: slower, never different.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PREAMBLE = Path("mlx", "backend", "cpu", "compiled_preamble.h")
# MLX's own (libmlx's command line): a .gch serves only a compile with the same ones.
MLX_FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")


def gxx_with_precompiled_preamble(root: Path) -> Path | None:
    """A directory (under `root`) holding a `g++` that compiles as the real one with MLX's
    preamble header precompiled; put it first on PATH. None where there is no g++ or
    the header does not precompile (callers then compile as MLX would, only slower)."""
    import mlx.core as mx

    gxx = shutil.which("g++")
    include = Path(mx.__file__).parent / "include"
    if gxx is None or not (include / PREAMBLE).is_file():
        return None
    pch = root / "pch"
    (pch / PREAMBLE.parent).mkdir(parents=True, exist_ok=True)
    built = subprocess.run([gxx, *MLX_FLAGS, "-x", "c++-header", "-I", str(include),
                            str(include / PREAMBLE), "-o", str(pch / f"{PREAMBLE}.gch")],
                           capture_output=True, timeout=120)
    if built.returncode != 0:
        return None
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec "{gxx}" -I "{pch}" "$@"\n')
    wrapper.chmod(0o755)
    return bin_dir

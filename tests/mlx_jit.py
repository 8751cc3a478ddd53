"""MLX's CPU JIT made cheaper for the test suite, whose kernel cache may start empty.

MLX's CPU backend compiles each fused kernel with `g++ -std=c++17 -O3 -Wall -fPIC
-shared -I <mlx/include> kernel.cpp`, each source opening with
`#include "mlx/backend/cpu/compiled_preamble.h"`: parsing that header is ~0.65 s of a
compile's ~0.75 s, paid again by every kernel (a suite run from an empty cache compiles
~330 of them; the compiled-decode tests start from an empty cache on purpose). GCC takes
a precompiled `<header>.gch` found in an include directory ahead of the header itself, so
a `g++` on PATH that puts a directory holding one first makes each compile ~0.2 s. The
kernels' code, their library names and which of them get compiled are MLX's as before:
only the header's parsing is shared. Were the flags below ever other than MLX's, GCC
would ignore the .gch (it checks them) and parse the header as before: slower, never
different. GCC does not check the headers a .gch was made from, so the directory holding
it is named by MLX's version, every MLX header's bytes and the compiler's version.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PREAMBLE = Path("mlx", "backend", "cpu", "compiled_preamble.h")
# MLX's own (libmlx's command line): a .gch serves only a compile with the same ones.
MLX_FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")


def gxx_with_precompiled_preamble() -> Path | None:
    """A directory holding a `g++` that compiles as the real one with MLX's preamble
    header precompiled; put it first on PATH. Made once per MLX, headers and compiler
    (under the temporary directory), then reused. None where there is no g++ or the
    header does not precompile (callers then compile as MLX would, only slower)."""
    import mlx.core as mx

    gxx = shutil.which("g++")
    include = Path(mx.__file__).parent / "include"
    if gxx is None or not (include / PREAMBLE).is_file():
        return None
    version = subprocess.run([gxx, "--version"], capture_output=True, timeout=30).stdout
    key = hashlib.sha256(mx.__version__.encode() + version)
    for header in sorted(include.rglob("*.h")):
        key.update(header.read_bytes())
    home = Path(tempfile.gettempdir(), "kiln-tests-gxx", key.hexdigest()[:16])
    if not (home / "bin" / "g++").is_file():
        # Built aside and renamed into place: two suites starting at once both succeed.
        home.parent.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(dir=home.parent))
        if not _build(aside, gxx, include, home):
            shutil.rmtree(aside, ignore_errors=True)
            return None
        try:
            os.rename(aside, home)
        except OSError:  # another run got there first: its copy is the same
            shutil.rmtree(aside, ignore_errors=True)
    return home / "bin"


def _build(root: Path, gxx: str, include: Path, home: Path) -> bool:
    """The .gch and the wrapper under `root`, the wrapper pointing at `home` (where root
    will be moved); False if the header does not precompile."""
    pch = root / "pch"
    (pch / PREAMBLE.parent).mkdir(parents=True)
    built = subprocess.run([gxx, *MLX_FLAGS, "-x", "c++-header", "-I", str(include),
                            str(include / PREAMBLE), "-o", str(pch / f"{PREAMBLE}.gch")],
                           capture_output=True, timeout=120)
    if built.returncode != 0:
        return False
    wrapper = root / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{gxx}" -I "{home / "pch"}" "$@"\n')
    wrapper.chmod(0o755)
    return True


def path_with_gxx(path: str) -> str:
    """`path` (a PATH value) with the precompiled-preamble g++ first, where there is one."""
    bin_dir = gxx_with_precompiled_preamble()
    if bin_dir is None or path.split(os.pathsep)[0] == str(bin_dir):
        return path
    return os.pathsep.join([str(bin_dir), path])

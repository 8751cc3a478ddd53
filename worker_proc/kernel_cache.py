"""MLX's on-disk cache of compiled CUDA kernels, kept usable.

MLX's CUDA backend keeps every kernel module it compiles (kiln's paged-attention kernels
among them) in a directory (MLX_PTX_CACHE_DIR, else `<temp dir>/mlx/<version>/ptx`) and
loads a module from there whenever its file exists. It writes those files in place, not
through a rename, so a process stopped while writing one (a server killed during its
warm-up) leaves a module cut short, and every later process then fails to load it
("Failed to load compiled <module> kernel: .") until someone finds and deletes the file.
kiln deletes it itself and lets MLX compile the module again.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

_LOAD_FAILURE = re.compile(r"Failed to load compiled (\S+) kernel")
# MLX's file names: a module name longer than this is cut into directories of this length.
_NAME_PART = 245
_SUFFIXES = (".ptx", ".txt", ".cu")  # the module, its kernels' mangled names, its source
# The temp directory as std::filesystem::temp_directory_path finds it (libstdc++).
_TEMP_VARIABLES = ("TMPDIR", "TMP", "TEMP", "TEMPDIR")

T = TypeVar("T")


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this MLX keeps its compiled CUDA kernel modules."""
    import mlx.core as mx

    if environ.get("MLX_PTX_CACHE_DIR"):
        return Path(environ["MLX_PTX_CACHE_DIR"])
    temp = next((environ[v] for v in _TEMP_VARIABLES if environ.get(v)), "/tmp")
    return Path(temp) / "mlx" / mx.__version__ / "ptx"


def module_files(module: str, directory: Path) -> list[Path]:
    """The files MLX keeps for a module named `module` under `directory`."""
    path = directory
    while len(module) > _NAME_PART:
        path, module = path / module[:_NAME_PART], module[_NAME_PART:]
    return [path / (module + suffix) for suffix in _SUFFIXES]


def unloadable_module(exc: BaseException) -> str | None:
    """The kernel module an MLX error says failed to load, if it says so."""
    found = _LOAD_FAILURE.search(str(exc))
    return found.group(1) if found else None


def forget_unloadable_module(exc: BaseException, directory: Path | None = None) -> list[Path]:
    """Delete the cached files of the module `exc` says failed to load, so that MLX
    compiles it again at its next use; returns the files deleted (none: `exc` is no such
    failure, or the module was not cached)."""
    module = unloadable_module(exc)
    if module is None:
        return []
    removed = []
    for path in module_files(module, directory or cache_dir()):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    if removed:
        logger.warning("kernel module %s failed to load from MLX's cache (a file cut short by "
                       "a process stopped while writing it): deleted %s; it is compiled "
                       "again", module, ", ".join(str(p) for p in removed))
    return removed


def healing_cached_modules(run: Callable[[], T], after_failure: Callable[[], None],
                           directory: Path | None = None, attempts: int = 4) -> T:
    """`run()`, run again (after `after_failure()`) each time it fails only because a
    cached kernel module did not load, once that module's files are deleted; at most
    `attempts` runs, and never twice for one module (a module that fails again once
    compiled afresh is no cache problem)."""
    healed: set[str] = set()
    for attempt in range(1, attempts + 1):
        try:
            return run()
        except RuntimeError as exc:
            module = unloadable_module(exc)
            if (attempt == attempts or module is None or module in healed
                    or not forget_unloadable_module(exc, directory)):
                raise
            healed.add(module)
            after_failure()
    raise AssertionError("unreachable: the last attempt returns or raises")

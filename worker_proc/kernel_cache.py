"""MLX's just-in-time CUDA kernels: kept across starts, and their compiles reported.

MLX's CUDA backend compiles part of its kernels the first time a process needs them
(NVRTC): its tiled quantized GEMMs (a module per activation dtype, format and tile of
rows, tens of seconds each), gathers and scatters per dtype, fused element-wise graphs.
It keeps each compiled module as a file in MLX_PTX_CACHE_DIR, by default a directory
under the system's temporary one, which reboots and fresh containers empty. A quantized
model's first start thus spends minutes in compiles that look like a hang, and pays
them again after every reboot.

kiln points MLX_PTX_CACHE_DIR (unless the user set it) at a directory of its own cache,
one per MLX version and GPU architecture (the modules are that GPU's machine code, and
their file names carry neither), and reports the modules compiled while it starts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "MLX_PTX_CACHE_DIR"
# Seconds between two reports of compiles in progress.
REPORT_EVERY_S = 30.0
_POLL_S = 2.0
_NAME_SHOWN = 80


def kernel_cache_dir(environ: dict[str, str] | os._Environ, cache_root: Path,
                     mlx_version: str, architecture: str) -> tuple[Path, bool]:
    """Where MLX keeps its compiled CUDA kernels: the user's MLX_PTX_CACHE_DIR, else
    kiln's; and whether kiln chose it (then MLX_PTX_CACHE_DIR must be set to it)."""
    given = environ.get(ENV)
    if given:
        return Path(given), False
    return cache_root / "mlx-kernels" / f"{mlx_version}-{architecture or 'unknown'}", True


def keep_kernels(cache_root: Path) -> Path:
    """Call on MLX's CUDA backend before its first kernel compile in this process: sets
    MLX_PTX_CACHE_DIR to kiln's directory unless the user chose one; returns it."""
    import mlx.core as mx

    architecture = str(mx.device_info().get("architecture", ""))
    path, chosen = kernel_cache_dir(os.environ, cache_root, mx.__version__, architecture)
    if chosen:
        path.mkdir(parents=True, exist_ok=True)
        os.environ[ENV] = str(path)  # MLX reads it at its first compile
    return path


def compiled_modules(directory: Path) -> dict[str, float]:
    """Each compiled module in MLX's cache directory and when it was written (a name
    too long for one file is cut into folders: the path read whole is the name)."""
    found = {}
    for path in directory.rglob("*.ptx"):
        try:
            found[path.relative_to(directory).as_posix().replace("/", "")] = path.stat().st_mtime
        except (OSError, ValueError):  # written or removed meanwhile
            continue
    return found


@dataclass
class CompileCount:
    """Modules that appeared in the cache directory since start-up began."""

    directory: Path
    before: frozenset[str]
    new: dict[str, float]
    reported: int = 0

    @classmethod
    def start(cls, directory: Path) -> "CompileCount":
        return cls(directory, frozenset(compiled_modules(directory)), {})

    def poll(self) -> str | None:
        """A line on the compiles since the last one that said something, or None."""
        now = compiled_modules(self.directory)
        self.new = {name: t for name, t in now.items() if name not in self.before}
        if len(self.new) == self.reported:
            return None
        self.reported = len(self.new)
        latest = max(self.new, key=self.new.get).removesuffix(".ptx")
        if len(latest) > _NAME_SHOWN:  # a fused graph's name runs to hundreds
            latest = latest[:_NAME_SHOWN] + "..."
        return (f"MLX compiled {len(self.new)} CUDA kernel modules so far (latest "
                f"{latest}): their first use on this machine, which "
                "can take minutes for a quantized model; kept in "
                f"{self.directory} for later starts")

    def summary(self) -> str:
        self.poll()
        if not self.new:
            return f"MLX's CUDA kernels: every one this start used was compiled before ({self.directory})"
        return (f"MLX compiled {len(self.new)} CUDA kernel modules during start-up (first use "
                f"on this machine), kept in {self.directory}: later starts skip them")


class CompileWatch:
    """Reports MLX's compiles from a thread while start-up runs (the main thread is
    inside MLX meanwhile). `report` must be safe to call from that thread."""

    def __init__(self, directory: Path, report: Callable[[str], None],
                 every_s: float = REPORT_EVERY_S, poll_s: float = _POLL_S) -> None:
        self.count = CompileCount.start(directory)
        self._report = report
        self._every_s = every_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-compiles", daemon=True)

    def __enter__(self) -> "CompileWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._poll_s):
            if time.monotonic() - last < self._every_s:
                continue
            line = self.count.poll()
            if line:
                last = time.monotonic()
                try:
                    self._report(line)
                except Exception:  # a report lost is no reason to stop the start-up
                    logger.exception("reporting kernel compiles failed")

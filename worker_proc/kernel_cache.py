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

MLX trusts whatever file it finds there. One left cut short (a process killed while
writing it, a full disk) would fail every later start that needs the module, and a
kept cache keeps it, so the worker drops incomplete modules before MLX reads any: MLX
compiles them again.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

ENV = "MLX_PTX_CACHE_DIR"
# Seconds between two reports of compiles in progress.
REPORT_EVERY_S = 30.0
_POLL_S = 2.0
_NAME_SHOWN = 80
_SHT_NOBITS = 8  # an ELF section that takes no bytes in the file (.bss)


def kernels_root(environ: Mapping[str, str], cache_root: Path) -> tuple[Path, bool]:
    """The user's MLX_PTX_CACHE_DIR, else the folder of kiln's per-version directories;
    and whether it is kiln's."""
    given = environ.get(ENV)
    return (Path(given), False) if given else (cache_root / "mlx-kernels", True)


def kernel_cache_dir(environ: Mapping[str, str], cache_root: Path,
                     mlx_version: str, architecture: str) -> tuple[Path, bool]:
    """Where MLX keeps its compiled CUDA kernels: the user's MLX_PTX_CACHE_DIR, else
    kiln's; and whether kiln chose it (then MLX_PTX_CACHE_DIR must be set to it)."""
    root, chosen = kernels_root(environ, cache_root)
    return (root / f"{mlx_version}-{architecture or 'unknown'}" if chosen else root), chosen


def compiled_since(environ: Mapping[str, str], cache_root: Path, started: float) -> int:
    """Modules compiled into the kernel cache since `started` (a time.time()), by any
    MLX version's worker: for a launcher that knows neither version nor GPU."""
    root, _ = kernels_root(environ, cache_root)
    return sum(t >= started for t in compiled_modules(root).values())


def keep_kernels(cache_root: Path) -> Path | None:
    """Call on MLX's CUDA backend before its first kernel compile in this process: sets
    MLX_PTX_CACHE_DIR to kiln's directory unless the user chose one, and drops the
    incomplete modules there; returns it (None: kiln's cannot be made, MLX's default
    stays)."""
    import mlx.core as mx

    architecture = str(mx.device_info().get("architecture", ""))
    path, chosen = kernel_cache_dir(os.environ, cache_root, mx.__version__, architecture)
    if chosen:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only home, say: slower starts, not a failed one
            logger.warning("cannot keep MLX's compiled CUDA kernels in %s (%s): MLX's own "
                           "cache directory it is (set %s or KILN_CACHE_DIR to choose one)",
                           path, exc, ENV)
            return None
        os.environ[ENV] = str(path)  # MLX reads it at its first compile
    dropped = drop_incomplete(path)
    if dropped:
        logger.warning("dropped %d incomplete compiled kernel modules from %s (MLX compiles "
                       "them again): %s", len(dropped), path, ", ".join(dropped))
    return path


def complete(module: Path) -> bool:
    """Whether a module's files were written whole: the kernel list (written after the
    code) ends its last line, and machine code in ELF form holds everything its header
    and tables place in the file (a file cut short lacks its end). PTX text is only
    checked to be there."""
    try:
        names = module.with_suffix(".txt").read_bytes()
        with module.open("rb") as f:
            head = f.read(64)
            return (names.endswith(b"\n")
                    and all(b"\t" in line for line in names.splitlines())
                    and (_elf_whole(f, head) if head[:4] == b"\x7fELF" else len(head) > 0))
    except (OSError, struct.error):
        return False


def _elf_whole(f: BinaryIO, head: bytes) -> bool:
    """A 64-bit ELF's file holds its section and program tables, and every section's
    and segment's bytes they point at."""
    size = os.fstat(f.fileno()).st_size
    if len(head) < 64 or head[4] != 2:
        return False
    order = "<" if head[5] == 1 else ">"
    ph_off, sh_off = struct.unpack_from(order + "QQ", head, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from(order + "HHHH", head, 0x36)
    ends = [ph_off + ph_size * ph_count, sh_off + sh_size * sh_count]
    if max(ends) > size:
        return False
    f.seek(sh_off)
    table = f.read(sh_size * sh_count)
    for i in range(sh_count):  # sh_type, then sh_offset and sh_size at 0x18
        kind, = struct.unpack_from(order + "I", table, i * sh_size + 4)
        offset, length = struct.unpack_from(order + "QQ", table, i * sh_size + 0x18)
        ends.append(0 if kind == _SHT_NOBITS else offset + length)
    f.seek(ph_off)
    table = f.read(ph_size * ph_count)
    for i in range(ph_count):  # p_offset at 8, p_filesz at 0x20
        offset, = struct.unpack_from(order + "Q", table, i * ph_size + 8)
        length, = struct.unpack_from(order + "Q", table, i * ph_size + 0x20)
        ends.append(offset + length)
    return max(ends) <= size


def drop_incomplete(directory: Path) -> list[str]:
    """Removes every module in MLX's cache directory whose files are not whole; their
    names."""
    dropped = []
    try:
        for module in list(directory.rglob("*.ptx")):
            if complete(module):
                continue
            try:
                for path in (module, module.with_suffix(".txt"), module.with_suffix(".cu")):
                    path.unlink(missing_ok=True)
            except OSError as exc:  # not ours to remove: MLX may fail on it, say so
                logger.warning("cannot remove the incomplete kernel module %s: %s", module, exc)
                continue
            dropped.append(_module_name(directory, module).removesuffix(".ptx"))
    except OSError as exc:  # a folder that cannot be read: MLX will say what it cannot use
        logger.warning("cannot check the compiled kernels in %s: %s", directory, exc)
    return dropped


def _module_name(directory: Path, path: Path) -> str:
    """A module file's name as MLX gave it (a name too long for one file is cut into
    folders: the path read whole is the name)."""
    return path.relative_to(directory).as_posix().replace("/", "")


def compiled_modules(directory: Path) -> dict[str, float]:
    """Each compiled module in MLX's cache directory (none if there is no such
    directory) and when it was written."""
    found: dict[str, float] = {}
    try:
        for path in directory.rglob("*.ptx"):
            try:
                found[_module_name(directory, path)] = path.stat().st_mtime
            except (OSError, ValueError):  # written or removed meanwhile
                continue
    except OSError:  # a folder removed while walked: what was seen
        pass
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
            return (f"MLX compiled no CUDA kernel module during start-up (its cache: "
                    f"{self.directory})")
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
            try:
                line = self.count.poll()
                if line:
                    last = time.monotonic()
                    self._report(line)
            except Exception:  # a report lost is no reason to stop the start-up or the watch
                logger.exception("reporting kernel compiles failed")

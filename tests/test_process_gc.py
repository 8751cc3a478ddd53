"""A child process freezes what its start-up made once it reports ready."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_start_up_objects_are_frozen_out_of_the_collectors_walk():
    """What a full collection walks (gc.get_objects) shrinks to a tenth or less."""
    code = ("import gc, mlx_lm, transformers\n"
            "from ipc.process import freeze_startup_objects\n"
            "n = len(gc.get_objects())\n"
            "freeze_startup_objects()\n"
            "print(n, gc.get_freeze_count(), len(gc.get_objects()))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    n, frozen, left = (int(x) for x in out)
    assert frozen >= n // 2 and left < n // 10, out


def test_slow_collections_are_logged_at_debug(caplog):
    """A collection that takes the threshold or more is logged with its generation; the
    callback leaves with the test."""
    import gc
    import logging

    from ipc.process import log_slow_collections

    watch = log_slow_collections(least_ms=0.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="ipc.process"):
            gc.collect(1)
    finally:
        gc.callbacks.remove(watch)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("garbage collection of generation 1 took ") for line in lines), lines

"""Errors after which the process's GPU context can run nothing more.

CUDA's "sticky" errors (an illegal address, a kernel fault, a failed device assert) poison
the context: every later call in the process fails with the same error (session 38 on
the H100: after an out-of-memory step, each of the next ~30 steps failed with "an illegal
memory access was encountered", so the server answered every request with an error and
looked alive). A worker that meets one exits instead; the launcher then answers what
waits, stops the server and exits non-zero, so a supervisor can start a fresh process."""

from __future__ import annotations

from ipc.process import ExitAtOnce

# cudaGetErrorString's texts for the errors that leave the context unusable.
_STICKY = (
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "device-side assert triggered",
    "misaligned address",
    "an illegal instruction was encountered",
    "invalid program counter",
    "hardware stack error",
    "uncorrectable ECC error encountered",
    "the launch timed out and was terminated",
)


class DeviceLost(ExitAtOnce):
    """The worker's GPU context is unusable: the worker exits with this, at once."""


def device_lost(exc: BaseException) -> bool:
    """Whether `exc` reports a CUDA error that no later call in the process survives."""
    text = str(exc)
    return any(sticky in text for sticky in _STICKY)

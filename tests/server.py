"""Start the real server (all four processes) as a subprocess for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float,
               what: str, interval: float = 0.25) -> float:
    """Poll `ready` (an HTTP error counts as not yet) until it holds; returns the seconds
    it took. Fails at once when `proc` exits, and after `timeout` seconds."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if ready():
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s")


def free_port_pair() -> int:
    """A port p such that p and p + 1 (HTTP and ZMQ) are both free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


class Server:
    def __init__(self, model_dir: Path, *extra: str, log_path: Path | None = None,
                 own_group: bool = False, env: dict[str, str] | None = None) -> None:
        """own_group: the server leads a process group of its own (a session), which a
        test may signal whole; env: variables set for the server beside ours."""
        self.port = free_port_pair()
        self.url = f"http://127.0.0.1:{self.port}"
        self.zmq = f"tcp://127.0.0.1:{self.port + 1}"
        self.log_path = log_path
        args = [sys.executable, str(ROOT / "launch.py"), "--model", str(model_dir),
                "--port", str(self.port), *extra]
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=own_group)

    def wait_ready(self, timeout: float = 180.0) -> "Server":
        def ready() -> bool:
            return (httpx.get(self.url + "/health", timeout=1.0).status_code == 200
                    and self._all_ready())

        try:
            wait_until(ready, self.proc, timeout, "server", interval=0.2)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {self.log_tail()}") from None
        return self

    def _all_ready(self) -> bool:
        return self.log_path is None or b"serving " in self.log_path.read_bytes()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace") if self.log_path else ""

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def child(self, role: str) -> psutil.Process:
        for p in self.children():
            if role in " ".join(p.cmdline()):
                return p
        raise LookupError(role)

    def stats(self) -> dict:
        return httpx.get(self.url + "/get_server_info", timeout=10).json()["scheduler"]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for p in self.children():
                p.kill()
            if self._log is not subprocess.DEVNULL:
                self._log.close()

"""Typed ZMQ socket wrappers. The only module (with `ipc.client`) that imports zmq.

Internal traffic is PUSH/PULL over `ipc://` paths in the run directory: each receiving
process binds one PULL socket, senders connect to it.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from ipc.codec import Decoder, encode

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A sender must never block the step loop: the high-water marks are far above any
# backlog a healthy peer leaves, and a dead peer is the launcher's business.
_HWM = 100_000


def _configure(sock: zmq.Socket, endpoint: str, bind: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class Sender:
    """PUSH side of an internal pipe."""

    def __init__(self, endpoint: str, bind: bool = False) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        _configure(self._sock, endpoint, bind)

    def send(self, message: msgspec.Struct) -> None:
        self._sock.send(encode(message), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms > 0 lets queued frames reach a live peer before the socket goes."""
        self._sock.close(linger=linger_ms)


class Receiver(Generic[T]):
    """PULL side of an internal pipe; decodes into the record types it accepts."""

    def __init__(self, endpoint: str, accepted: Any, bind: bool = True) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        _configure(self._sock, endpoint, bind)
        self._decoder: Decoder[T] = Decoder(accepted, endpoint)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Next record; None on timeout or when the frame did not decode."""
        if timeout_ms is not None and not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._decoder.decode(self._sock.recv(copy=True))

    def drain(self) -> list[T]:
        """Every record already waiting, without blocking."""
        out: list[T] = []
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            message = self._decoder.decode(frame)
            if message is not None:
                out.append(message)

    def close(self) -> None:
        self._sock.close(linger=0)


def wait_readable(receivers: list[Receiver], timeout_ms: int) -> list[Receiver]:
    """The receivers that have a frame waiting, after blocking at most timeout_ms."""
    poller = zmq.Poller()
    for r in receivers:
        poller.register(r._sock, zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    return [r for r in receivers if r._sock in ready]


class AsyncSender:
    """PUSH side for asyncio code (the tokenizer process)."""

    def __init__(self, endpoint: str, bind: bool = False) -> None:
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        _configure(self._sock, endpoint, bind)

    async def send(self, message: msgspec.Struct) -> None:
        await self._sock.send(encode(message), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms > 0 lets queued frames reach a live peer before the socket goes."""
        self._sock.close(linger=linger_ms)


class AsyncReceiver(Generic[T]):
    def __init__(self, endpoint: str, accepted: Any, bind: bool = True) -> None:
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        _configure(self._sock, endpoint, bind)
        self._decoder: Decoder[T] = Decoder(accepted, endpoint)

    async def recv(self) -> T:
        """Next record that decodes (undecodable frames are logged and skipped)."""
        while True:
            message = self._decoder.decode(await self._sock.recv(copy=True))
            if message is not None:
                return message

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncRouter(Generic[T]):
    """Server side of the programmatic-client endpoint: many clients, replies by identity."""

    def __init__(self, endpoint: str, accepted: Any, max_message_bytes: int = -1) -> None:
        """max_message_bytes: a larger message is never read into memory; ZMQ drops its
        sender's connection instead (-1: no limit)."""
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        _configure(self._sock, endpoint, bind=True)
        self._decoder: Decoder[T] = Decoder(accepted, endpoint)

    async def recv(self) -> tuple[bytes, T]:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            if len(frames) != 2:
                logger.error("client endpoint: dropped a message of %d frames", len(frames))
                continue
            message = self._decoder.decode(frames[1])
            if message is not None:
                return frames[0], message

    async def send(self, identity: bytes, message: msgspec.Struct) -> None:
        # A client that went away is silently unroutable (ROUTER_MANDATORY off).
        await self._sock.send_multipart([identity, encode(message)])

    def close(self) -> None:
        self._sock.close(linger=0)

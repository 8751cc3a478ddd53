"""Typed ZMQ socket wrappers. The only module (with `ipc.client`) that imports zmq.

Internal traffic is PUSH/PULL over `ipc://` paths in the run directory: each receiving
process binds one PULL socket, senders connect to it.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ipc.codec import Decoder, DecodeProblem, encode

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


def send_last(endpoint: str, message: msgspec.Struct, timeout_ms: int) -> None:
    """Send one message from a process about to exit, and return once it is delivered
    (or after timeout_ms). A private context, terminated here: at interpreter exit pyzmq
    never terminates the shared one, so what its sockets still queue is lost."""
    context = zmq.Context()
    try:
        sock = context.socket(zmq.PUSH)
        sock.connect(endpoint)
        sock.send(encode(message))
        sock.close(linger=timeout_ms)
    finally:
        context.term()  # waits for the linger


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


@dataclass(frozen=True)
class ClientMessage(Generic[T]):
    """A record from the client with this routing id."""

    identity: bytes
    message: T


@dataclass(frozen=True)
class ClientMalformed:
    """A well-framed message that did not decode as any record the endpoint accepts."""

    identity: bytes
    problem: DecodeProblem


@dataclass(frozen=True)
class ClientGone:
    """The connection of the client with this routing id closed: the process went away,
    or heartbeats stopped (a lost host or network). Nothing will reach it any more."""

    identity: bytes


RouterEvent = ClientMessage[T] | ClientMalformed | ClientGone

# ZMTP heartbeats on every client connection: a peer whose ZMQ stack (its I/O thread,
# which answers whatever the client's own code is doing) is silent this long is dropped.
# A killed client process needs none of it (its kernel closes the TCP connection at
# once); these catch a lost host or network, which TCP itself notices only after minutes.
_HEARTBEAT_IVL_MS = 500
_HEARTBEAT_TIMEOUT_MS = 2000


class Connections:
    """Which client (routing id) each open connection (its socket fd) carries.

    NOTE: a message names its connection only by fd, and once a connection closes its
    fd may be the next connection's; so the socket monitor's events are applied before
    each message is looked up. libzmq reports a disconnect before it closes the fd, hence
    before any new connection can reuse it, and a connection's acceptance before its
    first message.
    """

    def __init__(self) -> None:
        self._client_on: dict[int, bytes] = {}
        self._closed: set[int] = set()

    def opened(self, fd: int) -> None:
        self._closed.discard(fd)

    def closed(self, fd: int) -> bytes | None:
        """The client whose connection this was, if it ever sent anything."""
        self._closed.add(fd)
        return self._client_on.pop(fd, None)

    def came(self, identity: bytes, fd: int) -> bool:
        """Record a message's connection; False if that connection is already closed
        (a message still queued from a client that is gone)."""
        if fd in self._closed:
            return False
        self._client_on[fd] = identity
        return True


class AsyncRouter(Generic[T]):
    """Server side of the programmatic-client endpoint: many clients, replies by identity.

    It also says when a client's connection closes (`ClientGone`), from a socket monitor
    mapped to routing ids by each message's source fd, so the front can abort what that
    client had running; and it hands on messages that do not decode (`ClientMalformed`),
    so their senders can be answered instead of waiting.
    """

    def __init__(self, endpoint: str, accepted: Any, max_message_bytes: int = -1) -> None:
        """max_message_bytes: a larger message is never read into memory; ZMQ drops its
        sender's connection instead (-1: no limit)."""
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        # Before the bind, so that no connection is accepted unseen.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED
                                                      | zmq.EVENT_DISCONNECTED)
        _configure(self._sock, endpoint, bind=True)
        self._decoder: Decoder[T] = Decoder(accepted, endpoint)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._connections = Connections()
        self._events: deque[RouterEvent[T]] = deque()

    async def recv(self) -> RouterEvent[T]:
        """The next client message, malformed message or departure."""
        while not self._events:
            await self._poller.poll()
            self._read_ready()
        return self._events.popleft()

    async def send(self, identity: bytes, message: msgspec.Struct) -> None:
        # A client that went away is silently unroutable (ROUTER_MANDATORY off).
        await self._sock.send_multipart([identity, encode(message)])

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def _read_ready(self) -> None:
        """Everything waiting, without blocking: each message, then the monitor's news up
        to it, then the message's sender looked up (see Connections)."""
        while True:
            frames = _try_recv(self._sock)
            self._read_monitor()
            if frames is None:
                return
            event = self._classify(frames)
            if event is not None:
                self._events.append(event)

    def _read_monitor(self) -> None:
        # Read after the message: every event libzmq emitted before it is then queued.
        # ZMQ_EVENTS makes the monitor socket take its pending commands now; a
        # non-blocking receive may skip them (libzmq throttles that), leaving an event
        # written before the message unseen (a reused fd's new connection taken for the
        # closed one's).
        self._monitor.getsockopt(zmq.EVENTS)
        while (frames := _try_recv(self._monitor)) is not None:
            event = parse_monitor_message([f.bytes for f in frames])
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._connections.opened(fd)
            elif (identity := self._connections.closed(fd)) is not None:
                self._events.append(ClientGone(identity))

    def _classify(self, frames: list[zmq.Frame]) -> RouterEvent[T] | None:
        identity = frames[0].bytes
        if not self._connections.came(identity, frames[-1].get(zmq.SRCFD)):
            logger.info("client endpoint: dropped a message from a client already gone")
            return None
        if len(frames) != 2:
            logger.error("client endpoint: dropped a message of %d frames", len(frames))
            return None
        result = self._decoder.decode_or_problem(frames[1].bytes)
        if isinstance(result, DecodeProblem):
            return ClientMalformed(identity, result)
        return ClientMessage(identity, result)


def _try_recv(sock: zmq.asyncio.Socket) -> list[zmq.Frame] | None:
    """The next multipart message if one is waiting (an asyncio socket answers a
    non-blocking receive at once, with a finished future)."""
    try:
        return sock.recv_multipart(zmq.NOBLOCK, copy=False).result()
    except zmq.Again:
        return None

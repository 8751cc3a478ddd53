"""Python client for kiln's ZMQ endpoint (the `client_endpoint` printed at start-up).

    from ipc.client import KilnClient

    with KilnClient("tcp://127.0.0.1:8001") as client:
        result = client.generate("Once upon a time", max_tokens=32, temperature=0)
        print(result.text, result.finish_reason, result.usage)
        for delta in client.stream("Tell me a story", max_tokens=64):
            print(delta.text, end="", flush=True)

`AsyncKilnClient` is the asyncio twin (`await client.generate(...)`,
`async for delta in client.stream(...)`). One client carries any number of requests at
once over one DEALER socket; replies are routed to their waiter by request id.

Sampling keywords (all optional): max_tokens (16), temperature (1.0; 0 = greedy),
top_p (1.0), top_k (0 = off), seed (None), min_p (0), logit_bias ({token id: bias}),
repetition_penalty (1), frequency_penalty (0), presence_penalty (0), min_tokens (0),
stop_token_ids (None), ignore_eos (False), skip_special_tokens (True), logprobs (None;
k in 0..20 returns each token's log-probability and the top k), prompt_logprobs (None;
k in 0..20 returns the same for every prompt token given the ones before it, as
`prompt_logprobs[i]` for prompt position i, None at position 0; max_tokens may then be 0
to only score the prompt; streamed, the first delta carries them), n (1; up to 16 outputs
of the prompt, which is computed once: `generate` then returns a list of n results in
index order, and `stream` interleaves the outputs' deltas, each naming its `index`;
with a seed, output i samples with seed + i), and at most one structured-output
constraint: json_schema (a dict or JSON text), regex, ebnf (GBNF) or lark. Every call takes
`timeout` (seconds; default: the client's) for the wait on each reply; a request that
times out is aborted on the server. A server started with --api-key needs
`KilnClient(address, api_key=...)`; with a wrong or missing key every request fails with
KilnRequestError, as does every request in flight when the engine behind the server dies.
A reply that does not decode (a server of another version) fails its call with
KilnProtocolError.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import uuid
from dataclasses import dataclass, replace
from typing import (Any, AsyncIterator, Awaitable, Coroutine, Generator, Iterator, Sequence,
                    TypeVar)

import msgspec
import zmq
import zmq.asyncio

from ipc.codec import Decoder, DecodeProblem, encode
from ipc.messages.client import (AbortGenerate, GenerateOutput, GenerateRequest,
                                 ServerToClient, StatsQuery, StatsResult)
from ipc.messages.common import SchedulerStats, Usage
from ipc.messages.to_tokenizer import TextLogprob

T = TypeVar("T")

DEFAULT_TIMEOUT = 300.0
# The server's --max-request-bytes default: its endpoint drops the connection of a client
# whose message is larger, so the client refuses to send one (with a clear error) first.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
"""Seconds to wait for any one reply (a whole result, or the next streamed delta)."""

Prompt = str | Sequence[int]


class KilnError(Exception):
    """Base of the client's errors."""


class KilnRequestError(KilnError):
    """The server refused or failed the request (message from the server)."""


class KilnTimeoutError(KilnError, TimeoutError):
    """No reply within the timeout; the request has been aborted."""


class KilnClosedError(KilnError):
    """The client was closed while the request was waiting."""


class KilnProtocolError(KilnError):
    """A reply to the request did not decode (a server of another version?)."""


@dataclass(frozen=True)
class GenerateResult:
    """A whole generation. finish_reason: "stop", "length" or "abort"."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TextLogprob] | None = None  # per token, with logprobs=k (0..20)
    index: int = 0  # which of the request's n outputs
    # Per prompt position, with prompt_logprobs=k (0..20); position 0 is None (nothing
    # precedes it). Every one of n results carries the same list.
    prompt_logprobs: list[TextLogprob | None] | None = None


@dataclass(frozen=True)
class StreamDelta:
    """New text since the previous delta; the last one has finished=True and usage."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[TextLogprob] | None = None
    index: int = 0  # which of the request's n outputs
    # As GenerateResult's, on the first delta only (with n > 1: the first of output 0).
    prompt_logprobs: list[TextLogprob | None] | None = None


_CLOSED = object()  # put in waiting queues when the client closes


class _Call:
    """One request's reply queue; it ends with the last of its `outputs` final replies
    (or an error)."""

    def __init__(self, request_id: str, outputs: int = 1) -> None:
        self.request_id = request_id
        self.replies: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self._open = outputs

    async def next(self, timeout: float | None) -> ServerToClient:
        try:
            reply = await asyncio.wait_for(self.replies.get(), timeout)
        except asyncio.TimeoutError:
            raise KilnTimeoutError(f"no reply to {self.request_id} within {timeout} s") from None
        if reply is _CLOSED:
            raise KilnClosedError("the client was closed")
        if isinstance(reply, KilnError):
            self.finished = True
            raise reply
        if isinstance(reply, StatsResult) or reply.error is not None:
            self.finished = True
        elif reply.finished:
            self._open -= 1
            self.finished = self._open == 0
        return reply


class AsyncKilnClient:
    """asyncio client; use it from one event loop. Close it (or `async with`) when done."""

    def __init__(self, address: str, *, timeout: float | None = DEFAULT_TIMEOUT,
                 api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        """max_request_bytes: the server's --max-request-bytes (requests larger are
        refused here with KilnRequestError, as the server would drop them)."""
        self.address = address
        self.timeout = timeout
        self.max_request_bytes = max_request_bytes
        self._api_key = api_key
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._decoder: Decoder[ServerToClient] = Decoder(ServerToClient, address)
        self._calls: dict[str, _Call] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> "AsyncKilnClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(self, prompt: Prompt | None = None, *,
                       input_ids: Sequence[int] | None = None, request_id: str | None = None,
                       timeout: float | None = None,
                       **sampling: Any) -> GenerateResult | list[GenerateResult]:
        """Generate from text or token ids; returns when the request ends. With n > 1, a
        list of the n results in index order."""
        request = _request(prompt, input_ids, request_id, False, sampling, self._api_key)
        results: list[GenerateResult] = []
        async with self._call(request) as call:
            while not call.finished:
                results.append(_result(_checked(await call.next(self._timeout(timeout)))))
        results.sort(key=lambda r: r.index)
        return _shared_prompt_logprobs(results) if request.n > 1 else results[0]

    async def stream(self, prompt: Prompt | None = None, *,
                     input_ids: Sequence[int] | None = None, request_id: str | None = None,
                     timeout: float | None = None, **sampling: Any) -> AsyncIterator[StreamDelta]:
        """Yield text deltas as they are generated; leaving the loop early aborts.

        `timeout` bounds the wait for each delta. Wrap in `contextlib.aclosing` to abort
        at once when breaking out (otherwise it happens when the generator is collected).
        """
        request = _request(prompt, input_ids, request_id, True, sampling, self._api_key)
        async with self._call(request) as call:
            while not call.finished:
                yield _delta(_checked(await call.next(self._timeout(timeout))))

    async def abort(self, request_id: str) -> None:
        """Stop a request; its generate() returns (or its stream ends) with "abort"."""
        self._check_open()
        await self._sock.send(encode(AbortGenerate(request_id=request_id,
                                                   api_key=self._api_key)))

    async def server_stats(self, *, timeout: float | None = None,
                           flush_cache: bool = False) -> SchedulerStats:
        """The scheduler's current KV and queue statistics; with flush_cache, taken after
        dropping every cached prefix that no running request uses."""
        query = StatsQuery(request_id=_new_id(), api_key=self._api_key, flush_cache=flush_cache)
        async with self._call(query) as call:
            reply = await call.next(self._timeout(timeout))
        if not isinstance(reply, StatsResult) or reply.stats is None:
            raise KilnRequestError(getattr(reply, "error", None) or "no stats in the reply")
        return reply.stats

    def close(self) -> Awaitable[None]:
        """Close at once: waiting requests fail with KilnClosedError, the socket closes.

        Plain `client.close()` is enough; `await client.close()` also waits for the
        reader task to wind down.
        """
        reader = self._reader
        if not self._closed:
            self._closed = True
            if reader is not None:
                reader.cancel()
            for call in self._calls.values():
                call.replies.put_nowait(_CLOSED)
            self._sock.close(linger=0)
        return _Settled(reader)

    # --- internals ----------------------------------------------------------------------

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _check_open(self) -> None:
        if self._closed:
            raise KilnClosedError("the client is closed")

    @contextlib.asynccontextmanager
    async def _call(self, request: GenerateRequest | StatsQuery) -> AsyncIterator[_Call]:
        """Register a waiter, send the request; on an early exit abort it on the server."""
        self._check_open()
        if request.request_id in self._calls:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self._start_reader()
        outputs = request.n if isinstance(request, GenerateRequest) else 1
        payload = encode(request)
        if len(payload) > self.max_request_bytes:
            raise KilnRequestError(f"the request is {len(payload)} bytes, over the server's "
                                   f"limit of {self.max_request_bytes} (--max-request-bytes)")
        call = self._calls[request.request_id] = _Call(request.request_id, outputs)
        try:
            await self._sock.send(payload)
            yield call
        finally:
            del self._calls[request.request_id]
            if not call.finished and not self._closed and isinstance(request, GenerateRequest):
                # Not awaited: this may run while the task is being cancelled.
                self._sock.send(encode(AbortGenerate(request_id=request.request_id,
                                                     api_key=self._api_key)))

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            reply = self._decoder.decode_or_problem(await self._sock.recv())
            call = self._calls.get(reply.request_id or "")
            # No waiter: a late reply to a request that timed out or was aborted.
            if call is None:
                continue
            if isinstance(reply, DecodeProblem):  # its waiter hears why, without waiting
                call.replies.put_nowait(KilnProtocolError(
                    f"the server's reply to {call.request_id} did not decode: {reply.error}"))
            else:
                call.replies.put_nowait(reply)


class KilnClient:
    """Blocking client, safe to share between threads.

    It runs an `AsyncKilnClient` on a private event loop in a daemon thread, so any
    number of threads may have requests in flight at once. Close it (or use `with`).
    """

    def __init__(self, address: str, *, timeout: float | None = DEFAULT_TIMEOUT,
                 api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="kiln-client")
        self._thread.start()
        self._client = self._run(_make_async_client(address, timeout, api_key,
                                                    max_request_bytes))

    def __enter__(self) -> "KilnClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: Prompt | None = None, *, input_ids: Sequence[int] | None = None,
                 request_id: str | None = None, timeout: float | None = None,
                 **sampling: Any) -> GenerateResult | list[GenerateResult]:
        """Generate from text or token ids; blocks until the request ends (n > 1: a list
        of the n results, as AsyncKilnClient.generate)."""
        return self._run(self._client.generate(prompt, input_ids=input_ids,
                                               request_id=request_id, timeout=timeout,
                                               **sampling))

    def stream(self, prompt: Prompt | None = None, *, input_ids: Sequence[int] | None = None,
               request_id: str | None = None, timeout: float | None = None,
               **sampling: Any) -> Iterator[StreamDelta]:
        """Yield text deltas as they come; breaking out of the loop aborts the request."""
        items: queue.Queue[Any] = queue.Queue()
        deltas = self._client.stream(prompt, input_ids=input_ids, request_id=request_id,
                                     timeout=timeout, **sampling)
        feeding = asyncio.run_coroutine_threadsafe(_feed(deltas, items), self._loop)
        try:
            while (item := items.get()) is not _CLOSED:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            feeding.cancel()  # aborts the request if it is still running

    def abort(self, request_id: str) -> None:
        """Stop a request running in another thread of this client."""
        self._run(self._client.abort(request_id))

    def server_stats(self, *, timeout: float | None = None,
                     flush_cache: bool = False) -> SchedulerStats:
        """The scheduler's current KV and queue statistics (see AsyncKilnClient)."""
        return self._run(self._client.server_stats(timeout=timeout, flush_cache=flush_cache))

    def close(self) -> None:
        if not self._loop.is_running():
            return
        self._run(_close(self._client))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. Ctrl-C: the request is aborted on the server
            raise


async def _make_async_client(address: str, timeout: float | None, api_key: str | None,
                             max_request_bytes: int) -> AsyncKilnClient:
    # Built on the loop thread, which is the only thread that touches its socket.
    return AsyncKilnClient(address, timeout=timeout, api_key=api_key,
                           max_request_bytes=max_request_bytes)


async def _close(client: AsyncKilnClient) -> None:
    await client.close()


class _Settled:
    """What `AsyncKilnClient.close` returns: awaiting it waits for the reader to end."""

    def __init__(self, reader: asyncio.Task[None] | None) -> None:
        self._reader = reader

    def __await__(self) -> Generator[Any, None, None]:
        if self._reader is not None and not self._reader.done():
            yield from asyncio.wait([self._reader]).__await__()


async def _feed(deltas: AsyncIterator[StreamDelta], items: queue.Queue[Any]) -> None:
    """Move an async stream into a thread-safe queue: deltas, then an error or the end."""
    try:
        async for delta in deltas:
            items.put(delta)
    except Exception as exc:  # handed to the consuming thread, which raises it
        items.put(exc)
    finally:
        items.put(_CLOSED)
        await deltas.aclose()  # type: ignore[attr-defined]


def _new_id() -> str:
    return uuid.uuid4().hex


def _request(prompt: Prompt | None, input_ids: Sequence[int] | None,
             request_id: str | None, stream: bool, sampling: dict[str, Any],
             api_key: str | None = None) -> GenerateRequest:
    """Build and type-check a request here, so a mistake raises now instead of the server
    dropping a frame it cannot decode."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give a prompt (text or token ids) or input_ids, not both")
    if prompt is not None and not isinstance(prompt, str):
        prompt, input_ids = None, prompt
    ids = None if input_ids is None else list(input_ids)
    request = GenerateRequest(request_id=request_id or _new_id(), prompt=prompt, input_ids=ids,
                              stream=stream, api_key=api_key, **sampling)
    try:
        return msgspec.msgpack.decode(encode(request), type=GenerateRequest)
    except msgspec.ValidationError as exc:
        raise TypeError(f"invalid generate argument: {exc}") from None


def _result(output: GenerateOutput) -> GenerateResult:
    return GenerateResult(output.request_id, output.text, output.token_ids,
                          output.finish_reason, output.usage, output.logprobs, output.index,
                          output.prompt_logprobs)


def _delta(output: GenerateOutput) -> StreamDelta:
    return StreamDelta(output.request_id, output.text, output.token_ids, output.finished,
                       output.finish_reason, output.usage, output.logprobs, output.index,
                       output.prompt_logprobs)


def _shared_prompt_logprobs(results: list[GenerateResult]) -> list[GenerateResult]:
    """Only output 0 scores the prompt (the server's fan-out lets the others read it from
    the prefix cache), so its entries are given to every result, sorted by index."""
    prompt = results[0].prompt_logprobs
    if prompt is None:
        return results
    return [replace(r, prompt_logprobs=prompt) for r in results]


def _checked(reply: ServerToClient) -> GenerateOutput:
    if not isinstance(reply, GenerateOutput):
        raise KilnError(f"unexpected reply {type(reply).__name__}")
    if reply.error is not None:
        raise KilnRequestError(reply.error)
    return reply

"""The programmatic-client front: `ipc.client` requests in, `GenerateOutput`s out.

Pure logic like the HTTP layer: replies go through a `reply(identity, message)`
coroutine, so tests run it without sockets. Client request ids are only unique per
client, so requests are keyed by (client identity, request id) and get an internal rid.
With --api-key every message must carry the key; a request without it gets an error reply.
A message that does not decode is answered with an error naming the problem, when it
names a request id to answer; a client whose connection closes has its requests aborted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from ipc.codec import DecodeProblem
from ipc.messages.client import (AbortGenerate, ClientToServer, GenerateOutput,
                                 GenerateRequest, ServerToClient, StatsQuery, StatsResult)
from ipc.messages.to_tokenizer import PromptTextLogprobs, TextLogprob, TextOutput
from tokenizer_proc.errors import RequestError
from tokenizer_proc.manager import (RequestStream, StatsUnavailable, TokenizerManager,
                                    new_id)
from tokenizer_proc.prepare import RequestPreparer, choice_count, fan_out
from tokenizer_proc.security import ApiKey

logger = logging.getLogger(__name__)

Reply = Callable[[bytes, ServerToClient], Awaitable[None]]
_Key = tuple[bytes, str]
_BAD_KEY = "Missing or incorrect API key: pass the server's key as KilnClient(..., api_key=)."


class ClientFront:
    """Serves GenerateRequest / AbortGenerate / StatsQuery from many clients at once."""

    def __init__(self, manager: TokenizerManager, preparer: RequestPreparer,
                 reply: Reply, api_key: ApiKey | None = None) -> None:
        self._manager = manager
        self._preparer = preparer
        self._reply = reply
        self._api_key = api_key or ApiKey()
        self._active: dict[_Key, list[RequestStream]] = {}  # a request's n outputs
        self._tasks: set[asyncio.Task[None]] = set()
        self.accepting = True

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def handle(self, identity: bytes, message: ClientToServer) -> None:
        """Act on one client message; never blocks on a generation."""
        if not self._api_key.accepts(message.api_key):
            await self._refuse(identity, message)
        elif isinstance(message, GenerateRequest):
            await self._start(identity, message)
        elif isinstance(message, AbortGenerate):
            self._abort(identity, message.request_id)
        elif isinstance(message, StatsQuery):
            self._spawn(self._stats(identity, message.request_id, message.flush_cache))

    async def refuse_malformed(self, identity: bytes, problem: DecodeProblem) -> None:
        """Answer a message that did not decode, so its sender does not wait for ever; an
        abort, or a message naming no request id, has nobody waiting on a reply."""
        if problem.request_id is None or problem.record_type == AbortGenerate.__name__:
            return
        if problem.record_type == StatsQuery.__name__:
            await self._reply(identity, StatsResult(request_id=problem.request_id,
                                                    error=problem.describe()))
        else:
            await self._reply(identity, _error(problem.request_id, problem.describe()))

    def client_gone(self, identity: bytes) -> None:
        """The client's connection closed: nobody will read its outputs, so stop them.
        (The router's events are handled one at a time and `handle` returns once a
        request is registered, so every request of that client is found here.)"""
        keys = [key for key in self._active if key[0] == identity]
        if keys:
            logger.info("a ZMQ client went away: aborting %d request(s)", len(keys))
        for _, request_id in keys:
            self._abort(identity, request_id)

    async def _refuse(self, identity: bytes, message: ClientToServer) -> None:
        if isinstance(message, GenerateRequest):
            await self._reply(identity, _error(message.request_id, _BAD_KEY))
        elif isinstance(message, StatsQuery):
            await self._reply(identity, StatsResult(request_id=message.request_id,
                                                    error=_BAD_KEY))
        else:  # an abort has no reply; its request was refused the same way anyway
            logger.warning("ignored an abort with a wrong API key")

    async def wait_replies(self) -> None:
        """Wait until every generation task has sent its last reply (shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _start(self, identity: bytes, message: GenerateRequest) -> None:
        key = (identity, message.request_id)
        try:
            streams = await self._submit(key, message)
        except RequestError as exc:
            await self._reply(identity, _error(message.request_id, exc.message))
            return
        self._active[key] = list(streams)
        for index, stream in enumerate(streams):
            self._spawn(self._pump(key, index, message.stream, stream))

    async def _submit(self, key: _Key, message: GenerateRequest) -> list[RequestStream]:
        """One engine request per output; n > 1 shares the prompt (prepare.fan_out)."""
        await self._preparer.prevalidate(message)
        n = choice_count(message.n)
        tokenized = await self._preparer.run(self._preparer.generate, message, new_id("zmq"))
        # Checked after tokenizing (an await), so a request that came meanwhile is seen.
        if not self.accepting:
            raise RequestError("The server is shutting down.")
        if key in self._active:
            raise RequestError(f"Request id {message.request_id!r} is already in flight.")
        streams: list[RequestStream] = []
        try:
            for one in fan_out(tokenized, n):
                streams.append(await self._manager.submit(one))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    async def _pump(self, key: _Key, index: int, streaming: bool,
                    stream: RequestStream) -> None:
        identity, request_id = key
        try:
            if streaming:
                await self._send_deltas(identity, request_id, index, stream)
            else:
                result = await stream.collect()
                await self._reply(identity, GenerateOutput(
                    request_id=request_id, text=result.text, token_ids=result.token_ids,
                    finished=True, finish_reason=result.finish_reason, usage=result.usage,
                    error=result.error, logprobs=result.logprobs, index=index,
                    prompt_logprobs=per_position(result.prompt_logprobs)))
        finally:
            streams = self._active[key]
            streams.remove(stream)
            if not streams:
                del self._active[key]
            stream.close()

    async def _send_deltas(self, identity: bytes, request_id: str, index: int,
                           stream: RequestStream) -> None:
        while not stream.done:
            output = await stream.next()
            await self._reply(identity, _delta(request_id, output, stream, index))

    def _abort(self, identity: bytes, request_id: str) -> None:
        # Each stream then yields a final "abort" output, which its pump relays.
        for stream in list(self._active.get((identity, request_id), [])):
            stream.close()

    async def _stats(self, identity: bytes, request_id: str, flush_cache: bool) -> None:
        try:
            stats = await self._manager.query_stats(flush_cache=flush_cache)
        except StatsUnavailable as exc:
            await self._reply(identity, StatsResult(request_id=request_id, error=str(exc)))
            return
        await self._reply(identity, StatsResult(request_id=request_id, stats=stats))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("client request task failed", exc_info=task.exception())


def _error(request_id: str, message: str) -> GenerateOutput:
    return GenerateOutput(request_id=request_id, text="", token_ids=[], finished=True,
                          error=message)


def _delta(request_id: str, output: TextOutput, stream: RequestStream,
           index: int) -> GenerateOutput:
    return GenerateOutput(request_id=request_id, text=output.text, token_ids=output.token_ids,
                          finished=stream.done, finish_reason=output.finish_reason,
                          usage=stream.usage(output) if stream.done else None,
                          error=output.error, logprobs=output.logprobs, index=index,
                          prompt_logprobs=per_position(output.prompt_logprobs))


def per_position(prompt: PromptTextLogprobs | None) -> list[TextLogprob | None] | None:
    """The client's shape of prompt logprobs: indexed by prompt position like `token_ids`
    index the output's, so token 0, which has no logprob, holds None."""
    if prompt is None:
        return None
    return [None, *prompt.rest]

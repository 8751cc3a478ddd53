"""The HTTP API: OpenAI completions and chat completions, models, the native /generate and
/abort_request, health, server info and Prometheus /metrics.

A thin layer: bodies are parsed and validated here, turned into requests by
`RequestPreparer`, run through `TokenizerManager`, and shaped by `responses`. The API key
and the body size cap are `security.HttpGuard`'s, in front of every route.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Mapping, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ipc.config import ServerConfig
from ipc.messages.common import SchedulerStats, Usage
from ipc.messages.to_scheduler import TokenizedRequest
from ipc.messages.to_tokenizer import TextOutput
from tokenizer_proc.errors import (EngineUnavailable, RequestError, error_body, error_body_for,
                                   from_validation_errors)
from tokenizer_proc.json_body import parse_object
from tokenizer_proc.manager import (Collected, RequestStream, StatsUnavailable,
                                    TokenizerManager, new_id)
from tokenizer_proc.prepare import (RequestPreparer, choice_count, completion_choices,
                                    fan_out)
from tokenizer_proc.protocol import (AbortBody, ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, GenerateBody, TokenizeRequest)
from tokenizer_proc.responses import (DONE, BestOf, ChatFormat, CompletionFormat,
                                      NativeFormat, ResponseFormat, merged_response,
                                      share_prompt_logprobs, sse, total_usage, with_index)
from tokenizer_proc.security import ApiKey, HttpGuard

# The scheduler answers between steps (milliseconds); only a starting or stuck engine
# takes this long.
HEALTH_TIMEOUT_S = 2.0

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# nginx's code for "client closed request": nobody reads it, but access logs show it.
_CLIENT_CLOSED = 499
# A scrape waits this long for fresh scheduler stats, then shows the last ones it has.
_SCRAPE_STATS_TIMEOUT_S = 2.0


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def create_app(manager: TokenizerManager, preparer: RequestPreparer,
               facts: Mapping[str, Any] | None = None,
               config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app; `facts` are config details shown by /get_server_info, `config`
    gives the API key and the body size cap (defaults: none and 8 MiB)."""
    config = config or ServerConfig()
    app = FastAPI(title="kiln", docs_url="/docs", redoc_url=None)
    routes = ApiRoutes(manager, preparer, dict(facts or {}))
    routes.install(app)
    # Imported here: the agent routes reuse this module's helpers.
    from tokenizer_proc.agent_routes import AgentRoutes

    AgentRoutes(manager, preparer).install(app)
    install_error_handlers(app)
    app.add_middleware(HttpGuard, api_key=ApiKey(config.api_key),
                       max_body_bytes=config.max_request_bytes)
    app.add_middleware(InternalErrors)  # added last: outermost, so it covers the guard too
    return app


class ApiRoutes:
    """The route handlers; state lives in the manager and the preparer."""

    def __init__(self, manager: TokenizerManager, preparer: RequestPreparer,
                 facts: dict[str, Any]) -> None:
        self._manager = manager
        self._preparer = preparer
        self._facts = facts
        self._started = int(time.time())

    def install(self, app: FastAPI) -> None:
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/get_server_info", self.server_info, methods=["GET"])
        app.add_api_route("/generate", self.generate, methods=["POST"])
        app.add_api_route("/abort_request", self.abort_request, methods=["POST"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/flush_cache", self.flush_cache, methods=["POST"])

    async def completions(self, request: Request) -> Response:
        body = _parse(CompletionRequest, await _read_json(request))
        await self._preparer.prevalidate(body)
        rid = new_id("cmpl")
        prep = self._preparer
        tokenized = await prep.run(prep.completion, body, rid)
        echo = await prep.run(prep.echo_text, body, tokenized.input_ids) if body.echo else ""
        fmt = CompletionFormat(rid, self._preparer.info.name, _include_usage(body), echo=echo)
        choices = completion_choices(body)
        if choices.best_of > 1:
            best = BestOf(choices.n, body.logprobs is not None) if choices.ranked else None
            return await self._generate_n(request, tokenized.rid,
                                          fan_out(tokenized, choices.best_of), fmt,
                                          body.stream, best)
        return await self._generate(request, tokenized, fmt, body.stream)

    async def chat_completions(self, request: Request) -> Response:
        body = _parse(ChatCompletionRequest, await _read_json(request))
        await self._preparer.prevalidate(body)
        rid = new_id("chatcmpl")
        turn = await self._preparer.run(self._preparer.chat_turn, body, rid)
        tokenized = turn.request
        fmt = ChatFormat(rid, self._preparer.info.name, _include_usage(body), parse=turn.parse)
        n = choice_count(body.n)
        if n > 1:
            return await self._generate_n(request, tokenized.rid, fan_out(tokenized, n), fmt,
                                          body.stream)
        return await self._generate(request, tokenized, fmt, body.stream)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """OpenAI's retrieve: the served model's card, 404 for any other name (no name,
        a trailing slash: the list)."""
        if not model_id:
            return await self.models()
        if model_id != self._preparer.info.name:
            raise RequestError(f"The model {model_id[:200]!r} does not exist.", param="model",
                               code="model_not_found", status=404)
        return self._card()

    def _card(self) -> dict[str, Any]:
        info = self._preparer.info
        return {"id": info.name, "object": "model", "created": self._started,
                "owned_by": "kiln", "root": info.path, "max_model_len": info.context_len}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = _parse(TokenizeRequest, await _read_json(request))
        prep = self._preparer
        ids = await prep.run(prep.tokenize, body)
        strs = await prep.run(prep.token_strs, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": prep.info.context_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        body = _parse(DetokenizeRequest, await _read_json(request))
        prep = self._preparer
        return {"prompt": await prep.run(prep.detokenize, body.tokens)}

    async def health(self) -> Response:
        """200 once the engine behind this front answers (the worker has loaded and the
        scheduler is stepping), 503 while it starts or when it stops answering: what a
        load balancer or readiness probe needs, not just a live HTTP socket."""
        try:
            await self._manager.query_stats(timeout=HEALTH_TIMEOUT_S)
        except StatsUnavailable:
            return JSONResponse(error_body("the engine is not ready", "server_error"),
                                status_code=503)
        return Response(status_code=200)

    async def server_info(self) -> dict[str, Any]:
        stats = await self._manager.query_stats()
        return {**self._facts, "in_flight_requests": self._manager.in_flight,
                "scheduler": _fields(stats)}

    async def flush_cache(self) -> dict[str, Any]:
        """Drop every cached prefix no running request reads; answers with the stats after."""
        stats = await self._manager.query_stats(flush_cache=True)
        return {"flushed": True, "scheduler": _fields(stats)}

    async def generate(self, request: Request) -> Response:
        """The native API: text or token ids in; text, ids and meta_info out."""
        body = _parse(GenerateBody, await _read_json(request))
        await self._preparer.prevalidate(body)
        rid = body.rid or new_id("gen")
        n = self._preparer.native_choices(body)
        tokenized = await self._preparer.run(self._preparer.native, body, rid)
        # After the last await before submit: no other request can take the rid between.
        if self._manager.is_in_flight(rid):
            raise RequestError(f"Request id {rid!r} is already in flight.", param="rid",
                               code="duplicate_request_id")
        start = body.logprob_start_len
        fmt = NativeFormat(rid, logprobs=bool(body.return_logprob),
                           logprob_start_len=-1 if start is None else start,
                           text_in_logprobs=body.return_text_in_logprobs)
        if n > 1:
            return await self._generate_n(request, rid, fan_out(tokenized, n), fmt, body.stream)
        return await self._generate(request, tokenized, fmt, body.stream)

    async def abort_request(self, request: Request) -> dict[str, bool]:
        """Abort any request by id (a /generate rid or an OpenAI response id)."""
        body = _parse(AbortBody, await _read_json(request))
        return {"aborted": self._manager.abort(body.rid)}

    async def metrics(self) -> Response:
        # A slow scheduler must not fail the scrape: the last stats it sent stay shown.
        with contextlib.suppress(StatsUnavailable):
            await self._manager.query_stats(_SCRAPE_STATS_TIMEOUT_S)
        return Response(self._manager.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def _generate(self, request: Request, tokenized: TokenizedRequest,
                        fmt: ResponseFormat | NativeFormat, streaming: bool) -> Response:
        stream = await self._manager.submit(tokenized)
        try:
            # Even a streamed response waits for the first output before its headers go
            # out, so an engine rejection can still be a proper 400.
            first = await _until_disconnect(request, stream.next())
            _raise_engine_error(first)
            if streaming:
                return _EventStream(_event_source(stream, first, fmt), stream)
            result = await _until_disconnect(request, stream.collect(first))
        except BaseException:
            stream.close()
            raise
        _raise_engine_error(result)
        return JSONResponse(fmt.response(result))


    async def _generate_n(self, request: Request, parent: str, tokenized: list[TokenizedRequest],
                          fmt: ResponseFormat | NativeFormat, streaming: bool,
                          best: BestOf | None = None) -> Response:
        """n choices of one prompt: one engine request each, one response for all (with
        best_of, only the best `best.n` of them; never streamed)."""
        streams: list[RequestStream] = []
        # /abort_request with the response's id must reach every choice.
        self._manager.group(parent, [t.rid for t in tokenized])
        try:
            for one in tokenized:
                streams.append(await self._manager.submit(one))
            firsts = [await _until_disconnect(request, s.next()) for s in streams]
            for first in firsts:
                _raise_engine_error(first)
            # One formatter per choice: a formatter may keep per-choice state.
            fmts = [_choice_format(fmt, i) for i in range(len(streams))]
            if streaming:
                return _EventStream(_choice_events(streams, firsts, fmts), *streams)
            results = [await _until_disconnect(request, s.collect(first))
                       for s, first in zip(streams, firsts)]
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        for result in results:
            _raise_engine_error(result)
        # usage counts every choice generated, best_of's dropped ones too (as OpenAI).
        usage = total_usage([r.usage for r in results])
        results = share_prompt_logprobs(results)
        if best is not None:
            results = best.pick(results)
        bodies = [f.response(r) for f, r in zip(fmts, results)]
        if isinstance(fmt, NativeFormat):
            return JSONResponse(bodies)
        return JSONResponse(merged_response(bodies, usage))


class _EventStream(StreamingResponse):
    """SSE response that aborts its requests however the response ends (disconnect too)."""

    def __init__(self, events: AsyncIterator[str], *streams: RequestStream) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


def _choice_format(fmt: ResponseFormat | NativeFormat, index: int) -> ResponseFormat | NativeFormat:
    if isinstance(fmt, NativeFormat):
        return dataclasses.replace(fmt, index=index)
    return dataclasses.replace(fmt)


def _event_source(stream: RequestStream, first: TextOutput,
                  fmt: ResponseFormat | NativeFormat) -> AsyncIterator[str]:
    if isinstance(fmt, NativeFormat):
        return _native_events(stream, first, fmt)
    return _events(stream, first, fmt)


async def _native_events(stream: RequestStream, first: TextOutput,
                         fmt: NativeFormat) -> AsyncIterator[str]:
    # Every output is an event, even one without text: its token ids are news too.
    output = first
    while True:
        if output.error is not None:
            yield sse(_output_error(output).body())
            break
        yield sse(fmt.chunk(output, stream.usage(output)))
        if output.finished:
            break
        output = await stream.next()
    yield DONE


async def _events(stream: RequestStream, first: TextOutput,
                  fmt: ResponseFormat) -> AsyncIterator[str]:
    for chunk in fmt.opening(first.prompt_logprobs):
        yield sse(chunk)
    output = first
    while True:
        if output.error is not None:
            # Headers are gone; OpenAI clients raise on a chunk carrying "error".
            yield sse(_output_error(output).body())
            break
        # Tokens still held back as text (part of a character) still bring their logprobs,
        # and count (reasoning tokens); a delta of neither makes no chunk.
        for chunk in fmt.text_chunks(output.text, output.logprobs, len(output.token_ids)):
            yield sse(chunk)
        if output.finished:
            for chunk in fmt.finish_chunks(output.finish_reason):
                yield sse(chunk)
            if fmt.include_usage:
                yield sse(fmt.usage_chunk(stream.usage(output)))
            break
        output = await stream.next()
    yield DONE


def _choice_events(streams: list[RequestStream], firsts: list[TextOutput],
                   fmts: list[Any]) -> AsyncIterator[str]:
    """The events of n choices, interleaved as their outputs come; each names its choice."""
    if isinstance(fmts[0], NativeFormat):
        return _native_choice_events(streams, firsts, fmts)
    return _openai_choice_events(streams, firsts, fmts)


async def _native_choice_events(streams: list[RequestStream], firsts: list[TextOutput],
                                fmts: list[NativeFormat]) -> AsyncIterator[str]:
    """/generate with n > 1: every output of every choice is an event naming its index."""
    async with contextlib.aclosing(_merged(streams, firsts)) as outputs:
        async for i, output in outputs:
            if output.error is not None:
                yield sse(_output_error(output).body())
                break
            # Only choice 0 scores the prompt: its entries come once, in its first event.
            yield sse(fmts[i].chunk(output, streams[i].usage(output)))
    yield DONE


async def _openai_choice_events(streams: list[RequestStream], firsts: list[TextOutput],
                                fmts: list[ResponseFormat]) -> AsyncIterator[str]:
    # Only choice 0 scores the prompt (prepare.fan_out): its entries open every choice.
    for i, fmt in enumerate(fmts):
        for chunk in fmt.opening(firsts[0].prompt_logprobs):
            yield sse(with_index(chunk, i))
    usages: dict[int, Usage] = {}
    async with contextlib.aclosing(_merged(streams, firsts)) as outputs:
        async for i, output in outputs:
            if output.error is not None:
                yield sse(_output_error(output).body())
                break
            for chunk in fmts[i].text_chunks(output.text, output.logprobs,
                                             len(output.token_ids)):
                yield sse(with_index(chunk, i))
            if output.finished:
                for chunk in fmts[i].finish_chunks(output.finish_reason):
                    yield sse(with_index(chunk, i))
                usages[i] = streams[i].usage(output)
        else:
            if fmts[0].include_usage:
                usage = total_usage([usages[i] for i in sorted(usages)])
                if isinstance(fmts[0], ChatFormat):
                    reasoning = sum(f.reasoning_tokens for f in fmts)
                    yield sse(fmts[0].usage_chunk(usage, reasoning))
                else:
                    yield sse(fmts[0].usage_chunk(usage))
    yield DONE


async def _merged(streams: list[RequestStream],
                  firsts: list[TextOutput]) -> AsyncIterator[tuple[int, TextOutput]]:
    """(choice index, output) of every stream, each stream's in order, as they arrive."""
    for i, first in enumerate(firsts):
        yield i, first
    waiting = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams) if not s.done}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.__getitem__):
                i = waiting.pop(task)
                yield i, task.result()
                if not streams[i].done:
                    waiting[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in waiting:
            task.cancel()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work, unless the client disconnects first (then ClientGone)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work_task.cancel()  # no-op when done
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientGone()


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the only message left to come is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_json(request: Request) -> dict[str, Any]:
    # Parsed by hand rather than by FastAPI so that any content type is accepted (curl -d
    # sends a form type) and malformed JSON (deep nesting, NaN, lone surrogates too) gets
    # a 400 of our own.
    return parse_object(await request.body())


def _parse(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _raise_engine_error(output: TextOutput | Collected) -> None:
    if output.error is not None:
        raise _output_error(output)


def _output_error(output: TextOutput | Collected) -> RequestError:
    """An output's error: the engine refused the request (400), or it died (503)."""
    assert output.error is not None
    if output.engine_dead:
        return EngineUnavailable(output.error)
    return RequestError(output.error, code="engine_rejected")


# --- error handlers ------------------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers with an OpenAI error body; validation failures are 400s."""
    app.add_exception_handler(RequestError, _on_request_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_exception_handler(StatsUnavailable, _on_stats_unavailable)
    # Any other exception: InternalErrors (a middleware, not a handler: see there).


async def _on_request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return JSONResponse(exc.body(request.url.path), status_code=exc.status)


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    # FastAPI prefixes locations with "body"/"query"; our params are body-relative.
    errors = [{**e, "loc": tuple(e["loc"])[1:]} for e in exc.errors()]
    return await _on_request_error(request, from_validation_errors(errors))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(error_body_for(request.url.path, str(exc.detail), exc.status_code),
                        status_code=exc.status_code, headers=exc.headers)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=_CLIENT_CLOSED)


async def _on_stats_unavailable(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body_for(request.url.path, str(exc), 503, "server_error"),
                        status_code=503)


class InternalErrors:
    """ASGI middleware: an unexpected exception becomes a 500 with an OpenAI error body,
    and the connection stays open for the client's next request.

    Not an exception handler for Exception: Starlette runs that one in its outermost
    middleware, which re-raises after sending the 500, and uvicorn then closes the
    connection, so a keep-alive client's next request on it was reset. An exception after
    the response has started goes on as before: cutting the connection is then the only
    way to tell the client its response is incomplete.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception:
            if started:
                raise
            logger.exception("unexpected error serving %s", scope.get("path"))
            body = error_body_for(scope.get("path", ""), "Internal server error.", 500,
                                  "server_error")
            response = JSONResponse(body, status_code=500)
            await response(scope, receive, send)


def _fields(stats: Any) -> dict[str, Any]:
    fields = {name: getattr(stats, name) for name in stats.__struct_fields__}
    if isinstance(stats, SchedulerStats):
        fields["kv_bytes_used"] = stats.kv_bytes_used
    return fields

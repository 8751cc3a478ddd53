"""The tokenizer process's I/O: sockets, the uvicorn server, the stop signal and shutdown.

Everything with logic lives in the manager, the preparer, the HTTP routes and the client
front; this module only connects them to the world.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import uvicorn

from ipc.channel import (AsyncReceiver, AsyncRouter, AsyncSender, ClientGone, ClientMalformed,
                         RouterEvent)
from ipc.config import ServerConfig
from ipc.messages.client import ClientToServer
from ipc.messages.to_tokenizer import TokenizerMessage
from ipc.process import STOP_SIGNAL
from kiln_common.model_info import ModelInfo
from tokenizer_proc.client_front import ClientFront
from tokenizer_proc.http_api import create_app
from tokenizer_proc.manager import StatsUnavailable, TokenizerManager
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.security import ApiKey

logger = logging.getLogger(__name__)

# The final aborts may still be queued in ZMQ when the sockets close: the scheduler pipe
# lingers this long so they reach it.
_FLUSH_LINGER_MS = 1000
# How long the ZMQ front may take to send its last replies after the final aborts.
_LAST_REPLIES_S = 1.0
# uvicorn's own deadline comes this long after ours, so our aborts end responses first.
_UVICORN_MARGIN_S = 2.0
# The throughput log line: how often, and how long it waits for the scheduler's counts.
_THROUGHPUT_LOG_S = 10.0
_THROUGHPUT_STATS_TIMEOUT_S = 1.0


class QuietSignalServer(uvicorn.Server):
    """uvicorn without its own signal handlers.

    Its handlers would catch SIGINT and SIGTERM (which setup_child ignores on purpose: the
    launcher decides when to stop) and, once shut down, re-raise them under the default
    handler, so the process would die of the signal instead of exiting 0. We handle the
    launcher's STOP_SIGNAL ourselves and set `should_exit`.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Sockets:
    """The process's three sockets: to the scheduler, from the detokenizer, clients."""

    scheduler: AsyncSender
    inbox: AsyncReceiver[TokenizerMessage]
    clients: AsyncRouter[ClientToServer]

    @classmethod
    def open(cls, config: ServerConfig) -> "Sockets":
        return cls(scheduler=AsyncSender(config.scheduler_endpoint),
                   inbox=AsyncReceiver(config.tokenizer_endpoint, TokenizerMessage),
                   clients=AsyncRouter(config.client_endpoint, ClientToServer,
                                       max_message_bytes=config.max_request_bytes))

    def close(self, engine_alive: bool = True) -> None:
        # Lingering for a dead engine would only hold the exit up.
        self.scheduler.close(linger_ms=_FLUSH_LINGER_MS if engine_alive else 0)
        self.inbox.close()
        self.clients.close()


def server_facts(config: ServerConfig, info: ModelInfo,
                 sampling_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The configuration details /get_server_info shows next to the scheduler's stats
    (sampling_defaults: what a request that leaves a sampling field out gets, where not
    OpenAI's default)."""
    return {"model_name": info.name, "model_path": info.path,
            "sampling_defaults": dict(sampling_defaults or {}),
            "context_length": info.context_len, "vocab_size": info.vocab_size,
            "eos_token_ids": list(info.eos_token_ids),
            "http_address": f"http://{config.host}:{config.port}",
            "client_endpoint": config.client_endpoint,
            "max_running_requests": config.max_running_requests,
            "max_total_tokens": config.max_total_tokens,
            "chunked_prefill_size": config.chunked_prefill_size,
            "max_prefill_tokens": config.max_prefill_tokens,
            "shutdown_timeout": config.shutdown_timeout,
            "max_request_bytes": config.max_request_bytes,
            "api_key_required": bool(config.api_key)}


class GracefulShutdown:
    """The stop signal: stop taking requests, give in-flight ones the grace period, abort
    the rest.

    Aborting ends each request with finish_reason "abort" ("length" on the OpenAI routes),
    so HTTP responses still end properly (a final chunk and [DONE]) before uvicorn's own,
    later deadline would cut their connections.
    """

    def __init__(self, server: uvicorn.Server, manager: TokenizerManager, front: ClientFront,
                 grace_s: float) -> None:
        self._server = server
        self._manager = manager
        self._front = front
        self._grace_s = grace_s
        self._drain: asyncio.Task[None] | None = None

    def begin(self) -> None:
        """The stop signal's handler; a second one aborts everything at once."""
        if self._drain is not None:
            self._abort_rest()
            return
        logger.info("stopping: finishing in-flight requests (up to %.1f s)", self._grace_s)
        self._front.accepting = False
        self._server.should_exit = True
        self._drain = asyncio.ensure_future(self._drain_then_abort())

    async def finish(self) -> None:
        """Once uvicorn has stopped: end what is left and let the last messages go out."""
        if self._drain is not None:
            await self._drain
        self._abort_rest()  # uvicorn may also have stopped without the stop signal
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._front.wait_replies(), _LAST_REPLIES_S)
        await self._manager.flush()
        logger.info("tokenizer process stopped")

    async def _drain_then_abort(self) -> None:
        if not await self._manager.wait_idle(self._grace_s):
            self._abort_rest()

    def _abort_rest(self) -> None:
        aborted = self._manager.abort_all()
        if aborted:
            logger.warning("aborted %d request(s) still running at shutdown", len(aborted))


class TokenizerServer:
    """Runs the HTTP API and the ZMQ front until the stop signal, then shuts down gracefully."""

    def __init__(self, config: ServerConfig, preparer: RequestPreparer) -> None:
        self._config = config
        self._preparer = preparer

    async def run(self, on_ready: Callable[[str], None]) -> None:
        sockets = Sockets.open(self._config)
        manager = TokenizerManager(sockets.scheduler)
        front = ClientFront(manager, self._preparer, sockets.clients.send,
                            ApiKey(self._config.api_key))
        server = QuietSignalServer(self._uvicorn_config(manager))
        shutdown = GracefulShutdown(server, manager, front, self._config.shutdown_timeout)
        asyncio.get_running_loop().add_signal_handler(STOP_SIGNAL, shutdown.begin)
        pumps = [asyncio.ensure_future(route_engine_outputs(sockets.inbox, manager)),
                 asyncio.ensure_future(serve_clients(sockets.clients, front)),
                 asyncio.ensure_future(log_throughput(manager, _THROUGHPUT_LOG_S))]
        try:
            await self._serve(server, on_ready)
            await shutdown.finish()
        finally:
            for pump in pumps:
                pump.cancel()
            sockets.close(engine_alive=manager.engine_failure is None)

    def _uvicorn_config(self, manager: TokenizerManager) -> uvicorn.Config:
        prep = self._preparer
        facts = server_facts(self._config, prep.info, prep.sampling_defaults)
        app = create_app(manager, prep, facts, self._config)
        return uvicorn.Config(
            app, host=self._config.host, port=self._config.port, loop="uvloop",
            log_config=None, log_level=self._config.log_level, lifespan="off",
            access_log=self._config.log_level == "debug",
            # A backstop only: GracefulShutdown aborts at shutdown_timeout, which ends
            # every response well before this.
            timeout_graceful_shutdown=self._config.shutdown_timeout + _UVICORN_MARGIN_S)

    async def _serve(self, server: uvicorn.Server, on_ready: Callable[[str], None]) -> None:
        serving = asyncio.ensure_future(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            on_ready(f"HTTP on http://{self._config.host}:{self._config.port}, "
                     f"ZMQ clients on {self._config.client_endpoint}")
        await serving  # returns once the graceful shutdown is over


async def route_engine_outputs(inbox: AsyncReceiver[TokenizerMessage],
                       manager: TokenizerManager) -> None:
    """Forever: hand what the detokenizer sends to the manager."""
    while True:
        message = await inbox.recv()
        try:
            manager.on_message(message)
        except Exception:  # one bad message must not stop the routing of all others
            logger.exception("failed to route %s", type(message).__name__)


async def serve_clients(router: AsyncRouter[ClientToServer], front: ClientFront) -> None:
    """Forever: hand programmatic clients' messages (and departures) to the front."""
    while True:
        event = await router.recv()
        try:
            await _to_front(event, front)
        except Exception:  # one bad client request must not stop the front
            logger.exception("failed to handle %s", type(event).__name__)


async def _to_front(event: RouterEvent[ClientToServer], front: ClientFront) -> None:
    if isinstance(event, ClientGone):
        front.client_gone(event.identity)
    elif isinstance(event, ClientMalformed):
        await front.refuse_malformed(event.identity, event.problem)
    else:
        await front.handle(event.identity, event.message)


async def log_throughput(manager: TokenizerManager, interval_s: float) -> None:
    """Forever: every interval with traffic, one info line of queue sizes and tokens/s."""
    while True:
        await asyncio.sleep(interval_s)
        if not manager.metrics.had_traffic():
            continue
        try:
            stats = await manager.query_stats(_THROUGHPUT_STATS_TIMEOUT_S)
        except StatsUnavailable:  # the line still says what the front saw
            stats = None
        logger.info(manager.metrics.throughput_line(stats))

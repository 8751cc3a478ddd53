"""`ipc.client` (sync and asyncio) against the ZMQ front with a scripted engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import msgspec
import pytest
import zmq

from ipc.channel import AsyncRouter
from ipc.client import (AsyncKilnClient, KilnClient, KilnClosedError, KilnProtocolError,
                        KilnRequestError, KilnTimeoutError)
from ipc.codec import Decoder, encode
from ipc.messages.client import (ClientToServer, GenerateOutput, GenerateRequest,
                                 ServerToClient, StatsResult)
from ipc.messages.common import Usage
from ipc.messages.to_scheduler import TokenizedRequest
from ipc.messages.to_tokenizer import PromptTextLogprobs, TextLogprob, TextOutput
from tokenizer_proc.client_front import ClientFront
from tests.fake_engine import (FAKE_STATS, FakeEngine, Script, endless_script,
                                        reject_script)
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.server import serve_clients
from worker_proc.demo_model import ensure_demo_model


def echo_script(request: TokenizedRequest) -> list[TextOutput]:
    """Echo the prompt's ids back, so concurrent results are told apart."""
    ids = request.input_ids[: request.sampling.max_new_tokens]
    last = len(ids) - 1
    return [TextOutput(rid=request.rid, text=f"{t} ", token_ids=[t], finished=i == last,
                       finish_reason="stop" if i == last else None,
                       usage=Usage(prompt_tokens=len(request.input_ids),
                                   completion_tokens=len(ids)) if i == last else None)
            for i, t in enumerate(ids)]


def echoed(ids: list[int]) -> str:
    return "".join(f"{t} " for t in ids)


def scored(token_id: int) -> TextLogprob:
    """A made-up prompt entry: token t gets logprob -t and one top alternative."""
    return TextLogprob(f"<{token_id}>", -float(token_id), [f"<{token_id + 1}>"],
                       [-0.5], token_id=token_id, top_ids=[token_id + 1])


def scoring_script(request: TokenizedRequest) -> list[TextOutput]:
    """echo_script, plus made-up prompt entries on the first output of a request that
    asked for them, as the detokenizer sends them (max_tokens 0: one empty output)."""
    outputs = echo_script(request) or [TextOutput(
        rid=request.rid, text="", token_ids=[], finished=True, finish_reason="length",
        usage=Usage(prompt_tokens=len(request.input_ids), completion_tokens=0))]
    if request.sampling.prompt_logprobs < 0:
        return outputs
    ids = request.input_ids
    prompt = PromptTextLogprobs(f"<{ids[0]}>", ids[0], [scored(t) for t in ids[1:]])
    return [msgspec.structs.replace(outputs[0], prompt_logprobs=prompt), *outputs[1:]]


@pytest.fixture(scope="module")
def preparer(tmp_path_factory: pytest.TempPathFactory) -> RequestPreparer:
    path = ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))
    return RequestPreparer.load("demo-tiny", str(path))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Front:
    """The ZMQ front on its own event loop thread, like in the tokenizer process."""

    def __init__(self, preparer: RequestPreparer, script: Script, delay: float,
                 **engine: Any) -> None:
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        self.engine = FakeEngine(script, delay, **engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start(preparer))

    async def _start(self, preparer: RequestPreparer) -> None:
        self._router = AsyncRouter(self.address, ClientToServer)
        self.manager = TokenizerManager(self.engine, stats_timeout=0.2)
        self.engine.connect(self.manager)
        self._front = ClientFront(self.manager, preparer, self._router.send)
        self._serving = asyncio.ensure_future(serve_clients(self._router, self._front))

    async def _stop(self) -> None:
        # The same order as the process's shutdown: abort what is left, let the last
        # replies and aborts go out, then close.
        self._serving.cancel()
        self.manager.abort_all()
        await self._front.wait_replies()
        await self.manager.flush()
        self._router.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def close(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def wait_aborted(self, count: int = 1) -> list[str]:
        deadline = time.monotonic() + 5
        while len(self.engine.aborted()) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.engine.aborted()


@pytest.fixture
def make_front(preparer: RequestPreparer) -> Iterator[Callable[..., Front]]:
    fronts: list[Front] = []

    def make(script: Script = echo_script, delay: float = 0.0, **engine: Any) -> Front:
        fronts.append(Front(preparer, script, delay, **engine))
        return fronts[-1]

    yield make
    for front in fronts:
        front.close()


@contextlib.contextmanager
def sync_client(front: Front, **kwargs: Any) -> Iterator[KilnClient]:
    with KilnClient(front.address, **kwargs) as client:
        yield client


@contextlib.contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket]:
    """A client socket without KilnClient's checks, or its manners (no abort on close)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)  # a missing reply fails the test, not hangs it
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


# --- the blocking client ----------------------------------------------------------------


def test_generate_from_text_and_ids(make_front: Callable[..., Front],
                                    preparer: RequestPreparer) -> None:
    front = make_front()
    ids = preparer.text_ids("hello there", "prompt")
    with sync_client(front) as client:
        result = client.generate("hello there", max_tokens=64, temperature=0)
        assert result.text == echoed(ids) and result.token_ids == ids
        assert result.finish_reason == "stop"
        assert result.usage == Usage(prompt_tokens=len(ids), completion_tokens=len(ids))
        assert client.generate([5, 6, 7], request_id="mine").request_id == "mine"
        assert client.generate(input_ids=[8, 9]).text == "8 9 "
        with pytest.raises(ValueError):
            client.generate("hi", input_ids=[8, 9])
    sent = front.engine.requests()
    assert sent[0].input_ids == ids and sent[0].sampling.greedy
    assert sent[0].sampling.max_new_tokens == 64 and sent[1].input_ids == [5, 6, 7]
    assert sent[0].stop_token_ids == list(preparer.info.eos_token_ids)


def test_sampling_controls_reach_the_engine(make_front: Callable[..., Front]) -> None:
    front = make_front()
    with sync_client(front) as client:
        client.generate([5, 6], max_tokens=6, min_p=0.1, logit_bias={5: -2.0},
                        repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=-0.3,
                        min_tokens=2, stop_token_ids=[9], ignore_eos=True)
        with pytest.raises(KilnRequestError, match="frequency_penalty"):
            client.generate([5, 6], frequency_penalty=3.0)
    s = front.engine.requests()[0].sampling
    assert (s.min_p, s.logit_bias, s.repetition_penalty) == (0.1, {5: -2.0}, 1.2)
    assert (s.frequency_penalty, s.presence_penalty, s.min_tokens) == (0.3, -0.3, 2)
    assert front.engine.requests()[0].stop_token_ids == [9]


def test_stream_yields_deltas(make_front: Callable[..., Front]) -> None:
    front = make_front(delay=0.01)
    with sync_client(front) as client:
        deltas = list(client.stream([5, 6, 7]))
    assert [d.text for d in deltas] == ["5 ", "6 ", "7 "]
    assert [d.finished for d in deltas] == [False, False, True]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].usage is not None


def test_prompt_logprobs_per_prompt_position(make_front: Callable[..., Front]) -> None:
    front = make_front(scoring_script, delay=0.005)
    expected = [None, scored(6), scored(7)]
    with sync_client(front) as client:
        result = client.generate([5, 6, 7], prompt_logprobs=1, max_tokens=2)
        assert result.prompt_logprobs == expected and result.logprobs is None
        assert client.generate([5, 6, 7]).prompt_logprobs is None
        deltas = list(client.stream([5, 6, 7], prompt_logprobs=1))
        assert [d.prompt_logprobs for d in deltas] == [expected, None, None]
        # Scoring only: max_tokens 0 is allowed with prompt logprobs, and only then.
        only = client.generate([5, 6, 7], prompt_logprobs=0, max_tokens=0)
        assert (only.token_ids, only.prompt_logprobs) == ([], expected)
        with pytest.raises(KilnRequestError, match="max_tokens"):
            client.generate([5, 6, 7], max_tokens=0)
    sent = front.engine.requests()
    assert [r.sampling.prompt_logprobs for r in sent] == [1, -1, 1, 0]
    assert sent[0].sampling.logprobs == -1


def test_prompt_logprobs_with_n_are_shared(make_front: Callable[..., Front]) -> None:
    front = make_front(scoring_script)
    with sync_client(front) as client:
        results = client.generate([5, 6], n=3, prompt_logprobs=2)
        assert [r.prompt_logprobs for r in results] == [[None, scored(6)]] * 3
        deltas = list(client.stream([5, 6], n=2, prompt_logprobs=2))
    carried = [(d.index, d.prompt_logprobs) for d in deltas if d.prompt_logprobs]
    assert carried == [(0, [None, scored(6)])]
    # Only output 0 scores the prompt; the others may read it from the prefix cache.
    assert [r.sampling.prompt_logprobs for r in front.engine.requests()[:3]] == [2, -1, -1]


def test_prompt_logprobs_refusals(make_front: Callable[..., Front]) -> None:
    front = make_front(scoring_script)
    with sync_client(front) as client:
        for bad in (21, -1):
            with pytest.raises(KilnRequestError, match="prompt_logprobs"):
                client.generate("hi", prompt_logprobs=bad)
        for wrong in (True, "2", 1.5):
            with pytest.raises(TypeError, match="prompt_logprobs"):
                client.generate("hi", prompt_logprobs=wrong)
        with pytest.raises(TypeError):  # the native API's field has no ZMQ twin
            client.generate("hi", prompt_logprobs=1, logprob_start_len=1)
    assert front.engine.requests() == []


def test_many_threads_share_one_client(make_front: Callable[..., Front]) -> None:
    front = make_front(delay=0.005)
    prompts = [[i, i + 1, i + 2] for i in range(5, 45)]
    with sync_client(front) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda ids: client.generate(ids).text, prompts))
    assert results == [echoed(ids) for ids in prompts]


def test_refusals_raise(make_front: Callable[..., Front]) -> None:
    front = make_front()
    with sync_client(front) as client:
        for bad in ({"max_tokens": 0}, {"top_p": 2.0}, {"temperature": -1.0}):
            with pytest.raises(KilnRequestError):
                client.generate("hi", **bad)
        with pytest.raises(KilnRequestError, match="empty"):
            client.generate("")
        with pytest.raises(KilnRequestError, match="vocabulary"):
            client.generate([10**6])
        with pytest.raises(KilnRequestError, match="context length"):
            client.generate("hi", max_tokens=10**6)
        with pytest.raises(TypeError):
            client.generate("hi", max_tokens="5")
        with pytest.raises(TypeError):
            client.generate("hi", frobnicate=1)
        assert client.generate("hi").finish_reason == "stop"  # still serving


def test_engine_rejection_raises(make_front: Callable[..., Front]) -> None:
    front = make_front(reject_script("request needs more KV slots than the server has"))
    with sync_client(front) as client:
        with pytest.raises(KilnRequestError, match="KV slots"):
            client.generate("hi")
        with pytest.raises(KilnRequestError, match="KV slots"):
            list(client.stream("hi"))


def test_breaking_out_of_a_stream_aborts(make_front: Callable[..., Front]) -> None:
    front = make_front(endless_script(pieces=3), delay=0.01)
    with sync_client(front) as client:
        for delta in client.stream("hi"):
            assert delta.text == " w0"
            break
        assert front.wait_aborted() == [front.engine.requests()[0].rid]


def test_abort_from_another_thread(make_front: Callable[..., Front]) -> None:
    front = make_front(endless_script())
    with sync_client(front) as client, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.generate, "hi", request_id="long")
        while not front.engine.requests():
            time.sleep(0.01)
        client.abort("long")
        assert pending.result(5).finish_reason == "abort"
    assert front.wait_aborted() == [front.engine.requests()[0].rid]


def test_timeout_raises_and_aborts(make_front: Callable[..., Front]) -> None:
    front = make_front(endless_script())
    with sync_client(front, timeout=0.2) as client:
        with pytest.raises(KilnTimeoutError):
            client.generate("hi")
        assert front.wait_aborted() == [front.engine.requests()[0].rid]


def test_server_stats(make_front: Callable[..., Front]) -> None:
    with sync_client(make_front()) as client:
        assert client.server_stats() == FAKE_STATS
    with sync_client(make_front(stats=None)) as client:
        with pytest.raises(KilnRequestError, match="did not answer"):
            client.server_stats()


def test_two_clients_may_reuse_request_ids(make_front: Callable[..., Front]) -> None:
    front = make_front(delay=0.01)
    with sync_client(front) as a, sync_client(front) as b, ThreadPoolExecutor(2) as pool:
        first = pool.submit(a.generate, [5, 6], request_id="same")
        second = pool.submit(b.generate, [7, 8], request_id="same")
        assert (first.result(5).text, second.result(5).text) == ("5 6 ", "7 8 ")
    assert len({r.rid for r in front.engine.requests()}) == 2


# --- the asyncio client -----------------------------------------------------------------


def test_async_generate_stream_and_concurrency(make_front: Callable[..., Front]) -> None:
    front = make_front(delay=0.002)

    async def body() -> None:
        async with AsyncKilnClient(front.address) as client:
            prompts = [[i, i + 1] for i in range(5, 55)]
            results = await asyncio.gather(*(client.generate(p) for p in prompts))
            assert [r.text for r in results] == [echoed(p) for p in prompts]
            deltas = [d async for d in client.stream([9, 8, 7], max_tokens=2)]
            assert "".join(d.text for d in deltas) == "9 8 " and deltas[-1].finished
            assert await client.server_stats() == FAKE_STATS

    asyncio.run(body())


def test_async_abort_ends_the_stream(make_front: Callable[..., Front]) -> None:
    front = make_front(endless_script(pieces=1))

    async def body() -> None:
        async with AsyncKilnClient(front.address) as client:
            deltas = client.stream("hi", request_id="s1")
            assert (await deltas.__anext__()).text == " w0"
            await client.abort("s1")
            rest = [d async for d in deltas]
            assert rest[-1].finished and rest[-1].finish_reason == "abort"

    asyncio.run(body())
    assert front.wait_aborted() == [front.engine.requests()[0].rid]


def test_async_duplicate_id_and_close(make_front: Callable[..., Front]) -> None:
    front = make_front(endless_script())

    async def body() -> None:
        client = AsyncKilnClient(front.address)
        pending = asyncio.ensure_future(client.generate("hi", request_id="x"))
        await asyncio.sleep(0.1)
        with pytest.raises(ValueError):
            await client.generate("hi", request_id="x")
        client.close()  # plain call: takes effect at once
        with pytest.raises(KilnClosedError):
            await pending
        with pytest.raises(KilnClosedError):
            await client.generate("hi")

    asyncio.run(body())


# --- the endpoint's care of its clients ----------------------------------------------------


def test_a_vanished_client_has_its_requests_aborted(make_front: Callable[..., Front]) -> None:
    """A client gone without an abort (a killed process: its kernel closes the TCP
    connection) leaves nothing running."""
    front = make_front(endless_script())
    with raw_dealer(front.address) as sock:
        sock.send(encode(GenerateRequest(request_id="r", prompt="hi", stream=True)))
        assert Decoder(ServerToClient, "test").decode(sock.recv()).text == " w0"
    started = time.monotonic()
    assert front.wait_aborted() == [front.engine.requests()[0].rid]
    assert time.monotonic() - started < 2.0


def test_a_malformed_message_is_answered_naming_the_problem(
        make_front: Callable[..., Front]) -> None:
    front = make_front()
    decoder: Decoder[ServerToClient] = Decoder(ServerToClient, "test")
    with raw_dealer(front.address) as sock:
        sock.send(msgspec.msgpack.encode({"type": "GenerateRequest", "request_id": "r1",
                                          "prompt": "hi", "max_tokens": "x"}))
        reply = decoder.decode(sock.recv())
        assert isinstance(reply, GenerateOutput) and (reply.request_id, reply.finished) == ("r1", True)
        assert "GenerateRequest" in reply.error and "max_tokens" in reply.error
        sock.send(msgspec.msgpack.encode({"type": "StatsQuery", "request_id": "q1",
                                          "flush_cache": 3}))
        reply = decoder.decode(sock.recv())
        assert isinstance(reply, StatsResult) and "flush_cache" in reply.error
    assert front.engine.requests() == []


def test_a_reply_that_does_not_decode_fails_its_call_at_once() -> None:
    """The client's side of the same care: a reply it cannot read (another version's)
    ends the call naming the problem, instead of waiting for the timeout."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(address)

    def answer_badly() -> None:
        identity, payload = server.recv_multipart()
        request_id = msgspec.msgpack.decode(payload)["request_id"]
        server.send_multipart([identity, msgspec.msgpack.encode(
            {"type": "GenerateOutput", "request_id": request_id, "text": 5, "token_ids": []})])

    thread = threading.Thread(target=answer_badly, daemon=True)
    thread.start()
    try:
        with KilnClient(address, timeout=10) as client:
            started = time.monotonic()
            with pytest.raises(KilnProtocolError, match="text"):
                client.generate("hi")
            assert time.monotonic() - started < 5
    finally:
        thread.join(5)
        server.close()

"""The front's pure logic on plain data: manager routing and aborts, model facts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import pytest

from ipc.messages.common import SamplingParams, Usage
from ipc.messages.to_scheduler import AbortRequest, GetStats, TokenizedRequest
from ipc.messages.to_tokenizer import BatchText, EngineDead, StatsReply, TextOutput
from kiln_common.model_info import load_model_info
from tests.fake_engine import FAKE_STATS
from tokenizer_proc.errors import EngineUnavailable
from tokenizer_proc.manager import StatsUnavailable, TokenizerManager

T = TypeVar("T")


class Recorder:
    """An engine link that only records; tests feed outputs by hand."""

    def __init__(self, on_send: Callable[[Any], None] | None = None) -> None:
        self.sent: list[Any] = []
        self._on_send = on_send

    async def send(self, message: Any) -> None:
        self.sent.append(message)
        if self._on_send is not None:
            self._on_send(message)


def run(make: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(make())


def request(rid: str = "r1") -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_ids=[1, 2, 3], sampling=SamplingParams(),
                            stop_token_ids=[0])


def out(rid: str, text: str, finished: bool = False, **kw: Any) -> TextOutput:
    return TextOutput(rid=rid, text=text, token_ids=[7], finished=finished, **kw)


def test_outputs_reach_their_stream_in_order() -> None:
    async def body() -> None:
        manager = TokenizerManager(Recorder())
        a, b = await manager.submit(request("a")), await manager.submit(request("b"))
        manager.on_message(BatchText(outputs=[out("a", "1"), out("b", "x"), out("a", "2")]))
        manager.on_message(BatchText(outputs=[out("a", "3", True, finish_reason="stop")]))
        result = await a.collect()
        assert (result.text, result.finish_reason, result.token_ids) == ("123", "stop", [7] * 3)
        # No usage from the engine: counted from the outputs.
        assert result.usage == Usage(prompt_tokens=3, completion_tokens=3)
        assert manager.rids() == ["b"] and (await b.next()).text == "x"

    run(body)


def test_outputs_sent_during_submit_are_not_lost() -> None:
    async def body() -> None:
        manager: TokenizerManager

        def answer(message: Any) -> None:
            manager.on_message(BatchText(outputs=[out(message.rid, "hi", True,
                                                      finish_reason="stop")]))

        manager = TokenizerManager(Recorder(answer))
        stream = await manager.submit(request())
        assert (await stream.collect()).text == "hi"

    run(body)


def test_late_and_unknown_outputs_are_dropped() -> None:
    async def body() -> None:
        manager = TokenizerManager(Recorder())
        stream = await manager.submit(request())
        manager.on_message(BatchText(outputs=[out("r1", "a", True, finish_reason="stop"),
                                              out("r1", "late"), out("nobody", "x")]))
        assert (await stream.collect()).text == "a" and manager.in_flight == 0

    run(body)


def test_duplicate_rid_is_refused() -> None:
    async def body() -> None:
        manager = TokenizerManager(Recorder())
        await manager.submit(request())
        with pytest.raises(ValueError):
            await manager.submit(request())

    run(body)


def test_abort_tells_the_engine_and_ends_the_stream() -> None:
    async def body() -> None:
        engine = Recorder()
        manager = TokenizerManager(engine)
        stream = await manager.submit(request())
        assert manager.abort("r1") and not manager.abort("r1")
        await manager.flush()
        assert engine.sent[-1] == AbortRequest(rid="r1")
        final = await stream.next()
        assert final.finished and final.finish_reason == "abort" and stream.done
        stream.close()  # already over: nothing more is sent
        await manager.flush()
        assert len(engine.sent) == 2

    run(body)


def test_close_in_a_cancelled_task_still_aborts() -> None:
    async def body() -> None:
        engine = Recorder()
        manager = TokenizerManager(engine)
        stream = await manager.submit(request())

        async def consume() -> None:
            try:
                await stream.next()
            finally:
                stream.close()

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await manager.flush()
        assert engine.sent[-1] == AbortRequest(rid="r1") and manager.in_flight == 0

    run(body)


def test_finished_request_close_sends_nothing() -> None:
    async def body() -> None:
        engine = Recorder()
        manager = TokenizerManager(engine)
        stream = await manager.submit(request())
        manager.on_message(BatchText(outputs=[out("r1", "a", True, finish_reason="stop")]))
        stream.close()  # finished but not yet read: the manager knows it ended
        await manager.flush()
        assert engine.sent == [request()]

    run(body)


def test_engine_error_is_terminal() -> None:
    async def body() -> None:
        manager = TokenizerManager(Recorder())
        stream = await manager.submit(request())
        manager.on_message(BatchText(outputs=[TextOutput(rid="r1", text="", token_ids=[],
                                                         error="no room")]))
        result = await stream.collect()
        assert result.error == "no room" and manager.in_flight == 0

    run(body)


def test_abort_all_and_wait_idle() -> None:
    async def body() -> None:
        engine = Recorder()
        manager = TokenizerManager(engine)
        for rid in ("a", "b"):
            await manager.submit(request(rid))
        assert not await manager.wait_idle(0.05)
        assert manager.abort_all() == ["a", "b"]
        await manager.flush()
        assert engine.sent[2:] == [AbortRequest(rid="a"), AbortRequest(rid="b")]
        assert await manager.wait_idle(0.0)

    run(body)


def test_engine_dead_fails_everything_in_flight_and_refuses_more() -> None:
    async def body() -> None:
        engine = Recorder()
        manager = TokenizerManager(engine, stats_timeout=30)
        a, b = await manager.submit(request("a")), await manager.submit(request("b"))
        manager.group("n", ["b"])
        manager.on_message(BatchText(outputs=[out("a", "x")]))
        query = asyncio.ensure_future(manager.query_stats())
        await asyncio.sleep(0)
        manager.on_message(EngineDead(reason="the worker died"))
        result = await asyncio.wait_for(a.collect(), 1)
        assert (result.text, result.error, result.engine_dead) == ("x", "the worker died", True)
        last = await asyncio.wait_for(b.next(), 1)
        assert (last.error, last.engine_dead, b.done) == ("the worker died", True, True)
        with pytest.raises(StatsUnavailable, match="the worker died"):
            await asyncio.wait_for(query, 1)  # at once, not after stats_timeout
        with pytest.raises(StatsUnavailable):
            await manager.query_stats()
        with pytest.raises(EngineUnavailable) as refused:
            await manager.submit(request("c"))
        assert refused.value.status == 503 and refused.value.type == "server_error"
        assert manager.rids() == [] and not manager.abort("n")
        # Nothing more for the dead engine: no aborts of what failed, no new requests.
        assert [type(m) for m in engine.sent] == [TokenizedRequest, TokenizedRequest, GetStats]

    run(body)


def test_stats_query_matches_its_reply() -> None:
    async def body() -> None:
        engine = Recorder()
        manager = TokenizerManager(engine)
        query = asyncio.ensure_future(manager.query_stats())
        await asyncio.sleep(0)
        (sent,) = engine.sent
        assert isinstance(sent, GetStats)
        manager.on_message(StatsReply(query_id="someone-else", stats=FAKE_STATS))
        assert not query.done()
        manager.on_message(StatsReply(query_id=sent.query_id, stats=FAKE_STATS))
        assert await query == FAKE_STATS

    run(body)


def test_stats_query_times_out() -> None:
    async def body() -> None:
        manager = TokenizerManager(Recorder(), stats_timeout=0.05)
        with pytest.raises(StatsUnavailable):
            await manager.query_stats()
        assert manager._stats == {}

    run(body)


# --- model facts ------------------------------------------------------------------------


class _Tok:
    def __init__(self, eos: int | None, max_len: int = 10**30) -> None:
        self.eos_token_id = eos
        self.model_max_length = max_len

    def __len__(self) -> int:
        return 100


def _write(path: Path, name: str, data: dict[str, Any]) -> None:
    (path / name).write_text(json.dumps(data))


def test_model_info_merges_eos_ids(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {"max_position_embeddings": 512, "eos_token_id": [2, 5]})
    _write(tmp_path, "generation_config.json", {"eos_token_id": 7})
    info = load_model_info("m", str(tmp_path), _Tok(eos=2))
    assert info.eos_token_ids == (2, 5, 7) and info.context_len == 512
    assert info.vocab_size == 100 and info.name == "m"


def test_model_info_context_fallbacks(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {"text_config": {"max_position_embeddings": 333}})
    assert load_model_info("m", str(tmp_path), _Tok(None)).context_len == 333
    _write(tmp_path, "config.json", {})
    assert load_model_info("m", str(tmp_path), _Tok(None, max_len=777)).context_len == 777
    info = load_model_info("m", str(tmp_path / "missing"), _Tok(9))
    assert info.context_len == 2048 and info.eos_token_ids == (9,)


def test_model_info_takes_the_servers_context_length(tmp_path: Path, caplog) -> None:
    _write(tmp_path, "config.json", {"max_position_embeddings": 512})
    assert load_model_info("m", str(tmp_path), _Tok(None), context_length=100).context_len == 100
    with caplog.at_level("WARNING"):
        assert load_model_info("m", str(tmp_path), _Tok(None), context_length=900).context_len == 900
    assert "above the model's 512" in caplog.text


# --- the ZMQ front's logic --------------------------------------------------------------


class _StubPreparer:
    async def prevalidate(self, message: Any) -> None:  # no constraints here
        pass

    async def run(self, entry: Any, *args: Any) -> Any:
        return entry(*args)

    def generate(self, message: Any, rid: str) -> TokenizedRequest:
        return request(rid)


def test_front_relays_the_abort_even_when_it_comes_during_a_reply() -> None:
    from ipc.messages.client import AbortGenerate, GenerateOutput, GenerateRequest
    from tokenizer_proc.client_front import ClientFront

    async def body() -> None:
        engine = Recorder()
        manager = TokenizerManager(engine)
        replies: list[GenerateOutput] = []

        async def reply(identity: bytes, message: Any) -> None:
            replies.append(message)
            if len(replies) == 1:  # the client's abort lands while we are sending
                await front.handle(b"c", AbortGenerate(request_id="q"))

        front = ClientFront(manager, _StubPreparer(), reply)  # type: ignore[arg-type]
        await front.handle(b"c", GenerateRequest(request_id="q", prompt="x", stream=True))
        (sent,) = engine.sent
        manager.on_message(BatchText(outputs=[out(sent.rid, "a")]))
        await front.wait_replies()
        assert [(r.text, r.finished, r.finish_reason) for r in replies] == \
            [("a", False, None), ("", True, "abort")]
        assert front.in_flight == 0

    run(body)


def test_front_refuses_a_reused_id_and_new_work_when_stopping() -> None:
    from ipc.messages.client import GenerateRequest
    from tokenizer_proc.client_front import ClientFront

    async def body() -> None:
        replies: list[Any] = []

        async def reply(identity: bytes, message: Any) -> None:
            replies.append((identity, message))

        manager = TokenizerManager(Recorder())
        front = ClientFront(manager, _StubPreparer(), reply)  # type: ignore[arg-type]
        ask = GenerateRequest(request_id="q", prompt="x")
        await front.handle(b"a", ask)
        await front.handle(b"b", ask)  # another client may use the same id
        await front.handle(b"a", ask)
        assert replies == [(b"a", replies[0][1])] and "in flight" in replies[0][1].error
        front.accepting = False
        await front.handle(b"c", GenerateRequest(request_id="z", prompt="x"))
        assert "shutting down" in replies[1][1].error and manager.in_flight == 2
        manager.abort_all()
        await front.wait_replies()

    run(body)


def test_request_ids_are_those_the_tokenizer_knows_and_the_model_embeds(tmp_path: Path) -> None:
    """An embedding padded past the tokenizer (the demo bench models: 8,192 rows for 4,096
    ids) or, rarely, smaller than it: ids past either are refused at the front."""
    _write(tmp_path, "config.json", {"vocab_size": 80})
    assert load_model_info("m", str(tmp_path), _Tok(None)).vocab_size == 80
    _write(tmp_path, "config.json", {"text_config": {"vocab_size": 4096}})
    assert load_model_info("m", str(tmp_path), _Tok(None)).vocab_size == 100

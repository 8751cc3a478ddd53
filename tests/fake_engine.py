"""A stand-in for scheduler + worker + detokenizer that answers with scripted outputs.

For tests and for working on the front without a model: plug it in as the manager's
engine link (`FakeEngine.connect(manager)`), and every TokenizedRequest is answered by
its script's TextOutputs, one per `delay` seconds. A script whose outputs never finish
leaves the request in flight until it is aborted.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from ipc.messages.common import SchedulerStats, Usage
from ipc.messages.to_scheduler import AbortRequest, GetStats, TokenizedRequest
from ipc.messages.to_tokenizer import BatchText, StatsReply, TextOutput, TokenizerMessage

Script = Callable[[TokenizedRequest], Sequence[TextOutput]]
Sink = Callable[[TokenizerMessage], None]

FAKE_STATS = SchedulerStats(
    capacity_slots=1024, used_slots=0, free_slots=1024, running_requests=0,
    waiting_requests=0, prompt_tokens_total=0, computed_prompt_tokens_total=0,
    generated_tokens_total=0, finished_requests_total=0, aborted_requests_total=0)


def counting_script(length: int = 5) -> Script:
    """Outputs " w0", " w1", ... (token ids 10, 11, ...): "length" when max_new_tokens cuts
    the text short, "stop" after `length` tokens otherwise."""

    def script(request: TokenizedRequest) -> list[TextOutput]:
        limit = request.sampling.max_new_tokens
        count = min(limit, length)
        reason = "length" if limit <= length else "stop"
        return [_output(request, i, f" w{i}", count, reason) for i in range(count)]

    return script


def text_script(pieces: Sequence[str], finish_reason: str = "stop") -> Script:
    """One output per piece (token ids 10, 11, ...), the last one finishing the request."""

    def script(request: TokenizedRequest) -> list[TextOutput]:
        return [_output(request, i, piece, len(pieces), finish_reason)
                for i, piece in enumerate(pieces)]

    return script


def reject_script(error: str) -> Script:
    """The engine refuses the request with its first output (e.g. KV capacity)."""
    return lambda request: [TextOutput(rid=request.rid, text="", token_ids=[], finished=True,
                                       error=error)]


def endless_script(pieces: int = 1) -> Script:
    """A few outputs and then silence: the request stays in flight until aborted."""
    return lambda request: [TextOutput(rid=request.rid, text=f" w{i}", token_ids=[10 + i])
                            for i in range(pieces)]


class FakeEngine:
    """Records everything sent to it and plays each request's script back."""

    def __init__(self, script: Script | None = None, delay: float = 0.0,
                 stats: SchedulerStats | None = FAKE_STATS) -> None:
        self.script = script or counting_script()
        self.delay = delay
        self.stats = stats  # None: stats queries are never answered
        self.sent: list[TokenizedRequest | AbortRequest | GetStats] = []
        self._sink: Sink | None = None
        self._plays: dict[str, asyncio.Task[None]] = {}

    def connect(self, manager: object) -> None:
        """Deliver outputs to `manager.on_message` (a TokenizerManager)."""
        self._sink = getattr(manager, "on_message")

    async def send(self, message: TokenizedRequest | AbortRequest | GetStats) -> None:
        self.sent.append(message)
        if isinstance(message, TokenizedRequest):
            self._plays[message.rid] = asyncio.ensure_future(self._play(message))
        elif isinstance(message, AbortRequest):
            play = self._plays.pop(message.rid, None)
            if play is not None:
                play.cancel()
        elif isinstance(message, GetStats) and self.stats is not None:
            reply = StatsReply(query_id=message.query_id, stats=self.stats)
            asyncio.get_running_loop().call_soon(self._deliver, reply)

    def requests(self) -> list[TokenizedRequest]:
        return [m for m in self.sent if isinstance(m, TokenizedRequest)]

    def played(self, rid: str) -> bool:
        """Whether the request `rid` reached the engine and its script has been played."""
        return any(r.rid == rid for r in self.requests()) and rid not in self._plays

    def aborted(self) -> list[str]:
        return [m.rid for m in self.sent if isinstance(m, AbortRequest)]

    async def _play(self, request: TokenizedRequest) -> None:
        for output in self.script(request):
            await asyncio.sleep(self.delay)
            self._deliver(BatchText(outputs=[output]))
        self._plays.pop(request.rid, None)

    def _deliver(self, message: TokenizerMessage) -> None:
        if self._sink is None:
            raise RuntimeError("FakeEngine.connect(manager) was not called")
        self._sink(message)


def _usage(request: TokenizedRequest, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=len(request.input_ids), completion_tokens=completion_tokens)


def _output(request: TokenizedRequest, i: int, text: str, count: int,
            reason: str) -> TextOutput:
    """Output i of count (token id 10 + i); the last one finishes with `reason`."""
    last = i == count - 1
    return TextOutput(rid=request.rid, text=text, token_ids=[10 + i], finished=last,
                      finish_reason=reason if last else None,
                      usage=_usage(request, count) if last else None)

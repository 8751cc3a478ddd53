"""Every wire record survives encode/decode unchanged; bad frames are dropped, not fatal."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import signal

import pytest

import msgspec

import ipc.messages
from ipc.codec import Decoder, DecodeProblem, encode
from ipc.messages.client import (AbortGenerate, ClientToServer, GenerateOutput, GenerateRequest,
                                 ServerToClient, StatsQuery, StatsResult)
from ipc.messages.common import Message, SamplingParams, SchedulerStats, TokenLogprob, Usage
from ipc.messages.to_detokenizer import (BatchTokens, DetokenizerMessage, PromptTokenLogprobs,
                                         StatsReply, TokenOutput)
from ipc.messages.to_launcher import (LauncherMessage, ProcessFailed, ProcessProgress,
                                      ProcessReady)
from ipc.messages.to_scheduler import (AbortRequest, FlushCache, GetStats, PromptLogprobs,
                                       SchedulerMessage, StepResult, TokenizedRequest,
                                       WorkerReady)
from ipc.messages.to_tokenizer import (BatchText, EngineDead, PromptTextLogprobs, TextLogprob,
                                       TextOutput, TokenizerMessage)
from ipc.messages.to_worker import (ForwardBatch, NewRequest, PrefillChunk, Shutdown, SyncSteps,
                                    WorkerMessage)

STATS = SchedulerStats(capacity_slots=100, used_slots=3, free_slots=97, running_requests=1,
                       waiting_requests=2, prompt_tokens_total=10, computed_prompt_tokens_total=9,
                       generated_tokens_total=5, finished_requests_total=4, aborted_requests_total=1,
                       cached_slots=2, evictable_slots=1, preemptions_total=3,
                       cache_hit_tokens_total=6, slots_consistent=True)
USAGE = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**40, max_new_tokens=12,
                          min_p=0.05, logit_bias={3: -100.0, 17: 2.5}, repetition_penalty=1.1,
                          frequency_penalty=0.5, presence_penalty=-0.5, min_tokens=2,
                          logprobs=3, prompt_logprobs=3, grammar='{"grammars": []}')

# (record, the union its receiving socket decodes)
SAMPLES = [
    (ProcessProgress(name="worker", text="loading"), LauncherMessage),
    (ProcessReady(name="worker", detail="100 slots"), LauncherMessage),
    (ProcessFailed(name="worker", reason="layer 0: ArraysCache", refusal=True), LauncherMessage),
    (TokenizedRequest(rid="a", input_ids=[1, 2, 3], sampling=SAMPLING, stop_token_ids=[0],
                      skip_special_tokens=False), SchedulerMessage),
    (AbortRequest(rid="a"), SchedulerMessage),
    (GetStats(query_id="q"), SchedulerMessage),
    (FlushCache(query_id="f"), SchedulerMessage),
    (WorkerReady(num_slots=10, max_context_len=8, overlap=True), SchedulerMessage),
    (StepResult(step=3, rids=["a", "b"], token_ids=[5, 6]), SchedulerMessage),
    (StepResult(step=4, rids=[], token_ids=[], prompt_logprobs=[PromptLogprobs(
        rid="a", start=1, logprobs=[-0.5, -1.5], top_k=1, top_ids=[3, 4],
        top_logprobs=[-0.1, -0.2])]), SchedulerMessage),
    (ForwardBatch(step=1, new_requests=[NewRequest(rid="a", sampling=SAMPLING,
                                                   prefix_slot_ids=[7, 8], num_sampled=2,
                                                   stop_token_ids=[0], prompt_ids=[1, 2],
                                                   output_ids=[5, 6])],
                  prefill=[PrefillChunk(rid="a", start=0, token_ids=[1, 2], slot_ids=[4, 5],
                                        sample=True)],
                  decode_rids=["b"], decode_slots=[9], released=["c"]), WorkerMessage),
    (Shutdown(reason="bye"), WorkerMessage),
    (SyncSteps(), WorkerMessage),
    (BatchTokens(outputs=[TokenOutput(rid="a", token_ids=[1], finished=True, finish_reason="stop",
                                      usage=USAGE, prompt_tail=[1, 2])]), DetokenizerMessage),
    (BatchTokens(outputs=[TokenOutput(
        rid="a", token_ids=[4], logprobs=[TokenLogprob(logprob=-0.3, top_ids=[4],
                                                        top_logprobs=[-0.3])],
        prompt_logprobs=PromptTokenLogprobs(token_ids=[1, 2], logprobs=[TokenLogprob(-1.0)]),
        cumulative_logprob=-0.3)]), DetokenizerMessage),
    (StatsReply(query_id="q", stats=STATS), DetokenizerMessage),
    (BatchText(outputs=[TextOutput(rid="a", text="h\u00e9\U0001F642", token_ids=[1],
                                   finished=True, finish_reason="length", usage=USAGE)]),
     TokenizerMessage),
    (BatchText(outputs=[TextOutput(
        rid="a", text="x", token_ids=[4], cumulative_logprob=-0.3,
        logprobs=[TextLogprob("x", -0.3, ["x"], [-0.3], token_id=4, top_ids=[4])],
        prompt_logprobs=PromptTextLogprobs("a", 1, [TextLogprob("b", -1.0, token_id=2)]))]),
     TokenizerMessage),
    (StatsReply(query_id="q2", stats=STATS), TokenizerMessage),
    (EngineDead(reason="the worker died"), TokenizerMessage),
    (GenerateRequest(request_id="c1", prompt="hi", max_tokens=3, temperature=0.0, stream=True),
     ClientToServer),
    (AbortGenerate(request_id="c1"), ClientToServer),
    (StatsQuery(request_id="s"), ClientToServer),
    (GenerateOutput(request_id="c1", text="x", token_ids=[3], finished=True, usage=USAGE),
     ServerToClient),
    (GenerateRequest(request_id="c2", input_ids=[1], n=3, logprobs=2), ClientToServer),
    (GenerateRequest(request_id="c3", prompt="x", json_schema={"type": "object"}),
     ClientToServer),
    (GenerateRequest(request_id="c4", prompt="x", regex="a+"), ClientToServer),
    (GenerateOutput(request_id="c2", text="", token_ids=[], index=2), ServerToClient),
    (StatsResult(request_id="s", stats=STATS), ServerToClient),
]


def _all_message_types() -> set[type]:
    found = set()
    for info in pkgutil.iter_modules(ipc.messages.__path__):
        module = importlib.import_module(f"ipc.messages.{info.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Message) and obj is not Message:
                found.add(obj)
    return found


def test_every_message_type_has_a_round_trip_sample():
    assert _all_message_types() <= {type(m) for m, _ in SAMPLES}


@pytest.mark.parametrize("message,accepted", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(message, accepted):
    assert Decoder(accepted, "test").decode(encode(message)) == message


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"garbage that is not msgpack",
                                   encode(ProcessReady(name="x")),  # a record of another family
                                   encode(AbortRequest(rid="a"))[:-1]])  # truncated
def test_undecodable_frames_are_dropped(frame, caplog):
    assert Decoder(SchedulerMessage, "test").decode(frame) is None
    assert "dropped a frame" in caplog.text


def test_wrong_field_type_is_dropped():
    bad = encode(StepResult(step=1, rids=["a"], token_ids=[1])).replace(b"StepResult", b"AbortRequest")
    assert Decoder(SchedulerMessage, "test").decode(bad) is None


def test_receiver_keeps_serving_after_a_bad_frame(tmp_path):
    from ipc.channel import Receiver, Sender

    endpoint = f"ipc://{tmp_path}/sock"
    rx = Receiver(endpoint, SchedulerMessage)
    raw = Sender(endpoint)
    raw._sock.send(b"\x00\x01junk")
    raw.send(AbortRequest(rid="ok"))
    got = [rx.recv(timeout_ms=2000), rx.recv(timeout_ms=2000)]
    assert got == [None, AbortRequest(rid="ok")]
    raw.close()
    rx.close()


@pytest.mark.parametrize("raw,expected", [
    ({"type": "GenerateRequest", "request_id": "r1", "prompt": "hi", "max_tokens": "x"},
     DecodeProblem("Expected `int | null`, got `str` - at `$.max_tokens`", "GenerateRequest",
                   "r1")),
    ({"type": "Nonsense", "request_id": "r2"},
     DecodeProblem("Invalid value 'Nonsense' - at `$.type`", "Nonsense", "r2")),
    ({"request_id": 7}, DecodeProblem("Object missing required field `type`")),
    ([1, 2], DecodeProblem("Expected `object`, got `array`")),
])
def test_a_frame_that_does_not_decode_says_why_and_whose(raw, expected):
    problem = Decoder(ClientToServer, "test").decode_or_problem(msgspec.msgpack.encode(raw))
    assert problem == expected


def test_garbage_says_why_without_a_request_id():
    problem = Decoder(ClientToServer, "test").decode_or_problem(b"\xc1junk")
    assert isinstance(problem, DecodeProblem) and problem.request_id is None and problem.error


def test_connections_name_a_closed_connections_client_and_never_a_newcomer():
    """The client endpoint's map from connections (fds) to clients: a closed fd names
    its client once; a message still queued from it is refused; the fd's next
    connection is someone else."""
    from ipc.channel import Connections

    connections = Connections()
    connections.opened(7)
    assert connections.came(b"a", 7) and connections.came(b"a", 7)
    assert connections.closed(7) == b"a"
    assert not connections.came(b"a", 7)
    connections.opened(7)
    assert connections.came(b"b", 7)
    assert connections.closed(7) == b"b"
    assert connections.closed(9) is None  # it never sent anything


def _lose_the_device(config) -> None:  # noqa: ANN001 - a child's entry (picklable)
    import atexit

    from worker_proc.device_lost import DeviceLost

    # A destructor that would run at a normal exit (MLX's CUDA streams abort there on a
    # lost context): exiting at once skips it.
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))
    raise DeviceLost("the GPU can run nothing more after a step failed with: an illegal "
                     "memory access was encountered")


def test_a_child_that_loses_its_device_reports_why_and_exits_1_at_once(tmp_path):
    """ExitAtOnce (DeviceLost): the launcher hears the reason, then the child exits with
    code 1 without tearing its native state down (no atexit, no destructors)."""
    import multiprocessing as mp

    from ipc.channel import Receiver
    from ipc.config import ServerConfig
    from ipc.process import run_child

    config = ServerConfig(run_dir=str(tmp_path))
    inbox = Receiver(config.launcher_endpoint, LauncherMessage)
    child = mp.get_context("spawn").Process(target=run_child,
                                            args=("worker", _lose_the_device, config))
    child.start()
    report = inbox.recv(timeout_ms=20_000)
    child.join(20)
    inbox.close()
    assert child.exitcode == 1
    assert isinstance(report, ProcessFailed) and report.name == "worker"
    assert "DeviceLost" in report.reason and "illegal memory access" in report.reason

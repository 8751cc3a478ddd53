"""Stop strings (scheduler stops, detokenizer cuts) and n > 1 choices.

Three layers: the pure text logic, the real engine on the tiny model (the stop must end
generation at the very token that completes it), and end to end through the server.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from detokenizer_proc.state import DetokenizerManager
from ipc.messages.common import SamplingParams
from ipc.messages.to_detokenizer import BatchTokens, TokenOutput
from ipc.messages.to_scheduler import TokenizedRequest
from kiln_common.stops import LogprobGate, StopStringMatcher, StopTrimmer, first_stop
from tests.engine_driver import InProcessEngine
from tests.server import Server

MODEL = "demo-tiny"
PROMPT = "Hello world, this is"


# --- the text logic ----------------------------------------------------------------------


def test_first_stop_takes_the_earliest_then_shortest():
    assert first_stop("xabcb", ["b", "abc"]) == (1, "abc")
    assert first_stop("xab", ["ab", "a"]) == (1, "a")
    assert first_stop("xyz", ["q"]) is None


def test_matcher_finds_a_stop_split_across_increments():
    matcher = StopStringMatcher(["<end>", "zz"])
    assert [matcher.feed(d) for d in ["ab", "c<e", "n", "", "d>tail"]] == [
        None, None, None, None, "<end>"]


def test_matcher_keeps_a_bounded_tail():
    matcher = StopStringMatcher(["abc"])
    for _ in range(1000):
        matcher.feed("xyz")
    assert len(matcher._tail) == 2 and matcher.feed("abc") == "abc"


@pytest.mark.parametrize("include", [False, True])
def test_trimmer_never_emits_past_the_cut(include):
    trimmer = StopTrimmer(["STOP", "!!"], include_stop=include)
    deltas = [trimmer.push(d) for d in ["Hello S", "T", "OP and", " more"]]
    assert deltas == ["Hello ", "", "STOP" if include else "", ""]
    assert trimmer.matched == "STOP"


def test_trimmer_releases_a_false_start_and_flushes_at_the_end():
    trimmer = StopTrimmer(["STOP"])
    assert trimmer.push("a ST") == "a "
    assert trimmer.push("ing S") == "STing "
    assert trimmer.push("T", final=True) == "ST"


def test_detokenizer_cuts_the_text_at_the_stop(tiny_model):
    tokenizer = tiny_model[1]
    ids = tokenizer.encode(" one two three four")
    manager = DetokenizerManager(tokenizer)
    outs = [TokenOutput(rid="r", token_ids=[t], stop=["thr"] if i == 0 else None)
            for i, t in enumerate(ids)]
    outs[-1] = TokenOutput(rid="r", token_ids=[ids[-1]], finished=True, finish_reason="stop",
                           stop_str="thr")
    text = "".join(manager.process(BatchTokens(outputs=[o])).outputs[0].text for o in outs)
    assert text == " one two " and len(manager) == 0


# --- the engine: the stop ends generation at the token that completes it ----------------


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _spanning_stop(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A 4-character stop string that first occurs across the boundary of two visible
    tokens, and the number of tokens up to the one that completes it."""
    texts = [tokenizer.decode(ids[:j]) for j in range(len(ids) + 1)]
    for k in range(1, len(ids) - 1):
        left, right = texts[k + 1][len(texts[k]):], texts[k + 2][len(texts[k + 1]):]
        if len(left) < 2 or len(right) < 2 or "\ufffd" in left + right:
            continue
        stop = left[-2:] + right[:2]
        if stop not in texts[k + 1] and texts[k + 2].find(stop) >= len(texts[k + 1]) - 2:
            return stop, k + 2
    raise AssertionError("no stop candidate in the oracle's output")


@pytest.mark.parametrize(("include", "depth"), [(False, 2), (True, 2), (False, 3)])
def test_engine_stops_at_the_token_completing_a_stop(tiny_model, hf_tokenizer, oracle, include,
                                                     depth):
    """depth: steps in flight; rows planned past the stop are computed, then discarded."""
    model, _ = tiny_model
    prompt = hf_tokenizer.encode(PROMPT)
    expected = oracle(prompt, 40)
    stop, n_tokens = _spanning_stop(hf_tokenizer, expected)
    engine = InProcessEngine(model, tokenizer=hf_tokenizer, steps_in_flight=depth)
    engine.submit_message(TokenizedRequest(
        rid="s", input_ids=prompt, stop_token_ids=[],
        sampling=SamplingParams(temperature=0.0, max_new_tokens=40), stop=[stop],
        include_stop_str_in_output=include))
    engine.run_until_idle()
    result = engine.results["s"]
    assert result.finish_reason == "stop"
    assert result.token_ids == expected[:n_tokens]  # not one token more
    # The detokenizer's cut, fed the same outputs the scheduler sends.
    outputs = [TokenOutput(rid="d", token_ids=[t], stop=[stop] if i == 0 else None,
                           include_stop_str=include) for i, t in enumerate(result.token_ids)]
    outputs[-1] = TokenOutput(rid="d", token_ids=outputs[-1].token_ids, finished=True,
                              finish_reason="stop", stop_str=stop, include_stop_str=include)
    detok = DetokenizerManager(hf_tokenizer)
    text = "".join(detok.process(BatchTokens(outputs=[o])).outputs[0].text for o in outputs)
    full = hf_tokenizer.decode(expected)
    cut = full.find(stop) + (len(stop) if include else 0)
    assert text == full[:cut]
    assert engine.scheduler.slots_consistent()


# --- end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = Server(tiny_model_dir, "--max-total-tokens", "20000", "--served-model-name", MODEL,
                 log_path=log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x")


def _full_text(client, max_tokens: int = 40) -> str:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True})
    return r.choices[0].text


@pytest.mark.parametrize("include", [False, True])
def test_stop_streamed_equals_whole(client, hf_tokenizer, include):
    full = _full_text(client)
    stop, n_tokens = _spanning_stop(hf_tokenizer, hf_tokenizer.encode(full,
                                                                       add_special_tokens=False))
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "@@@"],
                  extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
    whole = client.completions.create(**kwargs)
    expected = full[:full.find(stop) + (len(stop) if include else 0)]
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stop(client):
    messages = [{"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                          temperature=0).choices[0].message.content
    stop = full[5:8] if len(full) > 8 else None
    if not stop or not stop.strip():
        pytest.skip("the tiny model's reply is too short for a stop string")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                       temperature=0, stop=stop)
    assert r.choices[0].message.content == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_n_choices_share_the_prompt(client, server):
    prompt = "The same long prompt, computed once for every choice. " * 8
    before = server.stats()["computed_prompt_tokens_total"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=3, seed=5,
                                  temperature=1.0)
    computed = server.stats()["computed_prompt_tokens_total"] - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3
    assert r.usage.prompt_tokens < computed + 3 < 2 * r.usage.prompt_tokens
    assert r.usage.completion_tokens == 36
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=3, seed=5,
                                      temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seed + i


def test_abort_request_with_the_response_id_stops_every_choice(server):
    import json
    import time

    body = {"model": MODEL, "prompt": "go on and on", "max_tokens": 3000, "n": 2,
            "temperature": 1.0, "stream": True}
    finishes = {}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            aborted = http.post("/abort_request", json={"rid": first["id"]}).json()
            assert aborted == {"aborted": True}
            for line in lines:
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("finish_reason"):
                            finishes[choice["index"]] = choice["finish_reason"]
    # OpenAI's schema has no "abort": a cut choice reports "length" (responses.py)
    assert finishes == {0: "length", 1: "length"}
    deadline = time.monotonic() + 20
    while server.stats()["running_requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_n_choices_stream_with_their_index(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2,
        seed=1, temperature=1.0, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1} and chunks[-1].usage.completion_tokens > 0
    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, seed=1,
        temperature=1.0)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]


@pytest.mark.parametrize("body,param", [
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"n": 1, "best_of": 17}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
])
def test_invalid_stop_and_n_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_best_of_equal_to_n_is_accepted(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# --- logprob entries follow the cut --------------------------------------------------------


@pytest.mark.parametrize(("include", "expected"), [(False, [[0], [1], [], []]),
                                                   (True, [[0], [1], [], [2, 3]])])
def test_logprob_gate_keeps_the_entries_of_returned_text(include, expected):
    """One entry per token; a token is kept when its text starts before the cut."""
    trimmer, gate = StopTrimmer(["STOP"], include_stop=include), LogprobGate()
    out = []
    for i, token_text in enumerate(["Hel", "lo S", "TO", "Px"]):
        text = trimmer.push(token_text)
        out.append(gate.push([i], token_text, text, trimmer.matched is not None, final=False))
    assert out == expected


def test_logprob_gate_holds_with_the_text_and_flushes_at_the_end():
    trimmer, gate = StopTrimmer(["STOP"]), LogprobGate()
    assert gate.push([0], "a S", trimmer.push("a S"), False, False) == [0]
    assert gate.push([1], "T", trimmer.push("T"), False, False) == []  # "ST" is held back
    text = trimmer.push("", final=True)
    assert text == "ST" and gate.push([], "", text, False, final=True) == [1]

"""Structured output end to end, through all four processes: OpenAI `response_format` with
the official client, the native /generate constraints (regex, Lark, GBNF), the ZMQ client,
refusals, batch mates left exact, and the plain loop without overlap."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from tests.server import Server

pytestmark = pytest.mark.timeout(300)

MODEL = "demo-tiny"
# Bounded strings, enums, integers and booleans: a random-weight model, held to the
# schema, finishes well within max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "species": {"enum": ["cat", "dog", "axolotl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "vaccinated": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "vaccinated", "tags"],
    "additionalProperties": False,
}
PET_FORMAT = {"type": "json_schema",
              "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
PROMPT = [{"role": "user", "content": "Describe a pet as JSON."}]


def _start(model_dir, tmp_path_factory, *extra: str) -> Server:
    log = tmp_path_factory.mktemp("server") / "server.log"
    return Server(model_dir, "--max-total-tokens", "16000", "--max-running-requests", "32",
                  "--served-model-name", MODEL, *(extra or ("--overlap", "on")),
                  log_path=log).wait_ready()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = _start(tiny_model_dir, tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


def _async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


async def _pets(client: openai.AsyncOpenAI, seeds: range, **extra: Any) -> list[Any]:
    return await asyncio.gather(*(client.chat.completions.create(
        model=MODEL, messages=PROMPT, response_format=PET_FORMAT, temperature=1.0, seed=seed,
        max_tokens=200, **extra) for seed in seeds))


def _assert_pets(responses: list[Any]) -> None:
    for r in responses:
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_twenty_seeded_json_schema_outputs_validate(server) -> None:
    responses = asyncio.run(_pets(_async_client(server), range(20)))
    _assert_pets(responses)
    assert len({r.choices[0].message.content for r in responses}) > 10  # really sampled


def test_n_choices_and_streaming_each_follow_the_schema(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    whole = client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=PET_FORMAT,
                                           temperature=1.0, seed=7, max_tokens=200, n=3)
    assert len(whole.choices) == 3
    _assert_pets([whole])
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PROMPT, response_format=PET_FORMAT, temperature=1.0, seed=8,
        max_tokens=200, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_outputs_are_json_objects(server, tiny_model) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    # A free-form object can go on for ever on random weights: a bias towards the tokens
    # that close strings and objects lets it end; the grammar still decides what is valid.
    closers = tiny_model[1]._tokenizer.convert_tokens_to_ids(['"', '":', '"}', "}"])
    bias = {str(t): 6.0 for t in closers}
    for seed in range(4):
        chat = client.chat.completions.create(
            model=MODEL, messages=PROMPT, response_format={"type": "json_object"},
            temperature=1.0, seed=seed, max_tokens=150, logit_bias=bias)
        completion = client.completions.create(
            model=MODEL, prompt="A JSON object:", temperature=1.0, seed=seed, max_tokens=150,
            logit_bias=bias, extra_body={"response_format": {"type": "json_object"}})
        for text, reason in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                             (completion.choices[0].text, completion.choices[0].finish_reason)):
            assert reason == "stop", text
            assert isinstance(json.loads(text), dict), text


def _generate(server: Server, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=60)


def test_regex_on_native_generate(server) -> None:
    pattern = r"[A-Z][a-z]{2,5} (19|20)[0-9]{2}"
    for seed in range(5):
        r = _generate(server, text="A name and a year:", sampling_params={
            "regex": pattern, "temperature": 1.0, "seed": seed, "max_new_tokens": 30})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"] == "stop"
        assert re.fullmatch(pattern, out["text"]), out["text"]


def test_lark_and_gbnf_grammars_on_native_generate(server) -> None:
    lark = 'start: answer " " number\nanswer: "yes" | "no" | "maybe"\nnumber: /[1-9][0-9]?/\n'
    gbnf = 'root ::= ("yes" | "no" | "maybe") " " [1-9] [0-9]?\n'
    for params in ({"lark": lark}, {"ebnf": gbnf}):
        for seed in range(3):
            r = _generate(server, text="Answer:", sampling_params={
                **params, "temperature": 1.0, "seed": seed, "max_new_tokens": 20})
            assert r.status_code == 200, r.text
            assert re.fullmatch(r"(yes|no|maybe) [1-9][0-9]?", r.json()["text"]), r.json()


def test_zmq_client_with_a_json_schema(server) -> None:
    from ipc.client import KilnClient, KilnRequestError

    with KilnClient(server.zmq) as client:
        as_object = client.generate("A pet:", json_schema=SCHEMA, temperature=1.0, seed=3,
                                    max_tokens=200)
        as_text = client.generate("A pet:", json_schema=json.dumps(SCHEMA), temperature=1.0,
                                  seed=3, max_tokens=200)
        with pytest.raises(KilnRequestError, match="at most one"):
            client.generate("x", json_schema=SCHEMA, regex="a+")
    assert as_object.finish_reason == "stop"
    jsonschema.validate(json.loads(as_object.text), SCHEMA)
    assert as_text.token_ids == as_object.token_ids


def test_invalid_constraints_are_a_400_with_an_openai_error_body(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=PROMPT, response_format=bad)
    assert info.value.body["param"] == "response_format.json_schema.schema"
    r = _generate(server, text="x", sampling_params={"regex": "a(", "max_new_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.regex"
    r = _generate(server, text="x", sampling_params={"regex": "a+", "lark": 'start: "a"'})
    assert r.status_code == 400 and "at most one" in r.json()["error"]["message"]


def _greedy_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(5, vocab, size=n).tolist() for n in (3, 40, 150, 9)]


async def _greedy_beside_constrained(server: Server, prompts: list[list[int]],
                                     max_tokens: int) -> list[Any]:
    client = _async_client(server)
    greedy = [client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens,
                                        temperature=0) for p in prompts]
    results = await asyncio.gather(*greedy, _pets(client, range(100, 106)))
    _assert_pets(results[-1])
    return list(results[:-1])


def _check_greedy_beside_constrained(server, tiny_model, oracle) -> None:
    model, tokenizer = tiny_model
    prompts = _greedy_prompts(model.args.vocab_size)
    responses = asyncio.run(_greedy_beside_constrained(server, prompts, 40))
    for p, r in zip(prompts, responses):
        assert r.choices[0].text == tokenizer.decode(oracle(p, 40))


def test_greedy_requests_beside_constrained_ones_match_mlx_lm(server, tiny_model, oracle) -> None:
    _check_greedy_beside_constrained(server, tiny_model, oracle)


def test_without_overlap(tiny_model_dir, tmp_path_factory, tiny_model, oracle) -> None:
    srv = _start(tiny_model_dir, tmp_path_factory, "--disable-overlap")
    try:
        _check_greedy_beside_constrained(srv, tiny_model, oracle)
        r = _generate(srv, text="Code:", sampling_params={
            "regex": "[A-Z]{3}-[0-9]{4}", "temperature": 1.0, "seed": 1, "max_new_tokens": 20})
        assert re.fullmatch("[A-Z]{3}-[0-9]{4}", r.json()["text"]), r.text
    finally:
        assert srv.stop() == 0, srv.log_tail()


# --- validation off the event loop, kept verdicts, tokenizers built ahead -----------------
# Unit tests of the front's logic (no sockets, no server) and of the worker's matchers.

REGEX_BODY = {"text": "x", "sampling_params": {"regex": "[a-c]{2,5}", "max_new_tokens": 3}}


class GatedValidation:
    """A validation that blocks until released and counts its calls: a big schema stand-in
    whose slowness is under the test's control rather than the clock's."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()  # open unless a test closes it

    def __call__(self, grammar: str, tokenizer: Any) -> Any:
        from tokenizer_proc.constraints import llguidance_verdict

        self.calls.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30), "the test never released the validation"
        return llguidance_verdict(grammar, tokenizer)


@pytest.fixture(scope="module")
def hf_and_info(tiny_model_dir):
    from transformers import AutoTokenizer

    from kiln_common.model_info import load_model_info

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return hf, load_model_info(MODEL, str(tiny_model_dir), hf)


def _gated_preparer(hf_and_info, gate: GatedValidation, make: Any = None) -> Any:
    from tokenizer_proc.constraints import GrammarCompiler
    from kiln_common.llguidance_tokenizer import ll_tokenizer
    from tokenizer_proc.prepare import RequestPreparer

    hf, info = hf_and_info
    make = make or (lambda: ll_tokenizer(hf, info.eos_token_ids))
    return RequestPreparer(hf, info, GrammarCompiler(make, gate))


async def _wait_for(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 30)


def _closed_gate_and_engine() -> tuple[GatedValidation, Any, Any]:
    """A validation gate that holds every grammar until released, and a fake engine
    answering "ab" behind a manager."""
    from tests.fake_engine import FakeEngine, text_script
    from tokenizer_proc.manager import TokenizerManager

    gate = GatedValidation()
    gate.release.clear()
    engine = FakeEngine(text_script(["ab"]))
    manager = TokenizerManager(engine)
    engine.connect(manager)
    return gate, engine, manager


def test_a_slow_validation_does_not_hold_up_a_plain_http_request(hf_and_info) -> None:
    from tokenizer_proc.http_api import create_app

    gate, engine, manager = _closed_gate_and_engine()
    app = create_app(manager, _gated_preparer(hf_and_info, gate), {"model_name": MODEL})

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as http:
            constrained = asyncio.ensure_future(http.post("/generate", json=REGEX_BODY))
            await _wait_for(gate.entered)  # its validation now runs (and blocks) off the loop
            plain = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                             "max_tokens": 2})
            assert plain.status_code == 200, plain.text
            assert not constrained.done()
            assert [r.sampling.grammar for r in engine.requests()] == [None]
            gate.release.set()
            assert (await constrained).status_code == 200
        assert engine.requests()[1].sampling.grammar
        assert gate.calls and all(name.startswith("grammar-validation") for name in gate.calls)

    asyncio.run(scenario())


def test_a_slow_validation_does_not_hold_up_a_plain_zmq_request(hf_and_info) -> None:
    from ipc.messages.client import GenerateOutput, GenerateRequest
    from tokenizer_proc.client_front import ClientFront

    gate, engine, manager = _closed_gate_and_engine()

    async def scenario() -> None:
        replies: asyncio.Queue[GenerateOutput] = asyncio.Queue()

        async def reply(identity: bytes, message: Any) -> None:
            await replies.put(message)

        front = ClientFront(manager, _gated_preparer(hf_and_info, gate), reply)
        constrained = asyncio.ensure_future(front.handle(b"a", GenerateRequest(
            request_id="constrained", prompt="x", regex="[a-c]{2,5}", max_tokens=3)))
        await _wait_for(gate.entered)
        await front.handle(b"b", GenerateRequest(request_id="plain", prompt="x", max_tokens=2))
        first = await asyncio.wait_for(replies.get(), 30)
        assert (first.request_id, first.finished, first.error) == ("plain", True, None)
        assert not constrained.done()
        gate.release.set()
        await constrained
        second = await asyncio.wait_for(replies.get(), 30)
        assert (second.request_id, second.error) == ("constrained", None)
        assert engine.requests()[1].sampling.grammar

    asyncio.run(scenario())


def test_a_repeated_grammar_is_validated_once(hf_and_info) -> None:
    from tokenizer_proc.constraints import Constraint

    gate = GatedValidation()
    grammars = _gated_preparer(hf_and_info, gate).grammars
    schema = Constraint("json_schema", SCHEMA, "response_format.json_schema.schema")
    first = grammars.compile(schema)
    assert grammars.compile(schema) == first and len(gate.calls) == 1
    # The same schema under another parameter (and as JSON text) is the same grammar.
    assert grammars.compile(Constraint("json_schema", json.dumps(SCHEMA), "json_schema")) == first
    assert len(gate.calls) == 1

    async def clients_at_once() -> None:
        regex = Constraint("regex", "[0-9]{3}", "regex")
        await asyncio.gather(*(grammars.prevalidate(regex) for _ in range(5)))
        grammars.compile(regex)

    asyncio.run(clients_at_once())
    assert len(gate.calls) == 2


def test_a_kept_refusal_still_names_each_requests_parameter(hf_and_info) -> None:
    from tokenizer_proc.constraints import Constraint
    from tokenizer_proc.errors import RequestError

    gate = GatedValidation()
    grammars = _gated_preparer(hf_and_info, gate).grammars
    for param in ("regex", "sampling_params.regex"):
        asyncio.run(grammars.prevalidate(Constraint("regex", "a(", param)))  # raises nothing
        with pytest.raises(RequestError) as info:
            grammars.compile(Constraint("regex", "a(", param))
        assert (info.value.param, info.value.code) == (param, "invalid_grammar")
    assert len(gate.calls) == 1


def test_prevalidation_leaves_the_order_of_errors_alone(hf_and_info) -> None:
    from tokenizer_proc.errors import RequestError
    from tokenizer_proc.protocol import GenerateBody

    gate = GatedValidation()
    preparer = _gated_preparer(hf_and_info, gate)
    bad = GenerateBody.model_validate({"text": "x", "sampling_params": {
        "regex": "a(", "ignore_eos": True}})
    asyncio.run(preparer.prevalidate(bad))
    with pytest.raises(RequestError) as info:
        preparer.native(bad, "r1")
    assert info.value.param == "sampling_params.ignore_eos"  # checked before the grammar
    two = GenerateBody.model_validate({"text": "x", "sampling_params": {
        "regex": "a+", "lark": 'start: "a"'}})
    asyncio.run(preparer.prevalidate(two))  # one_constraint's 400 is the entry point's
    with pytest.raises(RequestError, match="at most one"):
        preparer.native(two, "r2")


def test_the_fronts_llguidance_tokenizer_is_built_once_at_start_up(hf_and_info) -> None:
    from tokenizer_proc.constraints import Constraint
    from kiln_common.llguidance_tokenizer import ll_tokenizer

    hf, info = hf_and_info
    built: list[str] = []

    def make() -> Any:
        built.append(threading.current_thread().name)
        return ll_tokenizer(hf, info.eos_token_ids)

    preparer = _gated_preparer(hf_and_info, GatedValidation(), make)
    preparer.start_grammar_build()
    for pattern in ("a+", "b+"):
        preparer.grammars.compile(Constraint("regex", pattern, "regex"))
    assert built == ["llguidance tokenizer"]  # the background thread, not the caller


def test_a_tokenizer_llguidance_cannot_use_is_refused_without_retrying(hf_and_info) -> None:
    from tokenizer_proc.constraints import Constraint
    from kiln_common.llguidance_tokenizer import structured_output_supported
    from tokenizer_proc.errors import RequestError
    from tokenizer_proc.prepare import RequestPreparer

    hf, info = hf_and_info
    assert structured_output_supported(hf) and not structured_output_supported(object())
    unsupported = RequestPreparer(object(), info)
    unsupported.start_grammar_build()  # builds nothing for a tokenizer it can't wrap
    assert not unsupported.grammars.building_started
    builds: list[int] = []

    def broken() -> Any:
        builds.append(1)
        raise ValueError("Only fast tokenizers are supported")

    preparer = _gated_preparer(hf_and_info, GatedValidation(), broken)
    for _ in range(2):
        asyncio.run(preparer.grammars.prevalidate(Constraint("regex", "a+", "regex")))
        with pytest.raises(RequestError, match="not available") as info_:
            preparer.grammars.compile(Constraint("regex", "a+", "regex"))
        assert info_.value.code == "unsupported_parameter"
    assert builds == [1]


def test_worker_matchers_wait_for_the_start_up_build_instead_of_building(tiny_model,
                                                                         hf_and_info) -> None:
    from llguidance import LLMatcher

    from kiln_common.llguidance_tokenizer import ll_tokenizer
    from worker_proc.grammar import GrammarMatchers

    hf, info = hf_and_info
    gate = threading.Event()
    built: list[str] = []

    def make() -> Any:
        built.append(threading.current_thread().name)
        assert gate.wait(30)
        return ll_tokenizer(hf, info.eos_token_ids)

    matchers = GrammarMatchers(make)
    matchers.start_building()
    with ThreadPoolExecutor(1) as step:  # a step's first constrained row, mid-build
        first = step.submit(matchers.matcher, LLMatcher.grammar_from_regex("(yes|no)"))
        while not built:
            time.sleep(0.001)
        assert not first.done()
        gate.set()
        assert not first.result(30).is_error()
    matchers.matcher(LLMatcher.grammar_from_regex("[0-9]+"))
    assert built == ["llguidance tokenizer"]


def test_build_runner_builds_llguidance_tokenizer_only_when_it_can(tiny_model_dir,
                                                                   monkeypatch) -> None:
    import mlx_lm

    from ipc.config import ServerConfig
    from worker_proc import build_runner

    config = ServerConfig(model_path=str(tiny_model_dir), max_running_requests=2)
    runner = build_runner(config)
    assert runner.grammars.building_started
    assert runner.grammars.tokenizer.vocab_size > 0
    load = mlx_lm.load
    monkeypatch.setattr(mlx_lm, "load", lambda *a, **k: (load(*a, **k)[0], object()))
    assert not build_runner(config).grammars.building_started

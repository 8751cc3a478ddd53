"""Structured output end to end, through all four processes: OpenAI `response_format` with
the official client, the native /generate constraints (regex, Lark, GBNF), the ZMQ client,
refusals, batch mates left exact, and the plain loop without overlap."""

from __future__ import annotations

import asyncio
import json
import re
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
                  "--served-model-name", MODEL, *extra, log_path=log).wait_ready()


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

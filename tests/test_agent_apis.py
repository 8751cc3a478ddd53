"""The agent APIs end to end, through all four processes on demo-tiny with tool-capable
templates (tests/agent_models.py), with the official `openai` and `anthropic` clients:
forced and required calls validate against their schemas (chat, Responses, Messages,
streamed and not), histories with tool results render, reasoning comes apart, and bad
requests get each API's error format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.agent_models import family_model
from tests.server import Server

pytestmark = pytest.mark.timeout(300)

MODEL = "demo-tiny"
# Bounded strings and enums: the random model, held to the schema, ends within max_tokens.
WEATHER = {"type": "object", "additionalProperties": False,
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "additionalProperties": False,
        "properties": {"tz": {"type": "string", "maxLength": 5}}, "required": ["tz"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool",
                                                "parameters": s}} for n, s in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": f"{n} tool", "input_schema": s}
                   for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _start(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    log = tmp_path_factory.mktemp("server") / "server.log"
    return Server(model_dir, "--max-total-tokens", "8000", "--max-running-requests", "8",
                  "--served-model-name", MODEL, log_path=log).wait_ready()


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agent-models")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, models: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = _start(family_model(tiny_model_dir, models, "hermes"), tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def _valid(name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMAS[name])
    return value


# --- chat completions -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_calls_validate(oai: openai.OpenAI, seed: int) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS,
                                    tool_choice="required", seed=seed, temperature=1.0,
                                    max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        assert call.id and call.type == "function"
        _valid(call.function.name, call.function.arguments)


def test_named_function_streamed_is_id_and_name_then_argument_fragments(
        oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=CHAT_TOOLS, seed=3, max_tokens=300, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas, content, reasons = [], "", []
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        deltas += choice.delta.tool_calls or []
        reasons.append(choice.finish_reason)
    assert content == "" and reasons[-1] == "tool_calls"
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2 and {d.index for d in deltas} == {0}
    _valid("get_weather", "".join(d.function.arguments or "" for d in deltas))


def test_one_call_without_parallel_tool_calls(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, seed=5,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_tokens=300)
    assert len(r.choices[0].message.tool_calls) == 1


def test_history_with_tool_results_renders(oai: openai.OpenAI) -> None:
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, seed=1,
                                        tool_choice="required", max_tokens=300)
    calls = first.choices[0].message.tool_calls
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=CHAT_TOOLS,
                                    max_tokens=8)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_auto_lets_the_model_answer_in_text_without_markup(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS, seed=2,
                                    max_tokens=24)
    message = r.choices[0].message
    assert "<tool_call>" not in (message.content or "")
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_requests_get_openai_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS,
                                    tool_choice={"type": "function",
                                                 "function": {"name": "missing"}})
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=ASK + [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "get_time", "arguments": "{not json"}}]}], tools=CHAT_TOOLS)
    assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


# --- Responses ------------------------------------------------------------------------


def test_responses_forced_call_then_output_continues_by_previous_id(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS,
                                 tool_choice="required", instructions="Use the tools.",
                                 max_output_tokens=300)
    assert first.status == "completed" and first.id.startswith("resp_")  # OpenAI's id form
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(_valid(c.name, c.arguments) for c in calls)
    second = oai.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=6, tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
               for c in calls])
    assert second.previous_response_id == first.id and second.status == "incomplete"
    assert second.usage.input_tokens > first.usage.input_tokens
    assert oai.responses.retrieve(second.id).id == second.id


def test_responses_stream_events(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text",
                                                          "text": "Time in UTC?"}]}],
        tools=RESPONSES_TOOLS, tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=200, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_time"
    _valid("get_time", done[0].arguments)
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"]


def test_responses_text_stream_and_errors(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input="Hello", max_output_tokens=5,
                                       stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert final.output[0].content[0].text == text
    with pytest.raises(openai.BadRequestError) as missing:  # OpenAI's answer: 400, not 404
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert missing.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_nope")
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as verbose:  # no such control here
        oai.responses.create(model=MODEL, input="x", text={"verbosity": "low"})
    assert verbose.value.body["param"] == "text.verbosity"
    plain = oai.responses.create(model=MODEL, input="x", max_output_tokens=1,
                                 text={"verbosity": "medium"})  # the default: taken
    assert plain.text.verbosity == "medium"


def test_responses_carry_input_system_messages_but_not_instructions(oai: openai.OpenAI) -> None:
    """previous_response_id carries the earlier input's system and developer messages
    (only `instructions` are not carried over): the continued prompt is the one sent
    whole with them."""
    first_input = [{"role": "system", "content": "Answer in French, in one short line."},
                   {"role": "user", "content": "Hello"}]
    first = oai.responses.create(model=MODEL, input=first_input, instructions="Be terse.",
                                 max_output_tokens=3, temperature=0.0)
    by_id = oai.responses.create(model=MODEL, previous_response_id=first.id, input="Again",
                                 max_output_tokens=1, temperature=0.0)
    said = [{"role": "assistant", "content": item.content[0].text}
            for item in first.output if item.type == "message"]
    whole = oai.responses.create(model=MODEL, input=first_input + said + [
        {"role": "user", "content": "Again"}], max_output_tokens=1, temperature=0.0)
    assert by_id.usage.input_tokens == whole.usage.input_tokens


def test_responses_as_codex_sends_them(oai: openai.OpenAI) -> None:
    """Codex's request shape (its own history, nothing stored, a cache key, function tools
    with strict false, one call at a time, streamed) is served; an effort the template
    cannot take is refused by name."""
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command",
             "strict": False, "parameters": {
                 "type": "object", "additionalProperties": False, "required": ["command"],
                 "properties": {"command": {"type": "array", "maxItems": 2,
                                            "items": {"type": "string", "maxLength": 6}}}}}
    events = list(oai.responses.create(
        model=MODEL, instructions="You are a coding agent.", stream=True, store=False,
        input=[{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "List the files."}]}],
        tools=[shell], tool_choice="required", parallel_tool_calls=False,
        include=["reasoning.encrypted_content"], reasoning={"effort": "medium"},
        max_output_tokens=200, extra_body={"prompt_cache_key": "conversation-1"}))
    final = events[-1].response
    assert events[-1].type == "response.completed", events[-1]
    assert final.prompt_cache_key == "conversation-1" and final.reasoning.effort == "medium"
    call = next(item for item in final.output if item.type == "function_call")
    assert call.name == "shell" and isinstance(json.loads(call.arguments)["command"], list)
    with pytest.raises(openai.NotFoundError):  # store false: nothing kept
        oai.responses.retrieve(final.id)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model=MODEL, input="x", reasoning={"effort": "high"})
    assert refused.value.body["param"] == "reasoning.effort"


# --- Anthropic Messages -----------------------------------------------------------------


def test_messages_usage_counts_cached_tokens_once(claude: anthropic.Anthropic) -> None:
    """Anthropic's input_tokens leaves out the cache's tokens (a client adds the two)."""
    ask = [{"role": "user", "content": "Tell me about the weather in Paris today, please."}]
    first = claude.messages.create(model=MODEL, max_tokens=1, messages=ask)
    again = claude.messages.create(model=MODEL, max_tokens=1, messages=ask)
    assert again.usage.cache_read_input_tokens > 0
    assert (again.usage.input_tokens + again.usage.cache_read_input_tokens
            == first.usage.input_tokens + first.usage.cache_read_input_tokens)


def test_messages_of_one_role_in_a_row_are_one_turn_and_cache_markers_are_taken(
        claude: anthropic.Anthropic) -> None:
    """Consecutive user messages are one turn (Anthropic combines them); a top-level
    cache_control is taken (every prompt is cached); max_tokens 0 computes the prompt
    alone (a cache warm-up): nothing generated, the prompt then read from the cache."""
    apart = [{"role": "user", "content": "What is the weather"},
             {"role": "user", "content": [{"type": "text", "text": "in Paris?"}]}]
    together = [{"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                             {"type": "text", "text": "in Paris?"}]}]
    count = lambda m: claude.messages.count_tokens(model=MODEL, messages=m).input_tokens  # noqa: E731
    assert count(apart) == count(together)
    warm = claude.messages.create(model=MODEL, max_tokens=0, messages=apart,
                                  extra_body={"cache_control": {"type": "ephemeral"}})
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0
    again = claude.messages.create(model=MODEL, max_tokens=1, messages=together)
    assert again.usage.cache_read_input_tokens > 0


def test_a_responses_stream_the_engine_ends_fails_with_error_then_response_failed() -> None:
    """The pair OpenAI sends when a response fails mid-stream, numbered in sequence."""
    from tokenizer_proc.assistant_parser import ParseSpec
    from tokenizer_proc.responses_api import ResponseBuilder
    from tokenizer_proc.tool_syntax import ModelSyntax

    builder = ResponseBuilder("resp_1", {"model": MODEL}, ParseSpec(ModelSyntax(None, None)))
    events = builder.opening() + builder.feed("Hello") + builder.fail("the engine died")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "the engine died"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert [item["type"] for item in failed["output"]] == ["message"]


def test_a_failed_tool_result_reaches_the_template_marked() -> None:
    """Anthropic's tool_result is_error: the tool message says so, for templates that
    mark failed calls (the others render its content alone)."""
    from tokenizer_proc.messages_api import MessagesRequest, messages_conversation

    body = MessagesRequest(model=MODEL, max_tokens=4, messages=ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time",
                                           "input": {"tz": "UTC"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "no clock", "is_error": True}]}])
    tool = messages_conversation(body, False).messages[-1]
    assert tool["role"] == "tool" and tool["is_error"] is True and tool["name"] == "get_time"


@pytest.mark.parametrize("inline", [False, True])
def test_reasoning_tokens_are_the_tokens_of_the_reasoning_block_with_its_markers(
        inline: bool) -> None:
    """Apart or inline (the text in content), reasoning's tokens are counted as OpenAI
    counts them: the tokens generated for it. Harmony: the analysis message's."""
    from tokenizer_proc.assistant_parser import ParseSpec
    from tokenizer_proc.responses import ChatFormat
    from tokenizer_proc.responses_api import ResponseBuilder
    from tokenizer_proc.tool_syntax import HARMONY, ModelSyntax, ReasoningMarkers

    think = ParseSpec(ModelSyntax(None, ReasoningMarkers("<think>", "</think>")),
                      inline_reasoning=inline)
    harmony = ParseSpec(ModelSyntax(HARMONY, None), inline_reasoning=inline)
    for spec, deltas, want in (
            (think, ["<think>", "Let", " me", " see", "</think>", "\n\n", "Hi", "!"], 5),
            (harmony, ["<|channel|>analysis<|message|>", "Let", " me", "<|end|>",
                       "<|start|>assistant<|channel|>final<|message|>", "Hi"], 4),
            # The same, a token a delta: the analysis header counts with its message.
            (harmony, ["<|channel|>", "analysis", "<|message|>", "Let", " me", "<|end|>",
                       "<|start|>", "assistant", "<|channel|>", "final", "<|message|>",
                       "Hi"], 6)):
        builder = ResponseBuilder("resp_1", {"model": MODEL}, spec)
        chat = ChatFormat("chatcmpl-1", MODEL, parse=spec)
        for text in deltas:
            builder.feed(text, 1)
            chat.text_chunks(text, None, 1)
        assert builder.reasoning_tokens == chat.reasoning_tokens == want, spec


def test_messages_continue_a_final_assistant_message(claude: anthropic.Anthropic,
                                                      tiny_model_dir: Path,
                                                      models: Path) -> None:
    """A final assistant message is the answer's beginning (Anthropic's prefill): the
    prompt ends with its text, the turn left open; what cannot follow text is refused."""
    from transformers import AutoTokenizer

    from kiln_common.model_info import load_model_info
    from tokenizer_proc.messages_api import MessagesRequest, messages_conversation
    from tokenizer_proc.prepare import RequestPreparer, SamplingInput

    prefill = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    model_dir = family_model(tiny_model_dir, models, "hermes")
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    preparer = RequestPreparer(hf, load_model_info(MODEL, str(model_dir), hf))
    body = MessagesRequest(model=MODEL, max_tokens=4, messages=prefill)
    turn = preparer.turn(messages_conversation(body, False),
                         SamplingInput(4, None, None, None, None), "r")
    assert hf.decode(turn.request.input_ids).endswith("assistant\nThe weather in Paris is")
    r = claude.messages.create(model=MODEL, max_tokens=4, messages=prefill)
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert (r.usage.input_tokens + r.usage.cache_read_input_tokens
            == claude.messages.count_tokens(model=MODEL, messages=prefill).input_tokens
            == len(turn.request.input_ids))
    with pytest.raises(anthropic.BadRequestError) as forced:
        claude.messages.create(model=MODEL, max_tokens=4, messages=prefill,
                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    assert "prefill" in forced.value.body["error"]["message"]


def test_messages_forced_tool_use(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model=MODEL, max_tokens=300, messages=ASK, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"},
                               system="You use tools.")
    assert r.stop_reason == "tool_use" and r.id.startswith("msg_")  # Anthropic's id form
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    _valid("get_weather", uses[0].input)
    # The result goes back as a tool_result block; the next turn renders it.
    follow = claude.messages.create(model=MODEL, max_tokens=4, tools=ANTHROPIC_TOOLS,
                                    messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny"}]}])
    prompt = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert prompt(follow) > prompt(r) + 10


def test_messages_stream_any_tool(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=MODEL, max_tokens=300, messages=ASK,
                                tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0
    for block in final.content:
        assert block.type == "tool_use"
        _valid(block.name, block.input)


def test_messages_text_stop_sequences_count_and_errors(claude: anthropic.Anthropic) -> None:
    greedy = {"temperature": 0.0, "top_k": 5}  # sent as such: this SDK's create() omits them
    r = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=greedy)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.content[0].type == "text"
    words = r.content[0].text.split()
    if len(words) > 2:
        cut = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK,
                                     extra_body=greedy, stop_sequences=[words[1]])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == words[1]
    count = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert count.input_tokens > claude.messages.count_tokens(model=MODEL,
                                                             messages=ASK).input_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_messages_validation_error_shape(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/messages", json={"messages": ASK}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Missing required parameter: 'max_tokens'."}}


# --- other families and reasoning -------------------------------------------------------


# Harmony is left to tests/test_tool_parsing.py: its forced call follows an optional
# analysis message, which random weights, once in it, never close.
@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_other_families_forced_calls(tiny_model_dir: Path, models: Path,
                                     tmp_path_factory: pytest.TempPathFactory,
                                     family: str) -> None:
    srv = _start(family_model(tiny_model_dir, models, family), tmp_path_factory)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        for stream in (False, True):
            kwargs = dict(model=MODEL, messages=ASK, tools=CHAT_TOOLS, seed=4, max_tokens=300,
                          tool_choice={"type": "function", "function": {"name": "get_time"}})
            if stream:
                deltas = [d for c in client.chat.completions.create(**kwargs, stream=True)
                          for d in c.choices[0].delta.tool_calls or []]
                name = deltas[0].function.name
                arguments = "".join(d.function.arguments or "" for d in deltas)
            else:
                call = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
                name, arguments = call.function.name, call.function.arguments
            assert name == "get_time"
            _valid(name, arguments)
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_reasoning_comes_apart_or_inline(tiny_model_dir: Path, models: Path,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = _start(family_model(tiny_model_dir, models, "thinking"), tmp_path_factory)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        apart = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                               temperature=0.0)
        message = apart.choices[0].message
        # The prompt opened <think>: the random text is all reasoning.
        assert message.reasoning_content and not message.content
        inline = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                                temperature=0.0,
                                                extra_body={"separate_reasoning": False})
        assert inline.choices[0].message.content
        assert inline.choices[0].message.content.strip() == message.reasoning_content
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=12, temperature=0.0, stream=True,
            stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                           for c in chunks if c.choices)
        assert streamed == message.reasoning_content
        # Every token is reasoning (the block never closes), counted alike whole, streamed
        # and summed over n choices.
        assert apart.usage.completion_tokens_details.reasoning_tokens == 12
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12
        two = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, n=2,
                                             seed=3)
        assert two.usage.completion_tokens_details.reasoning_tokens == 24
        assert inline.usage.completion_tokens_details.reasoning_tokens == 12  # inline too
        response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=12,
                                           temperature=0.0)
        assert response.output[0].type == "reasoning"
        # Its tokens are counted as reasoning, alike whole and streamed (all 12 here: the
        # random text never closes the block the prompt opened).
        events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=12,
                                              temperature=0.0, stream=True))
        usage = response.usage
        assert usage.output_tokens_details.reasoning_tokens == usage.output_tokens == 12
        assert events[-1].response.usage.output_tokens_details == usage.output_tokens_details
        answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=12,
                                         temperature=0.0,
                                         extra_body={"separate_reasoning": False})
        # Inline, the reasoning is content's text, and still its tokens are reasoning's.
        assert answer.usage.output_tokens_details.reasoning_tokens == 12
        # A stateless client gets the reasoning sealed and sends it back as it came.
        sealed = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                         store=False, include=["reasoning.encrypted_content"])
        item = sealed.output[0]
        assert item.type == "reasoning" and item.encrypted_content
        back = client.responses.create(model=MODEL, max_output_tokens=1, store=False, input=[
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": item.id, "summary": [],
             "encrypted_content": item.encrypted_content},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}])
        assert back.status in ("completed", "incomplete")
        with pytest.raises(openai.BadRequestError) as foreign:
            client.responses.create(model=MODEL, max_output_tokens=1, input=[
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-theirs"},
                {"role": "assistant", "content": "Hello"}])
        assert foreign.value.body["param"] == "input[0].encrypted_content"
        # R1's habit (the prompt opens the block; no enable_thinking): no way to skip it.
        with pytest.raises(openai.BadRequestError) as effort:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                           reasoning_effort="none")
        assert effort.value.body["param"] == "reasoning_effort"
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                       reasoning_effort="medium", prompt_cache_key="c-1")
        claude = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        msg = claude.messages.create(model=MODEL, max_tokens=12, messages=ASK,
                                     extra_body={"temperature": 0.0})
        assert msg.content[0].type == "thinking" and msg.content[0].thinking
        # A thinking budget closes the block once spent (the random text never does):
        # the answer follows it within max_tokens.
        held = claude.messages.create(model=MODEL, max_tokens=1040, messages=ASK,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in held.content] == ["thinking", "text"]
        assert held.usage.output_tokens == 1040 and held.stop_reason == "max_tokens"
        # Thinking off on a template that opens the block regardless: closed at once.
        off = claude.messages.create(model=MODEL, max_tokens=6, messages=ASK,
                                     thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"]
        for bad in ({"type": "enabled", "budget_tokens": 1000},  # below Anthropic's 1,024
                    {"type": "enabled", "budget_tokens": 2048}):  # not below max_tokens
            with pytest.raises(anthropic.BadRequestError) as refused:
                claude.messages.create(model=MODEL, max_tokens=2000, messages=ASK, thinking=bad)
            assert "budget_tokens" in refused.value.body["error"]["message"]
    finally:
        assert srv.stop() == 0, srv.log_tail()

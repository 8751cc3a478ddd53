"""OpenAI's reasoning controls on open models, without sockets: the reasoning effort
(chat's `reasoning_effort`, Responses' `reasoning.effort`) as each template takes it, and
Responses' sealed reasoning (`include: ["reasoning.encrypted_content"]`) that a stateless
client (Codex) sends back."""

from __future__ import annotations

import pytest

from tokenizer_proc.errors import RequestError
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.protocol import ChatCompletionRequest
from tokenizer_proc.responses_api import (ResponsesRequest, check_unsupported, input_messages,
                                          seal_reasoning)
from worker_proc.demo_model import ensure_demo_model

_BODY = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# GPT-OSS-like: the template reads reasoning_effort (and the model reasons: its markers).
EFFORT = _BODY + "|effort={{ reasoning_effort | default('unset') }}{# <think></think> #}"
# Qwen3-like: thinking can be turned off.
SWITCH = _BODY + ("|{% if enable_thinking is defined and not enable_thinking %}no-think"
                  "{% else %}<think>{% endif %}")
# DeepSeek-R1-like: always reasons (past answers lose their reasoning), no control.
ALWAYS = ("{% for m in messages %}{{ m['content'].split('</think>')[-1] }}{% endfor %}"
          "|<think>")
PLAIN = _BODY + "|"  # not a reasoning model


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))


def _render(demo, template: str, effort: str | None, **body: object) -> str:
    preparer = RequestPreparer.load("demo-tiny", str(demo), chat_template=template)
    request = preparer.chat(ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], reasoning_effort=effort,
        **body), "r0")
    return preparer._tokenizer.decode(request.input_ids)


def _render_with(demo, template: str, effort: str | None, defaults: dict) -> str:
    preparer = RequestPreparer.load("demo-tiny", str(demo), chat_template=template,
                                    template_kwargs=defaults)
    request = preparer.chat(ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], reasoning_effort=effort), "r0")
    return preparer._tokenizer.decode(request.input_ids)


def test_effort_reaches_a_template_that_reads_it(demo):
    assert _render(demo, EFFORT, None) == "hi|effort=unset"
    for effort in ("low", "medium", "high"):
        assert _render(demo, EFFORT, effort) == f"hi|effort={effort}"
    # GPT-OSS knows these three: others are refused, not written into its prompt.
    for effort in ("none", "minimal", "xhigh"):
        with pytest.raises(RequestError, match="low, medium or high only"):
            _render(demo, EFFORT, effort)
    # A request's own template variables win.
    assert _render(demo, EFFORT, "high", chat_template_kwargs={"reasoning_effort": "low"}) \
        == "hi|effort=low"


def test_no_effort_turns_thinking_off_where_the_template_can(demo):
    assert _render(demo, SWITCH, None) == "hi|<think>"
    assert _render(demo, SWITCH, "none") == "hi|no-think"
    assert _render(demo, SWITCH, "minimal") == "hi|no-think"
    assert _render(demo, SWITCH, "medium") == "hi|<think>"
    with pytest.raises(RequestError, match="no control of reasoning effort") as refused:
        _render(demo, SWITCH, "high")
    assert refused.value.param == "reasoning_effort"
    # A request asking for the default effort thinks, over a server default of no thinking.
    off = {"enable_thinking": False}
    assert _render_with(demo, SWITCH, None, off) == "hi|no-think"
    assert _render_with(demo, SWITCH, "medium", off) == "hi|<think>"


def test_effort_a_template_cannot_take_is_refused(demo):
    assert _render(demo, ALWAYS, "medium") == "hi|<think>"
    for effort in ("none", "low", "xhigh"):
        with pytest.raises(RequestError, match="no 'reasoning_effort' variable, nor a "
                           "thinking switch"):
            _render(demo, ALWAYS, effort)
    # A model that does not reason already reasons none.
    assert _render(demo, PLAIN, "none") == "hi|"
    with pytest.raises(RequestError):
        _render(demo, PLAIN, "high")


def test_sealed_reasoning_comes_back_as_the_reasoning_it_sealed():
    sealed = seal_reasoning("I should check the weather. ✓")
    messages = input_messages([
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": sealed},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}"}])
    assert messages[1]["reasoning_content"] == "I should check the weather. ✓"
    for foreign in ("gAAAAABo-opaque-bytes", "kiln-reasoning-1.%%%", 7):
        with pytest.raises(RequestError) as refused:
            input_messages([{"type": "reasoning", "summary": [], "encrypted_content": foreign},
                            {"role": "assistant", "content": "x"}])
        assert refused.value.param == "input[0].encrypted_content"


def test_responses_settings_codex_sends_are_taken_and_the_rest_refused():
    codex = {"model": "m", "instructions": "You are a coding agent.", "input": "hi",
             "tools": [{"type": "function", "name": "shell", "description": "Runs a command",
                        "strict": False, "parameters": {"type": "object", "properties": {}}}],
             "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": None,
             "store": False, "stream": True, "include": [], "prompt_cache_key": "conv-1"}
    check_unsupported(ResponsesRequest.model_validate(codex))
    check_unsupported(ResponsesRequest.model_validate({
        **codex, "include": ["reasoning.encrypted_content"],
        "prompt_cache_retention": "in-memory", "service_tier": "auto",
        "reasoning": {"effort": "high", "summary": "auto"}}))
    for field, value, param in (
            ("include", ["message.output_text.logprobs"], "include[0]"),
            ("prompt_cache_retention", "24h", "prompt_cache_retention"),
            ("service_tier", "priority", "service_tier"),
            ("reasoning", {"summary": "detailed"}, "reasoning.summary")):
        body = ResponsesRequest.model_validate({"input": "hi", field: value})
        with pytest.raises(RequestError) as refused:
            check_unsupported(body)
        assert refused.value.param == param


def test_a_reasoning_budget_and_a_response_format_are_refused_by_their_names(demo):
    """One grammar a request: a thinking budget beside a user's own constraint names
    both (not tool calls, which the request has none of)."""
    from tokenizer_proc.constraints import Constraint
    from tokenizer_proc.conversation import Conversation
    from tokenizer_proc.prepare import SamplingInput

    preparer = RequestPreparer.load("demo-tiny", str(demo), chat_template=ALWAYS)
    conversation = Conversation(messages=[{"role": "user", "content": "hi"}],
                                reasoning_budget=1024)
    own = Constraint("json_object", "", "response_format")
    with pytest.raises(RequestError, match="'response_format' cannot be combined with "
                       "'thinking.budget_tokens'") as refused:
        preparer.turn(conversation, SamplingInput(2048, None, None, None, None,
                                                  constraint=own), "r0")
    assert refused.value.param == "response_format"


def test_past_reasoning_reaches_a_template_that_reads_it_as_thinking(demo):
    """GPT-OSS's template reads a tool call's analysis from `message.thinking` (the only
    reasoning it renders back) or from its content, and refuses both: an assistant
    turn's reasoning reaches it there, and a commentary preamble (kiln's own GPT-OSS
    output: analysis, preamble, call) joins the reasoning instead of failing the turn."""
    harmony_like = (
        "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
        "{% if m.content and m.thinking %}{{ raise_exception('content and thinking') }}"
        "{% elif m.content %}[analysis:{{ m.content }}]"
        "{% elif m.thinking %}[analysis:{{ m.thinking }}]{% endif %}"
        "[call:{{ m.tool_calls[0].function.name }}]"
        "{% else %}[{{ m.role }}:{{ m.content }}]{% endif %}{% endfor %}")
    preparer = RequestPreparer.load("demo-tiny", str(demo), chat_template=harmony_like)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}

    def rendered(content: str) -> str:
        request = preparer.chat(ChatCompletionRequest(model="m", messages=[
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": content, "reasoning_content": "I need the clock.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]), "r0")
        return preparer._tokenizer.decode(request.input_ids)

    assert rendered("") == "[user:time?][analysis:I need the clock.][call:get_time][tool:noon]"
    assert rendered("Checking.") == (
        "[user:time?][analysis:I need the clock.\n\nChecking.][call:get_time][tool:noon]")


# DeepSeek-V3.1-like: its thinking switch is a bare `thinking` variable.
DEEPSEEK = ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
            + _BODY + "|{% if thinking %}<think>{% else %}</think>{% endif %}")


def test_a_deepseek_style_switch_takes_thinking_on_and_off(demo):
    """Anthropic's thinking enabled / disabled and OpenAI's none / medium effort reach a
    template whose switch is `thinking`, not enable_thinking (else they did nothing)."""
    from tokenizer_proc.messages_api import MessagesRequest, messages_conversation
    from tokenizer_proc.prepare import SamplingInput

    preparer = RequestPreparer.load("demo-tiny", str(demo), chat_template=DEEPSEEK)

    def anthropic(thinking: dict | None) -> str:
        body = MessagesRequest.model_validate({
            "model": "m", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}],
            **({"thinking": thinking} if thinking else {})})
        turn = preparer.turn(messages_conversation(body, False),
                             SamplingInput(2048, None, None, None, None), "r0")
        return preparer._tokenizer.decode(turn.request.input_ids)

    assert anthropic(None) == "hi|</think>"
    assert anthropic({"type": "enabled", "budget_tokens": 1024}) == "hi|<think>"
    assert anthropic({"type": "disabled"}) == "hi|</think>"
    assert _render(demo, DEEPSEEK, "medium") == "hi|<think>"
    assert _render(demo, DEEPSEEK, "none") == "hi|</think>"


def test_inline_reasoning_keeps_its_special_markers_in_the_text():
    """Reasoning kept inline, no tools: where the markers are special tokens, the text
    keeps them (else the reasoning runs into the answer unmarked, and its tokens could
    not be counted)."""
    from tokenizer_proc.conversation import Conversation
    from tokenizer_proc.tool_syntax import ModelSyntax, ReasoningMarkers
    from tokenizer_proc.turn_plan import TurnPlanner

    syntax = ModelSyntax(None, ReasoningMarkers("<think>", "</think>"))
    chat = Conversation(messages=[{"role": "user", "content": "hi"}], inline_reasoning=True)
    special = TurnPlanner(syntax, frozenset({"<think>", "</think>"})).plan(chat, "hi")
    plain = TurnPlanner(syntax, frozenset()).plan(chat, "hi")
    assert special.keep_special_tokens and not plain.keep_special_tokens


def test_past_calls_reach_a_template_that_joins_their_arguments_as_text(demo):
    """DeepSeek V3.1's template joins a past call's arguments as text (string + dict is a
    TypeError); most others write them with tojson. Both render a history with calls."""
    joins = ("{% for m in messages %}{% if m.tool_calls %}"
             "{% for c in m.tool_calls %}[{{ c['function']['name'] + ':' "
             "+ c['function']['arguments'] }}]{% endfor %}"
             "{% else %}[{{ m.role }}:{{ m.content }}]{% endif %}{% endfor %}")
    dumps = joins.replace("+ c['function']['arguments'] }}",
                          "}}{{ c['function']['arguments'] | tojson }}")
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    for template in (joins, dumps):
        preparer = RequestPreparer.load("demo-tiny", str(demo), chat_template=template)
        request = preparer.chat(ChatCompletionRequest(model="m", messages=history), "r0")
        assert preparer._tokenizer.decode(request.input_ids) == (
            '[user:weather?][get_weather:{"city": "Zürich"}][tool:sunny]')


def test_mistral_templates_get_call_ids_of_their_form(demo):
    """Mistral's templates refuse call ids other than 9 letters and digits: kiln writes
    such ids for Mistral's calls, and a history with other ids (OpenAI's, Anthropic's)
    renders with ids drawn from them, a call and its result alike."""
    from tokenizer_proc.assistant_parser import ParseSpec, parse_whole
    from tokenizer_proc.tool_syntax import MISTRAL, ModelSyntax

    parsed = parse_whole(ParseSpec(ModelSyntax(MISTRAL, None), MISTRAL),
                         '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')
    (call,) = parsed.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()

    checks = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
              "{% if c.id|length != 9 %}{{ raise_exception('ids of 9') }}{% endif %}"
              "[call {{ c.id }}]{% endfor %}{% if m.role == 'tool' %}"
              "{% if m.tool_call_id|length != 9 %}{{ raise_exception('ids of 9') }}{% endif %}"
              "[result {{ m.tool_call_id }}]{% endif %}{% endfor %}")
    preparer = RequestPreparer.load("demo-tiny", str(demo), chat_template=checks)
    long_id = "toolu_01A09q90qw90lq917835lq9"
    history = [{"role": "user", "content": "time?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": long_id, "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": long_id, "content": "noon"}]
    request = preparer.chat(ChatCompletionRequest(model="m", messages=history), "r0")
    text = preparer._tokenizer.decode(request.input_ids)
    ids = [part.split()[1] for part in text.strip("[]").split("][")]
    assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) == 9 and ids[0].isalnum()


def test_a_template_that_refuses_an_effort_names_the_effort(demo):
    """A template's own refusal of an effort value is the effort's 400, not the
    messages'."""
    picky = (EFFORT.replace("|effort=", "{% if reasoning_effort is defined and "
                            "reasoning_effort == 'high' %}{{ raise_exception('no high') }}"
                            "{% endif %}|effort="))
    with pytest.raises(RequestError,
                       match="rejected 'reasoning_effort' 'high': no high") as refused:
        _render(demo, picky, "high")
    assert refused.value.param == "reasoning_effort"
    assert _render(demo, picky, "low") == "hi|effort=low"


def test_a_response_format_keyword_the_grammar_cannot_enforce_fails_strict_only(demo):
    """A pydantic set (`uniqueItems`) in a schema that is not strict goes unenforced (as
    OpenAI enforces nothing of such a schema); a strict one is refused by name."""
    preparer = RequestPreparer.load("demo-tiny", str(demo))
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}

    def chat(strict: bool | None) -> str | None:
        fmt = {"type": "json_schema", "json_schema": {
            "name": "t", "schema": schema, **({} if strict is None else {"strict": strict})}}
        return preparer.chat(ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], response_format=fmt,
            max_tokens=8), "r0").sampling.grammar

    assert chat(None) is not None and chat(False) is not None
    with pytest.raises(RequestError, match="Unimplemented keys") as refused:
        chat(True)
    assert refused.value.param == "response_format.json_schema.schema"

"""The agent parsers and grammars on plain data: realistic outputs of each family parsed
whole and streamed (one character at a time) to the same message, and each family's
forcing grammar walked by random tokens under llguidance, every walk parsing back into
calls that validate against their schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jsonschema
import numpy as np
import pytest

from tokenizer_proc.assistant_parser import AssistantMessage, ParseSpec, parse_whole
from tokenizer_proc.tool_grammar import GrammarTool, Lark, ToolGrammarPlan, tool_grammar
from tokenizer_proc.tool_syntax import (DEEPSEEK_V3, DEEPSEEK_V31, HARMONY, HERMES, KIMI_K2,
                                        LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, NEUTRAL_JSON,
                                        ModelSyntax, ReasoningMarkers, ToolSyntax,
                                        syntax_named)

THINK = ReasoningMarkers("<think>", "</think>")
WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ("get_time", '{"tz": "UTC"}')
DS = {"calls": "<｜tool▁calls▁begin｜>", "end": "<｜tool▁calls▁end｜>",
      "call": "<｜tool▁call▁begin｜>", "call_end": "<｜tool▁call▁end｜>", "sep": "<｜tool▁sep｜>"}

# (syntax, reasoning markers, prompt opened reasoning, output, reasoning, content, calls)
CASES: dict[str, tuple[Any, ...]] = {
    "hermes-two-calls": (HERMES, None, False,
                         "I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                         "{\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n"
                         "{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>",
                         "", "I'll check both.", [WEATHER, TIME]),
    "qwen3-thinking": (HERMES, THINK, False,
                       "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{\"name\": "
                       "\"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": "
                       "\"celsius\"}}\n</tool_call>", "The user wants the weather.", "", [WEATHER]),
    "qwen3-answer": (HERMES, THINK, False, "<think>\nEasy.\n</think>\n\nParis is sunny.",
                     "Easy.", "Paris is sunny.", []),
    "hermes-arguments-first": (HERMES, None, False,
                               "<tool_call>\n{\"arguments\": {\"tz\": \"UTC\"}, \"name\": "
                               "\"get_time\"}\n</tool_call>", "", "", [TIME]),
    "llama3": (LLAMA3_JSON, None, False,
               "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": "
               "\"celsius\"}}", "", "", [WEATHER]),
    "llama3-python-tag-two": (LLAMA3_JSON, None, False,
                              "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": "
                              "\"Paris\", \"unit\": \"celsius\"}}; {\"name\": \"get_time\", "
                              "\"parameters\": {\"tz\": \"UTC\"}}", "", "", [WEATHER, TIME]),
    "llama3-json-answer": (LLAMA3_JSON, None, False, '{"answer": 42}', "", '{"answer": 42}', []),
    "mistral-list": (MISTRAL, None, False,
                     "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                     "\"unit\": \"celsius\"}}, {\"name\": \"get_time\", \"arguments\": {\"tz\": "
                     "\"UTC\"}}]", "", "", [WEATHER, TIME]),
    "mistral-args": (MISTRAL_ARGS, None, False,
                     "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"unit\": \"celsius\"}"
                     "[TOOL_CALLS]get_time[ARGS]{\"tz\": \"UTC\"}", "", "", [WEATHER, TIME]),
    "gpt-oss-call": (HARMONY, None, False,
                     "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
                     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                     "{\"city\": \"Paris\", \"unit\": \"celsius\"}", "Need the weather tool.", "",
                     [WEATHER]),
    "gpt-oss-answer": (HARMONY, None, False,
                       "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>"
                       "final<|message|>Hi there!", "Simple.", "Hi there!", []),
    "deepseek-v3": (DEEPSEEK_V3, None, False,
                    f"Sure.{DS['calls']}{DS['call']}function{DS['sep']}get_weather\n```json\n"
                    f"{{\"city\": \"Paris\", \"unit\": \"celsius\"}}\n```{DS['call_end']}\n"
                    f"{DS['call']}function{DS['sep']}get_time\n```json\n{{\"tz\": \"UTC\"}}\n```"
                    f"{DS['call_end']}{DS['end']}", "", "Sure.", [WEATHER, TIME]),
    "deepseek-r1-v31": (DEEPSEEK_V31, THINK, True,
                        f"Let me think.\n</think>\n\n{DS['calls']}{DS['call']}get_time{DS['sep']}"
                        f"{{\"tz\": \"UTC\"}}{DS['call_end']}{DS['end']}", "Let me think.", "",
                        [TIME]),
    "kimi-k2": (KIMI_K2, None, False,
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
                "<|tool_call_argument_begin|>{\"tz\": \"UTC\"}<|tool_call_end|>"
                "<|tool_calls_section_end|>", "", "", [TIME]),
    "glm-4.5": ("glm47", None, False,
                "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n"
                "</tool_call>", "", "", [("get_time", '{"tz": "UTC"}')]),
    "qwen3-coder": ("qwen3_coder", None, False,
                    "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n"
                    "</function>\n</tool_call>", "", "", [("get_time", '{"tz": "UTC"}')]),
    "neutral-json": (NEUTRAL_JSON, None, False,
                     "[{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}]", "", "",
                     [TIME]),
    "hermes-unparsable": (HERMES, None, False, "Hi <tool_call>oops</tool_call>", "",
                          "Hi<tool_call>oops</tool_call>", []),
}


def _spec(syntax: ToolSyntax | str, reasoning: ReasoningMarkers | None,
          opened: bool) -> ParseSpec:
    tools = syntax_named(syntax) if isinstance(syntax, str) else syntax
    return ParseSpec(ModelSyntax(tools, reasoning), None if tools is HARMONY else tools,
                     reasoning_open=opened)


def _streamed(spec: ParseSpec, text: str) -> AssistantMessage:
    parser, message = spec.parser(), AssistantMessage()
    for ch in text:
        message.add(parser.feed(ch))
    message.add(parser.finish())
    return message


@pytest.mark.parametrize("case", list(CASES))
def test_family_outputs_parse_whole_and_streamed_alike(case: str) -> None:
    syntax, reasoning, opened, text, want_reasoning, want_content, want_calls = CASES[case]
    spec = _spec(syntax, reasoning, opened)
    for message in (parse_whole(spec, text), _streamed(spec, text)):
        assert message.reasoning == want_reasoning
        assert message.content == want_content
        calls = [(c.name, json.loads(c.arguments)) for c in message.tool_calls]
        assert calls == [(n, json.loads(a)) for n, a in want_calls]
    assert ([c.arguments for c in parse_whole(spec, text).tool_calls]
            == [c.arguments for c in _streamed(spec, text).tool_calls])


def test_streamed_call_names_come_before_their_arguments() -> None:
    spec = _spec(HERMES, None, False)
    parser = spec.parser()
    events = parser.feed('<tool_call>\n{"name": "get_time", "arguments": {"tz"')
    assert [type(e).__name__ for e in events] == ["ToolCallStart", "ToolCallDelta"]
    assert events[1].arguments == '{"tz"'
    assert parser.made_calls


def test_a_cut_call_keeps_the_arguments_written_so_far() -> None:
    message = parse_whole(_spec(HERMES, None, False),
                          'Look: <tool_call>\n{"name": "get_time", "arguments": {"tz": "UT')
    assert message.content == "Look:"
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("get_time", '{"tz": "UT')]


@pytest.mark.parametrize("text, content", [
    ('Look: <tool_call>\n{"name', 'Look:<tool_call>\n{"name'),  # cut inside the header
    ("Look: <tool_call>\n", "Look:<tool_call>"),  # cut right after the region's start
])
def test_a_call_cut_before_its_name_is_the_text_written(text: str, content: str) -> None:
    """max_tokens inside a call's header: no call to return, so the model's text as it
    wrote it (never an end marker it did not write, never nothing), whole and streamed."""
    spec = _spec(HERMES, None, False)
    for message in (parse_whole(spec, text), _streamed(spec, text)):
        assert message.content == content and not message.tool_calls


def test_kimi_keeps_the_models_call_id() -> None:
    syntax, _, _, text, *_ = CASES["kimi-k2"]
    assert parse_whole(_spec(syntax, None, False), text).tool_calls[0].id == "functions.get_time:0"


# --- grammars, walked ---------------------------------------------------------------

SCHEMAS = {"get_weather": {"type": "object", "additionalProperties": False,
                           "properties": {"city": {"type": "string", "maxLength": 8},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                           "required": ["city", "unit"]},
           "get_time": {"type": "object", "additionalProperties": False,
                        "properties": {"tz": {"type": "string", "maxLength": 5}},
                        "required": ["tz"]}}
TOOLS = tuple(GrammarTool(name, schema) for name, schema in SCHEMAS.items())
FORCED = [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, KIMI_K2, DEEPSEEK_V3, DEEPSEEK_V31,
          HARMONY, NEUTRAL_JSON]


@pytest.fixture(scope="module")
def walker(tiny_model_dir: Path) -> "Walker":
    from transformers import AutoTokenizer

    return Walker(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


class Walker:
    """Random tokens under a grammar until it allows only EOS (or a limit)."""

    def __init__(self, tokenizer: Any) -> None:
        from kiln_common.llguidance_tokenizer import ll_tokenizer
        from tokenizer_proc.turn_plan import special_tokens

        self.tokenizer = tokenizer
        self.ll = ll_tokenizer(tokenizer, [tokenizer.eos_token_id])
        self.lark = Lark(special_tokens(tokenizer))

    def walk(self, grammar: str, rng: np.random.Generator, limit: int = 400) -> str | None:
        ids, ended = self.walk_ids(grammar, rng, limit)
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ended else None

    def walk_ids(self, grammar: str, rng: np.random.Generator,
                 limit: int = 400) -> tuple[list[int], bool]:
        """The ids walked, and whether the grammar allowed EOS at their end (else the
        limit stopped the walk, still inside free text)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll, LLMatcher.grammar_from_lark(grammar))
        assert not matcher.is_error(), matcher.get_error()
        out: list[int] = []
        eos, vocab = self.tokenizer.eos_token_id, len(self.tokenizer)
        for _ in range(limit):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                                 bitorder="little")[:vocab]
            allowed = np.nonzero(bits)[0]
            if eos in allowed and (len(allowed) == 1 or rng.random() < 0.05):
                return out, True
            token = int(rng.choice(allowed[allowed != eos]))
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
        return out, False


def _reasoning_ids(walker: Walker, ids: list[int], end: str) -> int:
    """How many of the walked ids come before the reasoning's end marker."""
    for k in range(1, len(ids) + 1):
        if end in walker.tokenizer.decode(ids[:k], skip_special_tokens=False):
            return k - len(walker.tokenizer.encode(end, add_special_tokens=False))
    raise AssertionError(f"no {end!r} in the walk")


@pytest.mark.parametrize("case", ["opened", "unopened", "tools", "harmony", "off"])
def test_a_reasoning_budget_closes_the_block_once_spent(walker: Walker, case: str) -> None:
    """thinking.budget_tokens: random tokens under the grammar (which never close the
    block themselves) reason for exactly the budget, then the end marker comes and the
    answer (text, or the forced call) follows: a block the prompt opened or the output
    opens, in the tools' grammar too, and harmony's analysis message."""
    from tokenizer_proc.tool_grammar import reasoning_grammar

    budget = 0 if case == "off" else 7  # 0: thinking turned off, the block closed at once
    if case == "harmony":
        grammar = reasoning_grammar(ModelSyntax(HARMONY, None), False, budget, walker.lark)
        start, end = "<|channel|>analysis<|message|>", "<|end|>"
    elif case == "tools":
        grammar = tool_grammar(ToolGrammarPlan(ModelSyntax(HERMES, THINK), HERMES, TOOLS,
                                               "required", reasoning_open=True,
                                               reasoning_budget=budget), walker.lark)
        start, end = "", "</think>"
    else:
        opened = case in ("opened", "off")
        grammar = reasoning_grammar(ModelSyntax(HERMES, THINK), opened, budget, walker.lark)
        start, end = ("" if opened else "<think>"), "</think>"
    opening = len(walker.tokenizer.encode(start, add_special_tokens=False)) if start else 0
    for seed in range(3):
        ids, _ = walker.walk_ids(grammar, np.random.default_rng(seed), limit=120)
        assert _reasoning_ids(walker, ids, end) == opening + budget


# Ids by position (two syntaxes may share a name): the same in every pytest process.
@pytest.mark.parametrize("syntax", FORCED, ids=[f"{s.name}-{i}" for i, s in enumerate(FORCED)])
@pytest.mark.parametrize("mode", ["required", "function"])
def test_forced_grammars_write_calls_that_parse_and_validate(walker: Walker, syntax: ToolSyntax,
                                                             mode: str) -> None:
    rng = np.random.default_rng(7)
    reasoning = None if syntax is HARMONY else THINK
    plan = ToolGrammarPlan(ModelSyntax(syntax, reasoning), syntax, TOOLS, mode)
    grammar = tool_grammar(plan, walker.lark)
    done = 0
    for _ in range(4):
        text = walker.walk(grammar, rng)
        if text is None:  # random thinking that never closed
            continue
        done += 1
        message = parse_whole(_spec(syntax, reasoning, False), text)
        assert message.tool_calls and not message.content, text
        if mode == "function":
            assert [c.name for c in message.tool_calls] == ["get_weather"]
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert done


@pytest.mark.parametrize("syntax", [HERMES, MISTRAL, KIMI_K2, DEEPSEEK_V31, LLAMA3_JSON])
def test_auto_grammar_finishes_a_started_call_under_the_schema(walker: Walker,
                                                               syntax: ToolSyntax) -> None:
    from llguidance import LLMatcher

    plan = ToolGrammarPlan(ModelSyntax(syntax, None), syntax, TOOLS, "auto")
    grammar = LLMatcher.grammar_from_lark(tool_grammar(plan, walker.lark))
    tokenizer = walker.tokenizer
    free = tokenizer.encode("Let me see.", add_special_tokens=False)
    bad = tokenizer.encode(syntax.start + '{"name": "nope"', add_special_tokens=False)
    if syntax.at_start:
        free = tokenizer.encode("It is sunny.", add_special_tokens=False)
        bad = tokenizer.encode('{"name": "nope"', add_special_tokens=False)
    text_matcher = LLMatcher(walker.ll, grammar)
    assert text_matcher.consume_tokens(free) and text_matcher.is_accepting()
    call_matcher = LLMatcher(walker.ll, grammar)
    assert not all(call_matcher.consume_token(t) for t in bad)  # no such function


def _hermes_call_writer(preparer: Any) -> Callable[[str, str, str], bool]:
    """Whether a tools grammar lets a model write a Hermes call of `name` with these
    arguments (JSON text), token by token in the preparer's tokenizer."""
    from llguidance import LLMatcher

    from kiln_common.llguidance_tokenizer import ll_tokenizer

    tokenizer = preparer._tokenizer
    ll = ll_tokenizer(tokenizer, [tokenizer.eos_token_id])

    def writes(grammar: str, name: str, arguments: str) -> bool:
        matcher = LLMatcher(ll, grammar)
        text = f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
        return all(matcher.consume_token(t)
                   for t in tokenizer.encode(text, add_special_tokens=False))

    return writes


def test_a_tool_schema_keyword_the_grammar_cannot_enforce_fails_strict_tools_only(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """An agent's tool with `uniqueItems`, `not` or `if` (MCP tools have them) still gets
    its calls finished under the rest of its schema; only a tool marked strict (Responses'
    default) is refused, by name, since its whole schema was promised."""
    from tests.agent_models import family_model
    from tokenizer_proc.errors import RequestError
    from tokenizer_proc.prepare import RequestPreparer
    from tokenizer_proc.protocol import ChatCompletionRequest

    preparer = RequestPreparer.load("m", str(family_model(tiny_model_dir, tmp_path, "hermes")))
    odd = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "mode": {"not": {"const": "off"}}},
        "if": {"required": ["mode"]}, "then": {"required": ["tags"]}}

    def chat(strict: bool | None, choice: str) -> object:
        function = {"name": "tag", "parameters": odd,
                    **({} if strict is None else {"strict": strict})}
        return preparer.chat(ChatCompletionRequest(
            messages=[{"role": "user", "content": "tag it"}], tool_choice=choice,
            tools=[{"type": "function", "function": function}], max_tokens=64), "r")

    writes = _hermes_call_writer(preparer)

    for choice in ("auto", "required"):
        grammar = chat(None, choice).sampling.grammar
        assert grammar is not None and chat(False, choice).sampling.grammar is not None
        # The rest of the schema still holds: tags are an array of strings.
        assert (writes(grammar, "tag", '{"tags": ["a", "b"]}')
                and not writes(grammar, "tag", '{"tags": 5}'))
        with pytest.raises(RequestError, match="Unimplemented keys") as refused:
            chat(True, choice)
        # The grammar's field: the tools in auto, the forcing tool_choice otherwise.
        assert refused.value.param == ("tools" if choice == "auto" else "tool_choice")


def test_a_tool_schema_the_grammar_cannot_compile_holds_its_calls_to_an_object(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A schema llguidance cannot build at all (a look-around `pattern`: no keyword to
    leave out) no longer fails an agent's every request: that tool's calls are held to a
    JSON object, the other tools to their schemas; a strict tool so written is refused."""
    from tests.agent_models import family_model
    from tokenizer_proc.errors import RequestError
    from tokenizer_proc.prepare import RequestPreparer
    from tokenizer_proc.protocol import ChatCompletionRequest

    preparer = RequestPreparer.load("m", str(family_model(tiny_model_dir, tmp_path, "hermes")))
    odd = {"type": "object", "properties": {"path": {"type": "string",
                                                     "pattern": "^(?!/etc).*$"}}}
    plain = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def chat(strict: bool) -> str:
        tools = [{"type": "function", "function": {"name": "read", "parameters": odd,
                                                   "strict": strict}},
                 {"type": "function", "function": {"name": "count", "parameters": plain}}]
        return preparer.chat(ChatCompletionRequest(
            messages=[{"role": "user", "content": "go"}], tools=tools, max_tokens=64),
            "r").sampling.grammar

    writes = _hermes_call_writer(preparer)
    grammar = chat(strict=False)
    assert writes(grammar, "read", '{"path": "/etc/passwd", "other": 1}')  # any object
    assert writes(grammar, "count", '{"n": 3}') and not writes(grammar, "count", '{"n": "x"}')
    with pytest.raises(RequestError) as refused:
        chat(strict=True)
    assert refused.value.param == "tools"


def test_strictness_comes_from_each_api_as_it_defines_it(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    """Responses' function tools are strict unless they say otherwise (OpenAI's default),
    chat's and Anthropic's only when they say so: a keyword the grammar cannot enforce is
    refused for strict tools alone."""
    from tests.agent_models import family_model
    from tokenizer_proc.errors import RequestError
    from tokenizer_proc.messages_api import MessagesRequest, messages_conversation
    from tokenizer_proc.prepare import RequestPreparer, SamplingInput
    from tokenizer_proc.responses_api import ResponsesRequest, responses_conversation

    preparer = RequestPreparer.load("m", str(family_model(tiny_model_dir, tmp_path, "hermes")))
    odd = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    sampling = SamplingInput(64, None, None, None, None)

    def responses(**strict: bool) -> object:
        body = ResponsesRequest.model_validate({"input": "go", "tools": [
            {"type": "function", "name": "tag", "parameters": odd, **strict}]})
        return preparer.turn(responses_conversation(body, [], False), sampling, "r")

    def anthropic(**strict: bool) -> object:
        body = MessagesRequest.model_validate({
            "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "go"}],
            "tools": [{"name": "tag", "input_schema": odd, **strict}]})
        return preparer.turn(messages_conversation(body, False), sampling, "r")

    for strict_turn in (responses, lambda: anthropic(strict=True)):
        with pytest.raises(RequestError, match="Unimplemented keys"):
            strict_turn()
    for loose_turn in (lambda: responses(strict=False), anthropic):
        assert loose_turn().request.sampling.grammar is not None

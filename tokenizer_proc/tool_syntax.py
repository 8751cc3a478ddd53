"""How a model family writes tool calls and reasoning, found from the tokenizer's metadata.

Parsing and grammar-forcing both start here: a `ToolSyntax` says where a call region opens
and closes, how each call's header (its name) reads before its JSON arguments, and how a
call is written out (`CallTemplate`, for the grammar that forces one). Families whose
arguments are not JSON (GLM's key/value tags, Qwen3-Coder's XML, pythonic lists, ...) are
parsed whole by mlx-lm's own parser (`fallback`), once their region has closed.

Detection follows mlx-lm: the tokenizer config's `tool_parser_type`, else the chat
template's markers (`mlx_lm.tokenizer_utils._infer_tool_parser`); before it, the families
mlx-lm has no parser for (Llama 3's JSON, DeepSeek, GPT-OSS's harmony) by their own
template markers. Reasoning markers come from mlx-lm's `_infer_thinking` (vocabulary
tokens), else from `<think>`/`</think>` in the template.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import regex

from tokenizer_proc.mlx_lm_shim import mlx_lm_module

logger = logging.getLogger(__name__)

# A parser of a whole call region, mlx-lm's signature: (text, tools) -> call dict(s).
RegionParser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class CallTemplate:
    """How calls are written, for the grammar that forces them: `open`, then each call as
    `before` + JSON arguments + `after` (`before` names it: "{name}", "{index}"), joined by
    `between`, then `close`."""

    before: str
    after: str
    open: str = ""
    between: str = ""
    close: str = ""


@dataclass(frozen=True)
class ToolSyntax:
    """One family's tool-call format.

    start/end: the markers around a region of calls ("" end: the region runs to the end
    of the output). at_start: no marker; a region is the whole output when it opens with
    one of `start_patterns` (Llama 3's bare JSON). header: a regex matching from a call's
    start to where its JSON arguments begin, with a `name` group (and an `id` group when
    the model names its calls); None: the region is parsed whole by `fallback`.
    template: how the grammar writes a call; None: forced calls use the neutral JSON
    syntax instead. one_call: the format holds one call per turn (harmony). short_ids:
    call ids of 9 letters and digits (Mistral's templates refuse any other).
    """

    name: str
    start: str
    end: str
    header: regex.Pattern[str] | None
    template: CallTemplate | None
    fallback: RegionParser | None = None
    at_start: bool = False
    one_call: bool = False
    short_ids: bool = False


def _header(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern, regex.DOTALL)


def _json_header(args_key: str = "arguments") -> str:
    # {"name": "f", "arguments": ...  (also "function"/"parameters", as models vary)
    return (r'\s*\{\s*"(?:name|function)"\s*:\s*"(?P<name>[^"]+)"\s*,\s*'
            rf'"(?:{args_key})"\s*:\s*')


def _mlx_lm_parser(name: str) -> RegionParser:
    """mlx-lm's parser of a family, imported when first used."""

    def parse(text: str, tools: Any) -> Any:
        return mlx_lm_module(f"tool_parsers.{name}").parse_tool_call(text, tools)

    return parse


HERMES = ToolSyntax(
    "hermes", "<tool_call>", "</tool_call>", _header(_json_header("arguments|parameters")),
    CallTemplate(before='<tool_call>\n{"name": "{name}", "arguments": ', after="}\n</tool_call>",
                 between="\n"), fallback=_mlx_lm_parser("json_tools"))

LLAMA3_JSON = ToolSyntax(
    "llama3_json", "", "",
    _header(r"\s*(?:<\|python_tag\|>)?\s*(?:;\s*)?" + _json_header("parameters|arguments")),
    CallTemplate(before='{"name": "{name}", "parameters": ', after="}", between="; "),
    at_start=True)

MISTRAL = ToolSyntax(
    "mistral", "[TOOL_CALLS]", "",
    # [{"name": ..., "arguments": ...}, ...]  or  name[ARGS]{...} (v11 tokenizers)
    _header(r'\s*(?:\[TOOL_CALLS\])?\s*(?:[\[,]' + _json_header()
            + r'|(?P<name>[\w.-]+)\s*\[ARGS\]\s*)'),
    CallTemplate(open="[TOOL_CALLS][", before='{"name": "{name}", "arguments": ', after="}",
                 between=", ", close="]"), fallback=_mlx_lm_parser("mistral"), short_ids=True)

MISTRAL_ARGS = ToolSyntax(
    "mistral", MISTRAL.start, MISTRAL.end, MISTRAL.header,
    CallTemplate(before="[TOOL_CALLS]{name}[ARGS]", after=""), fallback=MISTRAL.fallback,
    short_ids=True)

KIMI_K2 = ToolSyntax(
    "kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    _header(r"\s*<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^:<\s]+):\d+)\s*"
            r"<\|tool_call_argument_begin\|>\s*"),
    CallTemplate(open="<|tool_calls_section_begin|>",
                 before="<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
                 after="<|tool_call_end|>", close="<|tool_calls_section_end|>"),
    fallback=_mlx_lm_parser("kimi_k2"))

_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_BEGIN_RE, _DS_SEP_RE = regex.escape(_DS_CALL_BEGIN), regex.escape(_DS_SEP)



# DeepSeek V3/R1: <call begin>function<sep>name\n```json\n{...}\n```<call end>
DEEPSEEK_V3 = ToolSyntax(
    "deepseek_v3", _DS_CALLS_BEGIN, _DS_CALLS_END,
    _header(rf"\s*{_DS_BEGIN_RE}\s*function{_DS_SEP_RE}(?P<name>[^\n]+?)\s*```json\s*"),
    CallTemplate(open=_DS_CALLS_BEGIN, before=f"{_DS_CALL_BEGIN}function{_DS_SEP}{{name}}\n```json\n",
                 after=f"\n```{_DS_CALL_END}", between="\n", close=_DS_CALLS_END))

# DeepSeek V3.1: <call begin>name<sep>{...}<call end>
DEEPSEEK_V31 = ToolSyntax(
    "deepseek_v31", _DS_CALLS_BEGIN, _DS_CALLS_END,
    _header(rf"\s*{_DS_BEGIN_RE}\s*(?P<name>[^<\n]+?){_DS_SEP_RE}\s*"),
    CallTemplate(open=_DS_CALLS_BEGIN, before=f"{_DS_CALL_BEGIN}{{name}}{_DS_SEP}",
                 after=_DS_CALL_END, close=_DS_CALLS_END))

# GPT-OSS's harmony: parsed by HarmonyParser (channels), not by region; this carries the
# template its grammar writes a call with (the call's <|call|> is an EOS token).
HARMONY = ToolSyntax(
    "harmony", "", "", None,
    CallTemplate(before="<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
                 after=""), one_call=True)

# The syntax of forced calls for families without a template of their own (and models
# with no tool format): a JSON list of {"name", "arguments"} objects, the whole output.
NEUTRAL_JSON = ToolSyntax(
    "json", "", "", _header(r"\s*[\[,]" + _json_header()),
    CallTemplate(open="[", before='{"name": "{name}", "arguments": ', after="}", between=", ",
                 close="]"), at_start=True)

_OWN_SYNTAXES = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL, KIMI_K2, DEEPSEEK_V3,
                                     DEEPSEEK_V31, HARMONY, NEUTRAL_JSON)}
# mlx-lm's parser names for the families parsed (and forced) here with streamed arguments.
_FROM_MLX_LM = {"json_tools": HERMES, "mistral": MISTRAL, "kimi_k2": KIMI_K2}
TOOL_PARSER_CHOICES = ("auto", "none", *_OWN_SYNTAXES, "json_tools", "glm47", "qwen3_coder",
                       "pythonic", "minimax_m2", "gemma4", "function_gemma", "longcat",
                       "minicpm5", "muse_spark", "kimi_k3", "laguna")


@dataclass(frozen=True)
class ReasoningMarkers:
    """The text that opens and closes a reasoning block (`<think>`, `</think>`)."""

    start: str
    end: str


@dataclass(frozen=True)
class ModelSyntax:
    """What the served model writes: its tool syntax (None: no known format) and its
    reasoning markers (None: not a reasoning model); harmony covers both."""

    tools: ToolSyntax | None
    reasoning: ReasoningMarkers | None

    @property
    def harmony(self) -> bool:
        return self.tools is HARMONY


def detect_syntax(tokenizer: Any, tool_parser: str = "auto") -> ModelSyntax:
    """The model's syntax from its tokenizer (`tool_parser`: a name to use instead of
    detection, or "none")."""
    template = chat_template_source(tokenizer)
    tools = _tool_syntax(tokenizer, template, tool_parser)
    reasoning = None if tools is HARMONY else _reasoning_markers(tokenizer, template)
    return ModelSyntax(tools, reasoning)


def _tool_syntax(tokenizer: Any, template: str, choice: str) -> ToolSyntax | None:
    if choice == "none":
        return None
    if choice != "auto":
        return syntax_named(choice, template)
    configured = getattr(tokenizer, "init_kwargs", {}).get("tool_parser_type")
    if isinstance(configured, str):
        return syntax_named(configured, template)
    own = _own_family(template)
    if own is not None:
        return own
    name = _mlx_lm_inferred(tokenizer)
    return syntax_named(name, template) if name else None


def _own_family(template: str) -> ToolSyntax | None:
    """Families mlx-lm does not parse, told apart by their templates' own markers."""
    if "<|channel|>" in template and "<|message|>" in template:
        return HARMONY
    if _DS_CALLS_BEGIN in template:
        return DEEPSEEK_V3 if "```json" in template else DEEPSEEK_V31
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return LLAMA3_JSON
    return None


def syntax_named(name: str, template: str = "") -> ToolSyntax:
    """A syntax by its name (ours or mlx-lm's parser module)."""
    if name == "mistral" or name == "json_tools" or name == "kimi_k2":
        syntax = _FROM_MLX_LM[name]
        # Mistral's v11+ templates write name[ARGS]{...}; older ones a JSON list.
        return MISTRAL_ARGS if syntax is MISTRAL and "[ARGS]" in template else syntax
    if name in _OWN_SYNTAXES:
        return _OWN_SYNTAXES[name]
    return _mlx_lm_region_syntax(name)


def _mlx_lm_region_syntax(name: str) -> ToolSyntax:
    """A family mlx-lm parses: its markers and its parser, on whole regions."""
    try:
        module = mlx_lm_module(f"tool_parsers.{name}")
    except ImportError:
        raise ValueError(f"unknown tool parser {name!r}") from None
    return ToolSyntax(name, module.tool_call_start, module.tool_call_end or "", None, None,
                      fallback=module.parse_tool_call)


def _mlx_lm_inferred(tokenizer: Any) -> str | None:
    try:
        return mlx_lm_module("tokenizer_utils")._infer_tool_parser(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no format
        return None


def _reasoning_markers(tokenizer: Any, template: str) -> ReasoningMarkers | None:
    try:
        start, end, _, _ = mlx_lm_module("tokenizer_utils")._infer_thinking(tokenizer)
    except Exception:  # noqa: BLE001 - as above
        start = end = None
    if start and end:
        return ReasoningMarkers(start, end)
    if "<think>" in template and "</think>" in template:
        return ReasoningMarkers("<think>", "</think>")
    return None


def chat_template_source(tokenizer: Any) -> str:
    """The tokenizer's chat template text (all of them, where it names several)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: look at all of them
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def opens_reasoning(prompt: str, markers: ReasoningMarkers | None) -> bool:
    """Whether the rendered prompt leaves a reasoning block open (DeepSeek-R1's templates
    end with `<think>\\n`), so the output starts inside it."""
    if markers is None:
        return False
    return prompt.rfind(markers.start) > prompt.rfind(markers.end)

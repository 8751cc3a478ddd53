"""Structured output: the API's constraint parameters as one llguidance grammar.

A request carries at most one constraint: OpenAI's `response_format` (json_object,
json_schema) or, on the native API and the ZMQ client, `json_schema`, `regex`, `ebnf`
(llama.cpp's GBNF, converted to Lark by llguidance) or `lark` (llguidance's Lark dialect).
`GrammarCompiler` turns it into the grammar text that travels in `SamplingParams.grammar`
and refuses, before the request is queued, any that llguidance cannot build against the
model's tokenizer, so the worker never meets a grammar it cannot run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from tokenizer_proc.errors import RequestError
from tokenizer_proc.protocol import ResponseFormat

logger = logging.getLogger(__name__)

ConstraintKind = Literal["json_schema", "regex", "ebnf", "lark"]
# The native API's and the ZMQ client's parameters, each naming its kind.
CONSTRAINT_PARAMS: tuple[ConstraintKind, ...] = ("json_schema", "regex", "ebnf", "lark")
# Compact JSON (no free whitespace between tokens): a model left free to emit whitespace
# can loop on it until max_tokens. A schema's own "x-guidance" options override this.
JSON_DEFAULTS = {"whitespace_flexible": False}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Constraint:
    """One request's constraint as the client gave it; `param` names its field in errors."""

    kind: ConstraintKind
    source: str | dict[str, Any]  # a schema (object or JSON text), a regex or a grammar
    param: str


def one_constraint(fields: dict[str, Any]) -> Constraint | None:
    """The constraint among the native parameters (`json_schema`, `regex`, `ebnf`, `lark`);
    None when none is set, a 400 when more than one is."""
    given = [(name, value) for name, value in fields.items() if value is not None]
    if len(given) > 1:
        names = ", ".join(f"'{name}'" for name, _ in given)
        raise RequestError(f"Give at most one constraint; got {names}.", param=given[1][0])
    if not given:
        return None
    name, value = given[0]
    assert name in CONSTRAINT_PARAMS, name
    return Constraint(name, value, name)  # type: ignore[arg-type]


def response_format_constraint(fmt: ResponseFormat | None,
                               param: str = "response_format") -> Constraint | None:
    """OpenAI's `response_format`: "text" (none), "json_object" (any JSON object) or
    "json_schema" (its `json_schema.schema`). The schema is enforced whether or not
    `strict` is set: a constrained model cannot leave it anyway."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_schema", ANY_JSON_OBJECT, param)
    if fmt.type != "json_schema":
        raise RequestError(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'; "
                           f"got {fmt.type!r}.", param=f"{param}.type")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError(f"'{param}.json_schema.schema' is required when the type is "
                           "'json_schema'.", param=f"{param}.json_schema.schema")
    return Constraint("json_schema", fmt.json_schema.schema_, f"{param}.json_schema.schema")


class GrammarCompiler:
    """Builds and validates llguidance grammars against the model's tokenizer.

    The llguidance tokenizer is made on the first constrained request (about a second for
    a 150k vocabulary), so servers that never see one never pay for it.
    """

    def __init__(self, make_tokenizer: Callable[[], Any]) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: Any = None

    def compile(self, constraint: Constraint) -> str:
        """The grammar text for SamplingParams.grammar; a 400 naming the parameter when
        the constraint is malformed or llguidance cannot build it."""
        from llguidance import LLMatcher

        grammar = grammar_text(constraint)
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer())
        if failed:
            raise RequestError(f"Invalid '{constraint.param}': {_one_line(messages)}",
                               param=constraint.param, code="invalid_grammar")
        if messages:
            logger.info("grammar warnings for %s: %s", constraint.param, messages)
        return grammar

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            try:
                self._tokenizer = self._make_tokenizer()
            except Exception as exc:  # noqa: BLE001 - refuse the request, keep serving
                logger.exception("could not build llguidance's tokenizer")
                raise RequestError(f"Structured output is not available for this model's "
                                   f"tokenizer: {exc}", code="unsupported_parameter") from exc
        return self._tokenizer


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint, not yet checked against a tokenizer."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    source = constraint.source
    if constraint.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(_schema(source, constraint.param),
                                                  defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    assert isinstance(source, str)
    if not source:
        raise RequestError(f"'{constraint.param}' must not be empty.", param=constraint.param)
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if constraint.kind == "ebnf":
        try:
            source = gbnf_to_lark(source)
        except Exception as exc:  # noqa: BLE001 - the converter raises plain Exceptions
            raise RequestError(f"Invalid '{constraint.param}' (GBNF): {exc}",
                               param=constraint.param, code="invalid_grammar") from exc
    return LLMatcher.grammar_from_lark(source)


def ll_tokenizer(hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer. Its EOS ids are the ones the
    scheduler stops on, so a finished grammar's mask allows exactly the tokens that end
    the request."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids) or None)


def _schema(source: str | dict[str, Any], param: str) -> dict[str, Any]:
    if isinstance(source, str):
        try:
            source = json.loads(source)
        except json.JSONDecodeError as exc:
            raise RequestError(f"'{param}' is not valid JSON: {exc}", param=param,
                               code="invalid_grammar") from None
    if not isinstance(source, dict):
        raise RequestError(f"'{param}' must be a JSON Schema object.", param=param,
                           code="invalid_grammar")
    return source


def _one_line(messages: list[str], limit: int = 600) -> str:
    # llguidance's messages span lines (a source excerpt with a caret); an error body
    # reads better flat, and a huge grammar must not make a huge error.
    text = " ".join((messages[0] if messages else "rejected by llguidance").split())
    return text if len(text) <= limit else text[:limit] + "..."

"""Structured output: the API's constraint parameters as one llguidance grammar.

A request carries at most one constraint: OpenAI's `response_format` (json_object,
json_schema) or, on the native API and the ZMQ client, `json_schema`, `regex`, `ebnf`
(llama.cpp's GBNF, converted to Lark by llguidance) or `lark` (llguidance's Lark dialect).
`GrammarCompiler` turns it into the grammar text that travels in `SamplingParams.grammar`
and refuses, before the request is queued, any that llguidance cannot build against the
model's tokenizer, so the worker never meets a grammar it cannot run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal

from kiln_common.background import BackgroundBuild
from tokenizer_proc.errors import RequestError
from tokenizer_proc.json_body import find_problem, parse_text
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
    """One request's constraint as the client gave it; `param` names its field in errors.
    lenient (a JSON schema not `strict`): keywords llguidance cannot enforce are left
    out instead of refusing the request."""

    kind: ConstraintKind
    source: str | dict[str, Any]  # a schema (object or JSON text), a regex or a grammar
    param: str
    lenient: bool = False


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


def native_constraint(fields: Any) -> Constraint | None:
    """`one_constraint` of an object's native parameters: a /generate body's
    `sampling_params` or a ZMQ client's GenerateRequest."""
    return one_constraint({name: getattr(fields, name) for name in CONSTRAINT_PARAMS})


def response_format_constraint(fmt: ResponseFormat | None,
                               param: str = "response_format") -> Constraint | None:
    """OpenAI's `response_format`: "text" (none), "json_object" (any JSON object) or
    "json_schema" (its `json_schema.schema`). The schema is enforced whether or not
    `strict` is set: a constrained model cannot leave it anyway; `strict` decides what a
    keyword llguidance cannot enforce does: refuse the request (strict) or go
    unenforced (as OpenAI enforces nothing of a schema that is not strict)."""
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
    return Constraint("json_schema", fmt.json_schema.schema_, f"{param}.json_schema.schema",
                      lenient=not fmt.json_schema.strict)


Verdict = tuple[bool, list[str]]  # llguidance's (failed, messages)
Validate = Callable[[str, Any], Verdict]  # (grammar text, llguidance tokenizer) -> Verdict


def llguidance_verdict(grammar: str, tokenizer: Any) -> Verdict:
    """llguidance's compile of a grammar against the tokenizer (releases the GIL)."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)


class GrammarCompiler:
    """Builds and validates llguidance grammars against the model's tokenizer.

    Validating is compiling: milliseconds for a small schema, up to seconds for a big one.
    On the event loop that would stall every other request, so the front calls
    `prevalidate` first, which runs it on a small thread pool (llguidance drops the GIL
    while it compiles), and `compile`, called next (on the preparer's tokenizing thread),
    finds the verdict kept.
    Recent verdicts stay kept (keyed by grammar text), so clients repeating a schema pay
    once. The llguidance tokenizer, made on first use or from start-up on
    (`start_building`), is a `BackgroundBuild`.
    """

    CACHED_VERDICTS = 256
    # Grammar texts can be as large as a request body; this bounds what the keys hold.
    CACHED_CHARS = 16 * 2**20
    VALIDATION_THREADS = 4

    def __init__(self, make_tokenizer: Callable[[], Any],
                 validate: Validate = llguidance_verdict) -> None:
        self._tokenizer: BackgroundBuild[Any] = BackgroundBuild(make_tokenizer,
                                                                "llguidance tokenizer")
        self._validate = validate
        # Kept on the event loop's thread (prevalidate), read on the preparer's.
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()
        self._verdict_chars = 0
        self._pending: dict[str, asyncio.Future[Verdict | None]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def start_building(self) -> None:
        """Start-up: build the llguidance tokenizer on a thread now. Its construction holds
        the GIL (about half a second of its second on a 150k vocabulary), so no thread
        keeps that off the event loop; done before traffic comes, it stalls nobody."""
        self._tokenizer.start()

    @property
    def building_started(self) -> bool:
        return self._tokenizer.started

    async def prevalidate(self, constraint: Constraint) -> None:
        """Validate off the event loop and keep the verdict, for `compile` to find when the
        request's entry point runs next (if 256 other grammars pushed it out meanwhile,
        `compile` validates again). Raises nothing: `compile` raises the request's errors,
        in their usual order among the request's other checks."""
        try:
            grammar = grammar_text(constraint)
        except RequestError:
            return
        with self._lock:
            if grammar in self._verdicts:
                return
        pending = self._pending.get(grammar)
        if pending is None:  # clients sending one grammar at once share its validation
            pending = asyncio.get_running_loop().run_in_executor(
                self._validation_pool(), self._verdict_off_loop, grammar)
            self._pending[grammar] = pending
            pending.add_done_callback(lambda _: self._pending.pop(grammar, None))
        # Shielded: one client giving up must not cancel the others' shared validation.
        verdict = await asyncio.shield(pending)
        if verdict is not None:
            self._keep(grammar, verdict, constraint.param)

    def compile(self, constraint: Constraint) -> str:
        """The grammar text for SamplingParams.grammar; a 400 naming the parameter when
        the constraint is malformed or llguidance cannot build it."""
        grammar = grammar_text(constraint)
        with self._lock:
            verdict = self._verdicts.get(grammar)
            if verdict is not None:
                self._verdicts.move_to_end(grammar)
        if verdict is None:  # not prevalidated (or since evicted): validate on this thread
            verdict = self._validate(grammar, self._ll_tokenizer())
            self._keep(grammar, verdict, constraint.param)
        failed, messages = verdict
        if failed:
            raise RequestError(f"Invalid '{constraint.param}': {_one_line(messages)}",
                               param=constraint.param, code="invalid_grammar")
        return grammar

    def _verdict_off_loop(self, grammar: str) -> Verdict | None:
        try:
            return self._validate(grammar, self._tokenizer.get())
        except Exception:  # noqa: BLE001 - None: compile meets it again and answers as ever
            return None

    def _validation_pool(self) -> ThreadPoolExecutor:
        # Its own few threads: big schemas queue behind each other, not behind (or in
        # front of) whatever else uses the loop's default executor.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.VALIDATION_THREADS,
                                            thread_name_prefix="grammar-validation")
        return self._pool

    def _keep(self, grammar: str, verdict: Verdict, param: str) -> None:
        with self._lock:
            if grammar in self._verdicts:
                self._verdicts.move_to_end(grammar)
                return
            self._verdicts[grammar] = verdict
            self._verdict_chars += len(grammar)
            # The newest stays even alone over the budget: compile is about to read it.
            while len(self._verdicts) > 1 and (len(self._verdicts) > self.CACHED_VERDICTS
                                               or self._verdict_chars > self.CACHED_CHARS):
                old, _ = self._verdicts.popitem(last=False)
                self._verdict_chars -= len(old)
        failed, messages = verdict
        if messages and not failed:
            logger.info("grammar warnings for %s: %s", param, messages)

    def _ll_tokenizer(self) -> Any:
        try:
            return self._tokenizer.get()
        except Exception as exc:  # noqa: BLE001 - refuse the request, keep serving
            raise RequestError(f"Structured output is not available for this model's "
                               f"tokenizer: {exc}", code="unsupported_parameter") from exc


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint, not yet checked against a tokenizer."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    source = constraint.source
    if constraint.kind == "json_schema":
        return _json_schema_grammar(_schema(source, constraint.param), constraint.param,
                                    constraint.lenient)
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


def _json_schema_grammar(schema: dict[str, Any], param: str, lenient: bool = False) -> str:
    from llguidance import LLMatcher

    defaults = {**JSON_DEFAULTS, "lenient": True} if lenient else JSON_DEFAULTS
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=defaults)  # type: ignore[arg-type]
    # Its documented refusal of a value JSON cannot carry, e.g. an integer past 64 bits
    # (Python's json reads any).
    except ValueError as exc:
        raise RequestError(f"Invalid '{param}': {_one_line([str(exc)])}", param=param,
                           code="invalid_grammar") from None


def _schema(source: str | dict[str, Any], param: str) -> dict[str, Any]:
    # A schema in an HTTP body was checked with the body; JSON text in a field and a ZMQ
    # client's msgpack object are checked here (depth, NaN, surrogates: see json_body).
    if isinstance(source, str):
        source = parse_text(source, param, code="invalid_grammar")
    elif (problem := find_problem(source)) is not None:
        raise problem.error(param)
    if not isinstance(source, dict):
        raise RequestError(f"'{param}' must be a JSON Schema object.", param=param,
                           code="invalid_grammar")
    return source


def _one_line(messages: list[str], limit: int = 600) -> str:
    # llguidance's messages span lines (a source excerpt with a caret); an error body
    # reads better flat, and a huge grammar must not make a huge error.
    text = " ".join((messages[0] if messages else "rejected by llguidance").split())
    return text if len(text) <= limit else text[:limit] + "..."

"""JSON from clients, parsed once and refused whole when the rest of the front could not
handle it.

`json.loads` accepts more than JSON: NaN, Infinity and numbers that overflow to inf, and
`"\\ud800"` escapes, which become lone surrogates (a Python string, but no UTF-8 encoder,
tokenizer, grammar compiler or msgpack takes one). It also recurses once per nesting
level, as later walks do (pydantic, json.dumps). Each of these used to end as a 500 deep
inside a route; here they are a 400 that names the field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.errors import RequestError, param_path

# serde_json's default recursion limit; real bodies (a chat, a JSON schema in a
# response_format) stay far below it.
MAX_DEPTH = 128

_SURROGATE = re.compile("[\ud800-\udfff]")
# In a UTF-8 body a lone surrogate can only come from such an escape (the bytes decode),
# so a body without one needs no string checks.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_PLAIN = (int, type(None))  # values that need no check (bool is an int)

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class JsonProblem:
    """Why a parsed value is refused, and where in it (a pydantic-style location)."""

    loc: Loc
    reason: str

    def error(self, param: str | None) -> RequestError:
        what = f"value for '{param}'" if param else "request body"
        return RequestError(f"Invalid {what}: {self.reason}.", param=param,
                            code="invalid_value")


def parse_object(raw: bytes) -> dict[str, Any]:
    """An HTTP request body: one JSON object, or a 400 naming what is wrong and where."""
    if not raw.strip():
        raise RequestError("The request body is empty; send a JSON object.")
    scan = _NumberScan()
    data = _loads(raw, scan, param=None)
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object.", code="invalid_json")
    # The walk is needed only where json.loads may have let something through; a body of
    # 100k token ids is then not walked at all.
    if scan.non_finite or _may_nest_too_deep(raw) or _may_hold_surrogate(raw):
        _raise_problem(data)
    return data


def parse_text(text: str, param: str, code: str = "invalid_json") -> Any:
    """A JSON text given inside a field (a native `json_schema` string), checked whole;
    `code` is the error code of text that does not parse."""
    value = _loads(text, _NumberScan(), param, code)
    problem = find_problem(value)
    if problem is not None:
        raise problem.error(param)
    return value


def _raise_problem(value: Any) -> None:
    """A 400 naming the field of a body that `find_problem` refuses."""
    problem = find_problem(value)
    if problem is not None:
        raise problem.error(param_path(problem.loc))


def find_problem(value: Any) -> JsonProblem | None:
    """The first part of a value (parsed JSON, or decoded msgpack) nested more than
    MAX_DEPTH containers deep, or holding a non-finite float or a lone surrogate (in a
    string or a key). Iterative: a deep value must not exhaust the stack here either."""
    stack: list[tuple[Any, Loc]] = [(value, ())]
    while stack:
        item, loc = stack.pop()
        problem = _problem_of(item, loc)
        if problem is not None:
            return problem
        stack.extend(reversed(_children(item, loc)))  # reversed: first problem first
    return None


def _problem_of(item: Any, loc: Loc) -> JsonProblem | None:
    if isinstance(item, str):
        return _surrogate_problem(item, loc)
    if isinstance(item, float) and not math.isfinite(item):
        return JsonProblem(loc, f"{item} is not a number JSON has (give a finite number)")
    # A container at `loc` is the (len(loc) + 1)-th level. Named by its top-level field:
    # the full path would be 128 steps long.
    if isinstance(item, (dict, list)) and len(loc) >= MAX_DEPTH:
        return JsonProblem(loc[:1], f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(item, dict):
        bad_key = next((k for k in item if isinstance(k, str) and _SURROGATE.search(k)), None)
        if bad_key is not None:
            return _surrogate_problem(bad_key, loc)
    return None


def _surrogate_problem(text: str, loc: Loc) -> JsonProblem | None:
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return JsonProblem(loc, f"a lone UTF-16 surrogate ({ascii(found.group())}) at character "
                            f"{found.start()} is not text; escape a character outside the "
                            "BMP as a surrogate pair")


def _children(item: Any, loc: Loc) -> list[tuple[Any, Loc]]:
    if isinstance(item, dict):
        return [(v, (*loc, k)) for k, v in item.items() if not isinstance(v, _PLAIN)]
    if isinstance(item, list):
        return [(v, (*loc, i)) for i, v in enumerate(item) if not isinstance(v, _PLAIN)]
    return []


def _may_hold_surrogate(raw: bytes) -> bool:
    # json.loads also reads UTF-16 and UTF-32, where the escape's bytes differ.
    utf8 = json.detect_encoding(raw).startswith("utf-8")
    return not utf8 or _SURROGATE_ESCAPE.search(raw) is not None


def _may_nest_too_deep(raw: bytes) -> bool:
    # Deeper than MAX_DEPTH needs more than MAX_DEPTH opening brackets (some may be in
    # strings: then the walk just finds nothing).
    return raw.count(b"[") + raw.count(b"{") > MAX_DEPTH


@dataclass
class _NumberScan:
    """json.loads hooks that note a number JSON does not have (NaN, Infinity, 1e400),
    so the walk runs only for bodies that hold one."""

    non_finite: bool = False

    def number(self, text: str) -> float:
        value = float(text)
        self.non_finite |= not math.isfinite(value)
        return value

    def constant(self, name: str) -> float:
        self.non_finite = True
        return float(name)  # "NaN", "Infinity", "-Infinity"


def _loads(raw: bytes | str, scan: _NumberScan, param: str | None,
           code: str = "invalid_json") -> Any:
    where = f"'{param}'" if param else "The request body"
    try:
        return json.loads(raw, parse_float=scan.number, parse_constant=scan.constant)
    except RecursionError:
        raise RequestError(f"{where} is nested too deeply (more than {MAX_DEPTH} levels "
                           "are refused).", param=param, code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"{where} is not valid JSON: {exc}", param=param,
                           code=code) from None

"""Request errors and their OpenAI-style JSON body.

Every refusal the front makes (HTTP or ZMQ) is a `RequestError`; the HTTP layer turns it
into `{"error": {"message", "type", "param", "code"}}` with its status code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


@dataclass
class RequestError(Exception):
    """A request the server refuses; `param` names the offending field when there is one."""

    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    type: str = INVALID_REQUEST

    def __str__(self) -> str:
        return self.message

    def body(self, path: str = "") -> dict[str, Any]:
        """The error body in the format of the API that `path` belongs to."""
        if is_anthropic_path(path):
            return anthropic_error_body(self.message, self.status)
        return error_body(self.message, self.type, self.param, self.code)


@dataclass
class EngineUnavailable(RequestError):
    """The engine behind the front died: not the request's fault, and the server is
    going down (503)."""

    code: str | None = "engine_unavailable"
    status: int = 503
    type: str = SERVER_ERROR


def error_body(message: str, type_: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Anthropic's Messages API has its own error shape and types, by HTTP status.
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(message: str, status: int = 400) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, message: str, status: int, type_: str = INVALID_REQUEST,
                   code: str | None = None) -> dict[str, Any]:
    """An error body (no parameter) for the API that `path` belongs to."""
    if is_anthropic_path(path):
        return anthropic_error_body(message, status)
    return error_body(message, type_, None, code)


# Pydantic puts union-member tags ("str", "list[int]", "TextPart") into error locations;
# they are not field names, so they are dropped from the reported parameter path.
_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def param_path(loc: Sequence[int | str]) -> str | None:
    """OpenAI-style parameter path ("messages[0].content") from a pydantic location."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD_NAME.match(part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


def from_validation_errors(errors: Sequence[dict[str, Any]]) -> RequestError:
    """One RequestError summing up pydantic errors (locations relative to the body)."""
    extra = [param_path(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = ", ".join(str(name) for name in extra)
        return RequestError(f"Unrecognized request argument supplied: {names}",
                            param=extra[0], code="unrecognized_argument")
    # Our own validators' messages say the most; after them, the error that got deepest
    # (in a union, the alternative the client most likely meant).
    first = max(errors, key=lambda e: (e["type"] == "value_error", len(e["loc"])))
    param = param_path(first["loc"])
    if first["type"] == "missing":
        return RequestError(f"Missing required parameter: '{param}'.", param=param,
                            code="missing_required_parameter")
    if param is None:
        return RequestError(_strip_value_error(str(first["msg"])))
    # A value matching none of a union's types fails once per alternative, same place.
    alternatives = [_strip_value_error(str(e["msg"])) for e in errors
                    if param_path(e["loc"]) == param]
    return RequestError(f"Invalid value for '{param}': {'; or '.join(alternatives)}",
                        param=param, code="invalid_value")


def _strip_value_error(msg: str) -> str:
    # Our own validators raise ValueError; pydantic prefixes their text with this.
    return msg.removeprefix("Value error, ")

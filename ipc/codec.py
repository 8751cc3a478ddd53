"""The single msgpack encode/decode path for every wire record."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

logger = logging.getLogger(__name__)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
# msgspec's default tag field: every record's map names its class under this key.
_TAG_FIELD = "type"


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


@dataclass(frozen=True)
class DecodeProblem:
    """Why a frame did not decode, and what could still be read of it: a sender owed an
    answer (a client waiting on its request id) can then be told."""

    error: str  # msgspec's words; they name the field ("... - at `$.max_tokens`")
    record_type: str | None = None  # the tag the frame's map claims
    request_id: str | None = None  # its "request_id", when that is a string

    def describe(self) -> str:
        return f"invalid {self.record_type or 'message'}: {self.error}"


def read_problem(frame: bytes, error: Exception) -> DecodeProblem:
    """The problem with a frame that failed to decode, with its tag and request id when
    the frame is at least a msgpack map."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return DecodeProblem(str(error))
    if not isinstance(raw, dict):
        return DecodeProblem(str(error))
    return DecodeProblem(str(error), _string(raw.get(_TAG_FIELD)), _string(raw.get("request_id")))


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class Decoder(Generic[T]):
    """Decodes frames into one of the record types a socket accepts.

    A frame that does not decode (garbage, a truncated frame, a record of another
    family, a field of the wrong type) is logged and dropped: `decode` returns None and
    the process keeps serving. `decode_or_problem` says what was wrong instead, for a
    socket that answers its senders.
    """

    def __init__(self, accepted: Any, where: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(accepted)
        self._where = where

    def decode(self, frame: bytes) -> T | None:
        result = self.decode_or_problem(frame)
        return None if isinstance(result, DecodeProblem) else result

    def decode_or_problem(self, frame: bytes) -> T | DecodeProblem:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("%s: dropped a frame that does not decode (%d bytes): %s",
                         self._where, len(frame), exc)
            return read_problem(frame, exc)

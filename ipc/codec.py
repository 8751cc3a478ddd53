"""The single msgpack encode/decode path for every wire record."""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgspec

logger = logging.getLogger(__name__)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class Decoder(Generic[T]):
    """Decodes frames into one of the record types a socket accepts.

    A frame that does not decode (garbage, a truncated frame, a record of another
    family, a field of the wrong type) is logged and dropped: `decode` returns None and
    the process keeps serving.
    """

    def __init__(self, accepted: Any, where: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(accepted)
        self._where = where

    def decode(self, frame: bytes) -> T | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("%s: dropped a frame that does not decode (%d bytes): %s",
                         self._where, len(frame), exc)
            return None

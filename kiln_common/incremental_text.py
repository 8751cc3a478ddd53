"""Incremental detokenization: per-request text deltas that never split a UTF-8 character.

Pure logic, no sockets. `DetokenizerState` follows vLLM's prefix/read offsets: each step
decodes only a short window of ids (a little already-emitted left context plus the ids not
yet emitted) with `tokenizer.decode` itself, and emits what the window adds to its context.

Why not mlx-lm's `BPEStreamingDetokenizer`: it drops the first leading space and ignores
`skip_special_tokens`, so its text differs from `tokenizer.decode`.

NOTE: text is only ever emitted up to a cut whose text no later id can change. For byte-level
BPE (lossy UTF-8 over the tokens' bytes) that is a cut where the decode ends in a whole
character, or where decode(left) + decode(right) == decode(left + right) for a non-empty
right side (such a cut is a character boundary: brute-forced over short strings of
representative bytes). So the joined deltas equal `tokenizer.decode(generated_ids, ...)`
exactly, invalid bytes and special tokens included. SentencePiece byte-fallback runs are
decoded as a whole (an invalid run becomes all U+FFFD), so there the deltas are exact
whenever the run is valid UTF-8.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence


logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"

# A character cut by the end of the window spans at most 3 bytes, so some token boundary
# among the last few is a clean cut unless the tokens themselves straddle characters.
MAX_CUT_SEARCH = 4
# Safety valve: past this many unemitted ids without a clean cut (only garbage id sequences
# get there) text is emitted anyway, so the window stays bounded; such text may then
# differ from a full decode in its U+FFFD.
MAX_HELD_IDS = 16


@dataclass(frozen=True)
class _Cut:
    """A position in the window and the decode of the ids before it."""

    at: int
    text: str


class TokenizerLike(Protocol):
    """What the detokenizer needs of a tokenizer (a transformers tokenizer has both)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...


def byte_fallback_ids(tokenizer: TokenizerLike) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens ("<0xE6>"); none in byte-level BPE.

    NOTE: a run of them decodes as a whole: if its bytes are invalid UTF-8, every byte
    becomes U+FFFD, so the text of a cut inside a run is not final while the run grows.
    """
    vocab = tokenizer.get_vocab()
    names = (f"<0x{byte:02X}>" for byte in range(256))
    return frozenset(vocab[name] for name in names if name in vocab)


@dataclass
class DetokenizerState:
    """Incremental detokenizer of one request.

    `_window` holds ids from the prefix offset on; its first `_read` ids are already
    emitted (or are prompt context) and only give the rest its left context, whose decode
    is cached in `_prefix_text`. NOTE: the cut at `_read` is always a character boundary.
    """

    tokenizer: TokenizerLike
    skip_special_tokens: bool = True
    byte_tokens: frozenset[int] = frozenset()
    _window: list[int] = field(default_factory=list, init=False)
    _read: int = field(default=0, init=False)
    _prefix_text: str = field(default="", init=False)

    @classmethod
    def start(cls, tokenizer: TokenizerLike, prompt_tail: Sequence[int] | None = None,
              skip_special_tokens: bool = True,
              byte_tokens: frozenset[int] | None = None) -> DetokenizerState:
        """A state that decodes its output as a continuation of `prompt_tail`.

        `byte_tokens` defaults to `byte_fallback_ids(tokenizer)`; pass it to save the
        vocabulary scan when starting many requests.
        """
        if byte_tokens is None:
            byte_tokens = byte_fallback_ids(tokenizer)
        state = cls(tokenizer, skip_special_tokens, byte_tokens)
        context = list(prompt_tail or [])
        text = state._decode(context)
        # A tail that ends inside a character is no clean cut: decode without context.
        if context and not text.endswith(REPLACEMENT_CHAR):
            state._window, state._read, state._prefix_text = context, len(context), text
        return state

    def step(self, token_ids: Sequence[int]) -> str:
        """Add new ids; return the text they complete (possibly "")."""
        self._window.extend(token_ids)
        if self._read == len(self._window):
            return ""
        cut = self._clean_cut(self._decode(self._window))
        if cut is None and len(self._window) - self._read > MAX_HELD_IDS:
            cut = self._forced_cut()
        return "" if cut is None else self._emit(cut)

    def finish(self) -> str:
        """Flush everything held back; the text then equals a full decode."""
        if self._read == len(self._window):
            return ""
        delta = self._decode(self._window)[len(self._prefix_text):]
        self._window, self._read, self._prefix_text = [], 0, ""
        return delta

    @property
    def window_size(self) -> int:
        """Ids kept for decoding (bounded; for tests and debugging)."""
        return len(self._window)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _clean_cut(self, text: str) -> _Cut | None:
        """The last cut past `_read` up to which the window's text is final."""
        if not text.endswith(REPLACEMENT_CHAR):
            # Lossy decoding only ends in a complete character at a character boundary.
            return _Cut(len(self._window), text)
        # The tail is a cut character or invalid bytes: look for an earlier clean cut.
        lowest = max(self._read + 1, len(self._window) - MAX_CUT_SEARCH)
        for at in range(len(self._window) - 1, lowest - 1, -1):
            left = self._decode(self._window[:at])
            if self._is_clean(at, left, text):
                return _Cut(at, left)
        return None

    def _is_clean(self, at: int, left: str, text: str) -> bool:
        """Whether no later id can change the text `left` of the ids before `at`."""
        if not left.startswith(self._prefix_text):
            return False
        if not left.endswith(REPLACEMENT_CHAR):
            return True  # it ends in a whole character: later bytes start afresh
        # U+FFFD from invalid bytes is final when the cut is a character boundary, which
        # the text shows by not changing across the cut (see the module's NOTE). Inside
        # a run of byte-fallback tokens that proves nothing: each byte is its own U+FFFD.
        if {self._window[at - 1], self._window[at]} <= self.byte_tokens:
            return False
        right = self._decode(self._window[at:])
        # An empty right side (say, only skipped special tokens) proves nothing either.
        return bool(right) and left + right == text

    def _forced_cut(self) -> _Cut:
        # Keep the last ids back: they may still be part of a character in progress.
        logger.debug("no clean cut in %d held ids; emitting anyway", len(self._window))
        at = len(self._window) - MAX_CUT_SEARCH
        return _Cut(at, self._decode(self._window[:at]))

    def _emit(self, cut: _Cut) -> str:
        """Emit the text of ids up to the cut; they become the next window's left context."""
        delta = cut.text[len(self._prefix_text):]
        context_text = self._decode(self._window[self._read:cut.at])
        if context_text or self._read >= MAX_HELD_IDS:
            # The old read offset is a clean cut, so the next window may start there.
            # (A long run of invisible ids is dropped anyway, to bound the window.)
            del self._window[:self._read]
            self._read, self._prefix_text = cut.at - self._read, context_text
        else:
            # Invisible ids (say, skipped special tokens) are no left context: a decoder
            # that strips a leading space would strip the next word's.
            self._read, self._prefix_text = cut.at, cut.text
        return delta

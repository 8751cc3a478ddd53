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

from detokenizer_proc.stops import LogprobGate, StopTrimmer
from ipc.messages.common import TokenLogprob
from ipc.messages.to_detokenizer import BatchTokens, TokenOutput
from ipc.messages.to_tokenizer import BatchText, PromptTextLogprobs, TextLogprob, TextOutput

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


class DetokenizerManager:
    """Detokenizer states of the running requests, keyed by request id."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._byte_tokens = byte_fallback_ids(tokenizer)
        self._states: dict[str, DetokenizerState] = {}
        self._token_texts: dict[int, str] = {}  # logprobs' token texts, by id (bounded by V)
        self._trimmers: dict[str, StopTrimmer] = {}  # requests with stop strings
        self._gates: dict[str, LogprobGate[TextLogprob]] = {}  # the same requests

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def process(self, batch: BatchTokens) -> BatchText:
        """One text output per token output, in the same order."""
        return BatchText(outputs=[self._process_one(out) for out in batch.outputs])

    def _process_one(self, out: TokenOutput) -> TextOutput:
        logprobs = self._text_logprobs(out)
        try:
            text, logprobs = self._trim(out, self._detokenize(out), logprobs)
            error = out.error
        except Exception as exc:  # one bad request must not fail its batch mates
            logger.exception("request %s: detokenization failed", out.rid)
            self._states.pop(out.rid, None)
            self._trimmers.pop(out.rid, None)
            self._gates.pop(out.rid, None)
            text, error = "", out.error or f"detokenization failed: {exc}"
        return TextOutput(rid=out.rid, text=text, token_ids=out.token_ids,
                          finished=out.finished, finish_reason=out.finish_reason,
                          usage=out.usage, error=error, logprobs=logprobs,
                          prompt_logprobs=self._prompt_logprobs(out),
                          cumulative_logprob=out.cumulative_logprob, stop_str=out.stop_str)

    def _text_logprobs(self, out: TokenOutput) -> list[TextLogprob] | None:
        """The token logprobs with each token's own text (the decode of that one id)."""
        if out.logprobs is None:
            return None
        return [self._text_logprob(t, lp) for t, lp in zip(out.token_ids, out.logprobs)]

    def _text_logprob(self, token_id: int, lp: TokenLogprob) -> TextLogprob:
        return TextLogprob(token=self._token_text(token_id), logprob=lp.logprob,
                           top_tokens=[self._token_text(i) for i in lp.top_ids],
                           top_logprobs=lp.top_logprobs, token_id=token_id,
                           top_ids=lp.top_ids)

    def _prompt_logprobs(self, out: TokenOutput) -> PromptTextLogprobs | None:
        scored = out.prompt_logprobs
        if scored is None:
            return None
        ids = scored.token_ids
        return PromptTextLogprobs(
            first=self._token_text(ids[0]), first_id=ids[0],
            rest=[self._text_logprob(t, lp) for t, lp in zip(ids[1:], scored.logprobs)])

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _detokenize(self, out: TokenOutput) -> str:
        state = self._states.get(out.rid)
        if state is None:
            # Normally the first output, carrying the setup; any other starts fresh.
            state = DetokenizerState.start(self._tokenizer, out.prompt_tail,
                                           out.skip_special_tokens, self._byte_tokens)
            self._states[out.rid] = state
            if out.stop:
                self._trimmers[out.rid] = StopTrimmer(out.stop, out.include_stop_str)
                self._gates[out.rid] = LogprobGate()
        text = state.step(out.token_ids)
        if out.finished:
            text += state.finish()
            del self._states[out.rid]
        return text

    def _trim(self, out: TokenOutput, decoded: str, logprobs: list[TextLogprob] | None
              ) -> tuple[str, list[TextLogprob] | None]:
        """Cut the text at the request's first stop string and hold back what may start
        one; the logprob entries follow the text returned (LogprobGate)."""
        trimmer = self._trimmers.get(out.rid)
        if trimmer is None:
            return decoded, logprobs
        gate = self._gates[out.rid]
        if out.finished:
            del self._trimmers[out.rid], self._gates[out.rid]
        text = trimmer.push(decoded, final=out.finished)
        if out.stop_str is not None and trimmer.matched is None:
            logger.warning("request %s: the scheduler matched stop %r, the text holds none",
                           out.rid, out.stop_str)
        passed = gate.push(logprobs or [], decoded, text, trimmer.matched is not None,
                           out.finished)
        return text, passed if logprobs is not None or passed else None

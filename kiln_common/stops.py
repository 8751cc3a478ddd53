"""Stop strings on generated text: where the scheduler stops, where the detokenizer cuts.

Pure logic on text deltas (the exact deltas `DetokenizerState` emits, so the scheduler and
the detokenizer see the same text). The text of a request ends at the first occurrence of
any of its stop strings: the one that starts first (the shortest, on a tie), excluded
unless include_stop_str_in_output. Both classes keep only a bounded tail of text.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, Sequence, TypeVar

T = TypeVar("T")


class StopMatch(NamedTuple):
    start: int  # in the text searched
    stop: str


def first_stop(text: str, stops: Sequence[str]) -> StopMatch | None:
    """The first stop string occurrence in text, if any."""
    found = [StopMatch(text.find(s), s) for s in stops if s in text]
    return min(found, key=lambda m: (m.start, len(m.stop)), default=None)


class StopStringMatcher:
    """Fed a request's text increments; reports the stop string that ends it.

    NOTE: the text seen so far holds no stop string, so a new occurrence ends in the new
    increment and starts at most max_len - 1 characters before it: that is all it keeps.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self._keep = max(len(s) for s in self.stops) - 1
        self._tail = ""

    def feed(self, delta: str) -> str | None:
        """The matched stop string, or None while none has occurred."""
        if not delta:
            return None
        text = self._tail + delta
        match = first_stop(text, self.stops)
        self._tail = text[len(text) - self._keep:] if self._keep else ""
        return None if match is None else match.stop


class StopTrimmer:
    """The detokenizer's side: emits text deltas that never pass the cut.

    Holds back any tail that could be the start of a stop string, so a streamed delta is
    never taken back; after a match everything further is dropped.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = list(stops)
        self.include_stop = include_stop
        self.matched: str | None = None
        self._held = ""

    def push(self, delta: str, final: bool = False) -> str:
        """The part of delta (plus what was held) that is certainly before the cut."""
        if self.matched is not None:
            return ""
        text = self._held + delta
        match = first_stop(text, self.stops)
        if match is not None:
            self.matched, self._held = match.stop, ""
            end = match.start + (len(match.stop) if self.include_stop else 0)
            return text[:end]
        keep = 0 if final else self._possible_start(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _possible_start(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        longest = min(len(text), max(len(s) for s in self.stops) - 1)
        for n in range(longest, 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


class LogprobGate(Generic[T]):
    """Keeps a stop-string request's logprob entries in step with its returned text.

    An entry is tied to where its token's text starts in the untrimmed text (a token
    whose text is still held back, part of a character, starts where that text will).
    It goes out once the trimmer has let text past that point out, so streamed entries
    are never taken back; at a stop string, the entries of tokens that start at or past
    the cut are dropped. A token partly cut keeps its entry (some of its text is
    returned); with include_stop_str_in_output the cut is after the stop string, so the
    stop string's tokens keep theirs.
    """

    def __init__(self) -> None:
        self._decoded = 0  # characters of the untrimmed text so far
        self._released = 0  # characters the trimmer let out (a prefix of the above)
        self._held: list[tuple[int, T]] = []  # (start of the token's text, entry)
        self._cut = False

    def push(self, entries: Sequence[T], decoded: str, released: str, cut: bool,
             final: bool) -> list[T]:
        """The entries that may go out now. `entries` belong to the tokens that produced
        `decoded` (untrimmed), of which the trimmer released `released`; `cut`: the
        trimmer has matched a stop string."""
        if self._cut:
            return []
        self._held += [(self._decoded, e) for e in entries]
        self._decoded += len(decoded)
        self._released += len(released)
        ready = len(self._held) if final and not cut else \
            sum(1 for start, _ in self._held if start < self._released)
        out = [e for _, e in self._held[:ready]]
        self._held = [] if cut else self._held[ready:]
        self._cut = cut
        return out

"""Which earlier positions a windowed attention layer's queries see: the one rule the
worker (its masks and slot tables) and the scheduler (which gives back the window slots
of positions behind every window) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SLIDING = "sliding"  # a query sees itself and the span - 1 positions before it
CHUNKED = "chunked"  # a query sees its own chunk of `span` positions, up to itself


def first_visible(kind: str, span: int, lengths: Any) -> Any:
    """The first position a query at position lengths - 1 sees, for a numpy or an MLX
    array of lengths, or an int (operators only, so an MLX one stays in the graph)."""
    if kind == SLIDING:
        return (lengths - span) * (lengths > span)
    if kind == CHUNKED:
        return (lengths - 1) // span * span
    return lengths * 0


@dataclass(frozen=True)
class WindowRule:
    """A model's windowed layer kinds, each (kind, span): a position is still needed while
    a query to come of any of them may see it."""

    windows: tuple[tuple[str, int], ...]

    def first_needed(self, query: Any) -> Any:
        """The first position any windowed layer's query at position `query` (an int or a
        numpy array) sees; every position before it is behind every window."""
        firsts = [first_visible(kind, span, query + 1) for kind, span in self.windows]
        return firsts[0] if len(firsts) == 1 else np.minimum.reduce(firsts)

    @property
    def reach(self) -> int:
        """The most positions before a query that one of its windows still sees."""
        return max(span - 1 for _, span in self.windows)

    def most_held(self, tokens: int, fill: int, chunk: int) -> int:
        """The most window slots a request of `tokens` positions, `fill` of them computed
        in prefill chunks of at most `chunk`, needs at once: what its queries see (its
        window and a chunk). Cached positions behind it keep theirs only while room allows."""
        return min(tokens + 1, self.reach + min(chunk, max(1, fill)) + 1)

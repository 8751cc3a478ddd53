"""The slot space of windowed layers (sliding windows, chunk-local attention).

A windowed layer's queries see only the last positions of a context, so its K/V need not
live as long as a full layer's: such layers get a pool of their own, addressed by window
slots. Every position gets a window slot beside its full slot when it is computed; once
every windowed layer's queries to come are past it, its window slot is given back. The
scheduler owns both spaces; a window slot belongs to whoever owns its position's full
slot (a running request or the prefix cache) and goes back with it.

A running request gives back the window slots of its own positions as its queries pass
them; cached positions (a prompt the request cached at its end, or any prefix it left
behind) keep theirs while room allows, so a prompt sharing a prefix or extending one (a
chat's next turn) hits there. When window slots run short, the scheduler takes those of
cached positions no running query sees, least recently used first (the full K/V stay).
A cached prefix of length P then serves a hit only if its positions that a query at P
still sees kept their window slots (`usable`).
"""

from __future__ import annotations

import numpy as np

from kiln_common.windows import WindowRule
from scheduler_proc.allocator import SlotAllocator


class WindowSlots:
    def __init__(self, capacity: int, num_full_slots: int, rule: WindowRule,
                 chunk_size: int) -> None:
        self.allocator = SlotAllocator(capacity)
        self.rule = rule
        self.chunk_size = chunk_size
        self._of = np.zeros(num_full_slots + 1, dtype=np.int32)  # full slot -> window slot

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    def attach(self, full: np.ndarray) -> np.ndarray | None:
        """Window slots for newly computed positions (their full slots); None when too
        few are free."""
        window = self.allocator.alloc(len(full))
        if window is not None:
            self._of[full] = window
        return window

    def drop(self, full: np.ndarray) -> None:
        """Give back the window slots of these positions (those that have one)."""
        window = self._of[full]
        self.allocator.free(window[window > 0])
        self._of[full] = 0

    def of(self, full: np.ndarray) -> np.ndarray:
        """The window slot of each position (0: it has none any more)."""
        return self._of[full]

    def usable(self, slots: np.ndarray) -> int:
        """The longest prefix of a cached match (its full slots, in order) that every
        windowed layer can resume from: each position that the query right after it sees
        still has its window slot (a chunked layer at a chunk's start needs none)."""
        n = len(slots)
        if n == 0:
            return 0
        present = self._of[slots] > 0
        at = np.arange(n)
        # For position i, where the run of positions with window slots ending at i starts.
        run_start = np.maximum.accumulate(np.where(present, -1, at)) + 1
        ends = at + 1  # a hit of length L resumes with the query at position L
        needs = self.rule.first_needed(ends)
        ok = (needs >= ends) | (present & (needs >= run_start))
        found = np.nonzero(ok)[0]
        return int(found[-1]) + 1 if len(found) else 0

    def need(self, tokens: int, fill: int) -> int:
        """The most window slots a request of `tokens` positions with a prompt of `fill`
        to compute holds at once (WindowRule.most_held)."""
        return self.rule.most_held(tokens, fill, self.chunk_size)

    def consistent(self) -> bool:
        """Every window slot in use belongs to exactly one position."""
        attached = self._of[self._of > 0]
        return len(attached) == self.num_used and len(np.unique(attached)) == len(attached)

"""KV slot allocator and the req-to-token table: plain numpy, no MLX."""

from __future__ import annotations

import numpy as np


class SlotAllocator:
    """Hands out KV slot ids 1..capacity; slot 0 is the worker's padding slot."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the KV pool needs at least one slot")
        self.capacity = capacity
        # A stack: the most recently freed slots are reused first (warm in caches).
        self._free = np.arange(capacity, 0, -1, dtype=np.int32)
        self._top = capacity

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.capacity - self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """n free slots, or None (and nothing taken) when fewer are free."""
        if n > self._top:
            return None
        self._top -= n
        return self._free[self._top:self._top + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if self._top + n > self.capacity:
            raise RuntimeError("freeing more slots than were allocated")
        self._free[self._top:self._top + n] = slots
        self._top += n


class ReqToTokenTable:
    """Row r, column p: the slot holding the K/V of token p of the request in row r."""

    def __init__(self, rows: int, max_context: int) -> None:
        self.max_context = max_context
        self._table = np.zeros((rows, max_context), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self._table[row] = 0
        self._free_rows.append(row)

    def assign(self, row: int, start: int, slots: np.ndarray) -> None:
        self._table[row, start:start + len(slots)] = slots

    def slots(self, row: int, end: int) -> np.ndarray:
        return self._table[row, :end]

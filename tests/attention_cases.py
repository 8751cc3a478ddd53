"""Slot tables for decode-attention cases, shared by the attention tests."""

from __future__ import annotations

import numpy as np


def ragged_slot_table(lengths: np.ndarray, num_slots: int, rng: np.random.Generator) -> np.ndarray:
    """[B, max(lengths)] int32: each row's first lengths[b] entries are distinct slots in
    1..num_slots-1, scattered over the pool as a long-running server's would be; the rest
    is padding (slot 0)."""
    table = np.zeros((len(lengths), int(lengths.max())), dtype=np.int32)
    perm = rng.permutation(np.arange(1, num_slots))
    used = 0
    for b, n in enumerate(lengths):
        table[b, :n] = perm[used:used + n]
        used += n
    return table

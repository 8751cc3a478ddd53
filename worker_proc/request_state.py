"""What the worker keeps of each request between steps: its slot-table row and context
length, its sampling settings (checked once, when it arrives) and the device state they
need (the last sampled token, penalised requests' token counts)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from ipc.messages.common import SamplingParams
from worker_proc.sampling import SamplingBatch

_SERIALS = itertools.count()


@dataclass
class TokenCounts:
    """A penalised request's device rows, built at its first sample (the vocab size is
    known then) from the ids the scheduler sent, then advanced with each lazy token."""

    prompt_ids: list[int]
    output_ids: list[int]
    counts: mx.array | None = None  # [V] int32, possibly not evaluated yet
    in_prompt: mx.array | None = None  # [V] bool
    # Names this request's rows among stacked ones (an id() could be reused once freed).
    serial: int = field(default_factory=lambda: next(_SERIALS))

    def rows(self, vocab: int) -> tuple[mx.array, mx.array]:
        if self.counts is None:
            self.counts = mx.array(np.bincount(self.output_ids, minlength=vocab).astype(np.int32))
            in_prompt = np.zeros(vocab, dtype=bool)
            in_prompt[self.prompt_ids] = True
            self.in_prompt = mx.array(in_prompt)
            self.prompt_ids, self.output_ids = [], []  # the rows hold them from now on
        assert self.in_prompt is not None
        return self.counts, self.in_prompt


@dataclass
class RequestState:
    rid: str
    row: int
    sampling: SamplingParams
    seed: int
    length: int = 0  # tokens whose K/V is in the pool
    num_sampled: int = 0
    # The last sampled token: row last_row of a step's tokens array, possibly not
    # evaluated yet. Kept as (array, row), not a slice, so a decode batch gathers its
    # inputs in one op instead of concatenating a slice per row (a kernel each on a GPU).
    last_tokens: mx.array | None = None
    last_row: int = 0
    stop_ids: list[int] = field(default_factory=list)  # masked until min_tokens outputs
    token_counts: TokenCounts | None = None  # only for requests with penalties
    # Only for requests with a grammar: an llguidance matcher that has consumed every
    # output the host has seen (advanced in finish, so it may lag the lazy last_tokens).
    matcher: Any = None
    # Prompt logprobs: the last position's logits of the previous chunk, which score the
    # next chunk's first token.
    prompt_carry: mx.array | None = None
    # Recurrent layers: the snapshot its first chunk starts from (then 0).
    start_snapshot: int = 0


def check_sampling(sp: SamplingParams, seed: int, num_sampled: int, stop_ids: list[int],
                   vocab: int | None) -> None:
    """Raise if a request's settings cannot go into a step's sampling: the front bounds
    them, but a value that slipped past it must fail its request, not every request of
    the step (a top_k past int32 once took the whole worker down)."""
    SamplingBatch.build([sp], [seed], [num_sampled], [stop_ids])  # the dtype conversions
    check_ids("logit_bias ids", list(sp.logit_bias), vocab)
    check_ids("stop ids", stop_ids, vocab)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", *(["logit_bias"] * bool(sp.logit_bias))):
        values = sp.logit_bias.values() if name == "logit_bias" else [getattr(sp, name)]
        if not all(np.isfinite(v) for v in values):
            raise ValueError(f"{name} is not a finite number")


def check_ids(what: str, ids: list[int], vocab: int | None) -> None:
    if ids and (min(ids) < 0 or (vocab is not None and max(ids) >= vocab)):
        raise ValueError(f"{what} must be in [0, {vocab})")


def fold_seed(seed: int) -> int:
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF

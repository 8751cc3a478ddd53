"""A step's sampling over its rows' logits: the tokens, the penalised requests' token
counts (lazy: the next step may be built before these tokens exist) and the logprobs of
the rows that asked. Its host-made inputs come from staging rings of its own."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from worker_proc.request_state import RequestState
from worker_proc.sampling import (GrammarMask, Penalties, SamplingBatch, StepLogprobs, sample,
                                  step_logprobs)
from worker_proc.staging import HostStaging, Stage


class Sampled(NamedTuple):
    tokens: mx.array | None
    counts: list[mx.array]  # penalised requests' new token counts
    logprobs: StepLogprobs | None


NOTHING_SAMPLED = Sampled(None, [], None)


class StepSampler:
    """Samples each step's rows; keeps the last step's stacked penalty counts, so a step
    with the same penalised requests in the same order reuses them."""

    def __init__(self) -> None:
        # The last step's penalised rows, stacked ([P, V] counts and prompt presence), and
        # whose they are (TokenCounts serials, in order): see _penalties.
        self._stacked_key: tuple[int, ...] = ()
        self._stacked: tuple[mx.array, mx.array] | None = None
        # Host-written inputs: the rows' sampling settings; the extras (logit edits,
        # penalties, logprob rows: one use a step, each an add).
        self._settings_staging, self._extras_staging = HostStaging(), HostStaging()

    def reset(self) -> None:
        self._stacked_key, self._stacked = (), None

    def sample(self, logits: list[mx.array], states: list[RequestState],
               grammar: GrammarMask | None = None) -> Sampled:
        """The step's tokens, the penalised requests' new (lazy) token counts, and the
        logprobs of the rows that asked; each state's last tokens and count of sampled
        tokens move on."""
        stacked = mx.concatenate(logits, axis=0)
        self._extras_staging.begin()
        extras = self._extras_staging.add
        penalties = self._penalties(states, stacked.shape[-1], extras)
        params = SamplingBatch.build([s.sampling for s in states], [s.seed for s in states],
                                     [s.num_sampled for s in states],
                                     [s.stop_ids for s in states], penalties, grammar,
                                     stage=self._settings_staging.stage, extras=extras)
        tokens = sample(stacked, params)
        # From the raw logits: see StepLogprobs for which distribution.
        logprobs = step_logprobs(stacked, tokens, [s.sampling for s in states], extras)
        for i, s in enumerate(states):
            s.last_tokens, s.last_row = tokens, i
            s.num_sampled += 1
        return Sampled(tokens, self._count(states, penalties, tokens), logprobs)

    def _penalties(self, states: list[RequestState], vocab: int,
                   stage: Stage) -> Penalties | None:
        rows = [i for i, s in enumerate(states) if s.token_counts is not None]
        if not rows:
            return None
        counters = [states[i].token_counts for i in rows]
        key = tuple(c.serial for c in counters)  # type: ignore[union-attr]
        params = [states[i].sampling for i in rows]
        if key == self._stacked_key:
            # The same penalised requests as last step, in order: last step's stacked
            # arrays, not a restack of every row ([P, V] copies) each step.
            counts, in_prompt = self._stacked
            return Penalties.of(rows, params, counts, in_prompt, stage)
        counted = [c.rows(vocab) for c in counters]  # type: ignore[union-attr]
        return Penalties.build(rows, params, [c for c, _ in counted], [p for _, p in counted],
                               stage)

    def _count(self, states: list[RequestState], penalties: Penalties | None,
               tokens: mx.array) -> list[mx.array]:
        # NOTE: from the lazy tokens, never host values: the next step may be built
        # before this one's tokens exist.
        if penalties is None:
            return []
        counts = penalties.counted(tokens)
        rows = [s for s in states if s.token_counts is not None]
        for j, s in enumerate(rows):
            s.token_counts.counts = counts[j]  # type: ignore[union-attr]
        self._stacked_key = tuple(s.token_counts.serial for s in rows)  # type: ignore[union-attr]
        self._stacked = (counts, penalties.in_prompt)
        return [counts]

"""Batched in-graph sampling: greedy, temperature, top-k, top-p and min-p, per-row settings,
after the logit edits (logit_bias, min_tokens' stop-id mask), the penalties and the grammar
mask (structured output).

Random draws come from a counter-based hash of (seed, step, token id) instead of a shared
generator, so a seeded request's tokens do not depend on what else is in its batch, and
the whole batch still samples in one vectorised graph (Gumbel-max trick).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ipc.messages.common import SamplingParams
from worker_proc.staging import Stage, new_arrays

_U32 = mx.uint32
_BELOW_ONE = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
_BIT_VALUES = mx.array([1 << b for b in range(32)], dtype=_U32)  # bit b of a mask word


@dataclass(frozen=True)
class LogitEdits:
    """Sparse additions to the logits, entry k adding values[k] at (rows[k], tokens[k]):
    logit_bias, and -inf on stop ids for rows that have not reached min_tokens."""

    rows: mx.array  # [K] int32
    tokens: mx.array  # [K] int32
    values: mx.array  # [K] float32

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int],
              stop_ids: list[list[int]], stage: Stage = new_arrays) -> "LogitEdits | None":
        """None when no row edits anything, so such batches pay nothing. stage: makes the
        entries' arrays from numpy ones (worker_proc.staging)."""
        # Only rows with a bias or an unmet min_tokens get their entries built: in the
        # usual batch none, found without a list per row (measured on a 128-row step).
        edited = [i for i, (p, n, stops) in enumerate(zip(params, steps, stop_ids))
                  if p.logit_bias or (stops and n < p.min_tokens)]
        if not edited:
            return None
        rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for i in edited:
            p = params[i]
            masked = stop_ids[i] if steps[i] < p.min_tokens else []
            entries = [*p.logit_bias.items(), *((t, -np.inf) for t in masked)]
            rows += [i] * len(entries)
            tokens += [t for t, _ in entries]
            values += [v for _, v in entries]
        return cls(*stage(np.array(rows, dtype=np.int32), np.array(tokens, dtype=np.int32),
                          np.array(values, dtype=np.float32)))


@dataclass(frozen=True)
class Penalties:
    """Repetition, frequency and presence penalties of the rows that use any of them."""

    rows: mx.array  # [P] int32: their rows in the batch
    counts: mx.array  # [P, V] int32: how often each token was sampled (outputs only)
    in_prompt: mx.array  # [P, V] bool
    repetition: mx.array  # [P] float32
    frequency: mx.array  # [P] float32
    presence: mx.array  # [P] float32

    @classmethod
    def build(cls, rows: list[int], params: list[SamplingParams], counts: list[mx.array],
              in_prompt: list[mx.array], stage: Stage = new_arrays) -> "Penalties | None":
        if not rows:
            return None
        return cls.of(rows, params, mx.stack(counts), mx.stack(in_prompt), stage)

    @classmethod
    def of(cls, rows: list[int], params: list[SamplingParams], counts: mx.array,
           in_prompt: mx.array, stage: Stage = new_arrays) -> "Penalties":
        """From rows already stacked: counts and in_prompt [P, V]. stage: as
        LogitEdits.build takes it."""
        def f32(name: str) -> np.ndarray:
            return np.array([getattr(p, name) for p in params], dtype=np.float32)

        index, repetition, frequency, presence = stage(
            np.array(rows, dtype=np.int32), f32("repetition_penalty"),
            f32("frequency_penalty"), f32("presence_penalty"))
        return cls(rows=index, counts=counts, in_prompt=in_prompt, repetition=repetition,
                   frequency=frequency, presence=presence)

    def counted(self, tokens: mx.array) -> mx.array:
        """counts [P, V] after the batch's sampled tokens (lazy, like the tokens)."""
        vocab = mx.arange(self.counts.shape[-1], dtype=mx.int32)[None, :]
        return self.counts + (vocab == tokens[self.rows][:, None]).astype(mx.int32)


@dataclass(frozen=True)
class GrammarMask:
    """The tokens each constrained row's grammar allows next, as llguidance's bitmasks:
    bit t % 32 of word t // 32 allows token t. Ids past the mask (a model vocab wider
    than the tokenizer's) are never allowed."""

    rows: mx.array  # [G] int32: the constrained rows of the batch
    words: mx.array  # [G, W] uint32

    @classmethod
    def build(cls, rows: list[int], masks: np.ndarray,
              stage: Stage = new_arrays) -> "GrammarMask | None":
        """rows: distinct, ascending; masks: [G, W] int32 as llguidance fills them; None
        when no row is constrained. stage: as LogitEdits.build takes it."""
        assert rows == sorted(set(rows)), rows
        if not rows:
            return None
        return cls(*stage(np.array(rows, dtype=np.int32), masks.view(np.uint32)))

    def allowed(self, vocab: int) -> mx.array:
        """[G, vocab] bool."""
        g, w = self.words.shape
        bits = (self.words[:, :, None] & _BIT_VALUES) != 0
        bits = bits.reshape(g, w * 32)
        if w * 32 >= vocab:
            return bits[:, :vocab]
        return mx.concatenate([bits, mx.zeros((g, vocab - w * 32), dtype=mx.bool_)], axis=1)


def apply_grammar_mask(logits: mx.array, mask: GrammarMask) -> mx.array:
    """-inf on every token a constrained row's grammar does not allow; allowed tokens and
    unconstrained rows keep their logits bit for bit."""
    logits = logits.astype(mx.float32)  # a new array: the caller's stays as it was
    allowed = mask.allowed(logits.shape[-1])
    # NOTE: rows are distinct and ascending, so as many rows as the batch are all of it;
    # then no gather and scatter (on the CPU they cost as much as the mask itself).
    if mask.rows.shape[0] == logits.shape[0]:
        return mx.where(allowed, logits, -mx.inf)
    rows = logits[mask.rows]
    logits[mask.rows] = mx.where(allowed, rows, -mx.inf)
    return logits


@dataclass(frozen=True)
class RowDraws:
    """What the rows of a step with sampled (temperature > 0) rows draw with."""

    temperature: mx.array  # [N] float32; 0 rows are greedy
    top_p: mx.array  # [N] float32
    top_k: mx.array  # [N] int32; 0 = off
    seed: mx.array  # [N] uint32
    step: mx.array  # [N] uint32: how many tokens the row has sampled before
    min_p: mx.array  # [N] float32; 0 = off
    needs_filter: bool  # some sampled row uses top-p, top-k or min-p


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings for one step, as device arrays."""

    draws: RowDraws | None  # None when every row is greedy: no arrays to send
    edits: LogitEdits | None = None
    penalties: Penalties | None = None
    grammar: GrammarMask | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int],
              stop_ids: list[list[int]] | None = None,
              penalties: Penalties | None = None,
              grammar: GrammarMask | None = None,
              stage: Stage | None = None, extras: Stage = new_arrays) -> "SamplingBatch":
        """steps: tokens each row sampled before; stop_ids: each row's ids that min_tokens
        masks (default none); grammar: the constrained rows' masks (default none); stage:
        makes the per-row settings' arrays from numpy ones (worker_proc.staging; default
        mx.array each), in one call; extras: the logit edits' (HostStaging.add of a use
        begun for the step's extras)."""
        temps = np.array([p.temperature for p in params], dtype=np.float32)
        sampled = temps > 0
        draws = None
        if sampled.any():
            top_p = np.array([p.top_p for p in params], dtype=np.float32)
            top_k = np.array([p.top_k for p in params], dtype=np.int32)
            min_p = np.array([p.min_p for p in params], dtype=np.float32)
            made = (stage or new_arrays)(temps, top_p, top_k, np.array(seeds, dtype=np.uint32),
                                      np.array(steps, dtype=np.uint32), min_p)
            draws = RowDraws(*made, needs_filter=bool(
                ((top_p < 1.0) | (top_k > 0) | (min_p > 0))[sampled].any()))
        return cls(
            draws=draws,
            edits=LogitEdits.build(params, steps, stop_ids or [[] for _ in params], extras),
            penalties=penalties,
            grammar=grammar,
        )


def process_logits(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """float32 logits after the edits, then the penalties, then the grammar mask (last, so
    nothing can lift a disallowed token); rows without any are untouched, so their greedy
    tokens stay bit-identical to plain argmax."""
    logits = logits.astype(mx.float32)
    if batch.edits is not None:
        e = batch.edits
        logits = logits.at[e.rows, e.tokens].add(e.values)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    if batch.grammar is not None:
        logits = apply_grammar_mask(logits, batch.grammar)
    return logits


def apply_penalties(logits: mx.array, pen: Penalties) -> mx.array:
    """HF/vLLM repetition penalty over prompt + outputs (positive logits divided, negative
    multiplied), then OpenAI's logit -= frequency * count + presence * (count > 0)."""
    logits = logits.astype(mx.float32)  # a new array: the caller's stays as it was
    rows = logits[pen.rows]
    counts = pen.counts.astype(mx.float32)
    seen = pen.in_prompt | (pen.counts > 0)
    rep = pen.repetition[:, None]
    rows = mx.where(seen, mx.where(rows > 0, rows / rep, rows * rep), rows)
    rows = rows - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0)
    logits[pen.rows] = rows
    return logits


def sample(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """Next token per row of logits [N, V] (float32 math), as int32 [N]."""
    logits = process_logits(logits, batch)
    # Same quantity mlx-lm's greedy sampler takes the argmax of, so ties break alike.
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    draws = batch.draws
    if draws is None:
        return greedy
    temps = mx.where(draws.temperature > 0, draws.temperature, 1.0)
    scaled = logits / temps[:, None]
    noise = gumbel_noise(draws.seed, draws.step, logits.shape[-1])
    if draws.needs_filter:
        drawn = _sample_filtered(scaled, noise, draws)
    else:
        drawn = mx.argmax(scaled + noise, axis=-1).astype(mx.int32)
    return mx.where(draws.temperature > 0, drawn, greedy)


def _sample_filtered(scaled: mx.array, noise: mx.array, batch: RowDraws) -> mx.array:
    order = mx.argsort(-scaled, axis=-1)
    sorted_logits = mx.take_along_axis(scaled, order, axis=-1)
    # min-p first (as vLLM): top-p's mass is then taken over the tokens min-p kept.
    min_p_floor = sorted_logits[:, :1] + mx.log(batch.min_p)[:, None]
    sorted_logits = mx.where(sorted_logits >= min_p_floor, sorted_logits, -mx.inf)
    probs = mx.softmax(sorted_logits, axis=-1, precise=True)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    rank = mx.arange(scaled.shape[-1])[None, :]
    top_k = mx.where(batch.top_k > 0, batch.top_k, scaled.shape[-1])
    # The first (most likely) token always survives, whatever top_p is.
    keep = (mass_before < batch.top_p[:, None]) & (rank < top_k[:, None])
    filtered = mx.where(keep, sorted_logits, -mx.inf)
    choice = mx.argmax(filtered + mx.take_along_axis(noise, order, axis=-1), axis=-1)
    return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(mx.int32)


@dataclass(frozen=True)
class StepLogprobs:
    """Log-probabilities for the rows of a step whose request asked (lazy arrays).

    Of the raw model distribution: log-softmax of the logits before any edit, penalty,
    temperature or filter (vLLM's default "raw" mode), so a value does not depend on the
    request's sampling settings. top_ids/top_logprobs hold `max(counts)` entries per row,
    most likely first; row j keeps its first counts[j].
    """

    rows: list[int]  # indices into the step's rows
    counts: list[int]  # top-k wanted per row
    chosen: mx.array  # [R] float32: the sampled token's logprob
    top_ids: mx.array  # [R, K] int32
    top_logprobs: mx.array  # [R, K] float32

    @property
    def arrays(self) -> list[mx.array]:
        return [self.chosen, self.top_ids, self.top_logprobs]


def step_logprobs(logits: mx.array, tokens: mx.array, params: list[SamplingParams],
                  stage: Stage = new_arrays) -> StepLogprobs | None:
    """Logprobs of the sampled tokens and the top-k, only for rows with logprobs >= 0;
    None (nothing in the graph) when no row asked. stage: as LogitEdits.build takes it."""
    rows = [i for i, p in enumerate(params) if p.logprobs >= 0]
    if not rows:
        return None
    counts = [params[i].logprobs for i in rows]
    index, = stage(np.array(rows, dtype=np.int32))
    picked = token_logprobs(logits[index], tokens[index], max(counts))
    return StepLogprobs(rows, counts, *picked)


class PickedLogprobs(NamedTuple):
    chosen: mx.array  # [R] float32: each row's token's logprob
    top_ids: mx.array  # [R, k] int32, most likely first
    top_logprobs: mx.array  # [R, k] float32


def token_logprobs(logits: mx.array, tokens: mx.array, k: int) -> PickedLogprobs:
    """Log-softmax of logits [R, V] (float32) at tokens [R], and each row's k most likely."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if k == 0:
        top_ids = mx.zeros((logits.shape[0], 0), dtype=mx.int32)
        return PickedLogprobs(chosen, top_ids, top_ids.astype(mx.float32))
    # argpartition finds the k largest unordered; a sort of those k orders them.
    top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    top_values = mx.take_along_axis(logprobs, top, axis=-1)
    order = mx.argsort(-top_values, axis=-1)
    return PickedLogprobs(chosen, mx.take_along_axis(top, order, axis=-1).astype(mx.int32),
                          mx.take_along_axis(top_values, order, axis=-1))


def gumbel_noise(seed: mx.array, step: mx.array, vocab: int) -> mx.array:
    """Gumbel(0, 1) noise [N, vocab], a pure function of (seed, step, token id)."""
    token = mx.arange(vocab, dtype=_U32)[None, :]
    x = seed[:, None] * _c(0x9E3779B1) ^ (step[:, None] + _c(1)) * _c(0x85EBCA77)
    x = _fmix32(_fmix32(x) ^ token * _c(0xC2B2AE3D))
    return gumbel_from_bits(x >> _c(8))


def gumbel_from_bits(bits: mx.array) -> mx.array:
    """Gumbel(0, 1) from 24 random bits (uint32 < 2**24), centred in their bucket so u is
    never 0 or 1.

    NOTE: the top bucket's centre, 1 - 2**-25, rounds to 1.0 in float32, whose noise is
    +inf: that token then beat every other, and a grammar's -inf plus it made a NaN that
    argmax took. It is clamped to the float just below 1 (noise ~16.6); every other draw
    is unchanged.
    """
    u = (bits.astype(mx.float32) + 0.5) * (1.0 / (1 << 24))
    u = mx.minimum(u, _BELOW_ONE)
    return -mx.log(-mx.log(u))


def _c(v: int) -> mx.array:
    return mx.array(v, dtype=_U32)


def _fmix32(x: mx.array) -> mx.array:
    # MurmurHash3's finaliser: every input bit affects every output bit.
    x = x ^ (x >> _c(16))
    x = x * _c(0x85EBCA6B)
    x = x ^ (x >> _c(13))
    x = x * _c(0xC2B2AE35)
    return x ^ (x >> _c(16))

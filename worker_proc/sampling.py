"""Batched in-graph sampling: greedy, temperature, top-k and top-p, per-row settings.

Random draws come from a counter-based hash of (seed, step, token id) instead of a shared
generator, so a seeded request's tokens do not depend on what else is in its batch, and
the whole batch still samples in one vectorised graph (Gumbel-max trick).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ipc.messages.common import SamplingParams

_U32 = mx.uint32


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings for one step, as device arrays."""

    temperature: mx.array  # [N] float32; 0 rows are greedy
    top_p: mx.array  # [N] float32
    top_k: mx.array  # [N] int32; 0 = off
    seed: mx.array  # [N] uint32
    step: mx.array  # [N] uint32: how many tokens the row has sampled before
    all_greedy: bool
    needs_filter: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> "SamplingBatch":
        temps = np.array([p.temperature for p in params], dtype=np.float32)
        top_p = np.array([p.top_p for p in params], dtype=np.float32)
        top_k = np.array([p.top_k for p in params], dtype=np.int32)
        sampled = temps > 0
        return cls(
            temperature=mx.array(temps),
            top_p=mx.array(top_p),
            top_k=mx.array(top_k),
            seed=mx.array(np.array(seeds, dtype=np.uint32)),
            step=mx.array(np.array(steps, dtype=np.uint32)),
            all_greedy=not sampled.any(),
            needs_filter=bool(((top_p < 1.0) | (top_k > 0))[sampled].any()),
        )


def sample(logits: mx.array, batch: SamplingBatch) -> mx.array:
    """Next token per row of logits [N, V] (float32 math), as int32 [N]."""
    logits = logits.astype(mx.float32)
    # Same quantity mlx-lm's greedy sampler takes the argmax of, so ties break alike.
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if batch.all_greedy:
        return greedy
    temps = mx.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = logits / temps[:, None]
    noise = gumbel_noise(batch.seed, batch.step, logits.shape[-1])
    if batch.needs_filter:
        drawn = _sample_filtered(scaled, noise, batch)
    else:
        drawn = mx.argmax(scaled + noise, axis=-1).astype(mx.int32)
    return mx.where(batch.temperature > 0, drawn, greedy)


def _sample_filtered(scaled: mx.array, noise: mx.array, batch: SamplingBatch) -> mx.array:
    order = mx.argsort(-scaled, axis=-1)
    sorted_logits = mx.take_along_axis(scaled, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1, precise=True)
    mass_before = mx.cumsum(probs, axis=-1) - probs
    rank = mx.arange(scaled.shape[-1])[None, :]
    top_k = mx.where(batch.top_k > 0, batch.top_k, scaled.shape[-1])
    # The first (most likely) token always survives, whatever top_p is.
    keep = (mass_before < batch.top_p[:, None]) & (rank < top_k[:, None])
    filtered = mx.where(keep, sorted_logits, -mx.inf)
    choice = mx.argmax(filtered + mx.take_along_axis(noise, order, axis=-1), axis=-1)
    return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(mx.int32)


def gumbel_noise(seed: mx.array, step: mx.array, vocab: int) -> mx.array:
    """Gumbel(0, 1) noise [N, vocab], a pure function of (seed, step, token id)."""
    token = mx.arange(vocab, dtype=_U32)[None, :]
    x = seed[:, None] * _c(0x9E3779B1) ^ (step[:, None] + _c(1)) * _c(0x85EBCA77)
    x = _fmix32(_fmix32(x) ^ token * _c(0xC2B2AE3D))
    # 24 random bits, centred in their bucket so u is never exactly 0 or 1.
    u = ((x >> _c(8)).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))
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

"""Models kiln cannot page, served through mlx-lm's own caches.

A model whose cache kiln's pool cannot hold (a cache class of its own, such as
DeepSeek-V4.1's `LayerCache`, or code that reads from a cache what the paged one lacks:
layer_kinds' refusals) still runs under mlx-lm's own `make_prompt_cache()`, one set of
caches per request, as mlx_lm.generate runs it: every prefill chunk and every decode row
is a forward of its own, so each request gets exactly mlx_lm.generate's tokens. The
scheduler still plans the steps (continuous batching interleaves the requests, chunked
prefill bounds a step) and counts tokens against a budget sized from the caches' bytes
a token; there is no prefix cache (nothing is shared between requests' caches), and a
preempted request is recomputed from its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ipc.messages.to_scheduler import RequestError
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from worker_proc.grammar import GrammarMatchers
from worker_proc.kv_pool import KVPool
from worker_proc.runner import ModelRunner, PendingPromptLogprobs, PendingStep
from worker_proc.staging import new_arrays
from worker_proc.step_inputs import gather_last_tokens

# Tokens a chunk of the start-up probe that learns what a request's caches take: two such
# chunks through a fresh set. mlx-lm's KVCache grows its buffers 256 positions at a time,
# so a chunk of 256 sees whole steps of it.
PROBE_CHUNK = 256


@dataclass(frozen=True)
class CacheBytes:
    """What a request's mlx-lm caches take: per_token bytes for each token of its context
    (what the second probe chunk added, at least 1), and per_request bytes beside them
    (the first chunk's share above that: sliding windows already full, fixed states)."""

    per_token: int
    per_request: int


def cache_bytes(model: Any, chunk: int = PROBE_CHUNK) -> CacheBytes:
    """Two prompt chunks of `chunk` tokens through a fresh set of the model's caches."""
    caches = make_prompt_cache(model)
    ids = mx.zeros((1, chunk), dtype=mx.int32)
    sizes = []
    for _ in range(2):
        model(ids, cache=caches)
        mx.eval(_states([caches]))
        sizes.append(_nbytes(caches))
    per_token = max(1, -(-(sizes[1] - sizes[0]) // chunk))
    return CacheBytes(per_token, max(0, sizes[0] - per_token * chunk))


def _nbytes(caches: list[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


class OwnCacheRunner(ModelRunner):
    """A ModelRunner over mlx-lm's own caches, a set per request (see the module's
    docstring): its pool holds no layer; prefill chunks and decode rows run one request
    a forward."""

    def __init__(self, model: Any, pool: KVPool, max_requests: int, max_context: int,
                 grammars: GrammarMatchers | None = None, bytes_per_token: int = 0,
                 **kwargs: Any) -> None:
        """bytes_per_token: what a request's caches grow by a token (cache_bytes),
        reported as the bytes a position takes."""
        super().__init__(model, pool, max_requests, max_context, grammars, **kwargs)
        assert not self.pool.layer_specs, "the pool holds nothing of such a model"
        self.bytes_per_token = bytes_per_token
        self.shares_prefill = False  # one request a forward
        self.mixes_rows = False
        self.tail_bucket = 0  # a chunk runs as it is: padding would run through its caches
        self.spread_refusal = "its layers run on mlx-lm's own caches"
        self._caches: dict[str, list[Any]] = {}

    @property
    def slot_bytes(self) -> tuple[int, int]:
        return self.bytes_per_token, 0

    @property
    def serves_prefix_hits(self) -> bool:
        return False  # each request's caches are its own

    def _add(self, new: NewRequest, refused: list[RequestError]) -> None:
        if new.prefix_slot_ids:
            raise RuntimeError(f"{new.rid}: a prefix hit on a model served through its own "
                               "caches, which share nothing")
        super()._add(new, refused)
        self._caches[new.rid] = make_prompt_cache(self.model)

    def _release(self, rids: list[str], snapshots: list[int] | None = None) -> None:
        for rid in rids:
            self._caches.pop(rid, None)
        super()._release(rids, snapshots)

    def build(self, batch: ForwardBatch) -> PendingStep:
        pending = super().build(batch)
        # The decode rows' caches' new state lands with the step, whatever the logits need
        # of it (a part no logit reads would otherwise stay lazy and grow the graph step by
        # step); a prefill chunk's was launched with its forward (_prefill).
        pending.landing.extend(_states(self._caches[rid] for rid in batch.decode_rids))
        return pending

    def _prefill(self, chunk: PrefillChunk, prompt: list[PendingPromptLogprobs]) -> mx.array:
        state = self._place(chunk)
        caches = self._caches[chunk.rid]
        tokens = mx.array([chunk.token_ids], dtype=mx.int32)
        split = self._forwards.split
        out: mx.array | None = None  # every position's logits, where needed
        if state.sampling.prompt_logprobs < 0 and split is not None:
            # The output head over the last position alone (mlx_lm.generate's prefill
            # runs none over a prompt's positions either).
            logits = split.head(split.backbone(tokens, cache=caches)[:, -1:])[0]
        else:
            out = self.model(tokens, cache=caches)[0]
            logits = out[-1:]
        state.length += len(chunk.token_ids)
        scored = self._prompt_logprobs_of(state, chunk, out, logits)
        if scored is not None:
            prompt.append(scored)
        self._launch_prefill(len(chunk.token_ids), False, logits,
                             *(scored.picked if scored else ()), *_states([caches]))
        return logits

    def pad_tails(self, multiple: int) -> bool:
        return False  # as tail_bucket (__init__)

    def _prefill_many(self, chunks: list[PrefillChunk], width: int) -> list[mx.array]:
        raise AssertionError("prefill chunks of a model on its own caches run one a forward")

    def _decode(self, rids: list[str], slots: list[int], window_slots: list[int]) -> mx.array:
        states = [self.requests[rid] for rid in rids]
        for s in states:
            self._check_room(s, 1)
        tokens = gather_last_tokens(states, new_arrays)
        logits = [self.model(tokens[i:i + 1, None], cache=self._caches[s.rid])[:, -1, :]
                  for i, s in enumerate(states)]
        for s in states:
            s.length += 1
        return mx.concatenate(logits)


def _states(sets: Any) -> list[mx.array]:
    """The arrays of some requests' cache sets (the parts a cache has filled)."""
    return [a for caches in sets for c in caches for a in _flat(c.state)
            if isinstance(a, mx.array)]


def _flat(state: Any) -> list[Any]:
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _flat(s)]
    return [state]

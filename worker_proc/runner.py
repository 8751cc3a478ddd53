"""The model runner: turns the scheduler's step plans into forward passes and tokens.

The runner mirrors, per request, what it needs to build a step without being sent the
whole context again: the slot list (a row of its own table), the context length, and the
last sampled token, which stays a lazy device array so the next step can be built before
the previous one has finished.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx
import msgspec
import numpy as np

from ipc.messages.common import SamplingParams
from ipc.messages.to_scheduler import PromptLogprobs, RequestError, StepResult
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from worker_proc.attention import (ForwardLayout, batches_ragged_rows, build_layer_caches,
                                   build_mixed_caches,
                                   check_written, install_attention_hook, pads_state_rows)
from worker_proc.compiled_decode import CompiledDecode
from worker_proc.decode_block import dense_mlps, mixes_rows
from worker_proc.grammar import GrammarMatchers
from worker_proc.kv_pool import KVPool
from worker_proc.launcher import LaunchThread
from worker_proc.readback import Readback, ReadbackRing, prefill_mark
from worker_proc.memory import prefill_forward_tokens
from worker_proc.prefill_forward import PrefillForwards, rows_at, traceable
from worker_proc.prefill_parts import (PartedForward, SpreadWave, most_parts, part_bounds,
                                       run_blocks, spread_refusal)
from worker_proc.request_state import (RequestState, TokenCounts, check_ids, check_sampling,
                                       fold_seed)
from worker_proc.sampling import GrammarMask, PickedLogprobs, StepLogprobs, token_logprobs
from worker_proc.staging import HostStaging, Stage, new_arrays
from worker_proc.step_inputs import (gather_last_tokens, group_by_length,
                                     prefill_waves, rows_by_length)
from worker_proc.step_sampler import NOTHING_SAMPLED, Sampled, StepSampler
from worker_proc.step_stats import ForwardClock

logger = logging.getLogger(__name__)

# Padding a shared prefill forward may carry (the server's --prefill-padding default). On a
# GPU one forward over many prompts beats many small ones by far; the CPU backend is
# compute-bound already at one prompt, so there the padding is pure loss (16 prompts of
# 110-170 tokens: 3.35 s padded, 2.95 s one by one).
PREFILL_PADDING = 0.25
CPU_PREFILL_PADDING = 0.0
# Most tokens (padding included) one prefill forward computes. MLX allocates a launched
# op's output when it is launched, and the host launches a forward's 32 layers far faster
# than the device runs them, so one forward holds about all of its activations at once:
# ~5 MB a token for an 8B model (8192 tokens, a step's worth, ran the H200 out of memory
# beside a 74 GB pool), ~10 MB in forwards of many short prompts (their attention scores).
# A chunk longer than this still runs whole (--chunked-prefill-size bounds those).
# mlx-lm prefills in steps of 2048 too. On CUDA a forward takes fewer where two forwards'
# activations would not fit beside the pool (ModelRunner.forward_cap).
PREFILL_FORWARD_TOKENS = 2048
# What ModelRunner.pad_tails rounds a lone chunk up to a multiple of on the CUDA kernel path
# (--experiments unpadded-tails: not).
TAIL_MULTIPLE = 256
# A mixed forward's rows (its chunk's padded width, then one a decode row) are padded to a
# multiple of this with rows that touch only the scratch slot, where every MLP is dense:
# cuBLAS picks slow tilings for row counts past a multiple of 64 (on an H100 a 512-token
# chunk beside 32-36 decode rows: the GEMMs 1.1-1.3x those of 576 rows; docs/benchmarks.md,
# session 35; a few rows past 512, and the H200, unmeasured). Expert layers would route
# the pad rows, so a mixture of experts keeps its rows as they are.
MIXED_FORWARD_ROWS = 64


@dataclass(frozen=True)
class PendingStep:
    """A built step: its lazy graph, then (once started) its tokens computing.

    final: the sampled tokens (and what else the step reports), computed when it starts;
    landing: what lands its pool writes (KVPool.landing), computed with them.
    """

    step: int
    rids: list[str]
    tokens: mx.array | None
    final: list[mx.array]
    landing: list[mx.array]
    logprobs: StepLogprobs | None = None  # only when some row asked
    # Its tokens and logprobs, then its chunks' prompt logprobs, on their way to a
    # host-read buffer (ReadbackRing), where the runner lands results; finish reads them there.
    readback: Readback | None = None
    # Constrained rows (index into rids) and their matchers, which finish advances.
    matchers: list[tuple[int, Any]] = field(default_factory=list)
    # Set while a step with constrained rows holds only its forward (final: its logits and
    # the pool): sample_constrained adds the sampling once earlier steps have finished.
    unsampled: "_Unsampled | None" = None

    @property
    def needs_sampling(self) -> bool:
        return self.unsampled is not None


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """One prefill chunk's prompt logprobs (lazy): entry i scores prompt token start + i."""

    rid: str
    start: int
    top_k: int
    picked: PickedLogprobs

    def message(self, read: PickedLogprobs | None = None) -> PromptLogprobs:
        """The message, from `read` (the picks' values as read back) or the picks."""
        p = self.picked if read is None else read
        return PromptLogprobs(rid=self.rid, start=self.start, logprobs=p.chosen.tolist(),
                              top_k=self.top_k, top_ids=p.top_ids.reshape(-1).tolist(),
                              top_logprobs=p.top_logprobs.reshape(-1).tolist())


class _Unsampled(NamedTuple):
    logits: list[mx.array]
    states: list[RequestState]


@dataclass(frozen=True)
class PrefillMemory:
    """What the worker measured of prefill memory (fit_prefill_forwards): `room`, the
    bytes two forwards in flight may hold; a token's bytes in a lone prompt's forward
    (`lone`) and, at each probed width, in a forward of several fresh prompts that wide
    (`shared`: (width, bytes) pairs, widths ascending; their attention scores grow with
    the width, the rest of a token's activations do not)."""

    room: int
    lone: float
    shared: tuple[tuple[int, float], ...] = ()

    def token_bytes(self, shared: bool, width: int) -> float:
        """A token's bytes in a forward of chunks up to `width` long: between two probed
        widths, on the line through them (scores linear in the width); below the
        narrowest, its figure; past the widest, the costlier of it and a lone prompt's
        (a shared forward may then be as wide as a lone one)."""
        if not shared or not self.shared:
            return self.lone
        points = self.shared
        if width <= points[0][0]:
            return points[0][1]
        for (w0, b0), (w1, b1) in zip(points, points[1:]):
            if width <= w1:
                return b0 + (b1 - b0) * (width - w0) / (w1 - w0)
        return max(self.lone, points[-1][1])


class ModelRunner:
    def __init__(self, model: Any, pool: KVPool, max_requests: int, max_context: int,
                 grammars: GrammarMatchers | None = None,
                 prefill_padding: float = PREFILL_PADDING, compile_decode: bool = False,
                 compile_prefill: bool = False, tail_bucket: int = 0) -> None:
        """grammars: matchers for structured output (None: requests with a grammar are
        refused, as the worker has no tokenizer). prefill_padding: how much padding a
        shared prefill forward may carry, as a share of its real tokens (0: only chunks
        of one length share a forward). compile_decode: decode forwards through
        mx.compile (only where attention reads the pool: the CUDA kernel path).
        compile_prefill: prefill forwards of a shape met before through mx.compile
        (PrefillForwards; models with an output head and full-attention layers only).
        tail_bucket: a prompt's last chunk shorter than this, after a prefix of whole
        ones (the chunks before it aligned to it: PrefillChunking), runs right-padded to
        a whole one, in the forward shape of that prompt's earlier chunks, whose per-shape
        work (cuDNN graphs, GEMM plans, traces) is then done; 0: never (models with
        recurrent or windowed layers never: padding would run through their state or
        need the window's own mask)."""
        install_attention_hook()  # decode attention reads the pool (idempotent)
        self.prefill_padding = prefill_padding
        self.model = model
        self.pool = pool
        self.grammars = grammars
        self.max_context = max_context
        # NOTE: a mirror of the scheduler's req-to-token rows for the requests it sent us;
        # it is filled only from the slot ids in step plans.
        self.table = np.zeros((max_requests, max_context), dtype=np.int32)
        # The same rows' window slots, where windowed layers have a slot space of their own.
        self.window_table = (np.zeros_like(self.table) if pool.window_slots else None)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.requests: dict[str, RequestState] = {}
        self._sampler = StepSampler()
        # Decode contexts kept across steps, where the pool's backend keeps them (the
        # plain-MLX one, within its share of the pool's bytes: build_runner leaves room).
        backend = pool.backend
        self._dense_decode = backend.decode_context(len(pool.specs), pool.nbytes,
                                                    KVPool.bytes_per_slot(pool.specs))
        if compile_decode and not backend.compiles:
            raise ValueError(f"compiled decode needs the CUDA kernel's decode path, not "
                             f"{backend.name}'s (MLX's CUDA backend, head sizes a multiple of 32)")
        # A model whose own code mishandles rows of different lengths in one forward
        # (batches_ragged_rows) runs each step's rows in forwards of one length each.
        self.ragged = batches_ragged_rows(model, pool.layer_specs, backend)
        if not self.ragged:
            logger.warning("this model's code cannot batch rows of different lengths: "
                           "each forward takes rows of one context length (slower)")
            compile_decode = False  # a compiled bucket pads with rows of length 1
        # Recurrent layers: prefill chunks share forwards only where the model keeps
        # padding out of its state (pads_state_rows; else a padded row would carry its
        # state past its end).
        self.shares_prefill = self.ragged and (
            not pool.has_states or pads_state_rows(model, pool.layer_specs, backend))
        if pool.has_states and not self.shares_prefill:
            logger.warning("this model's recurrent layers cannot skip padding: each prefill "
                           "chunk runs in a forward of its own (slower)")
        # Host-written inputs, one buffer a use from each (the sampler has its own): a
        # decode step's (compiled or eager), a prefill forward's, a changed decode
        # batch's gathers of its previous tokens, a constrained step's grammar masks, a
        # step's released requests' snapshot copies.
        self._decode_staging, self._forward_staging = HostStaging(), HostStaging()
        self._gather_staging, self._grammar_staging = HostStaging(), HostStaging()
        self._release_staging = HostStaging()
        self._compiled_decode = (CompiledDecode(model, pool, self.window_table is not None,
                                                self._decode_staging)
                                 if compile_decode else None)
        self.mixed_forwards = 0  # forwards that carried a chunk and decode rows (_mixed)
        # Prompt logprobs computed by each built step's chunks, reported by its finish.
        self._prompt_logprobs: dict[int, list[PendingPromptLogprobs]] = {}
        # Requests refused by the checks of their step's _add, reported by its finish.
        self._refused: dict[int, list[RequestError]] = {}
        self.vocab_size: int | None = getattr(getattr(model, "args", None), "vocab_size", None)
        self._seed_rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        # The last prefill forward's probe and its launch, if launched by a thread (see
        # _launch_prefill).
        self._last_prefill: tuple[mx.array, Future | None] | None = None
        # Where a step's results are copied for the host to read (set by the worker on CUDA;
        # --experiments array-readback: None); None: the host reads the arrays themselves.
        self.readback: ReadbackRing | None = None
        # The thread launches go through (set by the worker on CUDA; --experiments
        # inline-launch: None); None: launched from the caller's.
        self.launcher: LaunchThread | None = None
        self._launches: dict[int, Future] = {}  # by step, launches handed to it
        self._last_prefill_bytes = 0.0
        # Where the worker measured prefill memory (CUDA: fit_prefill_forwards): the
        # bytes two forwards in flight may hold, and a token's bytes in a lone prompt's
        # forward and in shared ones by width; None: not measured, no bound.
        self.prefill_memory: PrefillMemory | None = None
        # Most tokens a shared prefill forward takes where memory allows (forward_cap).
        self.prefill_forward_tokens = PREFILL_FORWARD_TOKENS
        self._caps: dict[int, int] = {}  # forward_cap's, by width
        self._forwards = PrefillForwards(model, split_model(model), pool, compile_prefill)
        self.tail_bucket = tail_bucket if traceable(pool) and not pool.has_states else 0
        # Last chunks starting on multiples of this are padded too (0: of tail_bucket):
        # with a spread prefill, edges several buckets apart after a hit on a bucket's.
        self.tail_starts = 0
        # Where tail_bucket pads no tail (0: chunks not aligned, or layers it cannot trace,
        # windowed ones): a lone chunk's width rounded up to a multiple of this
        # (pad_tails; 0: as it is).
        self.tail_multiple = 0
        # A step's lone prompt chunk rides in its decode rows' forward (the backend's
        # mixed_forward; blocks that run it, full attention alone, an output head).
        self.mixes_rows = (backend.mixed_forward and mixes_rows(model) and self.ragged
                           and self._forwards.split is not None and traceable(pool)
                           and not pool.has_states and self.window_table is None)
        self.mixed_rows_multiple = MIXED_FORWARD_ROWS if dense_mlps(model) else 1
        # Prefill forwards spread over steps (ForwardBatch.parts), where the model allows.
        self.spread_refusal = spread_refusal(self._forwards.split, len(pool.groups),
                                             pool.has_states)
        self._spread: SpreadWave | None = None
        # The spread forwards' inputs, one use a spread: they are read over several steps.
        self._spread_staging = HostStaging()
        # This build's time starting prefill forwards and waiting for earlier ones.
        self.clock = ForwardClock()

    # -- request bookkeeping -------------------------------------------------------------

    def _add(self, new: NewRequest, refused: list[RequestError]) -> None:
        """Take a request's state. One whose settings the worker cannot serve is refused
        (appended to `refused`) but kept, greedy and unconstrained: its chunks still run
        in this step's forwards (their K/V may already be shared through the prefix
        cache), its tokens are dropped and the scheduler ends it with the error."""
        if new.rid in self.requests:
            raise RuntimeError(f"request {new.rid} is already on the worker")
        seed = new.sampling.seed
        seed32 = int(self._seed_rng.integers(1 << 32)) if seed is None else fold_seed(seed)
        state = RequestState(new.rid, self._free_rows.pop(), new.sampling, seed32,
                             length=len(new.prefix_slot_ids), num_sampled=new.num_sampled,
                             stop_ids=list(new.stop_token_ids))
        if new.prefix_slot_ids and self.pool.has_states and not new.state_snapshot:
            raise RuntimeError(f"{new.rid}: a prefix hit on a model with recurrent layers "
                               "without the snapshot of their state at its end")
        state.start_snapshot = new.state_snapshot
        # A cached prefix: its K/V is already in the pool, the first chunk starts after it.
        self.table[state.row, :state.length] = new.prefix_slot_ids
        if self.window_table is not None:
            self.window_table[state.row, :state.length] = _window_ids(
                new.rid, new.prefix_window_slot_ids, state.length)
        self.requests[new.rid] = state
        try:
            self._take_settings(state, new)
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the step's
            logger.warning("refusing %s: %s", new.rid, exc)
            refused.append(RequestError(new.rid, f"the worker cannot serve this request: {exc}"))
            state.sampling = SamplingParams(temperature=0.0, max_new_tokens=0)
            state.stop_ids, state.token_counts, state.matcher = [], None, None

    def _take_settings(self, state: RequestState, new: NewRequest) -> None:
        """The request's sampling state, checked as the step's sampling will use it."""
        sp = new.sampling
        check_sampling(sp, state.seed, state.num_sampled, state.stop_ids, self.vocab_size)
        if sp.uses_penalties:
            check_ids("prompt and output ids", [*new.prompt_ids, *new.output_ids], self.vocab_size)
            state.token_counts = TokenCounts(list(new.prompt_ids), list(new.output_ids))
        if sp.grammar is not None:
            if self.grammars is None:
                raise ValueError("it has a grammar but this worker has no tokenizer")
            state.matcher = self.grammars.matcher(sp.grammar, new.output_ids)

    def reset(self) -> None:
        """Forget every request and every step's pending reports (after a step failed
        as a whole: nothing it held can be trusted)."""
        if self.launcher is not None:
            self.launcher.quiesce(raise_errors=False)
            self._launches.clear()
        self._release(list(self.requests))
        self._prompt_logprobs.clear()
        self._refused.clear()
        self._sampler.reset()
        self._last_prefill, self._last_prefill_bytes = None, 0.0
        self._spread = None
        self.pool.take_landing()

    def _release(self, rids: list[str], snapshots: list[int] | None = None) -> None:
        """Forget requests, keeping each one's recurrent states as its snapshot first
        (where `snapshots` gives one, 0: none), in one copy per state array."""
        wave = self._spread
        if wave is not None and set(rids) & wave.rids():
            # The scheduler gives a spread's requests back only after its last part: one
            # released mid-spread means it dropped the spread, so the worker drops it too
            # (a safety net: the steps that could, planned before the scheduler learnt
            # of a failure, are not run: ForwardBatch.epoch).
            logger.info("dropping a spread prefill whose requests were released")
            self._spread = None
        kept: list[tuple[int, int]] = []
        for i, rid in enumerate(rids):
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            if snapshots and snapshots[i]:
                kept.append((state.row + 1, snapshots[i]))
            self._free_rows.append(state.row)
        # Before a request new this step takes a freed row (its writes follow the copy).
        self._keep_snapshots(kept, self._release_staging.stage)
        if not self.requests and self._dense_decode is not None:
            self._dense_decode.reset()

    # -- one step ------------------------------------------------------------------------

    def build(self, batch: ForwardBatch) -> PendingStep:
        """Build the step's lazy graph. A decode-only step is host work only; a step with
        prefill chunks already runs those forwards (with a scatter-written pool, see
        start's NOTE: no earlier step may still be running when this is called for one)."""
        self.clock = ForwardClock()
        self._release(batch.released, batch.released_snapshots)
        refused: list[RequestError] = []
        for new in batch.new_requests:
            self._add(new, refused)
        if refused:
            self._refused[batch.step] = refused
        logits: list[mx.array] = []
        sampled: list[RequestState] = []
        prompt: list[PendingPromptLogprobs] = []
        prefixes = {n.rid: n.prefix_slot_ids for n in batch.new_requests if n.prefix_slot_ids}
        snapshot_hits = {n.rid: n.state_snapshot for n in batch.new_requests if n.state_snapshot}
        groups = self._prefill_groups(batch.prefill, prefixes, snapshot_hits)
        if batch.parts > 1:
            logits, sampled = self._spread_step(batch, groups, prompt)
            groups = []
        mixed = self._mixed_chunk(groups, batch)
        row_logits: mx.array | None = None  # the decode rows', where they rode with a chunk
        if mixed is not None:  # the chunk and the decode rows in one forward
            chunk_logits, row_logits = self._mixed(*mixed, batch.decode_rids, batch.decode_slots)
            if chunk_logits is not None:
                logits.append(chunk_logits)
                sampled.append(self.requests[mixed[0].rid])
            groups = []
        for group in groups:
            width = self._padded_width(group)
            outs = (self._prefill_many(group, width) if len(group) > 1 or width
                    else [self._prefill(group[0], prompt)])
            for chunk, out in zip(group, outs):
                if chunk.sample:
                    logits.append(out)
                    sampled.append(self.requests[chunk.rid])
        if prompt:
            self._prompt_logprobs[batch.step] = prompt
        if batch.decode_rids:
            logits.append(row_logits if row_logits is not None else
                          self._decode(batch.decode_rids, batch.decode_slots,
                                       batch.decode_window_slots))
            sampled.extend(self.requests[rid] for rid in batch.decode_rids)
        if any(s.matcher is not None for s in sampled):
            # The masks need the tokens of the steps still in flight: sampled later.
            return PendingStep(batch.step, [s.rid for s in sampled], None, logits,
                               self.pool.take_landing(), unsampled=_Unsampled(logits, sampled))
        out = self._sampler.sample(logits, sampled) if sampled else NOTHING_SAMPLED
        return self._with_tokens(batch.step, sampled, out)

    def sample_constrained(self, pending: PendingStep) -> PendingStep:
        """The sampling of a step whose forward build() left alone because some rows have
        a grammar. Call it once every earlier step has finished (their tokens are then in
        the matchers); the forward may still be running: only the masks are host work."""
        assert pending.unsampled is not None and self.grammars is not None
        logits, states = pending.unsampled
        rows = [i for i, s in enumerate(states) if s.matcher is not None]
        masks = self.grammars.fill([states[i].matcher for i in rows])
        out = self._sampler.sample(logits, states,
                                   GrammarMask.build(rows, masks, self._grammar_staging.stage))
        return self._with_tokens(pending.step, states, out,
                                 [(i, states[i].matcher) for i in rows])

    def _with_tokens(self, step: int, sampled: list[RequestState], out: Sampled,
                     matchers: list[tuple[int, Any]] | None = None) -> PendingStep:
        tokens, logprobs = out.tokens, out.logprobs
        # The pool writes (and new token counts) are computed with the tokens: a step that
        # samples nothing (a middle prefill chunk) must still land its K/V, and the graph
        # must not grow.
        final = [*([tokens] if tokens is not None else []), *out.counts,
                 *(logprobs.arrays if logprobs is not None else [])]
        # The step's prompt logprobs ride along (read back with its results, never
        # from their own arrays).
        picks = [a for p in self._prompt_logprobs.get(step, []) for a in p.picked]
        readback = None
        if self.readback is not None and (tokens is not None or picks):
            readback = self.readback.land(*([tokens] if tokens is not None else []),
                                          *(logprobs.arrays if logprobs else ()), *picks)
            final.append(readback.done)
        return PendingStep(step, [s.rid for s in sampled], tokens, final,
                           self.pool.take_landing(), logprobs, matchers=matchers or [],
                           readback=readback)

    def start(self, pending: PendingStep) -> None:
        """Put a built step on the device; returns before it finishes.

        NOTE: with a scatter-written pool (KVPool), call only once every earlier step has
        finished: a write launched while work that holds the pool is in flight copies the
        layer instead of updating it in place (on the CPU, 2-4x slower steps: the
        pool-update probe in docs/benchmarks.md, "Retired probes"; on the H200, out of
        memory).
        """
        launched = self._launch_now([*pending.final, *pending.landing], f"step {pending.step}")
        if launched is not None:
            self._launches[pending.step] = launched
        if pending.tokens is not None:
            # Its tokens now stand for the whole step (finish waits on them). Scatter
            # pools: holding the layer arrays past this point would keep the next step
            # from updating them in place.
            pending.landing.clear()

    def start_head(self) -> None:
        """Launch the first half of the last built step's forward, ahead of `start`, so
        the host can report the previous step between the two halves (see WorkerLoop).
        Launching while a step runs is for in-place pools; a scatter pool's layers would
        be copied (correct, only slow). A step whose forwards launched as they were built
        (prefill) launches nothing new."""
        if not self.pool.layers or self.launcher is not None:
            # No K/V layer marks a half-way point (a purely recurrent model); a launch
            # thread takes the step whole.
            return
        middle = len(self.pool.layers) // 2
        head = self.pool.mark(middle) if self.pool.in_place else self.pool.layers[middle]
        if head is not None:
            mx.async_eval(head)

    def _launch_now(self, arrays: list[mx.array], what: str) -> Future | None:
        """Put arrays on the device: handed to the launch thread where there is one (the
        future ends once they are launched), else launched here."""
        if self.launcher is None:
            mx.async_eval(*arrays)
            return None
        return self.launcher.launch(arrays, what)

    @staticmethod
    def _wait_for(probe: mx.array, launched: Future | None) -> None:
        """Wait for a launched forward, through its probe: its own event alone, without
        the GIL (after its launch, where a thread launched it)."""
        if launched is not None:
            launched.result()
        mx.eval(probe)

    def launch(self, batch: ForwardBatch) -> PendingStep:
        pending = self.build(batch)
        self.start(pending)
        return pending

    def finish(self, pending: PendingStep) -> StepResult:
        """Wait for a started step and report its tokens; the grammars of its constrained
        rows consume theirs."""
        assert not pending.needs_sampling, "sample_constrained was not called"
        if self.launcher is not None:
            launched = self._launches.pop(pending.step, None)
            if launched is not None:
                launched.result()  # raises its launch's error
            self.launcher.check()  # and any launch before it (a prefill forward's)
            if pending.tokens is None or pending.readback is None:
                # It waits on, or reads, its own arrays, which a step launching now may use.
                self.launcher.quiesce()
        scored = self._prompt_logprobs.pop(pending.step, [])
        errors = self._refused.pop(pending.step, [])
        lp = pending.logprobs
        # NOTE: reading the tokens waits for this step's own work (start's async_eval gave
        # all of `final` one event). mx.eval would instead put a barrier at the end of the
        # stream and so also wait for a next step already started (the CUDA start-ahead):
        # measured on the H200, 3.3 ms of waiting per step at batch 1 for nothing.
        if pending.readback is not None:  # its results, then its prompt logprobs' picks
            read = self.readback.read(pending.readback)  # type: ignore[union-attr]
            ahead = (pending.tokens is not None) + (len(lp.arrays) if lp is not None else 0)
            results, picks = read[:ahead], read[ahead:]
            prompt = [p.message(PickedLogprobs(*picks[3 * i:3 * i + 3]))
                      for i, p in enumerate(scored)]
        else:
            results = [pending.tokens, *(lp.arrays if lp is not None else [])]
            prompt = [p.message() for p in scored]
        if pending.tokens is None:
            mx.eval(*pending.final, *pending.landing)
            return StepResult(step=pending.step, rids=[], token_ids=[], prompt_logprobs=prompt,
                              errors=errors)
        tokens, *logprob_parts = results
        result = StepResult(step=pending.step, rids=pending.rids,
                            token_ids=tokens.tolist(), prompt_logprobs=prompt,
                            errors=errors)
        for row, matcher in pending.matchers:
            GrammarMatchers.advance(matcher, result.token_ids[row])
        if lp is None:
            return result
        chosen, top_ids, top_logprobs = (a.tolist() for a in logprob_parts)
        return msgspec.structs.replace(
            result, logprob_rows=lp.rows, logprobs=chosen, top_counts=lp.counts,
            top_ids=[t for row, k in zip(top_ids, lp.counts) for t in row[:k]],
            top_logprobs=[v for row, k in zip(top_logprobs, lp.counts) for v in row[:k]])

    def run(self, batch: ForwardBatch) -> StepResult:
        pending = self.launch(batch)
        if pending.needs_sampling:
            pending = self.sample_constrained(pending)
            self.start(pending)
        return self.finish(pending)

    def _prefill(self, chunk: PrefillChunk, prompt: list[PendingPromptLogprobs]) -> mx.array:
        """Run one chunk's forward; its last position's logits. A request that asked for
        prompt logprobs gets this chunk's appended to `prompt`."""
        state = self._place(chunk)
        n = len(chunk.token_ids)
        staging = self._forward_staging
        staging.begin()
        self._load_snapshots([state], staging.add)
        layout = ForwardLayout.single(self.table[state.row], chunk.start, n,
                                      self._window_row(state.row), staging.add)
        # The last position as an index, not the last column: a traced forward of this
        # shape then also serves a prompt's last chunk padded to it (_padded_width).
        tokens, state_rows, last = staging.add(np.array([chunk.token_ids], dtype=np.int32),
                                               np.array([state.row + 1], dtype=np.int32),
                                               np.array([n - 1], dtype=np.int32))
        out: mx.array | None = None  # every position's logits, [n, V], where needed
        if state.sampling.prompt_logprobs >= 0:
            caches = build_layer_caches(self.pool, layout, state_rows, chunk.start == 0)
            out = self.model(tokens, cache=caches)[0]
            logits = out[-1:]
        else:
            logits = self._forwards.last_logits(tokens, layout, last, state_rows, chunk.start == 0)
        state.length += n
        self._save_snapshots([state], [chunk], staging.add)
        scored = self._prompt_logprobs_of(state, chunk, out, logits)
        if scored is not None:
            prompt.append(scored)
        self._launch_prefill(n, False, logits, *(scored.picked if scored else ()))
        return logits

    def prefill_parts(self, wanted: int) -> int:
        """Over how many steps this model's prefill forwards may be spread (--prefill-spread
        asks for `wanted`): at most one block a part; 1 where they must run whole
        (spread_refusal says why)."""
        return max(1, min(wanted, most_parts(self._forwards.split, self.spread_refusal)))

    def _spread_step(self, batch: ForwardBatch, groups: list[list[PrefillChunk]],
                     prompt: list[PendingPromptLogprobs]) -> tuple[list[mx.array],
                                                                   list[RequestState]]:
        """This step's parts of the spread prefill (ForwardBatch.parts), whose forwards
        its first step sets up; after the last part, the logits of the chunks that end
        their prompts and their requests."""
        if batch.parts_from > 0 and groups:
            raise RuntimeError(f"step {batch.step} continues a spread prefill with new chunks")
        if batch.parts_from == 0:
            if self._spread is not None:
                raise RuntimeError(f"step {batch.step} starts a spread prefill before the "
                                   "last one ended")
            if self.spread_refusal is not None:
                raise RuntimeError(f"step {batch.step} spreads the prefill of a model whose "
                                   f"forwards run whole: {self.spread_refusal}")
            self._spread = self._start_spread(batch.parts, groups, prompt)
        wave = self._spread
        if (wave is None or (wave.parts, wave.done) != (batch.parts, batch.parts_from)
                or batch.parts_to > wave.parts):
            raise RuntimeError(f"step {batch.step} runs prefill parts {batch.parts_from}-"
                               f"{batch.parts_to} of {batch.parts}; the worker's spread is "
                               f"at {None if wave is None else (wave.done, wave.parts)}")
        backbone = self._forwards.split.backbone
        blocks = len(backbone.layers)
        start = part_bounds(blocks, wave.parts, batch.parts_from)
        stop = part_bounds(blocks, wave.parts, batch.parts_to)
        for forward in wave.forwards:
            forward.hidden = run_blocks(backbone, forward.tokens, forward.caches,
                                        forward.hidden, start, stop)
            with self.clock.timing("start"):
                self._launch_now([forward.hidden, *self.pool.landing()], "a spread part")
        wave.done = batch.parts_to
        if wave.done < wave.parts:
            return [], []
        self._spread = None
        logits = [held for held, _ in wave.held]
        sampled = [state for _, state in wave.held]
        for forward in wave.forwards:
            check_written(forward.caches)
            ends = [i for i, chunk in enumerate(forward.chunks) if chunk.sample]
            if ends:
                rows = self._forwards.split.head(rows_at(forward.hidden, forward.last))
                logits += [rows[i:i + 1] for i in ends]
                sampled += [forward.states[i] for i in ends]
        return logits, sampled

    def _start_spread(self, parts: int, groups: list[list[PrefillChunk]],
                      prompt: list[PendingPromptLogprobs]) -> SpreadWave:
        """A spread prefill's forwards, set up over their own inputs. A chunk scored over
        every position (alone in its group) runs whole now, its logits held for the last
        part: no chunk of a spread reads another's K/V (the scheduler shares their
        prompts after the last part), so running it early changes nothing."""
        wave = SpreadWave(parts)
        stage = self._spread_staging
        stage.begin()
        for group in groups:
            state = self.requests[group[0].rid]
            if state.sampling.prompt_logprobs >= 0:
                logits = self._prefill(group[0], prompt)
                if group[0].sample:
                    wave.held.append((logits, state))
            else:
                wave.forwards.append(self._parted(group, self._padded_width(group), stage.add))
        return wave

    def _parted(self, chunks: list[PrefillChunk], width: int, stage: Stage) -> PartedForward:
        """A forward over the chunks (_padded_inputs'), to be run part by part."""
        states, sizes, tokens, layout = self._padded_inputs(chunks, width, stage)
        tokens_mx, last = stage(tokens, (sizes - 1).astype(np.int32))
        for state, n in zip(states, sizes):
            state.length += int(n)
        return PartedForward(chunks, states, tokens_mx, build_layer_caches(self.pool, layout),
                             last)

    def _padded_inputs(self, chunks: list[PrefillChunk], width: int, stage: Stage
                       ) -> tuple[list[RequestState], np.ndarray, np.ndarray, ForwardLayout]:
        """A forward's chunks placed in their requests' contexts: their states, sizes,
        tokens right-padded to the longest (or to `width`) and layout (one chunk unpadded
        as _prefill's, ForwardLayout.single; else ForwardLayout.prefill)."""
        states = [self._place(c) for c in chunks]
        sizes = np.array([len(c.token_ids) for c in chunks])
        tokens = np.zeros((len(chunks), max(int(sizes.max()), width)), dtype=np.int32)
        for i, chunk in enumerate(chunks):
            tokens[i, :sizes[i]] = chunk.token_ids
        rows = [s.row for s in states]
        if len(chunks) == 1 and tokens.shape[1] == sizes[0]:
            layout = ForwardLayout.single(self.table[rows[0]], chunks[0].start, int(sizes[0]),
                                          self._window_row(rows[0]), stage)
        else:
            layout = ForwardLayout.prefill(self.table[rows], np.array([c.start for c in chunks]),
                                           sizes, self._window_row(rows), stage, width)
        return states, sizes, tokens, layout

    def _mixed_chunk(self, groups: list[list[PrefillChunk]],
                     batch: ForwardBatch) -> tuple[PrefillChunk, int] | None:
        """The step's one prefill chunk where it rides in the decode rows' forward
        (mixes_rows), and the width it is padded to (_padded_width; 0: none): a lone
        chunk, not scored over every position."""
        if not (self.mixes_rows and batch.decode_rids and len(groups) == 1
                and len(groups[0]) == 1):
            return None
        chunk = groups[0][0]
        if self.requests[chunk.rid].sampling.prompt_logprobs >= 0:
            return None
        return chunk, self._padded_width(groups[0])

    def _mixed(self, chunk: PrefillChunk, width: int, rids: list[str],
               slots: list[int]) -> tuple[mx.array | None, mx.array]:
        """A prompt's chunk (right-padded to `width`, as _prefill_many pads a lone one)
        and the decode rows in one forward (MixedLayerCache): the chunk's last logits
        (None where it does not sample) and the rows'."""
        state = self._place(chunk)
        n = len(chunk.token_ids)
        padded = max(n, width)
        states = [self.requests[rid] for rid in rids]
        rows = np.array([s.row for s in states])
        lengths = np.array([s.length for s in states]) + 1
        for s in states:
            self._check_room(s, 1)
        self.table[rows, lengths - 1] = slots
        row_tokens = gather_last_tokens(states, self._gather_staging.stage)
        staging = self._forward_staging
        staging.begin()
        chunk_layout = ForwardLayout.prefill(self.table[[state.row]], np.array([chunk.start]),
                                             np.array([n]), None, staging.add, width)
        # Pad rows: length 1 over a table row of zeros, so each reads and writes the
        # scratch slot 0 alone (as compiled decode's pad rows); their outputs are dropped.
        # The table's columns past the longest row are not copied (the layout reads none).
        pad = -(padded + len(states)) % self.mixed_rows_multiple
        columns = int(lengths.max())
        table_rows = np.zeros((len(states) + pad, columns), dtype=self.table.dtype)
        table_rows[:len(states)] = self.table[rows, :columns]
        rows_layout = ForwardLayout.decode(table_rows, np.concatenate(
            [lengths, np.ones(pad, dtype=lengths.dtype)]), stage=staging.add)
        tokens = np.zeros(padded + pad, dtype=np.int32)
        tokens[:n] = chunk.token_ids
        chunk_tokens, = staging.add(tokens)
        caches = build_mixed_caches(self.pool, chunk_layout, rows_layout, padded)
        self.mixed_forwards += 1
        split = self._forwards.split
        inputs = [chunk_tokens[:padded], row_tokens] + ([chunk_tokens[padded:]] if pad else [])
        hidden = split.backbone(mx.concatenate(inputs)[None], cache=caches)[0]
        check_written(caches)
        state.length += n
        for s in states:
            s.length += 1
        row_hidden = hidden[padded:padded + len(states)]
        if not chunk.sample:
            return None, split.head(row_hidden)
        logits = split.head(mx.concatenate([hidden[n - 1:n], row_hidden]))
        return logits[:1], logits[1:]

    def _load_snapshots(self, states: list[RequestState], stage: Stage) -> None:
        """Hits' recurrent states, at their first chunks (not at _add: a snapshot's own
        chunk may run earlier in the same step)."""
        hits = [s for s in states if s.start_snapshot]
        if hits:
            ids = np.array([s.start_snapshot for s in hits], dtype=np.int32)
            self.pool.load_snapshots(*stage(ids, np.array([s.row + 1 for s in hits],
                                                          dtype=np.int32)))
            for s in hits:
                s.start_snapshot = 0

    def _save_snapshots(self, states: list[RequestState], chunks: list[PrefillChunk],
                        stage: Stage) -> None:
        """The states after the chunks, for later requests hitting their ends to start from."""
        self._keep_snapshots([(s.row + 1, c.snapshot_id)
                              for s, c in zip(states, chunks) if c.snapshot_id], stage)

    def _keep_snapshots(self, kept: list[tuple[int, int]], stage: Stage) -> None:
        """Copy the states of pool rows into snapshots, (row, snapshot id) pairs, at once."""
        if kept:
            rows, ids = zip(*kept)
            self.pool.save_snapshots(*stage(np.array(rows, dtype=np.int32),
                                            np.array(ids, dtype=np.int32)))

    def _place(self, chunk: PrefillChunk) -> RequestState:
        """Check a chunk continues its request's context and record its slots."""
        state = self.requests[chunk.rid]
        n = len(chunk.token_ids)
        if chunk.start != state.length:
            raise RuntimeError(f"{chunk.rid}: chunk starts at {chunk.start}, context is {state.length}")
        self._check_room(state, n)
        # The front checks prompt ids; an id past the embedding would read outside it.
        check_ids(f"{chunk.rid}: prompt token ids", chunk.token_ids, self.vocab_size)
        self.table[state.row, chunk.start:chunk.start + n] = chunk.slot_ids
        if self.window_table is not None:
            self.window_table[state.row, chunk.start:chunk.start + n] = _window_ids(
                chunk.rid, chunk.window_slot_ids, n)
        return state

    def _window_row(self, row: int | list[int] | np.ndarray) -> np.ndarray | None:
        """Rows of the window table (None where windowed layers share the full slots)."""
        return None if self.window_table is None else self.window_table[row]

    def forward_cap(self, width: int) -> int:
        """Most tokens a shared prefill forward of chunks up to `width` long takes:
        prefill_forward_tokens, or fewer where two such forwards in flight would not fit
        the measured room (memory.prefill_forward_tokens)."""
        memory = self.prefill_memory
        if memory is None:
            return self.prefill_forward_tokens
        if (cap := self._caps.get(width)) is None:
            cap = self._caps[width] = prefill_forward_tokens(
                memory.token_bytes(True, width), memory.room, self.prefill_forward_tokens)
        return cap

    def set_prefill_memory(self, memory: PrefillMemory) -> None:
        self.prefill_memory = memory
        self._caps.clear()

    def _prefill_groups(self, chunks: list[PrefillChunk], prefixes: dict[str, list[int]],
                        snapshot_hits: dict[str, int]) -> list[list[PrefillChunk]]:
        """The step's chunks as forwards, in an order that keeps the plan's meaning: a
        chunk whose cached prefix (or starting state snapshot) another chunk of this step
        writes runs in a later wave (prefill_waves). Within a wave, chunks of similar
        length share a forward, except a request's that asked for prompt logprobs (scored
        over every position, alone)."""
        forwards: list[list[PrefillChunk]] = []
        for wave in prefill_waves(chunks, prefixes, snapshot_hits):
            forwards += [[c] for c in wave if self.requests[c.rid].sampling.prompt_logprobs >= 0]
            rest = [c for c in wave if self.requests[c.rid].sampling.prompt_logprobs < 0]
            # A chunk after a prefix attends to it too: widths count the furthest start.
            behind = max((c.start for c in rest), default=0)
            groups = (group_by_length([len(c.token_ids) for c in rest], self.prefill_padding,
                                      lambda width: self.forward_cap(behind + width))
                  if self.shares_prefill else [[i] for i in range(len(rest))])
            forwards += [[rest[i] for i in g] for g in groups]
        return forwards

    def _padded_width(self, group: list[PrefillChunk]) -> int:
        """The width a forward of these chunks is padded to, 0 for as it is: a lone
        prompt's last chunk, starting on a multiple of tail_starts (default tail_bucket),
        to the next multiple of tail_bucket; without a tail_bucket, a lone chunk to a
        multiple of tail_multiple (pad_tails)."""
        if any(self.requests[c.rid].sampling.prompt_logprobs >= 0 for c in group):
            return 0  # scored over every position: alone and unpadded
        if len(group) != 1:
            return 0
        chunk, bucket, multiple = group[0], self.tail_bucket, self.tail_multiple
        size = len(chunk.token_ids)
        if bucket:
            if not chunk.start or chunk.start % (self.tail_starts or bucket):
                return 0
            width = bucket - chunk.start % bucket
        elif multiple:
            width = -(-size // multiple) * multiple
        else:
            return 0
        if 1 < size < width and chunk.start + width <= self.table.shape[1]:
            return width
        return 0

    def pad_tails(self, multiple: int) -> bool:
        """Run a lone prompt chunk padded to a multiple of `multiple` tokens where
        tail_bucket pads no tail (0), so a prompt's last chunk meets a few recurring
        shapes (MLX's host work for a forward's first shape is milliseconds on CUDA);
        False where it cannot: recurrent state (padding would run through it), or a
        tail_bucket (its rule pads the tails)."""
        if self.tail_bucket or self.pool.has_states:
            return False
        self.tail_multiple = multiple
        return True

    def _prefill_many(self, chunks: list[PrefillChunk], width: int = 0) -> list[mx.array]:
        """One forward over chunks of several requests, right-padded to the longest (or to
        `width`); each chunk's last position's logits, [1, V] each."""
        staging = self._forward_staging
        staging.begin()
        # (Several chunks, or one padded to `width`: ForwardLayout.prefill's layout.)
        states, sizes, tokens, layout = self._padded_inputs(chunks, width, staging.add)
        starts = np.array([c.start for c in chunks])
        rows = [s.row for s in states]
        fresh = bool((starts == 0).all())
        tokens_mx, last, lengths, state_rows = staging.add(
            tokens, (sizes - 1).astype(np.int32), sizes.astype(np.int32),
            np.array(rows, dtype=np.int32) + 1)
        if self.pool.has_states:
            self._load_snapshots(states, staging.add)
            starting = [s.row + 1 for s, start in zip(states, starts) if start == 0]
            if starting and not fresh:  # beside rows that carry theirs: zeros
                self.pool.clear_states(*staging.add(np.array(starting, dtype=np.int32)))
        logits = self._forwards.last_logits(tokens_mx, layout, last, state_rows, fresh,
                                            lengths if self.pool.has_states else None)
        for state, n in zip(states, sizes):
            state.length += int(n)
        self._save_snapshots(states, chunks, staging.add)
        self._launch_prefill(tokens.size, len(chunks) > 1, logits,
                             width=int(starts.max()) + tokens.shape[-1])
        return [logits[i:i + 1] for i in range(len(chunks))]

    def _launch_prefill(self, tokens: int, shared: bool, logits: mx.array,
                        *more: mx.array, width: int = 0) -> None:
        """Put a prefill forward of `tokens` positions (`shared`: of several prompts,
        `width` wide, prefixes included) on the device as it is built, then wait for the
        one put there before it: at most two forwards' activations are held at once,
        while the host still builds one ahead; where the two would pass the measured
        room (prefill_memory: a long chunk runs whole), the one before ends first.
        Launched now (by the launch thread, where there is one), also for start's NOTE: a
        scatter-written pool's next forward must find this one's reads done."""
        # A view of its first logit, evaluated with it: reading it waits for this
        # forward alone (mx.eval would wait for everything launched since).
        probe = logits[:1, :1] if self.readback is None else prefill_mark(logits)
        previous, memory = self._last_prefill, self.prefill_memory
        held = tokens * memory.token_bytes(shared, width) if memory else 0.0
        if previous is not None and memory and self._last_prefill_bytes + held > memory.room:
            with self.clock.timing("wait"):
                self._wait_for(*previous)
            previous = None
        with self.clock.timing("start"):
            launched = self._launch_now([logits, probe, *more, *self.pool.landing()],
                                        "a prefill forward")
        self._last_prefill, self._last_prefill_bytes = (probe, launched), held
        if previous is not None:
            with self.clock.timing("wait"):
                self._wait_for(*previous)

    def _prompt_logprobs_of(self, state: RequestState, chunk: PrefillChunk,
                            out: mx.array | None, last: mx.array) -> PendingPromptLogprobs | None:
        """The logprob of each prompt token of the chunk given the tokens before it, from
        the logits of the position before it (the previous chunk's last, for its first);
        None when the request did not ask (then nothing joins its graph)."""
        k = state.sampling.prompt_logprobs
        if k < 0:
            return None
        assert out is not None, "prompt logprobs need every position's logits"
        rows, targets, start = out[:-1], chunk.token_ids[1:], chunk.start + 1
        if state.prompt_carry is not None:
            rows, targets = mx.concatenate([state.prompt_carry, rows]), chunk.token_ids
            start = chunk.start
        state.prompt_carry = None if chunk.sample else last
        if not targets:
            return None
        picked = token_logprobs(rows, mx.array(targets, dtype=mx.int32), k)
        return PendingPromptLogprobs(chunk.rid, start, k, picked)

    def _decode(self, rids: list[str], slots: list[int], window_slots: list[int]) -> mx.array:
        states = [self.requests[rid] for rid in rids]
        if self.window_table is not None:
            window_slots = _window_ids("a decode step", window_slots, len(states))
        lengths = np.array([s.length for s in states]) + 1
        if self.ragged or (lengths == lengths[0]).all():
            return self._decode_rows(states, slots, window_slots, self._gather_staging.stage)
        # Forwards of one length each, the logits put back in the batch's order (their
        # gathers' indices as new arrays: a staging ring serves one use a step).
        groups = rows_by_length(lengths)
        parts = [self._decode_rows([states[i] for i in group], [slots[i] for i in group],
                                   [window_slots[i] for i in group] if window_slots else [],
                                   new_arrays)
                 for group in groups]
        order = np.concatenate(groups)
        return mx.concatenate(parts)[mx.array(np.argsort(order).astype(np.int32))]

    def _decode_rows(self, states: list[RequestState], slots: list[int],
                     window_slots: list[int], stage: Stage) -> mx.array:
        rows = np.array([s.row for s in states])
        lengths = np.array([s.length for s in states]) + 1
        for s in states:
            self._check_room(s, 1)
        self.table[rows, lengths - 1] = slots
        if self.window_table is not None:
            self.window_table[rows, lengths - 1] = window_slots
        dense = self._dense_decode
        if dense is not None:
            dense.plan(tuple(int(r) for r in rows), lengths)
        tokens = gather_last_tokens(states, stage)
        if self._compiled_decode is not None:
            logits = self._compiled_decode.run(tokens, rows, lengths, self.table,
                                               self.window_table, self.max_context)
        else:
            # Its inputs in the decode steps' staging, one use a step; a step of several
            # forwards (rows by length) makes new arrays.
            staging = self._decode_staging if stage is not new_arrays else None
            if staging is not None:
                staging.begin()
            add = staging.add if staging is not None else new_arrays
            layout = ForwardLayout.decode(self.table[rows], lengths, dense,
                                          self._window_row(rows), add)
            state_rows, = add(rows.astype(np.int32) + 1)  # row 0 of the states is scratch
            caches = build_layer_caches(self.pool, layout, state_rows)
            logits = self.model(tokens[:, None], cache=caches)[:, -1, :]
            check_written(caches)
        for s in states:
            s.length += 1
        return logits

    @property
    def slot_bytes(self) -> tuple[int, int]:
        """Bytes a position takes in the full layers' space and in the windowed ones'."""
        return self.pool.slot_bytes

    @property
    def serves_prefix_hits(self) -> bool:
        """Whether a prefix's cached K/V can serve a hit (WorkerReady.prefix_cache)."""
        return self.pool.serves_prefix_hits

    @property
    def compiles_decode(self) -> bool:
        return self._compiled_decode is not None

    @property
    def prefill_forwards(self) -> PrefillForwards:
        return self._forwards

    def trace_decode(self, size: int, width: int) -> None:
        """Trace the compiled decode forward for `size` rows over a `width`-column slot
        table, running nothing (CompiledDecode.trace)."""
        assert self._compiled_decode is not None
        self._compiled_decode.trace(size, width)

    @property
    def decode_traces(self) -> int:
        """How many times mx.compile traced the decode forward."""
        return self._compiled_decode.traces if self._compiled_decode is not None else 0

    def _check_room(self, state: RequestState, n: int) -> None:
        if state.length + n > self.max_context:
            raise RuntimeError(f"{state.rid}: context would exceed {self.max_context} tokens")


def _window_ids(what: str, ids: list[int], n: int) -> list[int]:
    """A plan's window slots for n positions (the scheduler sends them where windowed
    layers have their own space)."""
    if len(ids) != n:
        raise RuntimeError(f"{what}: {len(ids)} window slots for {n} positions")
    return ids


@dataclass(frozen=True)
class ModelSplit:
    """A model whose call is its backbone (hidden states, taking `cache`) then one output
    layer and nothing else: `head(backbone(tokens, cache=...))` is the model's call."""

    backbone: Any
    head: Any


# mlx-lm model modules whose Model call is a backbone then one output layer and nothing
# else (read from their source): the backbone's attribute, and where the layer's tying
# is read: "args" (args.tie_word_embeddings: the embedding's as_linear, else lm_head),
# "attr" (the model's tie_word_embeddings), "never" (lm_head), "always" (the embedding).
_OUTPUT_HEADS = {
    "llama": ("model", "args"), "qwen2": ("model", "args"), "qwen3": ("model", "args"),
    "qwen3_moe": ("model", "args"), "qwen3_next": ("model", "args"),
    "mixtral": ("model", "args"), "phi3": ("model", "args"), "olmo3": ("model", "args"),
    "ministral3": ("model", "args"), "exaone4": ("model", "args"),
    "gemma3_text": ("model", "attr"), "gpt_oss": ("model", "never"),
    "deepseek_v3": ("model", "never"), "nemotron_h": ("backbone", "never"),
    "mamba2": ("backbone", "args"), "lfm2": ("model", "always"),
}


def split_model(model: Any) -> ModelSplit | None:
    """The model as backbone and output head where its call is just that (_OUTPUT_HEADS;
    Qwen 3.5's wraps its text model, which is); None for other models. A prefill forward
    then computes the logits of the positions it samples from, not of every prompt token
    (an LM head over all of them was ~7% of a prompt's compute on the demo models, ~8% on
    a Gemma-3-12B with its 262k vocabulary, and its output, at a 128k vocabulary, 0.5 GB
    for a 2k-token forward)."""
    kind = type(model)
    package, _, name = kind.__module__.rpartition(".")
    if package != "mlx_lm.models" or kind.__name__ != "Model":
        return None
    if name == "qwen3_5":  # its text model, unsharded, is backbone then head
        text = getattr(model, "language_model", None)
        if type(text).__name__ != "TextModel" or getattr(text, "sharding_group", 0) is not None:
            return None
        return _split(text, "model", "args")
    rule = _OUTPUT_HEADS.get(name)
    return _split(model, *rule) if rule is not None else None


def _split(model: Any, backbone_name: str, tying: str) -> ModelSplit | None:
    import inspect

    backbone = getattr(model, backbone_name, None)
    if backbone is None or "cache" not in inspect.signature(type(backbone).__call__).parameters:
        return None
    tied = {"args": lambda: model.args.tie_word_embeddings, "never": lambda: False,
            "attr": lambda: model.tie_word_embeddings, "always": lambda: True}[tying]()
    if not tied:
        return ModelSplit(backbone, model.lm_head)
    # (An mlx Module is a dict: tested for None, not for truth.)
    embedding = getattr(backbone, "embed_tokens", None)
    if embedding is None:
        embedding = backbone.embeddings  # mamba2's name
    return ModelSplit(backbone, embedding.as_linear)

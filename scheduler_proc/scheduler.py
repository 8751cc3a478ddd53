"""The scheduler's decisions: admission, batching, chunked prefill, prefix caching,
preemption and stop checks.

Pure logic on plain data: the process loop in `scheduler_proc.__init__` feeds it messages
and ships what it returns.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from ipc.messages.common import SamplingParams, SchedulerStats, TokenLogprob, Usage
from ipc.messages.to_detokenizer import PromptTokenLogprobs, TokenOutput
from ipc.messages.to_scheduler import StepResult, TokenizedRequest
from ipc.messages.to_worker import ForwardBatch, NewRequest, PrefillChunk
from kiln_common.incremental_text import TokenizerLike
from kiln_common.windows import WindowRule
from scheduler_proc.allocator import ReqToTokenTable, SlotAllocator
from scheduler_proc.radix_cache import (DisabledCache, Node, RadixCache, SnapshotCache,
                                        common_prefix_len)
from scheduler_proc.request import PROMPT_TAIL, DupRange, FinishReason, Req, StopWatch, WaitingQueue
from scheduler_proc.window_slots import WindowSlots

logger = logging.getLogger(__name__)

# A waiting request that shares this many more tokens with a prompt still being prefilled
# than with the cache waits for that prompt to land in the cache instead of recomputing it.
IN_FLIGHT_PREFIX_MIN = 32
# Decode first protects a stream that was decoding this many steps before the oldest
# waiting request arrived. A burst's requests reach the scheduler over tens of ms (one
# HTTP request and tokenization after another), so its first ones start decoding while
# the rest arrive; on the H200 a request just ahead of a 64-request wave held the wave to
# the decode-first budget for 8 steps (docs/benchmarks.md, session 39).
BURST_STEPS = 16


@dataclass(frozen=True)
class SchedulerLimits:
    capacity: int  # KV slots in the worker's pool
    max_context: int  # longest sequence (prompt + output) the worker can hold
    max_running: int
    chunk_size: int
    max_prefill_tokens: int
    radix_cache: bool = True
    schedule_policy: str = "fcfs"  # or "lpm": longest cached prefix first
    # A model with recurrent layers: snapshot slots of their state at cached prompt ends
    # (hits only there, SnapshotCache); 0 for models without them. snapshot_stride: inside
    # a prompt, tokens between snapshots at chunk ends (0: every chunk's end).
    state_snapshots: int = 0
    snapshot_stride: int = 0
    # A model with windowed layers in a slot space of their own (WindowSlots): its size
    # and the layers' windows, each (kind, span); 0 and () when they share the full one.
    window_slots: int = 0
    windows: tuple[tuple[str, int], ...] = ()
    # What one position's K/V take in each space (for the stats).
    bytes_per_slot: int = 0
    window_bytes_per_slot: int = 0
    # Decode first: a step decoding streams that were decoding before the oldest waiting
    # request arrived computes at most this many prompt tokens (None: max_prefill_tokens),
    # so a burst of long prompts stretches each of their gaps by one bounded prefill, not
    # by a whole --max-prefill-tokens of it (see Scheduler._decode_first).
    max_prefill_tokens_while_decoding: int | None = None
    # ... and one whose streams all started after it (a burst's own first requests) too.
    decode_first_for_all: bool = False
    # A chunk that leaves its prompt unfinished ends at a multiple of this position (the
    # worker's prefill bucket, WorkerReady.chunk_align; 1: anywhere), so a long prompt's
    # chunks start on the worker's bucket edges (see PrefillBudget).
    chunk_align: int = 1
    # Where a prefix hit is cut back to (0: chunk_align): a bucket's edge, where a spread
    # prefill's chunks end on edges several buckets apart (WorkerReady.prefix_align).
    prefix_align: int = 0
    # A step that decodes runs its prefill over this many steps (the worker's
    # WorkerReady.prefill_parts: a share of the model's blocks a step), taking this many
    # times the decode-first budget; 1: in one.
    prefill_parts: int = 1

    def prefill_tokens(self, decode_first: bool) -> int:
        """The prompt tokens a step may compute (before a spread's parts multiply them)."""
        if not decode_first or self.max_prefill_tokens_while_decoding is None:
            return self.max_prefill_tokens
        return min(self.max_prefill_tokens, self.max_prefill_tokens_while_decoding)


class PrefillBudget:
    """Prompt tokens one step may still compute, cut into chunks of at most `chunk`.

    align (> 1): a chunk that leaves its prompt unfinished is cut back to end at a
    multiple of it. On the CUDA backend a chunk starting on such an edge runs causal
    attention through cuDNN at a recurring shape; one starting anywhere else needs an
    explicit mask (slower, and a cuDNN graph per new shape), and so does every later chunk
    of its prompt. What a budget has left after another prompt's last chunk (less than an
    edge's worth) is then not spent starting a long prompt off its edges: it waits a step.
    A budget that has given nothing yet still gives its whole (the oldest prompt advances
    every step, whatever the alignment).

    Unaligned, a budget does not start a prompt it cannot finish with a head shorter than
    half the longest chunk it gave: the worker shares a forward only between chunks of
    near one length (runner.PREFILL_PADDING), so such a head runs as a forward of its own,
    every layer's launches and weight reads again for few tokens (Gemma 3's steps joining
    one prompt's tail and the next one's head took 60-120 ms to start on the H200 against
    16-25 for one chunk; session 24 in docs/benchmarks.md).

    lone_pieces (unaligned budgets only: a spread prefill's): a prompt's tail, or a head
    that leaves it unfinished, comes alone, so no prompt's head joins another one's tail.
    Of different lengths, the two run as two forwards, each spread in parts: Gemma 3's
    steps starting a tail and a head took 45-80 ms to start their first part on the H100
    against 8 for one 1,024-token chunk, and made its ITL p99 (docs/benchmarks.md,
    session 38). Whole prompts (fresh, or the rest after a prefix hit) still go
    together. Aligned budgets pad a tail to its edge and start the next head on one."""

    def __init__(self, tokens: int, chunk: int, align: int = 1,
                 lone_pieces: bool = False) -> None:
        self.total = self.left = tokens
        self.chunk = chunk
        self.align = align if align > 1 and chunk % align == 0 else 1
        self.longest = 0  # the longest chunk given (see the unaligned rule above)
        self.lone_pieces = lone_pieces and self.align == 1
        self.gave_piece = False

    def take(self, start: int, wanted: int, admitting: bool = False) -> int:
        """Tokens for a prompt whose next chunk starts at `start` with `wanted` to go
        (`admitting`: its first chunk, after any prefix hit)."""
        n = min(wanted, self.chunk, self.left)
        if self.lone_pieces:
            # A hit's whole remainder may share a forward as a fresh prompt does.
            lone = n < wanted or (start > 0 and not admitting)
            if self.gave_piece or (lone and self.left < self.total):
                return self._scraps()
            self.gave_piece = lone
        if n < wanted and self.align > 1:
            aligned = (start + n) // self.align * self.align - start
            if aligned > 0:
                n = aligned
            elif self.left < self.total:
                return self._scraps()
        elif n < wanted and start == 0 and 2 * n < self.longest:
            return self._scraps()
        self.left -= n
        self.longest = max(self.longest, n)
        return n

    def _scraps(self) -> int:
        self.left = 0  # later prompts wait for the next step too (FCFS)
        return 0

    def give_back(self, n: int) -> None:
        self.left += n

    @property
    def exhausted(self) -> bool:
        return self.left <= 0


class DecodeRatio:
    """How much of their remaining max_tokens admission expects requests to still use.

    Optimistic at first (most requests stop early or share prefixes); a preemption shows
    the guess was too low, so it jumps to 1.0 and decays back step by step.
    """

    INITIAL, FLOOR, DECAY = 0.5, 0.1, 0.002

    def __init__(self) -> None:
        self.value = self.INITIAL

    def on_step(self) -> None:
        self.value = max(self.FLOOR, self.value - self.DECAY)

    def on_preempt(self) -> None:
        self.value = 1.0

    def expected(self, req: Req) -> int:
        return math.ceil(self.value * max(0, req.remaining_new - 1))


class KVReservation:
    """Admission control: the new request's uncached prompt plus its expected decode must
    fit in free + evictable slots, beyond what the running requests are expected to claim;
    with windowed layers in their own space, the most window slots each running request
    may hold at once (WindowSlots.need) must also fit in it."""

    def __init__(self, running: list[Req], ratio: DecodeRatio,
                 windows: WindowSlots | None = None) -> None:
        self.ratio = ratio
        self.windows = windows
        self.claimed = sum(r.remaining_fill + ratio.expected(r) for r in running)
        self.window_claimed = sum(self.window_need(r) for r in running)

    def need(self, req: Req, cached: int) -> int:
        return req.fill_len - cached + self.ratio.expected(req)

    def window_need(self, req: Req) -> int:
        if self.windows is None:
            return 0
        return self.windows.need(req.fill_len + self.ratio.expected(req), req.fill_len)

    def fits(self, room: int, need: int, window_need: int = 0) -> bool:
        return room - self.claimed >= need and (
            self.windows is None or self.window_claimed + window_need <= self.windows.capacity)

    def claim(self, need: int, window_need: int = 0) -> None:
        self.claimed += need
        self.window_claimed += window_need


@dataclass
class SpreadPrefill:
    """A step's prefill forwards running over several steps (SchedulerLimits.prefill_parts).

    Until its last part is planned the worker still writes its chunks' K/V, a share of the
    layers a step. So its requests do not decode yet (those whose prompts it ends sample
    with the last part), nobody else reads their prompts (they are shared with the last
    part) and their slots and ids stay theirs: an abort, an error or a finish ends a
    request for its client at once, but what it holds is given back with the last part
    (`held`). Preemption passes them over."""

    parts: int
    admitted_as: dict[str, int]  # rid -> Req.admission, of the chunks' requests
    samples: list[str] = field(default_factory=list)  # rids whose prompts it ends
    cache_at: list[tuple[Req, int]] = field(default_factory=list)  # (req, prompt end) to share
    held: list[tuple[Req, bool, bool]] = field(default_factory=list)  # _give_back's arguments
    next_part: int = 1

    def has(self, req: Req) -> bool:
        return self.admitted_as.get(req.rid) == req.admission

    def sharing(self) -> list[Req]:
        """The requests whose prompts it shares with its last part."""
        return [req for req, _ in self.cache_at]


@dataclass
class Counters:
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    cache_hit_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0


class Scheduler:
    def __init__(self, limits: SchedulerLimits,
                 load_tokenizer: Callable[[], TokenizerLike] | None = None) -> None:
        self.limits = limits
        # Stop strings need the text: the tokenizer is loaded for the first such request.
        self._load_tokenizer = load_tokenizer
        self._tokenizer: TokenizerLike | None = None
        self.allocator = SlotAllocator(limits.capacity)
        self.table = ReqToTokenTable(limits.max_running, limits.max_context)
        self.cache: RadixCache = _prefix_cache(limits)
        self.windows = (WindowSlots(limits.window_slots, limits.capacity,
                                    WindowRule(limits.windows), limits.chunk_size)
                        if limits.window_slots else None)
        self.waiting = WaitingQueue()
        self.running: dict[str, Req] = {}  # admission order: the newest is preempted first
        self.ratio = DecodeRatio()
        self.counters = Counters()
        self._released: list[str] = []
        self._released_snapshots: list[int] = []  # beside _released (ForwardBatch's)
        self._step = 0
        # Per step in flight: the admission (Req.admission) of each request it names, and
        # which of them it samples. A request preempted and re-admitted meanwhile, or a
        # new request reusing an ended one's id (a client's own rid), must not take what
        # the step computed for the old one: its token, error or prompt logprobs.
        self._admitted_as: dict[int, dict[str, int]] = {}
        self._sampled_for: dict[int, list[str]] = {}
        self._admissions = 0  # admissions so far, every request's: the next one's serial
        # The worker's whole-step failures learnt of (StepResult.epoch, ForwardBatch.epoch):
        # a failed result of no later one is a step planned before the last was known,
        # whose requests ended with it.
        self._epoch = 0
        self._spread: SpreadPrefill | None = None  # the prefill running over steps, if any
        self._planning: SpreadPrefill | None = None  # the one a step being planned starts

    @property
    def has_work(self) -> bool:
        # (A spread prefill whose requests all ended still has parts to run: it holds slots.)
        return bool(self.running or self.waiting or self._spread)

    def _last_token_planned(self, req: Req) -> bool:
        """Whether the steps in flight sample req's last token by max_tokens or the
        context limit: a further decode's token would only be discarded (and, with
        overlap, every length-bound request would cost a wasted row in the step after its
        last). Stops by token or string cannot be foreseen; those tokens are discarded."""
        n_out = len(req.output_ids) + req.samples_in_flight
        return (n_out >= req.sampling.max_new_tokens
                or req.prompt_len + n_out >= self.limits.max_context)

    def _finishing(self) -> list[Req]:
        """Running requests past their prompts whose last tokens are in flight."""
        return [r for r in self.running.values()
                if not r.prefilling and self._last_token_planned(r)]

    # -- requests in, aborts, cache control ---------------------------------------------------

    def add_request(self, msg: TokenizedRequest) -> list[TokenOutput]:
        """Queue a request, or answer at once with an error if it can never run."""
        req = Req.from_message(msg)
        if req.rid in self.running or req.rid in self.waiting:
            return [_error(req.rid, f"duplicate request id {req.rid}")]
        problem = self._never_fits(req) or self._watch_stops(req)
        if problem:
            return [_error(req.rid, problem)]
        self.counters.prompt_tokens += req.prompt_len
        self.waiting.push(req, self._step)
        return []

    def _never_fits(self, req: Req) -> str | None:
        if not req.input_ids:
            return "the prompt is empty"
        if req.sampling.max_new_tokens < 0:
            return "max_new_tokens must be >= 0"
        need = req.max_kv_tokens
        # The context counts every token, the last output's too (whose K/V is never
        # computed), as _append_token's length limit and the front's check do.
        if req.prompt_len + req.sampling.max_new_tokens > self.limits.max_context:
            return (f"prompt ({req.prompt_len} tokens) + max_tokens ({req.sampling.max_new_tokens}) "
                    f"exceeds the context length the server holds ({self.limits.max_context})")
        if need > self.limits.capacity:
            return (f"the request needs {need} KV slots but the server has only "
                    f"{self.limits.capacity}; lower max_tokens or raise --max-total-tokens")
        if self.windows is not None:
            window_need = self.windows.need(need, req.prompt_len)
            if window_need > self.windows.capacity:
                return (f"the request needs {window_need} slots of the windowed layers but "
                        f"the server has only {self.windows.capacity}; lower max_tokens or "
                        f"raise --window-ratio")
        return None

    def _watch_stops(self, req: Req) -> str | None:
        """Give a request with stop strings its StopWatch; a problem message if it can't."""
        if not req.stop:
            return None
        if self._tokenizer is None:
            if self._load_tokenizer is None:
                return "stop strings are not available: the scheduler has no tokenizer"
            try:  # once, on the first request with stop strings (a one-off pause)
                self._tokenizer = self._load_tokenizer()
            except Exception as exc:  # noqa: BLE001 - refuse the request, keep serving
                logger.exception("could not load the tokenizer for stop strings")
                return f"stop strings are not available: the tokenizer did not load ({exc})"
        req.stop_watch = StopWatch.start(self._tokenizer, req)
        return None

    def abort(self, rid: str) -> list[TokenOutput]:
        req = self.waiting.remove(rid) or self.running.get(rid)
        if req is None:
            return []  # already finished: its last output is on its way
        self.counters.aborted += 1
        self._finish(req, FinishReason.ABORT)
        return [self._output(req, [])]

    def flush_cache(self) -> int:
        """Drop every cached prefix no running request uses; returns the slots freed."""
        freed = self.cache.flush()
        self._free(freed)
        return len(freed)

    def _free(self, slots: np.ndarray) -> None:
        """Slots back to the allocator, with their positions' window slots."""
        self.allocator.free(slots)
        if self.windows is not None:
            self.windows.drop(slots)

    # -- planning a step ------------------------------------------------------------------

    def plan_step(self) -> ForwardBatch | None:
        """The next step, as a recipe:
        1. one decode slot for every running request past its prompt (when slots run
           short: evicting cached prefixes, then waiting a step if requests whose last
           tokens are in flight will give back enough, else preempting the newest
           requests that are not finishing);
        2. the prefill budget for unfinished prompts, oldest first, in chunks: the smaller
           one where step 1 decodes a stream that was decoding before the waiting prompts
           arrived (`_decode_first`, `SchedulerLimits.prefill_tokens`); it is never 0, so
           the oldest prompt advances every step however long decoding goes on;
        3. waiting requests admitted while budget, batch size and KV room allow.
        With --prefill-spread, a decode-first step runs its prefill over several steps
        (SpreadPrefill), the next ones carrying its later parts instead of new chunks.
        """
        new_reqs: list[NewRequest] = []
        decode_rids, decode_slots, decode_window = self._plan_decode()
        if self._spread is not None:
            return self._continue_spread(decode_rids, decode_slots, decode_window)
        decode_first = self._decode_first(decode_rids)
        parts = self._parts(decode_first)
        budget = PrefillBudget(
            min(self.limits.max_prefill_tokens, self.limits.prefill_tokens(decode_first) * parts),
            self.limits.chunk_size, self.limits.chunk_align, lone_pieces=parts > 1)
        self._planning = SpreadPrefill(parts, {}) if parts > 1 else None
        prefill = [self._plan_chunk(r, budget, new_reqs)
                   for r in list(self.running.values()) if r.prefilling and not budget.exhausted]
        prefill += self._admit(budget, new_reqs)
        prefill = [c for c in prefill if c is not None]
        spread, self._planning = self._planning, None
        if spread is not None and all(self.running[c.rid].sampling.prompt_logprobs >= 0
                                      for c in prefill):
            # Nothing to spread (the worker runs whole the chunks of requests asking for
            # prompt logprobs, as it scores them): their prompts shared now.
            for req, end in spread.cache_at:
                self._cache_prompt(req, end)
            spread = None
        if not (prefill or decode_rids):
            # Every running prompt is stuck for want of slots (none will come back).
            if self.running and not self._finishing():
                self._preempt(next(reversed(self.running.values())))
                return self.plan_step()
            return None  # nothing to do, or slots to wait for from requests finishing
        self._step += 1
        self.ratio.on_step()
        ends = [c.rid for c in prefill if c.sample]
        named = [n.rid for n in new_reqs] + [c.rid for c in prefill] + decode_rids
        self._admitted_as[self._step] = {rid: self.running[rid].admission for rid in named}
        if spread is not None:  # its prompts' ends sample with its last part
            spread.admitted_as = {c.rid: self.running[c.rid].admission for c in prefill}
            spread.samples, ends = ends, []
            self._spread = spread
        self._count_samples(ends + decode_rids)
        return self._batch(new_requests=new_reqs, prefill=prefill, decode_rids=decode_rids,
                           decode_slots=decode_slots, decode_window_slots=decode_window,
                           parts=spread.parts if spread is not None else 1)

    def _decode_first(self, decode_rids: list[str]) -> bool:
        """Whether this step holds its prefill to the decode-first budget (and spreads it):
        where a stream it decodes was decoding (BURST_STEPS steps or more) before the
        oldest request now waiting for its first token (queued, or admitted and
        mid-prompt) arrived. The budget protects streams from prompts that arrive while
        they decode; a burst's own first requests, decoding while the rest of it waits, do
        not hold the rest back: with only those decoding, a step prefills up to
        --max-prefill-tokens, so a burst at a nearly idle server is prefilled in a few
        large steps (as with nothing decoding), not trickled in beside its first streams
        (docs/benchmarks.md, sessions 14-15)."""
        if not decode_rids:
            return False
        if self.limits.decode_first_for_all:
            return True
        since = [r.waiting_since for r in self.running.values() if r.prefilling]
        queued = self.waiting.oldest_since()
        oldest = min(since + [queued] if queued is not None else since, default=None)
        if oldest is None:
            return True  # nothing waits
        earliest = min(self.running[rid].decoding_since for rid in decode_rids)
        return earliest + BURST_STEPS <= oldest

    def _parts(self, decode_first: bool) -> int:
        """Over how many steps this step's prefill runs: spread only in a decode-first step
        (alone, a whole forward is what finishes prompts soonest), and not where a hit
        needs a state snapshot at a chunk's end (the worker's spread refuses those models)."""
        if not decode_first or isinstance(self.cache, SnapshotCache):
            return 1
        return self.limits.prefill_parts

    def _continue_spread(self, decode_rids: list[str], decode_slots: list[int],
                         decode_window: list[int]) -> ForwardBatch:
        """A step running the spread prefill's next part beside the decode rows; with
        nothing decoding, all its remaining parts (no stream waits on the step)."""
        spread = self._spread
        assert spread is not None
        first = spread.next_part
        end = first + 1 if decode_rids else spread.parts
        self._step += 1
        self.ratio.on_step()
        running = {rid: r for rid, r in self.running.items() if spread.has(r)}
        ends = [rid for rid in spread.samples if rid in running] if end == spread.parts else []
        self._admitted_as[self._step] = {
            **spread.admitted_as, **{rid: self.running[rid].admission for rid in decode_rids}}
        self._count_samples(ends + decode_rids)
        batch = self._batch(decode_rids=decode_rids, decode_slots=decode_slots,
                            decode_window_slots=decode_window, parts=spread.parts,
                            parts_from=first, parts_to=end)
        spread.next_part = end
        if end == spread.parts:
            self._end_spread(keep=True)
        return batch

    def _end_spread(self, keep: bool) -> None:
        """The spread prefill's last part is planned (keep) or was lost with a failed step:
        its prompts are shared (keep) and what its ended requests held is given back."""
        spread, self._spread = self._spread, None
        if spread is None:
            return
        if keep:
            for req, end in spread.cache_at:
                if self.running.get(req.rid) is req and spread.has(req):
                    self._cache_prompt(req, end)
        for req, keep_kv, snapshot in spread.held:
            self._give_back(req, keep and keep_kv, snapshot)

    def _count_samples(self, rids: list[str]) -> None:
        self._sampled_for[self._step] = rids
        for rid in rids:
            self.running[rid].samples_in_flight += 1

    def _batch(self, **fields: Any) -> ForwardBatch:
        """This step's plan, with the requests released since the last one."""
        released, self._released = self._released, []
        snapshots, self._released_snapshots = self._released_snapshots, []
        return ForwardBatch(step=self._step, released=released, epoch=self._epoch,
                            released_snapshots=snapshots if any(snapshots) else [], **fields)

    def _make_room(self, n: int) -> bool:
        """Ensure n free slots (and n window slots), evicting unlocked cached prefixes,
        least recently used first, if needed."""
        short = n - self.allocator.num_free
        if short > 0:
            self._free(self.cache.evict(short))
        if self.windows is not None and self.windows.num_free < n:
            # A chunk's worth at least: else a full window space evicts a few slots every
            # decode step, each time over every running context.
            self._evict_windows(max(n - self.windows.num_free, self.limits.chunk_size))
            if self.windows.num_free < n:
                return False
        return self.allocator.num_free >= n

    def _alloc(self, req: Req, start: int, n: int) -> tuple[np.ndarray, list[int]]:
        """n slots (and window slots) for req's positions start.. (room was made)."""
        slots = self.allocator.alloc(n)
        self.table.assign(req.row, start, slots)
        window = self.windows.attach(slots) if self.windows is not None else None
        return slots, [] if window is None else window.tolist()

    def _trim_windows(self, req: Req, query: int) -> None:
        """Give back the window slots of req's own positions that its queries from
        `query` on no longer see. Cached positions (before prefix_len) keep theirs for
        later hits, until window eviction takes them; its copies of cached positions
        (dups) do not."""
        if self.windows is None:
            return
        sees_from = int(self.windows.rule.first_needed(query))
        req.sees_from = sees_from
        lo = max(req.window_from, req.prefix_len)
        if sees_from > lo:
            self.windows.drop(self.table.slots(req.row, sees_from)[lo:])
            req.window_from = sees_from
        # Its own copies of positions another request cached first (dups) are no hit's
        # to keep: behind every window they give their window slots back too. (They held
        # them all before: a prompt repeating a cached prefix whose windows had been
        # evicted filled the window space with them, and a lone such request was
        # preempted and readmitted for ever.)
        for dup in req.dups:
            behind = min(dup.end, sees_from)
            if behind > dup.windows_from:
                self.windows.drop(self.table.slots(req.row, behind)[dup.windows_from:])
                dup.windows_from = behind

    def _evict_windows(self, n: int) -> int:
        """Free at least n window slots (if that many can be) from cached positions that no
        running request's queries see, least recently used prefixes first; their full
        K/V stay cached (a hit is then cut back, WindowSlots.usable). Returns how many."""
        assert self.windows is not None
        # A flag per full slot, not a set operation: running contexts of long prompts are
        # hundreds of thousands of slots, and np.isin sorted them all (~0.2 s) each time.
        protected = np.zeros(self.allocator.capacity + 1, dtype=bool)
        # A spread's ended requests too: its later parts still read their windows (and
        # their K/V is cached with its last part).
        held = [r for r, _, _ in self._spread.held] if self._spread is not None else []
        for r in [*self.running.values(), *held]:
            if r.row is not None:
                protected[self.table.slots(r.row, r.num_computed)[r.sees_from:]] = True
        freed = 0
        for node in sorted(self.cache.nodes(), key=lambda x: x.last_access):
            held = node.value[self.windows.of(node.value) > 0]
            held = held[~protected[held]]
            self.windows.drop(held)
            freed += len(held)
            if freed >= n:
                break
        return freed

    def _plan_decode(self) -> tuple[list[str], list[int], list[int]]:
        """The decoding requests, their new slots and (windowed layers) window slots."""
        finishing = self._finishing()
        spreading = self._spread.has if self._spread is not None else lambda r: False
        decoding = [r for r in self.running.values()
                    if not r.prefilling and r not in finishing and not spreading(r)]
        for req in decoding:  # first: what falls out of the windows makes room
            self._trim_windows(req, req.num_computed)
        while decoding and not self._make_room(len(decoding)):
            if self._finishing_frees(finishing, len(decoding)):
                # Requests whose last tokens are in flight give back enough slots with
                # the next result: one step's wait costs less than a preemption's prefill.
                return [], [], []
            victim = next((r for r in reversed(self.running.values())
                           if r not in finishing and not spreading(r)), None)
            if victim is None:  # only the spread prefill's requests: its end frees theirs
                return [], [], []
            self._preempt(victim)
            decoding = [r for r in decoding if r is not victim]
        if not decoding:
            return [], [], []
        slots: list[int] = []
        window: list[int] = []
        for req in decoding:
            new, new_window = self._alloc(req, req.num_computed, 1)
            slots.append(int(new[0]))
            window += new_window
            req.num_computed += 1
        return [r.rid for r in decoding], slots, window

    def _finishing_frees(self, finishing: list[Req], n: int) -> bool:
        """Whether the finishing requests (preemption never takes them, so they keep what
        they hold) give back what n decode rows lack, in each slot space that is short:
        full slots, and window slots (theirs become evictable once they end). A shortage
        nothing finishing can relieve is not waited out (decoding would stall for as long
        as a prompt prefills beside it)."""
        if not finishing:
            return False
        if sum(r.num_computed for r in finishing) < n - self.allocator.num_free:
            return False
        if self.windows is None:
            return True
        held = sum(r.num_computed - r.window_from for r in finishing)
        return held >= n - self.windows.num_free

    def _admit(self, budget: PrefillBudget, new_reqs: list[NewRequest]) -> list[PrefillChunk | None]:
        if self.limits.schedule_policy == "lpm":
            self.waiting.reorder(lambda r: -self.cache.match_len(r.all_ids(max(0, r.prompt_len - 1))))
        chunks: list[PrefillChunk | None] = []
        reservation = KVReservation(list(self.running.values()), self.ratio, self.windows)
        while (self.waiting and not budget.exhausted
               and len(self.running) < self.limits.max_running):
            req = self.waiting.peek()
            if self._wait_for_in_flight_prefix(req):
                break
            if not self._try_admit(req, reservation):
                break  # FCFS: later requests do not overtake the head of the queue
            self.waiting.pop()
            chunks.append(self._plan_chunk(req, budget, new_reqs))
        return chunks

    def _try_admit(self, req: Req, reservation: KVReservation) -> bool:
        fill_len = req.prompt_len + len(req.output_ids)
        # At least the last token is computed: its logits give the next token. A request
        # scoring its prompt computes all of it (it still caches it for others).
        ids = req.all_ids(0 if req.wants_prompt_logprobs else fill_len - 1)
        match = self.cache.match_prefix(ids)
        usable = self._usable_hit(match.slots, fill_len)
        if usable < len(match):
            cut = self.cache.match_prefix(ids[:usable])
            if len(cut) < usable:
                # A snapshot cache hits only where a state was kept (chunk ends, prompt and
                # request ends): with none at the edge the cut falls to an earlier one, often
                # off an edge itself, recomputing far more than the bucket it meant to, as
                # a multi-turn chat's next turn would (its hit is the last answer's end).
                # The hit stays where it was then, cut only where windows need it.
                cut = self.cache.match_prefix(ids[:self._usable_hit(match.slots, fill_len,
                                                                    aligned=False)])
            match = cut
        self.cache.lock(match.node)
        req.fill_len = fill_len
        need, window_need = reservation.need(req, len(match)), reservation.window_need(req)
        room = self.allocator.num_free + self.cache.evictable_size
        if not reservation.fits(room, need, window_need):
            self.cache.unlock(match.node)
            return False
        reservation.claim(need, window_need)
        req.row = self.table.alloc_row()
        req.last_node, req.prefix_len, req.num_computed = match.node, len(match), len(match)
        req.window_from = len(match)
        if self.windows is not None:
            req.sees_from = int(self.windows.rule.first_needed(len(match)))
        self.table.assign(req.row, 0, match.slots)
        if not req.admission:
            req.cached_tokens = len(match)
        self._admissions += 1
        req.admission = self._admissions
        self.counters.cache_hit_tokens += len(match)
        self.running[req.rid] = req
        return True

    def _usable_hit(self, slots: np.ndarray, fill_len: int, aligned: bool = True) -> int:
        """How much of a cached prefix (its slots) a request of fill_len positions reuses:
        cut back to where every windowed layer still holds what it sees, and, where the
        worker wants chunks on bucket edges (chunk_align) and `aligned`, to an edge when
        half a bucket or more of the prompt is left to compute. Recomputing less than a
        bucket then keeps the prompt's chunks on the worker's recurring causal shapes; a
        hit at any length (one shared BOS token, say) would send its chunks through an
        explicit mask, at shapes the worker has not built."""
        def usable(slots: np.ndarray) -> int:
            return self.windows.usable(slots) if self.windows is not None else len(slots)

        n = usable(slots)
        align = (self.limits.prefix_align or self.limits.chunk_align) if aligned else 1
        while align > 1 and n % align and fill_len - n >= align // 2:
            n = usable(slots[:n - n % align])
        return n

    def _wait_for_in_flight_prefix(self, req: Req) -> bool:
        """True when req's prompt shares a long prefix with one still being prefilled:
        admitting it later lets it read that prefix from the cache."""
        if isinstance(self.cache, (DisabledCache, SnapshotCache)) or req.wants_prompt_logprobs:
            return False  # (a snapshot cache hits only at another prompt's whole end)
        ids = req.all_ids(req.prompt_len)
        cached = self.cache.match_len(ids)
        # Prompts a spread prefill shares with its last part are in flight too.
        spreads = [s for s in (self._spread, self._planning) if s is not None]
        sharing = [r for s in spreads for r in s.sharing()]
        for other in [*(r for r in self.running.values() if r.prefilling), *sharing]:
            shared = common_prefix_len(ids, other.all_ids(other.fill_len))
            if shared - cached >= IN_FLIGHT_PREFIX_MIN:
                return True
        return False

    def _plan_chunk(self, req: Req, budget: PrefillBudget,
                    new_reqs: list[NewRequest]) -> PrefillChunk | None:
        start = req.num_computed
        n = budget.take(start, req.remaining_fill, admitting=not req.on_worker)
        if n == 0:
            return None
        self._trim_windows(req, start)
        if not self._make_room(n):
            budget.give_back(n)
            return None  # waits for slots; plan_step preempts if nothing can move
        slots, window = self._alloc(req, start, n)
        req.num_computed += n
        self.counters.computed_prompt_tokens += n
        if not req.on_worker:
            req.on_worker = True
            new_reqs.append(self._new_request(req, start))
        if not req.prefilling and not req.output_ids:  # (a resumed stream keeps its own)
            # The step sampling its first token: this one, or a spread's last.
            parts = self._planning.parts if self._planning is not None else 1
            req.decoding_since = self._step + parts
        # Shared at the prompt's last chunk; a model whose hits need state snapshots at
        # every chunk's end, so that prompts sharing a long head hit at its last chunk
        # edge; one with windowed layers in their own space at every chunk's end too, so
        # the chunks behind its window keep their window slots in the cache (evictable)
        # instead of giving them back, and a prompt sharing its head still hits.
        shared = not req.prefilling or (
            isinstance(self.cache, SnapshotCache)
            and req.num_computed - req.prefix_len >= self.limits.snapshot_stride) or (
            self.windows is not None and not isinstance(self.cache, DisabledCache))
        snapshot = 0
        if shared and self._planning is not None:  # shared once its last part is planned
            self._planning.cache_at.append((req, req.num_computed))
        elif shared:
            snapshot = self._cache_prompt(req, req.num_computed)
        return PrefillChunk(rid=req.rid, start=start,
                            token_ids=req.all_ids(start + n)[start:].tolist(),
                            slot_ids=slots.tolist(), window_slot_ids=window,
                            sample=not req.prefilling, snapshot_id=snapshot)

    def _cache_prompt(self, req: Req, end: int) -> int:
        """Share a prompt's first `end` tokens as soon as the chunk ending there is planned:
        later steps (and later chunks of this one) run after its K/V is written. Returns
        the snapshot id the worker keeps the recurrent state in after that chunk (0:
        none)."""
        ids = req.all_ids(end)
        slots = self.table.slots(req.row, end).copy()
        inserted = self.cache.insert(ids, slots)
        self._free(inserted.replaced)
        node = inserted.node
        if inserted.adopted_from > req.prefix_len:
            req.dups.append(DupRange(req.prefix_len, inserted.adopted_from, req.prefix_len))
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.last_node, req.prefix_len = node, end
        if not isinstance(self.cache, SnapshotCache):
            return 0
        if not node.snapshot and not self.cache.free_snapshots:
            self._free(self.cache.evict_for_snapshot())
        return self.cache.snapshot_at(node)

    # -- preemption, finishing ---------------------------------------------------------------

    def _preempt(self, req: Req) -> None:
        """Back to the head of the queue with its outputs; its K/V goes to the cache, so a
        resumption reads whatever of it has not been evicted by then."""
        logger.info("preempting %s (%d tokens computed, %d generated)", req.rid,
                    req.num_computed, len(req.output_ids))
        self.counters.preemptions += 1
        self.ratio.on_preempt()
        self._release_kv(req, snapshot=True)
        self.waiting.push_front(req, self._step)

    def _release_kv(self, req: Req, keep: bool = True, snapshot: bool = False) -> None:
        """Give the request's slots to the cache (or back to the allocator) and drop its
        row. keep=False caches nothing more of it (its K/V is not to be trusted);
        snapshot: the worker ran it as planned (a finish or a preemption), so where the
        model has recurrent layers its state may be kept for the sequence cached. A
        request of the spread prefill under way leaves `running` now; the rest waits for
        its last part (SpreadPrefill)."""
        if req.row is None:
            return
        self.running.pop(req.rid, None)
        if self._spread is not None and self._spread.has(req):
            self._spread.held.append((req, keep, snapshot))
            return
        self._give_back(req, keep, snapshot)

    def _give_back(self, req: Req, keep: bool, snapshot: bool) -> None:
        """_release_kv's work: the request's slots to the cache or the allocator, its row
        and its worker state released."""
        slots = self.table.slots(req.row, req.num_computed).copy()
        # NOTE: with steps in flight the last planned position may hold the K/V of a token
        # we never learnt (the request stopped, or the token is still on its way): only
        # positions with known tokens can be cached, the rest is freed.
        known = min(req.num_computed, len(req.input_ids) + len(req.output_ids))
        if not keep:
            known = req.prefix_len
        inserted = self.cache.insert(req.all_ids(known), slots[:known])
        self._free(inserted.replaced)
        kept = self._release_snapshot(req, inserted.node, known) if keep and snapshot else 0
        self._free(slots[req.prefix_len:max(req.prefix_len, inserted.adopted_from)])
        self._free(slots[known:])
        for dup in req.dups:
            self._free(slots[dup.start:dup.end])
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        self.table.free_row(req.row)
        self.running.pop(req.rid, None)
        if req.on_worker:
            self._released.append(req.rid)
            self._released_snapshots.append(kept)
        req.row, req.last_node, req.dups = None, None, []
        req.num_computed = req.prefix_len = req.samples_in_flight = 0
        req.sees_from = req.window_from = 0
        req.on_worker = False

    def _release_snapshot(self, req: Req, node: Node, known: int) -> int:
        """A snapshot id for the worker to keep a released request's recurrent state in,
        at the cached node of its first `known` tokens (0: none). Valid only when the
        worker fed exactly those: nothing planned past the tokens learnt (with steps in
        flight a position may hold a token not learnt yet)."""
        if (not isinstance(self.cache, SnapshotCache) or not req.on_worker or not known
                or known != req.num_computed or node.snapshot):
            return 0
        self.cache.lock(node)  # not the leaf to evict for its own snapshot id
        if not self.cache.free_snapshots:
            self._free(self.cache.evict_for_snapshot())
        self.cache.unlock(node)
        return self.cache.snapshot_at(node)

    def _finish(self, req: Req, reason: FinishReason, keep_kv: bool = True) -> None:
        req.finish_reason = reason
        # An abort or an error may come before (or instead of) the worker's run as planned.
        self._release_kv(req, keep_kv, snapshot=reason in (FinishReason.STOP, FinishReason.LENGTH))
        if reason is not FinishReason.ABORT:
            self.counters.finished += 1

    def _fail(self, req: Req, error: str, keep_kv: bool = True) -> TokenOutput:
        logger.warning("%s ends with an error: %s", req.rid, error)
        req.error = error
        self._finish(req, FinishReason.ERROR, keep_kv)
        return self._output(req, [])

    def _fail_everything(self, reason: str) -> list[TokenOutput]:
        """A step failed as a whole: the worker has dropped every request, and what the
        steps in flight wrote to the pool is unknown. Every request sent to the worker
        ends with the error, keeping none of its K/V; the cache is dropped (all of it is
        unlocked then), so no later request reads a suspect slot. Waiting requests that
        never reached the worker stay queued. Serving goes on."""
        message = f"internal error in the worker: {reason}"
        outputs, unsent = [], []
        self._end_spread(keep=False)
        for req in list(self.running.values()):
            if req.on_worker:
                outputs.append(self._fail(req, message, keep_kv=False))
            else:  # admitted, its first chunk not planned yet: queued again, whole
                self._release_kv(req, keep=False)
                unsent.append(req)
        for req in reversed(unsent):  # at the queue's head, in their admission order
            self.waiting.push_front(req, self._step)
        self.flush_cache()
        self._admitted_as.clear()
        self._sampled_for.clear()
        return outputs

    # -- results ---------------------------------------------------------------------------

    def apply_result(self, result: StepResult) -> list[TokenOutput]:
        outputs = []
        if result.failed is not None:
            if result.epoch <= self._epoch:
                return []  # planned before the failure was known: its requests ended with it
            self._epoch = result.epoch
            return self._fail_everything(result.failed)
        admitted_as = self._admitted_as.pop(result.step, {})

        def planned(rid: str) -> Req | None:
            """The running request the step was planned for under this id, if it still
            runs: not finished, aborted or preempted (maybe re-admitted) since, nor a
            new request that took an ended one's id."""
            req = self.running.get(rid)
            return req if req is not None and admitted_as.get(rid) == req.admission else None

        for rid in self._sampled_for.pop(result.step, []):
            if (req := planned(rid)) is not None:
                req.samples_in_flight -= 1
        for error in result.errors:  # refused by the worker: their tokens mean nothing
            req = planned(error.rid)
            if req is not None and req.on_worker:
                outputs.append(self._fail(req, error.message))
        # Before the tokens: a request's first output carries its prompt's logprobs.
        for scored in result.prompt_logprobs:
            if (req := planned(scored.rid)) is not None:
                req.add_prompt_logprobs(scored.start, scored.entries())
        logprobs = result.token_logprobs()
        for row, (rid, token) in enumerate(zip(result.rids, result.token_ids)):
            if (req := planned(rid)) is not None:  # else its token is stale: dropped
                outputs.append(self._append_token(req, token, logprobs.get(row)))
        return outputs

    def _new_request(self, req: Req, start: int) -> NewRequest:
        """What the worker needs to (re)start sampling for req; its cached prefix ends at start."""
        sp = req.sampling
        penalised = sp.uses_penalties
        node = req.last_node
        return NewRequest(
            rid=req.rid, sampling=_worker_sampling(req),
            prefix_slot_ids=self.table.slots(req.row, start).tolist(),
            prefix_window_slot_ids=(self.windows.of(self.table.slots(req.row, start)).tolist()
                                    if self.windows is not None and start else []),
            state_snapshot=node.snapshot if start and node is not None else 0,
            num_sampled=len(req.output_ids),
            stop_token_ids=sorted(req.stop_token_ids) if sp.min_tokens > 0 else [],
            prompt_ids=req.input_ids if penalised and sp.repetition_penalty != 1.0 else [],
            # A grammar's matcher resumes after the outputs a preempted request already has.
            output_ids=req.output_ids if penalised or sp.grammar is not None else [])

    def _append_token(self, req: Req, token: int, logprob: TokenLogprob | None) -> TokenOutput:
        if req.sampling.max_new_tokens == 0:
            # Only the prompt was wanted (echo, prompt logprobs): the token is dropped.
            self._finish(req, FinishReason.LENGTH)
            return self._output(req, [])
        self.counters.generated_tokens += 1
        if logprob is not None:
            req.cumulative_logprob += logprob.logprob
        if token in req.stop_token_ids:
            self._finish(req, FinishReason.STOP)
            return self._output(req, [], stop_token=True)
        req.output_ids.append(token)
        n_out = len(req.output_ids)
        req.stop_str = req.stop_watch.feed(token) if req.stop_watch else None
        if req.stop_str is not None:
            self._finish(req, FinishReason.STOP)
        elif n_out >= req.sampling.max_new_tokens or req.prompt_len + n_out >= self.limits.max_context:
            self._finish(req, FinishReason.LENGTH)
        output = self._output(req, [token])
        # A stop token has no logprob entry: it is no output.
        return output if logprob is None else msgspec.structs.replace(output, logprobs=[logprob])

    def _output(self, req: Req, token_ids: list[int], stop_token: bool = False) -> TokenOutput:
        first = not req.announced
        req.announced = True
        usage = None
        if req.finished:
            usage = Usage(prompt_tokens=req.prompt_len,
                          completion_tokens=len(req.output_ids) + int(stop_token),
                          cached_tokens=req.cached_tokens)
        return TokenOutput(
            rid=req.rid, token_ids=token_ids, finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None, usage=usage,
            error=req.error,
            prompt_tail=req.input_ids[-PROMPT_TAIL:] if first else None,
            skip_special_tokens=req.skip_special_tokens,
            stop=req.stop if first and req.stop else None,
            include_stop_str=req.include_stop_str, stop_str=req.stop_str,
            prompt_logprobs=self._prompt_logprobs(req) if first else None,
            cumulative_logprob=(req.cumulative_logprob
                                if req.finished and req.sampling.logprobs >= 0 else None))

    def _prompt_logprobs(self, req: Req) -> PromptTokenLogprobs | None:
        """A request's prompt logprobs, once it has them all (its first output)."""
        if req.sampling.prompt_logprobs < 0 or req.wants_prompt_logprobs:
            return None
        return PromptTokenLogprobs(token_ids=req.input_ids, logprobs=req.prompt_logprobs)

    # -- introspection -----------------------------------------------------------------------

    def slots_consistent(self) -> bool:
        """Every slot is free, cached, or held by exactly one running request (counts)."""
        held = sum(r.owned_slots for r in self.running.values())
        if self._spread is not None:  # ended requests of the spread prefill, holding theirs
            held += sum(r.owned_slots for r, _, _ in self._spread.held)
        return (self.allocator.num_free + self.cache.total_size + held == self.allocator.capacity
                and (self.windows is None or self.windows.consistent()))

    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(
            capacity_slots=self.allocator.capacity, used_slots=self.allocator.num_used,
            free_slots=self.allocator.num_free, running_requests=len(self.running),
            waiting_requests=len(self.waiting), prompt_tokens_total=c.prompt_tokens,
            computed_prompt_tokens_total=c.computed_prompt_tokens,
            generated_tokens_total=c.generated_tokens, finished_requests_total=c.finished,
            aborted_requests_total=c.aborted, cached_slots=self.cache.total_size,
            evictable_slots=self.cache.evictable_size, preemptions_total=c.preemptions,
            cache_hit_tokens_total=c.cache_hit_tokens, slots_consistent=self.slots_consistent(),
            window_capacity_slots=self.windows.capacity if self.windows is not None else 0,
            window_used_slots=self.windows.num_used if self.windows is not None else 0,
            window_held_slots=(sum(r.num_computed - r.sees_from for r in self.running.values())
                               if self.windows is not None else 0),
            kv_bytes_per_slot=self.limits.bytes_per_slot,
            window_kv_bytes_per_slot=self.limits.window_bytes_per_slot,
            prefill_chunk_tokens=self.limits.chunk_size,
            prefill_parts=self.limits.prefill_parts,
            decode_first_tokens=self.limits.max_prefill_tokens_while_decoding or 0,
            state_snapshots=self.limits.state_snapshots,
            state_snapshots_used=(self.limits.state_snapshots - self.cache.free_snapshots
                                  if isinstance(self.cache, SnapshotCache) else 0))


def _prefix_cache(limits: SchedulerLimits) -> RadixCache:
    if not limits.radix_cache:
        return DisabledCache()
    return SnapshotCache(limits.state_snapshots) if limits.state_snapshots else RadixCache()


def _worker_sampling(req: Req) -> SamplingParams:
    """The request's settings for the worker: a resumed request whose prompt logprobs
    are all in does not score its prompt again."""
    if req.sampling.prompt_logprobs < 0 or req.wants_prompt_logprobs:
        return req.sampling
    return msgspec.structs.replace(req.sampling, prompt_logprobs=-1)


def _error(rid: str, message: str) -> TokenOutput:
    logger.info("rejected %s: %s", rid, message)
    return TokenOutput(rid=rid, token_ids=[], finished=True, finish_reason="error", error=message)

"""The scheduler and the worker wired together in one process, for tests.

`InProcessEngine` drives the real step loops (`SchedulerLoop`, `WorkerLoop`) over
in-memory pipes instead of sockets, so overlap (two steps in flight), discarded tokens and
SyncSteps are exercised exactly as in the server, deterministically, in one thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.switch_layers import SwitchLinear

from ipc.messages.common import SamplingParams, TokenLogprob
from ipc.messages.to_detokenizer import BatchTokens, TokenOutput
from ipc.messages.to_scheduler import AbortRequest, TokenizedRequest
from scheduler_proc import SchedulerLoop
from scheduler_proc.scheduler import Scheduler, SchedulerLimits
from tests.oracle import divergence_off_a_tie
from worker_proc import WorkerLoop
from worker_proc.decode_backend import DecodeBackend, KernelDecode
from worker_proc.expert_rows import fits as expert_rows_fit, preferred as expert_rows_preferred
from worker_proc.expert_rows import dense_fits as dense_rows_fit, reference_expert_rows
from worker_proc.fused_moe import reference_combine, reference_route
from worker_proc.kv_pool import KVPool
from worker_proc.memory import probe_attention_specs
from worker_proc.own_caches import OwnCacheRunner
from worker_proc.kernel_constants import MARK_SHAPE
from worker_proc.paged_attention import reference_decode_attention, reference_latent_attention
from worker_proc.paged_prefill import paged_prefill_fits, reference_paged_prefill_attention
from worker_proc.prefill_attention import fused_builds_per_shape
from worker_proc.runner import PREFILL_PADDING, ModelRunner
from worker_proc.qk_norm_rope import reference_qk_norm_rope
from worker_proc.launcher import LaunchThread
from worker_proc.readback import Readback, ReadbackRing
from worker_proc.residual_norm import reference_add_norm, reference_residual_norm


class Pipe:
    """Sender and Receiver in one, backed by a deque (no sockets, no codec)."""

    def __init__(self) -> None:
        self.items: deque = deque()

    def send(self, message: Any) -> None:
        self.items.append(message)

    def recv(self, timeout_ms: int | None = None) -> Any:
        return self.items.popleft() if self.items else None

    def drain(self) -> list:
        out = list(self.items)
        self.items.clear()
        return out


@dataclass
class Finished:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.., when asked
    cumulative_logprob: float | None = None


def stand_in_readback_copy(dst: mx.array, src: mx.array) -> mx.array:
    """readback.cuda_copy's meaning on the CPU: src's words into dst's buffer (now, on the
    host: MLX's CPU arrays are host memory), and the one-element mark."""
    np.asarray(dst)[:src.shape[0]] = np.asarray(src)
    return mx.zeros((1,), dtype=mx.int32)


class LazyStandInRing(ReadbackRing):
    """The ring on the CPU with its copy computed with the step, as the CUDA kernel's is
    (stand_in_readback_copy writes when the step is built): the mark is the words' copy
    itself, read once computed. Like the device's buffer, it is no array a later step
    reads, so a launch thread may be launching one meanwhile."""

    def __init__(self) -> None:
        super().__init__(lambda dst, src: src + 0)

    def _words(self, readback: Readback) -> np.ndarray:
        return np.asarray(readback.done)


class InProcessEngine:
    def __init__(self, model: Any, capacity: int = 8192, max_running: int = 16,
                 chunk_size: int = 256, max_prefill_tokens: int = 1024, max_context: int = 4096,
                 radix_cache: bool = True, schedule_policy: str = "fcfs",
                 overlap: bool | str = True, tokenizer: Any = None,
                 grammars: Any = None, compile_decode: bool = False,
                 compile_prefill: bool = False, prefill_padding: float = PREFILL_PADDING,
                 backend: DecodeBackend | None = None, state_snapshots: int = 64,
                 snapshot_stride: int = 0, window_slots: int | None = None,
                 max_prefill_tokens_while_decoding: int | None = None,
                 chunk_align: int = 1, tail_bucket: int = 0,
                 steps_in_flight: int = 2, own_caches: bool = False,
                 prefill_parts: int = 1, prefix_align: int = 0,
                 decode_first_for_all: bool = False, pad_tails: int = 0,
                 readback: bool = False, launcher: LaunchThread | None = None) -> None:
        """overlap: True (deferred start, the CPU default), "ahead" (start before waiting,
        as on CUDA) or False; steps_in_flight: how many steps the scheduler keeps at the
        worker with overlap (ServerConfig.steps_in_flight). tokenizer: what the scheduler decodes stop strings with.
        grammars: the worker's GrammarMatchers, for requests with a grammar.
        prefill_padding: how much padding a shared prefill forward may carry (the CPU
        server's is 0: only chunks of one length share a forward). backend: the decode
        backend (default: the device's; StandInKernel: the CUDA path on the CPU).
        window_slots: the windowed layers' own slot space (default: half the capacity,
        as --window-ratio's default, where the worker would keep one; 0: none).
        max_prefill_tokens_while_decoding: the decode-first budget (None: one budget).
        chunk_align: where unfinished chunks end (SchedulerLimits.chunk_align);
        tail_bucket: what a prompt's last chunk after them is padded to
        (ModelRunner.tail_bucket). own_caches: the model runs on mlx-lm's own caches, a set
        a request (OwnCacheRunner: what the worker falls back to for a model it cannot
        page). prefill_parts: --prefill-spread (as the worker grants it,
        ModelRunner.prefill_parts). prefix_align: where prefix hits are cut back to and
        last chunks starting there are padded to tail_bucket's next edge (a spread's
        PrefillChunking.hit_align; 0: chunk_align). decode_first_for_all: every decoding
        stream held to the decode-first budget (--fixed-decode-first-budget), not only
        those decoding well before the waiting prompts arrived. pad_tails: a lone chunk
        padded to a multiple of this (ModelRunner.pad_tails, the CUDA path's default).
        readback: a step's results read back through a ReadbackRing (the CUDA worker's
        default), its device copy stood in for (stand_in_readback_copy). launcher: the
        thread the runner's launches go through (the CUDA worker's default; its stream
        must be the caller's default), with a LazyStandInRing as the ring."""
        specs = [] if own_caches else probe_attention_specs(model)
        if window_slots is None:
            recurrent = KVPool.state_bytes_per_request(specs) > 0
            window_slots = capacity // 2 if KVPool.windows(specs) and not recurrent else 0
        self.pool = KVPool(specs, capacity, backend, state_rows=max_running,
                           snapshots=state_snapshots if radix_cache else 0,
                           window_slots=window_slots)
        runner = OwnCacheRunner if own_caches else ModelRunner
        self.runner = runner(model, self.pool, max_running, max_context, grammars,
                             prefill_padding=prefill_padding, compile_decode=compile_decode,
                             compile_prefill=compile_prefill, tail_bucket=tail_bucket)
        self.runner.tail_starts = prefix_align
        if pad_tails:  # where the runner can, as the worker asks on the CUDA path
            self.runner.pad_tails(pad_tails)
        if readback:
            self.runner.readback = ReadbackRing(stand_in_readback_copy)
        if launcher is not None:
            self.runner.readback, self.runner.launcher = LazyStandInRing(), launcher
        # As the worker tells the scheduler (WorkerReady): a model with recurrent layers
        # caches prefixes only where it keeps state snapshots (one on its own caches never).
        radix_cache = radix_cache and self.runner.serves_prefix_hits
        self.scheduler = Scheduler(SchedulerLimits(capacity, max_context, max_running, chunk_size,
                                                   max_prefill_tokens, radix_cache, schedule_policy,
                                                   self.pool.num_snapshots, snapshot_stride,
                                                   self.pool.window_slots,
                                                   tuple(self.pool.window_kinds),
                                                   max_prefill_tokens_while_decoding=(
                                                       max_prefill_tokens_while_decoding),
                                                   chunk_align=chunk_align,
                                                   prefix_align=prefix_align,
                                                   prefill_parts=self.runner.prefill_parts(
                                                       prefill_parts),
                                                   decode_first_for_all=decode_first_for_all),
                                   (lambda: tokenizer) if tokenizer is not None else None)
        self.to_scheduler, self.to_worker, self.to_detokenizer = Pipe(), Pipe(), Pipe()
        self.loop = SchedulerLoop(self.scheduler, self.to_scheduler, self.to_worker,
                                  self.to_detokenizer,
                                  max_in_flight=steps_in_flight if overlap else 1)
        self.worker = WorkerLoop(self.runner, self.to_scheduler, overlap=bool(overlap),
                                 start_ahead=overlap == "ahead")
        self.results: dict[str, Finished] = {}
        self.steps = 0

    def submit(self, rid: str, prompt: list[int], max_tokens: int, eos: list[int],
               **sampling: Any) -> None:
        msg = TokenizedRequest(rid=rid, input_ids=prompt, stop_token_ids=eos,
                               sampling=SamplingParams(max_new_tokens=max_tokens,
                                                       **{"temperature": 0.0, **sampling}))
        self.submit_message(msg)

    def submit_message(self, msg: TokenizedRequest) -> None:
        """A request as the tokenizer process would send it (e.g. from RequestPreparer)."""
        rid = msg.rid
        self.results[rid] = Finished()
        self.to_scheduler.send(msg)
        self._turn_scheduler(plan=False)

    def abort(self, rid: str) -> None:
        self.to_scheduler.send(AbortRequest(rid=rid))
        self._turn_scheduler(plan=False)

    def step(self) -> bool:
        """One scheduler turn and one worker turn; False once nothing moves any more."""
        before = self.scheduler._step
        self._turn_scheduler(plan=True)
        self.steps += self.scheduler._step - before
        moved = bool(self.to_worker.items)
        while self.to_worker.items:
            self.worker.handle(self.to_worker.recv())
        return moved or bool(self.loop.in_flight) or bool(self.to_scheduler.items)

    def run_until_idle(self, max_steps: int = 100_000) -> dict[str, Finished]:
        for _ in range(max_steps):
            if not self.step():
                break
        return self.results

    def _turn_scheduler(self, plan: bool) -> None:
        if plan:
            self.loop.run_once()
        else:  # only take the messages in, as the server does between steps
            outputs: list[TokenOutput] = []
            for message in self.to_scheduler.drain():
                self.loop.handle(message, outputs)
            if outputs:
                self.to_detokenizer.send(BatchTokens(outputs=outputs))
        for batch in self.to_detokenizer.drain():
            for out in batch.outputs:
                r = self.results[out.rid]
                r.token_ids += out.token_ids
                r.logprobs += out.logprobs or []
                if out.prompt_logprobs is not None:
                    r.prompt_logprobs = out.prompt_logprobs.logprobs
                if out.finished:
                    r.finish_reason, r.error = out.finish_reason, out.error
                    r.cumulative_logprob = out.cumulative_logprob


def assert_greedy(engine: InProcessEngine, prompts: list[list[int]], max_tokens: int,
                  eos: list[int], want: Any, ties_of: Any = None) -> dict[str, Finished]:
    """Submit the prompts together (as r0, r1, ...), run them to the end and check each
    request's tokens are want(prompt, max_tokens) (an oracle's); returns the results.
    ties_of: the oracle's model, for engines that round differently from it (fused
    matmuls): their tokens may then leave the oracle's at a near-tie only."""
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, max_tokens, eos)
    results = engine.run_until_idle()
    for i, p in enumerate(prompts):
        expected, got = want(p, max_tokens), results[f"r{i}"].token_ids
        if ties_of is not None:
            problem = divergence_off_a_tie(ties_of, p, got, expected, eos)
            assert problem is None, f"r{i}: {problem}"
        else:
            assert got == expected, f"r{i}: {got} != {expected}"
    return results


class StandInKernel(KernelDecode):
    """On the CPU, the CUDA kernel backend's decode path (no kept dense contexts; compiled
    decode allowed; a scatter-written pool) with the kernel's plain-MLX meaning in its
    place. A quantized router keeps its quantized matmul (its dense weight rounds
    otherwise: fused_moe.router_logits, tested apart)."""

    in_place = False
    dense_routers = False

    def _attend(self, q, pool, table, lengths, scale, written, sinks):  # noqa: ANN001, ANN202
        return reference_decode_attention(q, pool, table, lengths, scale, written, sinks)

    def _latent_attend(self, q, pool, table, lengths, bias, scale, written):  # noqa: ANN001, ANN202
        return reference_latent_attention(q, pool, table, lengths, bias, scale, written)

    def _paged_prefill(self, q, pool, table, starts, scale, written, window, sinks):  # noqa: ANN001, ANN202
        return reference_paged_prefill_attention(q, pool, table, starts, scale, written, window,
                                                 sinks)

    def _paged_prefill_takes(self, dtype, pool_dtype, key_dim, value_dim):  # noqa: ANN001, ANN202
        # The tests' float32 stands in for the GPU's bfloat16: the heads' sizes decide.
        bf16 = lambda d: mx.bfloat16 if d == mx.float32 else d  # noqa: E731
        return paged_prefill_fits(bf16(dtype), bf16(pool_dtype), key_dim, value_dim)

    def _qk_norm_rope(self, qkv, heads, lengths, scale, eps, rope):  # noqa: ANN001, ANN202
        return reference_qk_norm_rope(qkv, heads, lengths, scale, eps, rope)

    def _residual_norm(self, branch, residual, weight, eps, next_weight):  # noqa: ANN001, ANN202
        return reference_residual_norm(branch, residual, weight, eps, next_weight)

    def _add_norm(self, branch, bias, residual, weight, eps):  # noqa: ANN001, ANN202
        return reference_add_norm(branch, bias, residual, weight, eps)

    def _route_experts(self, logits, routing, bias):  # noqa: ANN001, ANN202
        return reference_route(logits, routing, bias)

    def _combine_experts(self, down, routed, bias, out_dims, residual, next_norm):  # noqa: ANN001, ANN202
        return reference_combine(down, routed, bias, out_dims, residual, next_norm)

    def _expert_rows(self, module, x, experts, tokens):  # noqa: ANN001, ANN202
        return reference_expert_rows(module, x, experts, tokens)

    def _expert_rows_takes(self, module, x, pairs):  # noqa: ANN001, ANN202
        # The tests' float32 stands in for the GPU's bfloat16: the weights' format decides,
        # float32 experts' weights standing for bfloat16 ones.
        dtype = mx.bfloat16 if x.dtype == mx.float32 else x.dtype
        if type(module) is SwitchLinear and module["weight"].dtype == mx.float32:
            fit = dense_rows_fit(x.shape[-1], module["weight"].shape[-1])
        else:
            fit = expert_rows_fit(module, x.shape[-1], dtype)
        return fit and expert_rows_preferred(module, pairs)

    def _fused_builds_per_shape(self, queries, values):  # noqa: ANN001, ANN202
        # The tests' float32 stands in for the GPU's bfloat16: the heads' sizes decide.
        return fused_builds_per_shape(mx.bfloat16, queries.shape[-1], values.shape[-1])


@dataclass(frozen=True)
class PagedPrefillCall:
    """One call of the stood-in paged prefill kernel: its rows' queries, the layer's
    window (0: full attention), whether it had sinks."""

    queries: int
    window: int
    sinks: bool


def record_paged_prefill(backend: StandInKernel) -> list[PagedPrefillCall]:
    """The backend's later calls of its stood-in paged prefill kernel, as they happen."""
    calls: list[PagedPrefillCall] = []
    attend = backend._paged_prefill

    def recorded(q, pool, table, starts, scale, written, window, sinks):  # noqa: ANN001, ANN202
        calls.append(PagedPrefillCall(q.shape[2], window, sinks is not None))
        return attend(q, pool, table, starts, scale, written, window, sinks)

    object.__setattr__(backend, "_paged_prefill", recorded)  # a frozen dataclass
    return calls


def _mark_of(written: mx.array) -> mx.array:
    """A zero mark that, as a kernel's, is only computed with the write: a step's landing
    then does the write (step inputs it read may be rewritten later, see HostStaging)."""
    return mx.depends(mx.zeros(MARK_SHAPE, dtype=mx.int32), written)


class StandInInPlaceKernels(StandInKernel):
    """On the CPU, the CUDA path with an in-place pool (eager decode only): the write and
    write-and-attend kernels (and the state rows' write) stood in by plain-MLX scatters
    into the array object (what KVPool.layers / .states hold), returning a zero mark as
    the kernels do; the fused q/k/v
    kernel's RoPE by mx.fast.rope at each row's position."""

    in_place = True

    def write_rows(self, layer, slots, keys, values, after):  # noqa: ANN001, ANN201
        b, h, s, _ = keys.shape
        rows = mx.concatenate([keys.swapaxes(1, 2), values.swapaxes(1, 2)], axis=-1)
        layer[slots] = rows.reshape(b * s, h, -1).astype(layer.dtype)
        return _mark_of(layer)

    def write_state_rows(self, state, rows, value, after):  # noqa: ANN001, ANN201
        state[rows] = value.astype(state.dtype)
        return _mark_of(state)

    def _write_attend(self, q, keys, values, slots, pool, table, lengths, scale, after,  # noqa: ANN001, ANN202
                      sinks=None):  # noqa: ANN001
        mark = self.write_rows(pool, slots, keys, values, after)
        return reference_decode_attention(q, pool, table, lengths, scale, mark, sinks), mark

    def _qkv_attend(self, qkv, n_q, rope, slots, pool, table, lengths, scale, after):  # noqa: ANN001, ANN202
        b, n_kv = qkv.shape[0], pool.shape[1]
        dim = qkv.shape[-1] // (n_q + 2 * n_kv)
        heads = qkv.reshape(b, 1, n_q + 2 * n_kv, dim).transpose(0, 2, 1, 3)
        q, keys = (rope.apply(x, lengths - 1)  # the kernel's RoPE, at each row's position
                   for x in (heads[:, :n_q], heads[:, n_q:n_q + n_kv]))
        out, mark = self._write_attend(q, keys, heads[:, n_q + n_kv:], slots, pool, table,
                                       lengths, scale, after)
        return out.transpose(0, 2, 1, 3).reshape(b, 1, n_q * dim), mark

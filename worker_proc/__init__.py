"""Worker process: loads the model with mlx-lm, owns the KV pool, runs the step plans."""

from __future__ import annotations

import logging
import time
from collections import deque
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ipc.channel import Receiver, Sender
from ipc.config import ServerConfig, switch_on
from ipc.messages.to_scheduler import StepResult, WorkerReady
from ipc.messages.to_worker import ForwardBatch, Shutdown, SyncSteps, WorkerMessage
from ipc.process import StartupReporter, setup_child
from worker_proc.device_lost import DeviceLost, device_lost
from worker_proc.step_stats import PHASES, HostClock, StepStats, Timer
from worker_proc.watchdog import StepWatchdog

if TYPE_CHECKING:
    from worker_proc.decode_backend import DecodeBackend
    from worker_proc.launcher import LaunchThread
    from worker_proc.grammar import GrammarMatchers
    from worker_proc.memory import DevicePool
    from worker_proc.own_caches import OwnCacheRunner
    from worker_proc.readback import ReadbackRing
    from worker_proc.runner import ModelRunner, PendingStep

logger = logging.getLogger(__name__)

_SUMMARY_POLL_MS = 1000
# The narrower shared prefill probe's prompts (fit_prefill_forwards): a burst of chat
# prompts is mostly tens to a few hundred tokens each.
SHARED_PROBE_WIDTH = 64


def build_runner(config: ServerConfig, reporter: StartupReporter | None = None):
    """Load the model and size the pool; returns the runner (split out for tests)."""
    return build_worker(config, reporter)[0]


def build_worker(config: ServerConfig, reporter: StartupReporter | None = None
                 ) -> tuple[ModelRunner, PrefillChunking]:
    """Load the model, size the pool and warm up: the runner, and how its prompts are cut
    into chunks (--prefill-spread resolved), which the scheduler learns of. On CUDA,
    MLX's kernels compiled meanwhile are kept in kiln's cache and reported as they come."""
    from worker_proc.demo_model import default_cache_root
    from worker_proc.kernel_cache import CompileWatch, keep_kernels
    from worker_proc.layer_kinds import UnsupportedModelError
    from worker_proc.paged_attention import kernel_available

    say = reporter.progress if reporter else logger.info
    if not kernel_available():
        if config.parallel_kernel_compiles == "on":
            raise UnsupportedModelError("--parallel-kernel-compiles on: only MLX's CUDA backend "
                                        "compiles its quantized kernels at first use")
        return _build_worker(config, say)
    kernels = keep_kernels(default_cache_root())  # before MLX's first compile
    if kernels is None:
        if config.parallel_kernel_compiles == "on":
            say("--parallel-kernel-compiles on: skipped, kiln's kernel cache could not be "
                "made (the warm-up compiles the kernels one after another)")
        return _build_worker(config, say)
    with CompileWatch(kernels, logger.info) as watch:  # a log line: thread-safe
        built = _build_worker(config, say, kernels)
    say(watch.count.summary())
    return built


def _expert_rows_experiments(model: Any, experiments: frozenset[str],
                             say: Callable[[str], None]) -> None:
    """Say what the experts' kernel's experiments take; refuse them for a model with
    nothing they take."""
    from worker_proc.expert_rows import (bf16_expert_layers, bf16_linear_layers,
                                         kernel_rows_layers)
    from worker_proc.layer_kinds import UnsupportedModelError

    # experiment: its count of what it takes, what a model without any lacks, what it says
    rules = (("quantized-rows-kernel", kernel_rows_layers,
              "4-bit quantized Linear layer the kernel takes (MXFP4 in groups of 32, or affine "
              "in groups of 32, 64 or 128 with bfloat16 scales)",
              "4-bit Linear layers: decode steps' rows through the experts' kernel"),
             ("bf16-expert-rows", bf16_expert_layers, "bfloat16 GPT-OSS or Qwen3-MoE experts",
              "blocks' bfloat16 experts: sorted decode steps through the experts' kernel"),
             ("bf16-rows-kernel", bf16_linear_layers,
              "bfloat16 Linear layer the kernel takes (inputs a multiple of 8)",
              "bfloat16 Linear layers: decode steps' rows through the experts' kernel (not "
              "the o and down projections' GEMMs with their residual add)"))
    for name, count, lacking, takes in rules:
        if name not in experiments:
            continue
        if not (taken := count(model)):
            raise UnsupportedModelError(f"--experiments {name}: the model has no {lacking}")
        say(f"{taken} {takes}")


def _build_worker(config: ServerConfig, say: Callable[[str], None], kernels: Path | None = None
                  ) -> tuple[ModelRunner, PrefillChunking]:
    """build_worker's work; kernels: the CUDA kernel cache kiln keeps (None: none)."""
    import mlx.core as mx
    import mlx_lm

    from kiln_common.windows import WindowRule
    from worker_proc.decode_backend import choose_decode_backend, kernel_misfit
    from worker_proc.prefill_attention import prefill_bucket_for
    from worker_proc.decode_block import FastDecodeBlock
    from worker_proc.expert_padding import TILE as EXPERT_TILE
    from worker_proc.gated_delta_cuda import install_gated_delta_kernel, uses_gated_delta
    from worker_proc.kernel_precompile import compile_quantized_kernels
    from worker_proc.kv_pool import KVPool
    from worker_proc.layer_kinds import UnsupportedModelError, describe_layers
    from worker_proc.memory import pool_spaces, probe_attention_specs, raise_cuda_graph_budgets
    from worker_proc.model_rewrites import rewrite_for_serving
    from worker_proc.paged_attention import kernel_available
    from worker_proc.prefill_parts import most_parts, spread_refusal
    from worker_proc.runner import (CPU_PREFILL_PADDING, PREFILL_PADDING, TAIL_MULTIPLE, ModelRunner,
                                    split_model)
    from worker_proc.warm_up import trace_decode_shapes, warm_up

    on_cuda = kernel_available()
    on_cpu = mx.default_device() == mx.cpu
    if config.compile_prefill and on_cpu:
        # Graph building is well under 1% of a CPU prefill forward: nothing to save.
        raise UnsupportedModelError("--compile-prefill: the CPU builds every prefill forward "
                                    "(its prefill is compute-bound); drop the flag")
    launcher = launch_thread(config.experiment_set, on_cuda)  # before anything is built
    budgets = raise_cuda_graph_budgets()  # before the model touches the GPU
    if budgets:
        say("CUDA graph budgets: " + ", ".join(f"{k}={v}" for k, v in budgets.items()))
    t0 = time.monotonic()
    say(f"loading model from {config.model_path}")
    model, tokenizer = mlx_lm.load(config.model_path, trust_remote_code=config.trust_remote_code,
                                   tokenizer_config={"trust_remote_code": config.trust_remote_code})
    if config.adapter_path:
        apply_adapters(model, config.adapter_path)
        say(f"adapters from {config.adapter_path}: {describe_adapters(model)}")
    try:
        specs = probe_attention_specs(model)  # refuses layer kinds the pool cannot hold
    except UnsupportedModelError as exc:
        say(f"not paged ({exc}): served through mlx-lm's own caches, one request a forward, "
            "no prefix cache (slower)")
        paged_only = [flag for flag, on in (
            ("--fast-decode-blocks on", config.fast_decode_blocks == "on"),
            ("--experiments", bool(config.experiment_set)),
            ("--compile-prefill", config.compile_prefill)) if on]
        if paged_only:
            raise UnsupportedModelError(f"{', '.join(paged_only)}: this model runs on mlx-lm's "
                                        f"own caches, not kiln's pool ({exc})") from None
        runner = own_cache_runner(config, model, tokenizer, say)
        return runner, prefill_chunking(config, runner.pool.backend, runner.pool.specs)
    say("layers: " + describe_layers([s.describe() for s in specs]))
    fuse = switch_on(config.fuse_projections, auto=on_cuda)
    fast_blocks = switch_on(config.fast_decode_blocks, auto=fuse and on_cuda)
    done = rewrite_for_serving(
        model, on_cuda=on_cuda, fuse=fuse, fast_blocks=fast_blocks,
        pad_experts=on_cuda and "unpadded-experts" not in config.experiment_set,
        flat_rows=on_cuda and "batched-quantized-rows" not in config.experiment_set,
        rows_kernel=on_cuda and "quantized-rows-kernel" in config.experiment_set,
        dense_rows_kernel=on_cuda and "bf16-rows-kernel" in config.experiment_set)
    if done.padded_experts:
        say(f"{done.padded_experts} quantized experts' projections padded to whole "
            f"{EXPERT_TILE}-row tiles (MLX's grouped kernel for rows sorted by expert)")
    if not done.fast_blocks and config.fast_decode_blocks == "on":
        raise UnsupportedModelError("--fast-decode-blocks on: the model has no llama, qwen2, "
                                    "Gemma 3 or GPT-OSS block (mlx_lm.models.llama, .qwen2, "
                                    ".gemma3_text, .gpt_oss) to speed up")
    # The other experiments are the attention kernel's and its prefill's: any model.
    if "rope-in-kernel" in config.experiment_set and not any(
            isinstance(m, FastDecodeBlock) for _, m in model.named_modules()):
        raise UnsupportedModelError("--experiments rope-in-kernel: the model has no llama or "
                                    "qwen2 block (mlx_lm.models.llama, .qwen2) to speed up")
    _expert_rows_experiments(model, config.experiment_set, say)
    if done.summed_norms:
        say(f"{done.summed_norms} RMSNorms scale by 1 + weight: the sum made once, not every call")
    if done.placed_layers:
        say(f"{done.placed_layers} attention layers place each row's queries at its own "
            "positions (rows of different lengths share a forward)")
    if done.flat_quantized:
        say(f"{done.flat_quantized} quantized Linear layers take a step's rows as one matrix")
    if done.convs:
        say(f"{done.convs} short convolutions as shifted multiply-adds (no cuDNN graph per shape)")
    say(f"model loaded in {time.monotonic() - t0:.1f}s")
    if kernels is not None and config.parallel_kernel_compiles != "off":
        compile_quantized_kernels(model, kernels, say)
    if uses_gated_delta(model) and install_gated_delta_kernel():
        say("gated delta rule (linear attention): kiln's CUDA kernel")
    # Decode first's prefill, whole or spread over steps (a model's blocks at most).
    split = split_model(model)
    refusal = spread_refusal(split, len(specs), KVPool.state_bytes_per_request(specs) > 0)
    parts = config.spread_parts(on_cuda, most_parts(split, refusal))
    backend = choose_decode_backend(  # the one choice
        specs, config.experiment_set,
        prefill_bucket_for(config.decode_first_tokens(parts)))
    # Why not the kernel, only where it is not the choice (choose_decode_backend asked).
    misfit = kernel_misfit(specs) if on_cuda and not backend.in_place else None
    say(f"decode attention: {backend.name}" + (
        f", experiments {', '.join(sorted(config.experiment_set))}" if config.experiment_set else "")
        + (f" (not the CUDA kernel: {misfit})" if misfit else ""))
    if latent := backend.latent_path(specs):
        say(f"latent (MLA) layers decode through {latent}")
    context = served_context(config, _hf_tokenizer(tokenizer))
    per_slot = KVPool.bytes_per_slot(specs)
    kept = backend.kept_share
    per_state = KVPool.state_bytes_per_request(specs)
    snapshots = config.state_snapshots if per_state and not config.disable_radix_cache else 0
    states = per_state * (config.max_running_requests + snapshots)
    # Windowed layers get a space of their own (positions behind every window give their
    # slots back), except beside recurrent layers, whose prefix hits need state snapshots
    # (a window tail is not kept with them).
    windows = [] if per_state else KVPool.windows(specs)
    per_window = KVPool.window_bytes_per_slot(specs) if windows else 0
    chunking = prefill_chunking(config, backend, specs, parts)
    say(f"prefill chunks of up to {chunking.size} tokens")
    floor = (WindowRule(tuple(windows)).most_held(context, context, chunking.size)
             if windows else 0)
    # A backend keeping dense decode contexts keeps up to `kept` of the pool's size again.
    slots, window_slots = pool_spaces(config, int(per_slot * (1 + kept)),
                                      int(per_window * (1 + kept)), context,
                                      reserved_bytes=states, window_floor=floor,
                                      most_slots=KVPool.most_slots(specs))
    pool = KVPool(specs, slots, backend, state_rows=config.max_running_requests,
                  snapshots=snapshots, window_slots=window_slots)
    cache_limit = cuda_cache_limits(config.experiment_set, say)
    if states:
        say(f"recurrent states: {states / 2**20:.1f} MiB for {config.max_running_requests} "
            f"requests and {snapshots} prompt-end snapshots")
    if pool.window_slots:
        say(f"windowed layers ({', '.join(f'{k} {n}' for k, n in windows)}): their own "
            f"{pool.window_slots} slots ({per_window} bytes each, full layers "
            f"{per_slot - per_window})")
    say(f"KV pool: {slots} slots, {pool.nbytes / 2**20:.1f} MiB"
        + (f" (+ up to {pool.nbytes * kept / 2**20:.1f} MiB of kept decode contexts)" if kept else ""))
    hf = _hf_tokenizer(tokenizer)
    grammars = grammar_matchers(config, hf)
    padding = config.prefill_padding_share
    if padding is None:
        padding = CPU_PREFILL_PADDING if on_cpu else PREFILL_PADDING
    runner = ModelRunner(model, pool, config.max_running_requests, min(context, slots), grammars,
                         prefill_padding=padding,
                         compile_decode=not config.eager_decode and backend.compiles,
                         compile_prefill=config.compile_prefill,
                         tail_bucket=chunking.tail_bucket)
    if on_cuda and "array-readback" not in config.experiment_set:
        runner.readback = readback_ring(say)
    if backend.pad_tails and runner.pad_tails(TAIL_MULTIPLE):
        say(f"a step's lone prompt chunk runs padded to a multiple of {TAIL_MULTIPLE} tokens")
    if backend.mixed_forward:
        if not runner.mixes_rows:
            raise UnsupportedModelError(
                "--experiments mixed-forward: needs every block a llama or qwen2 block with "
                "fused projections and the fast decode call (mlx_lm.models.llama, .qwen2), "
                "every layer full attention, and an output head")
        say("a step's lone prompt chunk rides in its decode rows' forward (mixed-forward)")
    if chunking.parts > 1:
        if runner.tail_bucket:
            runner.tail_bucket, runner.tail_starts = chunking.tail_bucket, chunking.hit_align
        edges = f"; chunks end on multiples of {chunking.align}" if chunking.align > 1 else ""
        say(f"decode first: {chunking.decode_first} prompt tokens a step, spread over "
            f"{chunking.parts} steps (--prefill-spread{edges})")
    else:
        say(f"decode first: {chunking.decode_first} prompt tokens a step")
        if config.prefill_spread > 1 or (refusal and config.spread_parts(on_cuda, 2) > 1):
            logger.log(logging.WARNING if config.prefill_spread > 1 else logging.INFO,
                       "--prefill-spread unused: this model's prefill forwards run whole "
                       "(%s)", refusal or "it has one block")
    hits = runner.serves_prefix_hits and not config.disable_radix_cache
    t0 = time.monotonic()
    steps = warm_up(runner, config.max_running_requests, long_chunk=chunking.size,
                    walk_chunk=chunking.warm_walk, walk_edge=chunking.align,
                    walk_offsets=chunking.walk_offsets() if hits else (),
                    tail_top=min(chunking.size, chunking.decode_first * chunking.parts))
    traces = trace_decode_shapes(runner, config.max_running_requests) if runner.compiles_decode else 0
    if cache_limit is not None:  # CUDA: device memory figures
        fit_prefill_forwards(runner, steps + 1, cache_limit, chunking.size, say)
    if runner.prefill_forwards.compiles:
        say("prefill forwards of a shape met before replay mx.compile traces")
    if launcher is not None and runner.readback is not None:
        runner.launcher = launcher
        say("steps are launched from a thread of their own while the next is built")
    elif launcher is not None:
        # Its steps' results would be read from arrays a launching step may use.
        logger.warning("steps are launched from the worker's own thread: no readback ring")
    say(f"warmed up ({steps} steps{f', {traces} more decode traces' if traces else ''}, "
        f"{time.monotonic() - t0:.1f}s)")
    start_grammars(grammars, hf)
    return runner, chunking


def cuda_cache_limits(experiments: frozenset[str], say: Callable[[str], None]) -> int | None:
    """On CUDA, bound MLX's buffer cache (memory.bound_cuda_cache; --experiments
    wide-cache: a wider share) and return the bound, or None off CUDA, where the memory
    experiments are refused."""
    from worker_proc.layer_kinds import UnsupportedModelError
    from worker_proc.memory import CUDA_CACHE_SHARE, WIDE_CUDA_CACHE_SHARE, bound_cuda_cache

    wide = "wide-cache" in experiments
    limit = bound_cuda_cache(WIDE_CUDA_CACHE_SHARE if wide else CUDA_CACHE_SHARE)
    if limit is None:
        if named := sorted(experiments & MEMORY_EXPERIMENTS):
            raise UnsupportedModelError(f"--experiments {', '.join(named)}: CUDA's memory only")
        return None
    say(f"MLX buffer cache capped at {limit / 2**30:.1f} GiB")
    return limit


def launch_thread(experiments: frozenset[str], on_cuda: bool) -> "LaunchThread | None":
    """The thread the runner's launches go through, its stream made this thread's default
    (CUDA; --experiments inline-launch, or array-readback, whose reads of a step's arrays
    could meet a launch: none). Off CUDA none: MLX's CPU launch returns only once a step
    is nearly computed, so there is no launch to hide."""
    if not on_cuda or experiments & {"inline-launch", "array-readback"}:
        return None
    import mlx.core as mx

    from worker_proc.launcher import LaunchThread

    launcher = LaunchThread()
    mx.set_default_stream(launcher.stream)
    return launcher


def readback_ring(say: Callable[[str], None]) -> "ReadbackRing | None":
    """A ring the steps' tokens are read back through (CUDA; --experiments array-readback:
    none), where the host reads what the device copies there; else None, with a warning."""
    from worker_proc.readback import ReadbackRing, reads_back_here

    if not reads_back_here():
        logger.warning("a step's tokens are read from their arrays: the host does not read "
                       "what the device writes into MLX's managed buffers here")
        return None
    say("a step's tokens are read back through a ring of managed buffers")
    return ReadbackRing()


# --experiments names about CUDA's memory, not a kernel: refused elsewhere.
MEMORY_EXPERIMENTS = frozenset({"wide-cache", "array-readback"})


def fit_prefill_forwards(runner: "ModelRunner", step: int, cache_limit: int, chunk: int,
                         say: Callable[[str], None]) -> None:
    """Measure what prefill forwards hold and bound them by the device memory left beside
    the pool (memory.prefill_room): the shared forwards' caps (ModelRunner.forward_cap),
    and the room ModelRunner._launch_prefill keeps two forwards in flight within. Probes:
    a lone prompt of a chunk's length and, where forwards are shared, fresh prompts
    SHARED_PROBE_WIDTH tokens long and one token short of FUSED_PREFILL_BUCKET, the most
    a shared forward's attention takes unfused (decode_backend._short_fresh_prompts):
    their scores grow with the width, so a forward of short prompts may take more tokens
    than one of long ones. An H100 ran out of memory in a burst of short prompts with
    two 2,048-token forwards beside a pool of 60% of the free memory
    (docs/benchmarks.md, session 40)."""
    from worker_proc.memory import available_memory_bytes, prefill_room
    from worker_proc.kv_pool import attention_specs
    from worker_proc.prefill_attention import FUSED_PREFILL_BUCKET, UNFUSED_SCORES_MAX_BYTES
    from worker_proc.runner import PrefillMemory
    from worker_proc.warm_up import probe_prefill_bytes, probe_space

    space = probe_space(runner)
    longest = min(chunk, space, runner.max_context)
    if longest < 1:
        return
    widest = max(1, min(FUSED_PREFILL_BUCKET, runner.max_context + 1) - 1)
    heads = max((s.query_heads for s in attention_specs(runner.pool.specs)), default=1)
    shared: list[tuple[int, float]] = []
    try:
        lone = probe_prefill_bytes(runner, step, [longest])
        for width in sorted({min(SHARED_PROBE_WIDTH, widest), widest}):
            n = min(runner.prefill_forward_tokens // width, space // width,
                    runner.table.shape[0],
                    UNFUSED_SCORES_MAX_BYTES // (max(heads, 1) * width * width * 4))
            if runner.shares_prefill and n >= 2:
                step += 2
                measured = probe_prefill_bytes(runner, step, [width] * n)
                # Never fewer bytes for wider prompts (a noisy narrow probe would tilt the
                # line down and understate wider forwards).
                shared.append((width, max([measured, *(b for _, b in shared)])))
    except RuntimeError as exc:
        if "out of memory" not in str(exc):
            raise
        raise RuntimeError(f"the device ran out of memory in a start-up prefill forward of up "
                           f"to {max(longest, runner.prefill_forward_tokens)} tokens beside the "
                           "KV pool: lower --mem-fraction (or --chunked-prefill-size)") from exc
    room = prefill_room(available_memory_bytes(), cache_limit)
    runner.set_prefill_memory(PrefillMemory(room=room, lone=lone, shared=tuple(shared)))
    caps = "; ".join(f"{runner.forward_cap(w)} of {w}-token prompts ({b / 2**20:.1f} MiB a "
                     "token)" for w, b in shared)
    say(f"prefill forwards of up to {runner.forward_cap(1)} tokens, two within "
        f"{room / 2**30:.1f} GiB (shared: {caps or 'none'}; lone prompts "
        f"{lone / 2**20:.1f} MiB a token)")


def served_context(config: ServerConfig, hf: object) -> int:
    """The context length served: the front's limit too (the same reading of
    config.json: a model whose mlx-lm args nest it, text_config, would otherwise get a
    limit of its own here)."""
    from kiln_common.model_info import read_json, served_context_len

    return served_context_len(read_json(Path(config.model_path) / "config.json"), hf,
                              config.context_length)


def start_grammars(grammars: GrammarMatchers, hf: object) -> None:
    """Start building structured output's matchers, once the warm-up is done: building
    holds the GIL (about half a second on a 150k vocabulary), which delayed the warm-up's
    graph building, hence readiness, as much. A tokenizer llguidance can't use builds
    nothing: the front refuses every grammar."""
    from kiln_common.llguidance_tokenizer import structured_output_supported

    if structured_output_supported(hf):
        grammars.start_building()


def apply_adapters(model: object, path: str) -> None:
    """What mlx_lm.load(adapter_path=path) does after loading the model; adapters that do
    not fit it are refused (UnsupportedModelError: the launcher's last line says why)."""
    from mlx_lm.tuner.utils import load_adapters

    from worker_proc.layer_kinds import UnsupportedModelError

    try:
        load_adapters(model, path)  # type: ignore[arg-type]
    # Whatever fails here is the adapter directory's fault (a config missing a key, a
    # file that is no safetensors, shapes of another model), never the server's.
    except Exception as exc:  # noqa: BLE001
        raise UnsupportedModelError(
            f"--adapter-path {path}: {type(exc).__name__}: {exc}") from None
    model.eval()  # type: ignore[attr-defined]


def describe_adapters(model: object) -> str:
    """What mlx-lm's load_adapters made of the model: how many projections of each adapter
    kind ("full" fine-tunes replace weights and add no module)."""
    from collections import Counter

    kinds = Counter(type(m).__name__ for _, m in model.named_modules()  # type: ignore[attr-defined]
                    if "lora_a" in m and "lora_b" in m)
    if not kinds:
        return "weights replaced (a full fine-tune)"
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) + (
        " (kept apart from the weights: their projections leave the fused fast path)")


def own_cache_runner(config: ServerConfig, model: object, tokenizer: object,
                     say: Callable[[str], None]) -> "OwnCacheRunner":
    """The runner for a model kiln cannot page (worker_proc.own_caches): its token budget
    from what its caches grow by a token."""
    from worker_proc.decode_backend import GatherDecode
    from worker_proc.kv_pool import KVPool
    from worker_proc.memory import pool_slots
    from worker_proc.own_caches import OwnCacheRunner, cache_bytes
    from worker_proc.warm_up import warm_up

    hf = _hf_tokenizer(tokenizer)
    context = served_context(config, hf)
    size = cache_bytes(model)
    slots = pool_slots(config, size.per_token, context,
                       reserved_bytes=size.per_request * config.max_running_requests)
    say(f"caches: about {size.per_token} bytes a token and {size.per_request} a request; "
        f"a budget of {slots} tokens")
    # The plain backend: no pool layer for a kernel to read or write in place.
    pool = KVPool([], slots, GatherDecode(), state_rows=config.max_running_requests)
    grammars = grammar_matchers(config, hf)
    runner = OwnCacheRunner(model, pool, config.max_running_requests, min(context, slots),
                            grammars, size.per_token)
    t0 = time.monotonic()
    steps = warm_up(runner, config.max_running_requests)
    say(f"warmed up ({steps} steps, {time.monotonic() - t0:.1f}s)")
    start_grammars(grammars, hf)
    return runner


def _hf_tokenizer(tokenizer: object) -> object:
    return getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps it


def grammar_matchers(config: ServerConfig, hf: object) -> GrammarMatchers:
    """Structured output's matchers, over the Hugging Face tokenizer with the EOS ids the
    tokenizer process stops on (config, generation config, tokenizer). Nothing is built
    yet (build_runner starts that)."""
    from kiln_common.llguidance_tokenizer import ll_tokenizer
    from kiln_common.model_info import load_model_info
    from worker_proc.grammar import GrammarMatchers

    def make() -> object:
        info = load_model_info("", config.model_path, hf)
        return ll_tokenizer(hf, info.eos_token_ids)

    return GrammarMatchers(make)


class WorkerLoop:
    """Runs step plans, keeping the next step's host work off the device's critical path.

    With overlap, step N+1's graph (fed by step N's still-lazy tokens) is built while
    step N computes, so the scheduler's bookkeeping and the worker's graph building hide
    behind the device. Then either
    - start_ahead (pools written in place: the CUDA backend): N+1 is started before the
      worker blocks on N, so the device has the next step queued when it finishes one
      (at most two steps in flight): its first half, then N is reported, then its second
      half (`_run_ahead`); or
    - deferred (scatter-written pools: the CPU, Metal): the worker waits for N, reports
      it, then starts N+1. A scatter launched while the previous step still reads the
      layer copies it (KVPool); a CPU step always runs past the next one's build
      (2-4x slower steps when started ahead: the pool-update probe, docs/benchmarks.md,
      "Retired probes").
    A SyncSteps message (the scheduler has nothing to chain) makes the worker report
    what it holds. A step with grammar-constrained rows starts with its forward only: its
    masks need every earlier step's tokens, so its sampling follows once those are
    reported (`_sampled`). Every phase of the loop is timed (see step_stats).
    """

    def __init__(self, runner, results: Sender, overlap: bool,  # noqa: ANN001
                 start_ahead: bool = False, stats: StepStats | None = None,
                 device_pool: "DevicePool | None" = None,
                 watchdog: StepWatchdog | None = None) -> None:
        """device_pool: the CUDA memory pool, whose reserve and use the summaries report.
        watchdog: armed while steps are handled (a stuck one ends the worker)."""
        self.runner = runner
        self.watchdog = watchdog or StepWatchdog(0)
        self.device_pool = device_pool
        self.results = results
        self.overlap = overlap
        self.start_ahead = overlap and start_ahead
        self.in_flight: deque = deque()
        # Steps received and not yet reported, oldest first: each gets exactly one result,
        # also when it fails (the scheduler counts its steps out and back).
        self.owed: deque[int] = deque()
        self.steps_built_ahead = 0  # observability: > 0 shows the overlap at work
        self.failures = 0  # steps failed as a whole (StepResult.epoch)
        self.stats = stats or StepStats()
        self._timer = Timer(self.stats)

    def handle(self, message: WorkerMessage | None) -> bool:
        """Process one message (None: a receive that timed out); False once the worker
        should stop. The time since the previous call returned counts as idle. Raises
        DeviceLost, once the failed step's requests are ended, where a step failed with
        an error that leaves the GPU unusable."""
        self._timer.mark("idle")
        if message is None or isinstance(message, Shutdown):
            self.watchdog.idle()
        else:
            self.watchdog.busy()
        if isinstance(message, Shutdown):
            logger.info("shutting down: %s", message.reason)
            return False
        try:
            self._handle_step_message(message)
        except Exception as exc:  # noqa: BLE001 - the worker lives on (see _fail_owed)
            logger.exception("a step failed; ending every request the worker holds")
            self._fail_owed(f"{type(exc).__name__}: {exc}")
            if device_lost(exc):  # unless nothing can run any more
                raise DeviceLost(f"the GPU can run nothing more after a step failed with: "
                                 f"{exc}") from exc
        return True

    def _handle_step_message(self, message: WorkerMessage | None) -> None:
        if isinstance(message, ForwardBatch):
            self.owed.append(message.step)
            if message.epoch < self.failures:
                # Planned before the scheduler learnt of the last failure, which ends every
                # request it names (ForwardBatch.epoch): not run, not a second failure.
                logger.info("step %d was planned before the last failed step was known: "
                            "reported failed", message.step)
                self._report_failed("its requests were ended by an earlier failed step")
                return
            self.stats.on_step(sum(len(c.token_ids) for c in message.prefill),
                               len(message.decode_rids))
            before = {p: self.stats.total(p) for p in PHASES}
            t0 = time.perf_counter()
            if self.start_ahead:
                self._run_ahead(message)
            else:
                self._run_deferred(message)
            self.stats.step_took(time.perf_counter() - t0,
                                 lambda: self._make_up(message, before))
        elif isinstance(message, SyncSteps):
            self._report_all()

    @property
    def launcher(self) -> "LaunchThread | None":
        """The runner's launch thread (a runner on mlx-lm's own caches has none)."""
        return getattr(self.runner, "launcher", None)

    def _make_up(self, batch: ForwardBatch, before: dict[str, float]) -> str:
        """What a step carried and where its time went (phases since `before`, ms)."""
        phases = " ".join(f"{p} {(self.stats.total(p) - before[p]) * 1e3:.1f}"
                          for p in PHASES if self.stats.total(p) > before[p])
        lengths = [len(c.token_ids) for c in batch.prefill]
        return (f"step {batch.step} ({phases}): {len(lengths)} prefill chunks ({sum(lengths)} "
                f"tokens, longest {max(lengths, default=0)}), {len(batch.decode_rids)} decode rows")

    def _fail_owed(self, reason: str) -> None:
        """A step failed with an error no request's checks caught (a bug, a device
        error). What the steps in flight wrote cannot be trusted, so the runner forgets
        every request and each unreported step is reported failed; the scheduler ends
        the requests it had sent and drops its prefix cache, and serving goes on."""
        self.failures += 1
        self.in_flight.clear()
        self.runner.reset()
        self._report_failed(reason)

    def _report_failed(self, reason: str) -> None:
        """Every step owed a result, reported failed."""
        while self.owed:
            self.results.send(StepResult(step=self.owed.popleft(), rids=[], token_ids=[],
                                         failed=reason, epoch=self.failures))

    def _run_ahead(self, batch: ForwardBatch) -> None:
        self.steps_built_ahead += bool(self.in_flight)
        cpu = HostClock.start()
        pending = self._build(batch)
        handed = self.launcher is not None
        if handed:
            # Its launch thread takes the whole step; meanwhile this one reports N and
            # then builds N+2.
            head = self._start(pending)
        else:
            # Launching a step takes the host about as long as the device takes to run
            # one. So half of N+1 goes first, then N is reported: the scheduler's round
            # trip for N+2 overlaps the launch of N+1's second half instead of following it.
            self.runner.start_head()
            head = self._timer.mark("start")
        cpu.pause()
        self._report_all()
        cpu.resume()
        rest = 0.0 if handed else self._start(pending)
        if logger.isEnabledFor(logging.DEBUG):
            # A launch that stalls (MLX building a CUDA graph anew, an allocation) shows
            # here, not in the build line nor in the wait for the tokens. The thread's CPU
            # time tells a host that computed longer (a collection, a slower path) from
            # one that was kept off its core or blocked in a call (a synchronizing free).
            wall, on_cpu = cpu.spent()
            if handed:  # (its launch: the launch thread's line)
                logger.debug("step %d handed to the launch thread; built and handed over "
                             "in %.2f ms, %.2f ms of it on the CPU", batch.step,
                             wall * 1e3, on_cpu * 1e3)
            else:
                logger.debug("step %d launched in %.2f ms (%.2f ms before the last step's "
                             "report); built and launched in %.2f ms, %.2f ms of it on the "
                             "CPU", batch.step, (head + rest) * 1e3, head * 1e3, wall * 1e3,
                             on_cpu * 1e3)
        self.in_flight.append(self._sampled(pending))

    def _run_deferred(self, batch: ForwardBatch) -> None:
        if batch.prefill or batch.continues_prefill:
            # Its forwards run as they are built: nothing may be in flight.
            self._report_all()
        pending = self._build(batch)
        self.steps_built_ahead += bool(self.in_flight)
        self._report_all()
        self._start(pending)
        self.in_flight.append(self._sampled(pending))
        if not self.overlap:
            self._report_oldest()

    def _build(self, batch: ForwardBatch) -> PendingStep:
        mixed = self.runner.mixed_forwards
        pending = self.runner.build(batch)
        # The prefill forwards it started and waited for are not graph building.
        clock = self.runner.clock
        spent = self._timer.mark("build", clock.phases())
        if logger.isEnabledFor(logging.DEBUG):
            import mlx.core as mx

            # MLX's cache beside the start's time: a start that waited while MLX emptied
            # its cache for an allocation shows as a fall from the step before.
            logger.debug("step %d built in %.2f ms (and %.2f ms starting prefill forwards, "
                         "%.2f ms waiting for them)%s; MLX cache %.2f GiB", batch.step,
                         spent * 1e3, clock.start * 1e3, clock.wait * 1e3,
                         "; its chunk rode in the decode forward"
                         if self.runner.mixed_forwards > mixed else "",
                         mx.get_cache_memory() / 2**30)
        return pending

    def _start(self, pending: PendingStep) -> float:
        self.runner.start(pending)
        return self._timer.mark("start")

    def _sampled(self, pending: PendingStep) -> PendingStep:
        """A started step, with its sampling: a step with constrained rows was started with
        only its forward, and its grammar masks need every earlier step's tokens, so those
        are reported first; the forward keeps running while the host fills the masks."""
        if not pending.needs_sampling:
            return pending
        self._report_all()
        pending = self.runner.sample_constrained(pending)
        self._timer.mark("build")
        self._start(pending)
        return pending

    def _report_oldest(self) -> None:
        result = self.runner.finish(self.in_flight[0])
        self.in_flight.popleft()
        waited = self._timer.mark("wait")
        self.owed.remove(result.step)
        self.results.send(result)
        self._timer.mark("report")
        logger.debug("step %d: waited %.2f ms for its tokens", result.step, waited * 1e3)

    def log_summary(self) -> None:
        """Log the last interval's phase times once one has passed (see StepStats)."""
        line = self.stats.summary()
        if line:
            if self.launcher is not None:
                line += f"; launch thread: {self.launcher.interval_note()}"
            logger.info("%s; %s", line, memory_note(self.device_pool))

    def _report_all(self) -> None:
        while self.in_flight:
            self._report_oldest()


def memory_note(device_pool: "DevicePool | None" = None) -> str:
    """MLX's memory figures, the peak since the last note: a peak far above the active
    memory (the pool is most of it) is a pool write that copied instead of updating.
    On CUDA also what the device's memory pool reserves and what of that is in use (see
    DevicePool)."""
    import mlx.core as mx

    gib = 1 << 30
    note = (f"memory GiB: active {mx.get_active_memory() / gib:.1f}, peak "
            f"{mx.get_peak_memory() / gib:.1f}, cache {mx.get_cache_memory() / gib:.1f}")
    if device_pool is not None:
        try:
            note += (f", device pool {device_pool.reserved() / gib:.1f} "
                     f"({device_pool.used() / gib:.1f} used)")
        except OSError as exc:
            note += f", device pool unread ({exc})"
    mx.reset_peak_memory()
    return note


def overlap_enabled(config: ServerConfig, on_gpu: bool) -> bool:
    """--overlap resolved for the device: auto keeps two steps in flight on a GPU only
    (on MLX's CPU backend a step's launch returns once the step is nearly done)."""
    return not config.disable_overlap and switch_on(config.overlap, auto=on_gpu)


@dataclass(frozen=True)
class PrefillChunking:
    """How this model's prompts are cut into chunks on this backend.

    size: the largest chunk (ServerConfig.chunk_size; WorkerReady.chunk_size). align:
    where the scheduler ends a prompt's unfinished chunks (WorkerReady.chunk_align): on the
    fused prefill bucket's edges where long causal chunks take that path (a chunk off them
    would need a masked forward), anywhere (1) elsewhere. warm_walk: decode first's chunk
    (at most `size`: no chunk is longer), walked over every key length at start-up where it
    is bucketed (aligned or not, a prompt's first chunks are: their cuDNN graphs built
    then); 0: none. tail_bucket: a
    prompt's last chunk after aligned ones runs padded to this (ModelRunner.tail_bucket);
    0: as it is. hit_align: where prefix hits are cut back to and a last chunk may start
    to be padded (ModelRunner.tail_starts; WorkerReady.prefix_align; 0: align)."""

    size: int
    align: int
    warm_walk: int
    tail_bucket: int = 0
    hit_align: int = 0
    decode_first: int = 512  # ServerConfig.decode_first_tokens (WorkerReady's)
    parts: int = 1  # a decode-first step's prefill runs over this many steps

    def walk_offsets(self) -> tuple[int, ...]:
        """Where a spread's prompt may start its chunks off their edges (after a prefix
        hit on a bucket's edge): the warm-up walks chunks from each to the next edge."""
        if not self.hit_align or not self.warm_walk:
            return ()
        return tuple(range(self.hit_align, self.align, self.hit_align))

    def spread(self, parts: int) -> "PrefillChunking":
        """The chunking where a step's prefill runs over `parts` steps (--prefill-spread):
        decode first's chunks are `parts` times longer, so the edges unfinished chunks end
        on are that many times apart, a prompt's last chunk is padded to one, and the
        warm-up walks such chunks: every chunk keeps to shapes built at start-up (pieces
        of 1,024 off the 256-token edges each started a new cuDNN graph on the H100,
        60-180 ms a step; docs/benchmarks.md, session 37). Prefix hits are still cut back
        to a bucket's edge only (a hit on a spread's edge would lose up to a spread's
        worth of cached tokens); the chunks from there to the next edge are walked too.
        Its edges unchanged where the spread's edge does not divide the chunk."""
        if parts <= 1:
            return self
        edge = self.align * parts
        if self.align <= 1 or self.size % edge:
            return dataclasses.replace(self, parts=parts)
        return dataclasses.replace(self, parts=parts, align=edge,
                                   tail_bucket=edge if self.tail_bucket else 0,
                                   hit_align=self.align,
                                   warm_walk=min(self.warm_walk * parts, self.size))


def prefill_chunking(config: ServerConfig, backend: DecodeBackend, specs: list,
                     parts: int = 1) -> PrefillChunking:
    """The chunking for this backend, with decode first's budget for a spread of `parts`
    (ServerConfig.spread_parts) and the spread applied."""
    from worker_proc.kv_pool import attention_specs

    fused = backend.fuses_long_prefill(attention_specs(specs))
    walk = config.decode_first_tokens(parts)
    bucket = backend.prefill_bucket
    align = bucket if fused and backend.align_chunks else 1
    size = config.chunk_size(fused_long_prefill=fused)
    whole = PrefillChunking(
        size=size,
        align=align,
        # A budget past the chunk (one budget for every step: 8,192) runs chunks of `size`
        # (an 8,192-token walk beside an H100's pool ended its start-up: session 37).
        warm_walk=min(walk, size) if fused and walk % bucket == 0 else 0,
        tail_bucket=align if align > 1 else 0,
        decode_first=walk)
    spread = whole.spread(parts)
    if parts > 1 and spread.align == whole.align and whole.align > 1:
        logger.log(logging.WARNING if config.prefill_spread > 1 else logging.INFO,
                   "--prefill-spread %d: its chunks (%d buckets of %d) do not divide the "
                   "%d-token chunk, so they end on the buckets' edges, at shapes the "
                   "warm-up does not build (a power of two avoids this)", parts, parts,
                   whole.align, size)
    return spread


def run_worker(config: ServerConfig) -> None:
    import mlx.core as mx

    from worker_proc.memory import DevicePool

    reporter = setup_child(config, "worker")
    runner, chunking = build_worker(config, reporter)
    on_gpu = mx.default_device() == mx.gpu
    overlap = overlap_enabled(config, on_gpu=on_gpu)
    plans: Receiver[WorkerMessage] = Receiver(config.worker_endpoint, WorkerMessage)
    results = Sender(config.scheduler_endpoint)
    results.send(WorkerReady(num_slots=runner.pool.num_slots, max_context_len=runner.max_context,
                             prefix_cache=runner.serves_prefix_hits,
                             state_snapshots=runner.pool.num_snapshots,
                             window_slots=runner.pool.window_slots,
                             windows=runner.pool.window_kinds,
                             bytes_per_slot=runner.slot_bytes[0],
                             window_bytes_per_slot=runner.slot_bytes[1],
                             chunk_size=chunking.size, chunk_align=chunking.align,
                             prefix_align=chunking.hit_align,
                             prefill_parts=chunking.parts,
                             decode_first_tokens=chunking.decode_first,
                             overlap=overlap))
    reporter.ready(f"{runner.pool.num_slots} KV slots, overlap {'on' if overlap else 'off'}")
    watchdog = config.watchdog_seconds(on_gpu=on_gpu)
    if watchdog > 0:
        logger.info("a step that keeps the worker %.0f s ends it, its stacks in this log "
                    "(--watchdog-timeout)", watchdog)
    loop = WorkerLoop(runner, results, overlap=overlap, start_ahead=runner.pool.in_place,
                      device_pool=DevicePool.find(), watchdog=StepWatchdog(watchdog))
    # A timeout now and then lets an interval's summary out while no plans come.
    while loop.handle(plans.recv(timeout_ms=_SUMMARY_POLL_MS)):
        loop.log_summary()

"""Sizing the KV pool from the memory the device has left after loading the weights."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import mlx.core as mx
import psutil

from ipc.config import ServerConfig
from worker_proc.kv_pool import (AttentionLayerSpec, CompositeSpec, LayerSpec, StateLayerSpec,
                                  UnusedLayerSpec)
from worker_proc.layer_kinds import LayerKind, UnsupportedModelError, probe_layers
from worker_proc.paged_attention import kernel_available

logger = logging.getLogger(__name__)


def probe_attention_specs(model: Any) -> list[LayerSpec]:
    """Each layer's K/V shape, dtype and kind (or, for a recurrent layer, its state's
    arrays), in mlx-lm's cache order, from tokens run through mlx-lm's own caches
    (layer_kinds.probe_layers); refuses a model with a layer kind the pool cannot hold."""
    probed = probe_layers(model)
    specs = [_layer_spec(c, kind, n, probed.filling.get(i, ()), i in probed.values_are_keys)
             for i, (c, kind, n) in enumerate(zip(probed.parts, probed.kinds, probed.heads))]
    groups = probed.lists
    out: list[LayerSpec] = []
    for size in groups:  # a layer's CacheList (of one cache too): one CompositeSpec
        out.append(CompositeSpec(tuple(specs[:size])) if size else specs[0])
        specs = specs[max(size, 1):]
    return out


def _layer_spec(cache: Any, kind: LayerKind, query_heads: int,
                filling: tuple[bool, ...], values_are_keys: bool) -> LayerSpec:
    if kind.recurrent:
        arrays = [a for a in cache.cache]
        if any(a is None for a in arrays):
            raise UnsupportedModelError("a recurrent layer left part of its state unset")
        return StateLayerSpec(tuple(tuple(a.shape[1:]) for a in arrays),
                              tuple(a.dtype for a in arrays), filling)
    if cache.keys is None:  # made by mlx-lm, never filled by the model's code
        return UnusedLayerSpec()
    return AttentionLayerSpec(n_kv_heads=cache.keys.shape[1], head_dim=cache.keys.shape[3],
                              v_head_dim=0 if values_are_keys else cache.values.shape[3],
                              dtype=cache.keys.dtype, kind=kind, query_heads=query_heads,
                              values_are_keys=values_are_keys)


def available_memory_bytes() -> int:
    """Memory the pool may draw on: device memory where MLX reports it, else host RAM."""
    info = mx.device_info()
    if "free_memory" in info:
        # CUDA: the device's free memory as NVML sees it, so memory other processes hold
        # is not counted as ours to take (a leftover server once made the pool OOM).
        return int(info["free_memory"])
    total = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if total:
        return max(0, int(total) - mx.get_active_memory())
    # The CPU backend reports no memory figures: the pool lives in host RAM.
    return int(psutil.virtual_memory().available)


# MLX keeps freed buffers for reuse, by default up to most of the device's memory. Mixed
# traffic (prefill forwards of many shapes beside decode) filled 36 GiB of cache beside a
# 71 GiB pool on the H200 until a prefill's allocation failed, which MLX does not retry
# after freeing its cache. On CUDA the cache may hold this share of what the pool and the
# weights leave free (decode steps reuse a few fixed sizes; they still hit it).
CUDA_CACHE_SHARE = 0.25
# The share with --experiments wide-cache: a capped cache that is full frees buffers at
# each new allocation, which may stall the host (an A/B of a spread step's host spikes).
WIDE_CUDA_CACHE_SHARE = 0.5


def bound_cuda_cache(share: float = CUDA_CACHE_SHARE) -> int | None:
    """On CUDA, cap MLX's buffer cache at `share` of the free device memory (call once
    the pool is allocated); returns the cap, or None elsewhere."""
    info = mx.device_info()
    if "free_memory" not in info:
        return None
    limit = max(1 << 28, int(int(info["free_memory"]) * share))
    mx.set_cache_limit(limit)
    return limit


# Attributes of cudaMemPoolGetAttribute in CUDA's runtime API.
_RESERVED_MEM_CURRENT = 5
_USED_MEM_CURRENT = 7


class DevicePool:
    """The device's default memory pool, where MLX's cudaMallocAsync takes memory and
    cudaFreeAsync gives it back, read through CUDA's runtime library.

    MLX 0.32 empties its whole buffer cache at each allocation the cache cannot serve
    once this pool has reserved more than 95% of the device (allocator.cpp), and frees
    the cache's host-read (managed) buffers with cudaFree, which waits for all the
    device's work in flight. Once a forward pushes this pool over that line it stays
    there (trimming does not bring it down; its use equals MLX's active memory) and
    every step pays for the emptied cache, decode steps too: Gemma-3-12B's did until its
    prefill attention stopped holding float32 scores (the paged prefill kernel;
    docs/benchmarks.md, sessions 50-53). The worker's 10-s summaries read it."""

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime
        self._handle = ctypes.c_void_p()
        if err := runtime.cudaDeviceGetDefaultMemPool(ctypes.byref(self._handle), 0):
            raise OSError(f"cudaDeviceGetDefaultMemPool failed (error {err})")

    @classmethod
    def find(cls) -> "DevicePool | None":
        """The pool of device 0 on MLX's CUDA backend, else None."""
        if "total_memory" not in mx.device_info():
            return None
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:  # the soname resolves to the copy MLX's library loaded
                runtime = ctypes.CDLL(name)
            except OSError:
                continue
            try:
                return cls(runtime)
            except OSError as exc:  # the figure is a log line's: serving goes on without it
                logger.warning("device memory pool unread: %s", exc)
                return None
        return None

    def _attribute(self, attribute: int) -> int:
        value = ctypes.c_uint64(0)
        if err := self._rt.cudaMemPoolGetAttribute(self._handle, attribute, ctypes.byref(value)):
            raise OSError(f"cudaMemPoolGetAttribute({attribute}) failed (error {err})")
        return int(value.value)

    def reserved(self) -> int:
        """Bytes the pool holds from the device, in use or not."""
        return self._attribute(_RESERVED_MEM_CURRENT)

    def used(self) -> int:
        """Bytes of the pool's allocations not yet freed."""
        return self._attribute(_USED_MEM_CURRENT)


# Memory beside the pool that a prefill forward's activations may not count on: cuBLAS's
# and cuDNN's workspaces, CUDA graphs' own allocations (an H100 failed in
# cudaGraphInstantiate when two forwards had taken the rest; docs/benchmarks.md, session
# 40), the decode step beside them.
FORWARD_MARGIN_BYTES = 2 << 30
# The fewest tokens a prefill forward is cut to: below, a forward's fixed host cost (~11 ms
# of launches for 32 layers) outweighs its work; a device this short of memory wants a
# smaller --mem-fraction instead.
LEAST_FORWARD_TOKENS = 256


def prefill_room(free_bytes: int, cache_bytes: int) -> int:
    """Bytes two prefill forwards in flight may hold at once: the device's free memory
    beside the pool and weights, less what MLX's buffer cache may hold and
    FORWARD_MARGIN_BYTES."""
    return max(0, free_bytes - cache_bytes - FORWARD_MARGIN_BYTES)


def prefill_forward_tokens(bytes_per_token: float, room: int, most: int) -> int:
    """Most tokens a shared prefill forward may take so that two in flight (the runner
    keeps two: ModelRunner._launch_prefill) fit in `room` (prefill_room) at
    `bytes_per_token` of activations (a probe forward's: warm_up.probe_prefill_bytes):
    `most` where they fit, a multiple of 64 otherwise, never below LEAST_FORWARD_TOKENS
    (nor above `most`)."""
    tokens = int(room // (2 * max(bytes_per_token, 1.0))) // 64 * 64
    return min(most, max(LEAST_FORWARD_TOKENS, tokens))


# MLX's CUDA backend records kernels into a CUDA graph and launches the graph once it holds
# MLX_MAX_OPS_PER_BUFFER kernels or its inputs add up to MLX_MAX_MB_PER_BUFFER million
# elements (not bytes). A served pool's layer is over MLX's element budget by itself (the
# decode kernel takes the whole layer as input), so every layer ended a graph, each one
# a graph update and launch of host time. Raised, the H200 served 64 streams at 7,386
# tok/s against 6,853 (ITL 7.3 against 8.1 ms) and one stream at 5.5 against 5.6 ms;
# 128 streams were level (10,943 against 11,145), docs/benchmarks.md session 7.
# The op budget also bounds how many kernels' buffers a graph holds until it completes:
# at 250 the H200's peak memory rose ~19 GiB (8B model, prefill forwards of up to 2,048
# tokens). So it is raised only on a device with LARGE_DEVICE_BYTES free before the
# model loads; elsewhere only the element budget is, and MLX's own op budget stays.
CUDA_GRAPH_BUDGETS = {"MLX_MAX_MB_PER_BUFFER": "100000", "MLX_MAX_OPS_PER_BUFFER": "250"}
LARGE_DEVICE_BYTES = 96 << 30


def raise_cuda_graph_budgets() -> dict[str, str]:
    """On MLX's CUDA backend (kernel_available), set CUDA_GRAPH_BUDGETS (the op budget only on a large
    device) where the environment has not set them; MLX reads them once, at the
    process's first GPU work, so call before any. Returns the values set or in force
    (empty elsewhere: Metal has variables of these names with other meanings)."""
    if not kernel_available():
        return {}
    names = list(CUDA_GRAPH_BUDGETS)
    if int(mx.device_info().get("free_memory", 0)) < LARGE_DEVICE_BYTES:
        names.remove("MLX_MAX_OPS_PER_BUFFER")
    for name in names:
        os.environ.setdefault(name, CUDA_GRAPH_BUDGETS[name])
    return {name: os.environ[name] for name in CUDA_GRAPH_BUDGETS if name in os.environ}


def pool_slots(config: ServerConfig, bytes_per_slot: int, max_context: int,
               reserved_bytes: int = 0, most_slots: int | None = None) -> int:
    """Slots to allocate: --max-total-tokens, else a --mem-fraction share of free memory
    (less `reserved_bytes`: the recurrent states), never more than every running request
    at full context could use (all of that when no layer keeps K/V), nor than
    `most_slots` (what one layer array can hold: KVPool.most_slots)."""
    slots = _budget_slots(config, bytes_per_slot, max_context, reserved_bytes)
    if most_slots is not None and slots > most_slots:
        logger.warning("KV pool: %d slots fit the budget; a layer array holds at most %d "
                       "(32-bit sizes)", slots, most_slots)
        return most_slots
    return slots


def _budget_slots(config: ServerConfig, bytes_per_slot: int, max_context: int,
                  reserved_bytes: int) -> int:
    if config.max_total_tokens:
        return config.max_total_tokens
    ceiling = config.max_running_requests * max_context
    if bytes_per_slot == 0:
        return ceiling  # slot ids only: the scheduler still tracks positions
    budget = int(available_memory_bytes() * config.mem_fraction) - reserved_bytes
    slots = min(max(0, budget) // bytes_per_slot, ceiling)
    if slots < max_context:
        logger.warning("KV pool holds %d tokens, less than one full context (%d)", slots, max_context)
    return slots


def pool_spaces(config: ServerConfig, bytes_per_slot: int, window_bytes_per_slot: int,
                max_context: int, reserved_bytes: int = 0, window_floor: int = 0,
                most_slots: int | None = None) -> tuple[int, int]:
    """(full slots, window slots): the windowed layers' own space takes --window-ratio
    window slots per full slot out of the same budget (bytes_per_slot counts every layer,
    window_bytes_per_slot the windowed ones), and at least `window_floor` (one longest
    request's window). (slots, 0) where they share the full space: no windowed layers,
    --window-ratio 0, or a window space as large as the full one (nothing to save).
    most_slots: as pool_slots takes it (the window space is at most the full one)."""
    ratio = config.window_ratio
    if not window_bytes_per_slot or ratio == 0:
        return pool_slots(config, bytes_per_slot, max_context, reserved_bytes, most_slots), 0
    full_bytes = bytes_per_slot - window_bytes_per_slot
    per_full_slot = full_bytes + ratio * window_bytes_per_slot
    full = pool_slots(config, max(1, int(per_full_slot)), max_context, reserved_bytes,
                      most_slots)
    window = max(int(ratio * full), window_floor)
    if not config.max_total_tokens and full_bytes:
        # The floor's bytes come out of the full space.
        budget = full * per_full_slot
        full = min(full, int((budget - window * window_bytes_per_slot) // full_bytes))
    if window >= full:
        return pool_slots(config, bytes_per_slot, max_context, reserved_bytes, most_slots), 0
    return full, window

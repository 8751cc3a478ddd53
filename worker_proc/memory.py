"""Sizing the KV pool from the memory the device has left after loading the weights."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import psutil
from mlx_lm.models.cache import make_prompt_cache

from ipc.config import ServerConfig
from worker_proc.kv_pool import AttentionLayerSpec

logger = logging.getLogger(__name__)


def probe_attention_specs(model: Any) -> list[AttentionLayerSpec]:
    """Run one token through mlx-lm's own caches to learn each layer's K/V shape and dtype."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    return [AttentionLayerSpec(n_kv_heads=c.keys.shape[1], head_dim=c.keys.shape[3],
                               v_head_dim=c.values.shape[3], dtype=c.keys.dtype) for c in cache]


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


def bound_cuda_cache() -> int | None:
    """On CUDA, cap MLX's buffer cache at CUDA_CACHE_SHARE of the free device memory
    (call once the pool is allocated); returns the cap, or None elsewhere."""
    info = mx.device_info()
    if "free_memory" not in info:
        return None
    limit = max(1 << 28, int(int(info["free_memory"]) * CUDA_CACHE_SHARE))
    mx.set_cache_limit(limit)
    return limit


def pool_slots(config: ServerConfig, bytes_per_slot: int, max_context: int) -> int:
    """Slots to allocate: --max-total-tokens, else a --mem-fraction share of free memory,
    never more than every running request at full context could use."""
    if config.max_total_tokens:
        return config.max_total_tokens
    by_memory = int(available_memory_bytes() * config.mem_fraction) // bytes_per_slot
    ceiling = config.max_running_requests * max_context
    slots = min(by_memory, ceiling)
    if slots < max_context:
        logger.warning("KV pool holds %d tokens, less than one full context (%d)", slots, max_context)
    return slots

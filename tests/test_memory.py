"""KV pool sizing."""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ipc.config import ServerConfig
from worker_proc import memory
from worker_proc.kv_pool import AttentionLayerSpec, KVPool


def test_explicit_max_total_tokens_wins():
    cfg = ServerConfig(max_total_tokens=1234)
    assert memory.pool_slots(cfg, bytes_per_slot=1000, max_context=100) == 1234


def test_pool_takes_mem_fraction_of_free_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 10_000_000)
    cfg = ServerConfig(mem_fraction=0.5, max_running_requests=1000)
    assert memory.pool_slots(cfg, bytes_per_slot=1000, max_context=4096) == 5000
    # ...but never more than every running request at full context could use.
    small = dataclasses.replace(cfg, max_running_requests=1)
    assert memory.pool_slots(small, bytes_per_slot=1000, max_context=4096) == 4096


def test_pool_bytes_per_slot_matches_allocation():
    specs = [AttentionLayerSpec(2, 16, 16, mx.float32), AttentionLayerSpec(4, 8, 8, mx.float32)]
    pool = KVPool(specs, num_slots=100)
    assert pool.nbytes == 101 * KVPool.bytes_per_slot(specs)
    assert pool.layers[0].shape == (101, 2, 32) and pool.keys(0).shape == (101, 2, 16)
    assert pool.values(1).shape == (101, 4, 8) and float(mx.abs(pool.layers[1]).sum()) == 0.0


def test_available_memory_is_positive_on_this_machine():
    assert memory.available_memory_bytes() > 0


def test_device_wide_free_memory_wins_where_reported(monkeypatch):
    monkeypatch.setattr(memory.mx, "device_info", lambda: {"free_memory": 123, "memory_size": 10**12})
    assert memory.available_memory_bytes() == 123

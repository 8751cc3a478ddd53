"""KV pool sizing."""

from __future__ import annotations

import dataclasses
import math
import os

import mlx.core as mx
import pytest

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


def test_in_place_pool_keeps_its_arrays_and_orders_reads_after_writes():
    """An in-place pool (the CUDA path; its kernel stood in for by a recorder here) never
    replaces a layer's array; each write takes the layer's previous mark (so a read of the
    last follows them all), reads take the last mark, and a step takes the marks it must
    evaluate once. A traced forward's view starts without marks and leaves the pool's
    alone until its own are adopted."""
    from worker_proc.decode_backend import KernelDecode

    calls = []

    class Recorder(KernelDecode):
        def write_rows(self, layer_array, slots, keys, values, after):  # noqa: ANN001, ANN202
            mark = mx.zeros((1,), dtype=mx.int32)
            calls.append((layer_array, after, mark))
            return mark

    specs = [AttentionLayerSpec(2, 4, 4, mx.float32)] * 2
    pool = KVPool(specs, num_slots=10, backend=Recorder())
    layers = list(pool.layers)
    k = v = mx.ones((1, 2, 1, 4))
    assert pool.landing() == [] and pool.mark(0) is None
    pool.write(0, mx.array([3]), k, v)
    pool.write(0, mx.array([4]), k, v)
    pool.write(1, mx.array([3]), k, v)
    assert [c[0] is layers[i] for c, i in zip(calls, (0, 0, 1))] == [True] * 3
    assert calls[0][1] is None and calls[1][1] is calls[0][2] and calls[2][1] is None
    assert pool.mark(0) is calls[1][2] and all(a is b for a, b in zip(pool.layers, layers))
    keys, _ = pool.read(0, mx.array([[3, 4]]))
    assert keys.shape == (1, 2, 2, 4)
    taken = pool.take_landing()
    assert [id(m) for m in taken] == [id(c[2]) for c in calls] and pool.landing() == []
    view = pool.with_layers(layers)
    assert view.mark(0) is None and view.landing() == []
    view.write(0, mx.array([5]), k, v)
    assert pool.landing() == [] and pool.mark(0) is calls[1][2]
    traced = [mx.zeros((1,), dtype=mx.int32), mx.zeros((1,), dtype=mx.int32)]
    pool.adopt_marks(traced)
    assert pool.mark(1) is traced[1] and [id(m) for m in pool.take_landing()] == [id(m) for m in traced]


def test_cuda_cache_is_capped_at_a_share_of_free_memory(monkeypatch):
    limits = []
    monkeypatch.setattr(memory.mx, "set_cache_limit", limits.append)
    monkeypatch.setattr(memory.mx, "device_info", lambda: {"free_memory": 40 << 30})
    assert memory.bound_cuda_cache() == 10 << 30 and limits == [10 << 30]
    monkeypatch.setattr(memory.mx, "device_info", lambda: {"memory_size": 1 << 40})
    assert memory.bound_cuda_cache() is None and limits == [10 << 30]  # CPU, Metal: untouched


class _FakeRuntime:
    """CUDA's runtime as DevicePool calls it: device 0's default pool."""

    def __init__(self, reserved: int, used: int, error: int = 0) -> None:
        self.reserved, self.used, self.error = reserved, used, error

    def cudaDeviceGetDefaultMemPool(self, pool_ref, device):
        assert device == 0
        pool_ref._obj.value = 0x1234
        return self.error

    def cudaMemPoolGetAttribute(self, pool, attribute, value_ref):
        assert pool.value == 0x1234
        value_ref._obj.value = {5: self.reserved, 7: self.used}[attribute]
        return self.error


def test_device_pool_reads_the_default_pool_and_says_when_it_cannot():
    gib = 1 << 30
    rt = _FakeRuntime(reserved=60 * gib, used=50 * gib)
    pool = memory.DevicePool(rt)
    assert (pool.reserved(), pool.used()) == (60 * gib, 50 * gib)
    rt.error = 2
    with pytest.raises(OSError, match="cudaMemPoolGetAttribute"):
        pool.reserved()
    with pytest.raises(OSError, match="cudaDeviceGetDefaultMemPool"):
        memory.DevicePool(rt)


def test_memory_experiments_widen_the_cache_and_are_refused_off_cuda(monkeypatch):
    from worker_proc import cuda_cache_limits
    from worker_proc.layer_kinds import UnsupportedModelError

    limits, said = [], []
    monkeypatch.setattr(memory.mx, "set_cache_limit", limits.append)
    monkeypatch.setattr(memory.mx, "device_info", lambda: {"free_memory": 40 << 30})
    assert cuda_cache_limits(frozenset(), said.append) == 10 << 30
    assert cuda_cache_limits(frozenset({"wide-cache"}), said.append) == 20 << 30
    assert limits == [10 << 30, 20 << 30]
    monkeypatch.setattr(memory.mx, "device_info", lambda: {"memory_size": 1 << 40})
    assert cuda_cache_limits(frozenset(), said.append) is None
    with pytest.raises(UnsupportedModelError, match="wide-cache: CUDA's memory only"):
        cuda_cache_limits(frozenset({"wide-cache"}), said.append)
    with pytest.raises(UnsupportedModelError, match="array-readback: CUDA's memory only"):
        cuda_cache_limits(frozenset({"array-readback"}), said.append)
    assert memory.DevicePool.find() is None  # no CUDA backend here


def test_memory_note_reports_the_device_pool_where_there_is_one():
    from worker_proc import memory_note

    gib = 1 << 30
    pool = memory.DevicePool(_FakeRuntime(reserved=75 * gib, used=50 * gib))
    assert memory_note(pool).endswith("device pool 75.0 (50.0 used)")
    assert "device pool" not in memory_note()


def test_cuda_graph_budgets_are_raised_on_cuda_only_and_yield_to_the_environment(monkeypatch):
    for name in memory.CUDA_GRAPH_BUDGETS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(memory, "kernel_available", lambda: False)
    assert memory.raise_cuda_graph_budgets() == {}
    assert not any(name in os.environ for name in memory.CUDA_GRAPH_BUDGETS)

    monkeypatch.setattr(memory, "kernel_available", lambda: True)
    free = {"free_memory": memory.LARGE_DEVICE_BYTES}
    monkeypatch.setattr(mx, "device_info", lambda: free)
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "40")  # the user's setting wins
    assert memory.raise_cuda_graph_budgets() == {"MLX_MAX_MB_PER_BUFFER": "100000",
                                                 "MLX_MAX_OPS_PER_BUFFER": "40"}
    for name in memory.CUDA_GRAPH_BUDGETS:
        monkeypatch.delenv(name)
    free["free_memory"] = memory.LARGE_DEVICE_BYTES - 1  # a smaller device: MLX's op budget
    assert memory.raise_cuda_graph_budgets() == {"MLX_MAX_MB_PER_BUFFER": "100000"}
    assert "MLX_MAX_OPS_PER_BUFFER" not in os.environ


def test_the_pool_never_asks_mlx_for_a_layer_past_32_bit_sizes():
    """MLX sizes dimensions (and the kernels index a layer) with 32-bit ints: the worker
    caps the slots at the most one layer array can hold (a 9B hybrid's 4 x (256 + 256)
    rows on an H200 asked for 2.1M slots and crashed at start-up)."""
    wide = [AttentionLayerSpec(4, 256, 256, mx.bfloat16), AttentionLayerSpec(2, 16, 16, mx.float32)]
    most = KVPool.most_slots(wide)
    assert most == 1_048_574  # what the H200's start-up logged for that model
    assert (most + 1) * 4 * 512 < 2**31 <= (most + 2) * 4 * 512  # the slot 0 row included
    assert KVPool.most_slots([]) >= 2**30  # a model without attention layers is not capped
    # The sizing takes the cap whatever the budget says, the memory's or the flag's.
    assert memory.pool_slots(ServerConfig(max_total_tokens=3_000_000), 1024, 100,
                             most_slots=most) == most
    assert memory.pool_spaces(ServerConfig(max_total_tokens=3_000_000), 1024, 0, 100,
                              most_slots=most) == (most, 0)


def test_state_rows_snapshots_and_clears_move_many_rows_at_once():
    """A forward's snapshots, hits and fresh rows are one batched copy per state array:
    rows saved as snapshots come back into other rows, clearing zeroes only its rows;
    alike on the scatter pool and the in-place one (its row writer stood in for)."""
    from tests.engine_driver import StandInInPlaceKernels
    from worker_proc.kv_pool import StateLayerSpec

    spec = StateLayerSpec(((3, 4), (2,)), (mx.float32, mx.float32))
    for backend in (None, StandInInPlaceKernels()):
        pool = KVPool([spec], num_slots=4, backend=backend, state_rows=5, snapshots=4)
        rows = mx.array([1, 3, 4], dtype=mx.int32)
        for i, shape in enumerate(spec.shapes):
            pool.write_state(0, i, rows, mx.arange(3 * math.prod(shape), dtype=mx.float32)
                             .reshape(3, *shape) + 1)
        want = [pool.read_state(0, i, rows) for i in range(2)]
        pool.save_snapshots(rows, mx.array([4, 1, 2], dtype=mx.int32))
        pool.clear_states(mx.array([1, 4], dtype=mx.int32))
        assert all(float(mx.abs(pool.read_state(0, i, mx.array([1, 4]))).sum()) == 0
                   for i in range(2))
        assert all(mx.array_equal(pool.read_state(0, i, mx.array([3])), want[i][1:2])
                   for i in range(2))
        into = mx.array([2, 5, 1], dtype=mx.int32)
        pool.load_snapshots(mx.array([4, 1, 2], dtype=mx.int32), into)
        for i in range(2):
            assert mx.array_equal(pool.read_state(0, i, into), want[i]), backend


def test_prefill_forwards_are_cut_to_what_two_in_flight_leave_room_for():
    """Two forwards' activations in the room beside the cache and a margin: all of `most`
    where they fit; else the tokens that fit, a multiple of 64; never below the floor."""
    gib, mib = 1 << 30, 1 << 20
    assert memory.prefill_room(60 * gib, 5 * gib) == 55 * gib - memory.FORWARD_MARGIN_BYTES
    assert memory.prefill_room(gib, 5 * gib) == 0
    assert memory.prefill_forward_tokens(5 * mib, 50 * gib, 2048) == 2048
    # An H100 beside a 31 GiB pool (session 40): ~10 MiB a token of short prompts.
    room = memory.prefill_room(int(35.4 * gib), int(5.1 * gib))
    cut = memory.prefill_forward_tokens(10 * mib, room, 2048)
    assert cut % 64 == 0 and 1344 <= cut < 2048
    assert 2 * cut * 10 * mib <= room < 2 * (cut + 64) * 10 * mib
    assert memory.prefill_forward_tokens(10 * mib, gib, 2048) == memory.LEAST_FORWARD_TOKENS
    assert memory.prefill_forward_tokens(0.0, 0, 2048) == memory.LEAST_FORWARD_TOKENS

"""bench/quantized_matmul.py on the CPU at small shapes: a row of timings for every shape
and row count, the quantized weights' bytes as MXFP4 packs them; a malformed shape is
refused by name."""

from __future__ import annotations

import pytest

from bench.quantized_matmul import main

SMALL = ["--dtype", "float32", "--layers", "2", "--repeats", "1", "--rows", "1,8"]


def test_every_shape_and_row_count_is_timed(capsys):
    results = main([*SMALL, "--shapes", "64x128,128x96"])
    assert [(r.case.inputs, r.case.outputs, r.case.rows) for r in results] == [
        (64, 128, 1), (64, 128, 8), (128, 96, 1), (128, 96, 8)]
    assert all(r.quantized_us > 0 and r.row_batch_us > 0 and r.dense_us > 0 for r in results)
    # MXFP4: half a byte a weight, one exponent byte a group of 32.
    assert results[0].weight_bytes == 64 * 128 // 2 + 64 * 128 // 32
    assert "128 x 96" in capsys.readouterr().out


def test_a_malformed_shape_is_named(capsys):
    with pytest.raises(SystemExit):
        main([*SMALL, "--shapes", "64x128,96"])
    assert "shape '96'" in capsys.readouterr().err

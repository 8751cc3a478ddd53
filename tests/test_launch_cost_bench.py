"""bench/launch_cost.py on the CPU at small shapes: every kind builds, launches and
returns its per-op host costs; an unknown kind is refused by name."""

from __future__ import annotations

import pytest

from bench.launch_cost import main

SMALL = ["--dtype", "float32", "--rows", "8", "--context", "32", "--hidden", "64",
         "--heads", "4,2,16", "--intermediate", "128", "--layers", "2", "--repeats", "1"]


def test_every_kind_runs_and_reports_per_op_costs(capsys):
    costs = main(SMALL)
    assert [c.kind for c in costs] == ["gemm (qkv)", "attention (causal)", "attention (bias)",
                                       "rms_norm", "rope", "pad copy", "gather (pool)", "swiglu",
                                       "llama layer"]
    assert all(c.build_us > 0 and c.launch_us > 0 and c.wait_ms >= 0 for c in costs)
    assert "2 ops a launch" in capsys.readouterr().out


def test_an_unknown_kind_is_named(capsys):
    with pytest.raises(SystemExit):
        main([*SMALL, "--kinds", "gemm (qkv),conv"])
    assert "unknown kinds ['conv']" in capsys.readouterr().err

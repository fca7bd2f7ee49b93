"""The benchmark scripts run end to end at tiny sizes and report every ratio (timings not checked)."""

from __future__ import annotations

import math

import pytest

from benchmarks import ostl_recurrent
from benchmarks.__main__ import BF16_OF, METHODS, OTTT_METHODS, main


def test_learner_benchmark_reports_every_method() -> None:
    results = main(["--quick", "--models", "lif256"])
    rows = results["models"]["lif256"]
    assert set(rows) == set(METHODS)
    for row in rows.values():
        assert row["vs_bptt"] > 0 and math.isfinite(row["vs_bptt"])
        assert row["compile_seconds"] > 0 and math.isfinite(row["compile_vs_bptt"])
    assert rows["D_RTRL single"]["vs_floor"] > 0 and rows["EProp(κ=.9) single"]["vs_floor"] > 0
    assert rows["D_RTRL single"]["vs_d_rtrl"] == 1.0
    assert rows["D_RTRL single"]["trace_bytes"] > 0 and rows["BPTT"]["mem_growth"] > 1
    # The weight's trace halves; the element-wise leak's (off the fast path) stays float32.
    assert 0.5 < rows["D_RTRL single bf16"]["trace_bytes"] / rows["D_RTRL single"]["trace_bytes"] < 0.51
    assert all(rows[name]["bf16_vs_f32"] > 0 for name in BF16_OF)
    imports = results["import_seconds"]
    assert imports["brainstate"] > 0 and imports["braintrace_over_brainstate"] > 0



def test_learner_benchmark_reports_ottt_on_the_fixed_leak_lif() -> None:
    rows = main(["--quick", "--models", "lif256-fixed"])["models"]["lif256-fixed"]
    assert set(rows) == set(OTTT_METHODS)
    for row in rows.values():
        assert row["vs_bptt"] > 0 and math.isfinite(row["vs_bptt"]) and row["vs_d_rtrl"] > 0
    # The online learners' compiled memory is flat in T; BPTT's grows.
    assert rows["OTTT single"]["mem_growth"] < rows["BPTT"]["mem_growth"]

@pytest.mark.parametrize("model", ["lif", "gru"])
def test_ostl_benchmark_reports_every_method(model: str) -> None:
    rows = ostl_recurrent.main(["--model", model, "--hidden", "8", "--batch", "2", "--steps", "5", "--repeats", "1"])
    assert set(rows) == {"BPTT", "D_RTRL", "OSTLRecurrent", "OSTLRecurrent (dense Jacobian)"}
    assert all(r["mem_vs_bptt"] > 0 for r in rows.values())
    assert all(r["time_vs_drtrl"] > 0 for name, r in rows.items() if "dense" not in name)

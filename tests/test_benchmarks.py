"""The benchmark scripts run end to end at tiny sizes and report every ratio (timings not checked)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from benchmarks import ostl_recurrent
from benchmarks.__main__ import BF16_OF, BY_HAND, METHODS, OTTT_METHODS, SETTINGS, main, run, temporary_bytes
from benchmarks.hand_written import leaky_d_rtrl_grads, leaky_d_rtrl_step
from benchmarks.models import GRU, LeakyRNN


def test_learner_benchmark_reports_every_method() -> None:
    results = main(["--quick", "--models", "lif256"])
    rows = results["models"]["lif256"]
    assert set(rows) == set(METHODS)
    for row in rows.values():
        assert row["vs_bptt"] > 0 and math.isfinite(row["vs_bptt"])
        assert row["compile_seconds"] > 0 and math.isfinite(row["compile_vs_bptt"])
    assert rows["D_RTRL single"]["vs_floor"] > 0 and rows["EProp(κ=.9) single"]["vs_floor"] > 0
    # The floor is a call's latency plus the trace traffic, so the step sits further above the traffic alone.
    for name in ("D_RTRL single", "EProp(κ=.9) single"):
        assert rows[name]["call_seconds"] > 0 and rows[name]["vs_traffic"] > rows[name]["vs_floor"]
    assert rows["D_RTRL single"]["vs_d_rtrl"] == 1.0
    assert rows["D_RTRL single"]["trace_bytes"] > 0 and rows["BPTT"]["mem_growth"] > 1
    # The weight's trace halves; the element-wise leak's (off the fast path) stays float32.
    assert 0.5 < rows["D_RTRL single bf16"]["trace_bytes"] / rows["D_RTRL single"]["trace_bytes"] < 0.51
    assert all(rows[name]["bf16_vs_f32"] > 0 for name in BF16_OF)
    imports = results["import_seconds"]
    assert imports["brainstate"] > 0 and imports["braintrace_over_brainstate"] > 0


def test_learner_benchmark_runs_the_chosen_methods_and_the_references_of_its_ratios() -> None:
    methods = ["SnAp(n=1) single", "D_RTRL single bf16"]
    rows = main(["--quick", "--models", "gru64", "--methods", *methods])["models"]["gru64"]
    assert list(rows) == ["BPTT", "D_RTRL single", "SnAp(n=1) single", "D_RTRL single bf16"]
    assert rows["D_RTRL single bf16"]["bf16_vs_f32"] > 0  # one of the bf16 rows, without the other
    assert rows["SnAp(n=1) single"]["vs_floor"] > 0 and rows["SnAp(n=1) single"]["vs_bptt"] > 0


def _stats(temp: int, peak: int) -> object:
    return type("Stats", (), {"temp_size_in_bytes": temp, "peak_memory_in_bytes": peak, "argument_size_in_bytes": 10,
                              "output_size_in_bytes": 30, "alias_size_in_bytes": 5})()


def test_temporary_memory_is_read_off_the_peak_where_the_backend_reports_no_temporaries() -> None:
    assert temporary_bytes(_stats(temp=7, peak=1000)) == 7  # the backend reports temporaries (CPU)
    assert temporary_bytes(_stats(temp=0, peak=1000)) == 1000 - 10 - 30 + 5  # a TPU: the peak less the rest
    assert temporary_bytes(_stats(temp=0, peak=0)) == 0


def test_learner_benchmark_reports_ottt_on_the_fixed_leak_lif() -> None:
    rows = main(["--quick", "--models", "lif256-fixed"])["models"]["lif256-fixed"]
    assert set(rows) == set(OTTT_METHODS)
    for row in rows.values():
        assert row["vs_bptt"] > 0 and math.isfinite(row["vs_bptt"]) and row["vs_d_rtrl"] > 0
    # The online learners' compiled memory is flat in T; BPTT's grows.
    assert rows["OTTT single"]["mem_growth"] < rows["BPTT"]["mem_growth"]


def _mse(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out - target) ** 2)


def test_hand_written_d_rtrl_is_the_learners_gradient() -> None:
    """The floor the benchmark compares D_RTRL with computes D_RTRL's gradient (float64)."""
    batch, steps = 3, 6
    with jax.enable_x64(True):
        model = LeakyRNN(4, 8, 2)
        model.tau.value = jnp.linspace(-1.0, 1.0, 8)  # a leak per neuron
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learner = braintrace.compile(model, "d_rtrl", jnp.zeros((batch, 4)), batch_size=batch)
        xs = jax.random.normal(jax.random.PRNGKey(1), (steps, batch, 4))
        ys = jax.random.normal(jax.random.PRNGKey(2), (steps, batch, 2))
        learner.reset()
        grads = learner.etrace_grad(xs, ys, step_fn=lambda x, y: _mse(learner(x), y), reduction="sum")
        names = {id(getattr(model, n)): n for n in ("tau", "w_in", "w_rec", "w_out")}
        ours = {names[id(learner.param_states[p])]: g for p, g in grads.items()}
        params = {n: getattr(model, n).value for n in names.values()}
        by_hand = leaky_d_rtrl_grads(params, xs, ys, _mse)
        for name, g in by_hand.items():
            np.testing.assert_allclose(ours[name], g, rtol=1e-12, atol=1e-14, err_msg=name)
        # Negative control: the comparison tells models apart (another leak, another gradient).
        wrong = leaky_d_rtrl_grads({**params, "tau": params["tau"] + 1.0}, xs, ys, _mse)
        assert not np.allclose(ours["w_rec"], wrong["w_rec"], rtol=1e-3)


def test_hand_written_step_refuses_another_model() -> None:
    with pytest.raises(TypeError, match="needs a LeakyRNN.*got a GRU"):
        leaky_d_rtrl_step(GRU(2, 3, 1), _mse, lambda states, grads: None)


def test_learner_benchmark_times_the_hand_written_floor() -> None:
    setting = dataclasses.replace(SETTINGS["leaky64"], hidden=8, methods=("BPTT", "D_RTRL single"))
    rows = run(setting, batch=2, steps=4, long_steps=24, repeats=1, bw=1e10)
    assert set(rows) == {"BPTT", "D_RTRL single", BY_HAND}
    assert rows[BY_HAND]["seconds"] > 0 and rows[BY_HAND]["compile_seconds"] > 0
    assert rows[BY_HAND]["mem_growth"] < rows["BPTT"]["mem_growth"]  # online: flat in T


@pytest.mark.parametrize("model", ["lif", "gru"])
def test_ostl_benchmark_reports_every_method(model: str) -> None:
    rows = ostl_recurrent.main(["--model", model, "--hidden", "8", "--batch", "2", "--steps", "5", "--repeats", "1"])
    assert set(rows) == {"BPTT", "D_RTRL", "OSTLRecurrent", "OSTLRecurrent (dense Jacobian)"}
    assert all(r["mem_vs_bptt"] > 0 for r in rows.values())
    assert all(r["time_vs_drtrl"] > 0 for name, r in rows.items() if "dense" not in name)

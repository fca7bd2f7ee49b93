"""The connectome workload (``benchmarks/connectome.py``) at a tiny size.

The generator's graph, the report's fields, and the workload model's D-RTRL gradient against
BPTT in float64: exact where the hidden-to-hidden Jacobian is diagonal (spikes detached from
the gradient, any number of steps; or the first two steps with surrogate gradients through the
spikes), and visibly not exact beyond that (the negative control).
"""

from __future__ import annotations

import math
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from benchmarks import connectome
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, x64

__all__ = ["x64"]  # the fixture is used by name


def test_generated_connectome_is_a_deterministic_heavy_tailed_simple_graph() -> None:
    indptr, indices = connectome.generate_connectome(3000, 60_000, seed=3)
    again = connectome.generate_connectome(3000, 60_000, seed=3)
    other = connectome.generate_connectome(3000, 60_000, seed=4)
    assert np.array_equal(indptr, again[0]) and np.array_equal(indices, again[1])
    assert not np.array_equal(indices[:1000], other[1][:1000])
    assert indptr.dtype == indices.dtype == np.int32
    assert indptr[0] == 0 and indptr[-1] == indices.size and np.all(np.diff(indptr) >= 0)
    assert 0.9 * 60_000 < indices.size <= 60_000
    rows = np.repeat(np.arange(3000), np.diff(indptr))
    assert np.all(rows != indices)  # no self connections
    keys = rows.astype(np.int64) * 3000 + indices
    assert np.all(np.diff(keys) > 0)  # sorted within rows, no repeated pair
    out_deg, in_deg = np.diff(indptr), np.bincount(indices, minlength=3000)
    assert out_deg.max() > 8 * out_deg.mean() and in_deg.max() > 8 * in_deg.mean()
    # The negative control of "heavy-tailed": a uniform graph of the same size is not.
    uniform = np.bincount(np.random.default_rng(0).integers(0, 3000, indices.size), minlength=3000)
    assert uniform.max() < 3 * uniform.mean()


def test_generator_rejects_degenerate_sizes() -> None:
    with pytest.raises(ValueError, match="n_neurons >= 2.*got n_neurons=1"):
        connectome.generate_connectome(1, 10)


def test_tiny_workload_reports_every_figure() -> None:
    report = connectome.run(neurons=500, synapses=5000, batch=2, steps=5, long_steps=20, longest_steps=200,
                            bptt_steps=(5, 10), repeats=1)
    nnz = report["connectome"]["synapses"]
    assert 4000 < nnz <= 5000 and report["connectome"]["neurons"] == 500
    assert report["kernels"] in ("numba", "jax_raw (pure JAX; numba not installed)")
    rows = report["methods"]
    assert set(rows) == set(connectome.METHODS)
    for row in rows.values():
        assert row["seconds_per_step"] > 0 and math.isfinite(row["vs_forward"]) and row["compile_seconds"] > 0
    assert rows["forward"]["vs_forward"] == 1.0
    # One trace value per connection per batch entry (plus none for the plain readout).
    assert rows["D_RTRL"]["trace_values"] == 2 * nnz
    assert rows["pp_prop"]["trace_values"] < rows["D_RTRL"]["trace_values"]
    for name in ("pp_prop", "D_RTRL"):
        assert rows[name]["temp_growth"] < 1.05  # flat in T (ten times the steps)
    bptt = report["bptt"]
    assert bptt["bytes_per_step"] > 0 and 0 < bptt["max_steps"] < math.inf
    assert bptt["mem_long"] > bptt["mem_short"]


def _model(detach: bool) -> connectome.ConnectomeLIF:
    indptr, indices = connectome.generate_connectome(40, 300, seed=1)
    return connectome.ConnectomeLIF(indptr, indices, n_in=4, n_sensory=12, n_readout=8, n_out=3,
                                    detach_spikes=detach)


def _drtrl_vs_bptt(detach: bool, steps: int) -> float:
    xs = normal(5, (steps, 2, 4), scale=2.0)
    reference = bptt_grads(_model(detach), xs, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(_model(detach), "d_rtrl", xs[0], batch_size=2)
    got = single_step_grads(learner, xs)
    assert np.max(np.abs(reference[("w_rec",)])) > 0  # the recurrent weights do receive a gradient
    return max_rel_err(reference, got)


@pytest.mark.parametrize("detach, steps", [(True, 6), (False, 2)])
def test_sparse_drtrl_equals_bptt_where_the_recurrence_is_diagonal(x64: None, detach: bool, steps: int) -> None:
    assert jnp.result_type(float) == jnp.float64
    assert _drtrl_vs_bptt(detach, steps) < 1e-10


def test_sparse_drtrl_departs_from_bptt_through_spiking_recurrence(x64: None) -> None:
    assert _drtrl_vs_bptt(False, 6) > 1e-3

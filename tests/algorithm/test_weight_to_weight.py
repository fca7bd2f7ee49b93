"""Weights that reach the hidden states only through another trainable operation, and tails that
move values between positions.

A GRU's reset gate ``Wr`` drives ``h`` only through the candidate's weight ``Wh``. A
per-position trace (D_RTRL, the coupled scope) cannot hold that influence, which lands on every
unit: the compiler leaves ``Wr`` out and says so. SnAp-n gathers the tail's Jacobian onto each
position's neighbourhood and UORO projects through the tail, so both learn ``Wr`` through its
trace, and saturated SnAp (and UORO in expectation) equals BPTT on every weight. The same holds
for a drive rolled before the hidden update (upstream's F-31). All references are float64.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import DiagnosticKind
from tests.algorithm.bptt import bptt_grads, normal
from tests.algorithm.test_uoro import TableUORO, sequence_grads, sign_tables

T = 6


@pytest.fixture
def f64() -> Iterator[None]:
    """float64 arrays and float64 brainstate defaults (parameters and reset states) for one test."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        with brainstate.environ.context(precision=64):
            yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def gru(units: int = 4) -> braintrace.nn.GRUCell:
    brainstate.random.seed(0)
    return braintrace.nn.GRUCell(3, units, w_init=braintools.init.Normal(0.0, 0.8),
                                 b_init=braintools.init.Normal(0.0, 0.3), state_init=braintools.init.Constant(0.4))


def mgu(units: int = 4) -> braintrace.nn.MGUCell:
    brainstate.random.seed(1)
    return braintrace.nn.MGUCell(3, units, w_init=braintools.init.Normal(0.0, 0.8),
                                 b_init=braintools.init.Normal(0.0, 0.3), state_init=braintools.init.Constant(0.4))


class Rolled(brainstate.nn.Module):
    """``h ← tanh(roll(x @ W) + h @ R)``: the input's drive lands one unit further on."""

    def __init__(self, units: int = 4) -> None:
        super().__init__()
        self.units = units
        self.w = brainstate.ParamState(normal(0, (3, units), 0.7))
        self.r = brainstate.ParamState(normal(1, (units, units), 0.7))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.full(self.units, 0.4))

    def update(self, x: jax.Array) -> jax.Array:
        drive = jnp.roll(braintrace.matmul(x, self.w.value), 1) + braintrace.matmul(self.h.value, self.r.value)
        self.h.value = jnp.tanh(drive)
        return self.h.value


def data(units: int) -> tuple[jax.Array, jax.Array]:
    return normal(2, (T, 3)), normal(3, (T, units), 0.5)


def per_weight(grads: dict[Any, Any]) -> dict[Any, np.ndarray]:
    """Every gradient flattened per ``ParamState`` (the first entry of its path)."""
    out: dict[Any, list[np.ndarray]] = {}
    for path, g in grads.items():
        out.setdefault(path[0], []).extend(np.ravel(leaf) for leaf in jax.tree.leaves(g))
    return {k: np.concatenate(v) for k, v in out.items()}


def errors(reference: dict[Any, Any], grads: dict[Any, Any]) -> dict[Any, float]:
    ref, got = per_weight(reference), per_weight(grads)
    return {k: float(np.max(np.abs(got[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref}


def reference(model: brainstate.nn.Module, xs: jax.Array, ys: jax.Array) -> dict[Any, Any]:
    return bptt_grads(model, xs, loss=lambda t, out: jnp.sum((out - ys[t]) ** 2))


def compiled(model: brainstate.nn.Module, algorithm: Any, x0: jax.Array, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, x0, **options)


def kinds(learner: Any) -> list[DiagnosticKind]:
    return [r.kind for r in learner.graph.diagnostics]


# --- which learners keep the reset gate --------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, options",
    [(braintrace.D_RTRL, {}), (braintrace.OSTLRecurrent, {}), (braintrace.SnAp, {"n": 1}), (braintrace.pp_prop, {"decay_or_rank": 0.9})],
    ids=["d_rtrl", "ostl-recurrent", "snap-1", "pp_prop"],
)
def test_per_position_traces_leave_the_reset_gate_out_and_say_so(algorithm: Any, options: dict[str, Any]) -> None:
    learner = compiled(gru(), algorithm, jnp.ones(3), **options)
    assert ("Wr", "weight") not in {rel.path for rel in learner.graph.hidden_param_op_relations}
    (record,) = [r for r in learner.graph.diagnostics if r.kind is DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT]
    assert record.weight_path == ("Wr", "weight") and "only through another trainable ETP operation" in record.message


@pytest.mark.parametrize("algorithm, options", [(braintrace.SnAp, {"n": 2}), (braintrace.UORO, {})],
                         ids=["snap-2", "uoro"])
def test_snap_and_uoro_trace_the_reset_gate_through_the_candidate_weight(algorithm: Any, options: dict[str, Any]) -> None:
    learner = compiled(gru(), algorithm, jnp.ones(3), **options)
    (rel,) = [r for r in learner.graph.hidden_param_op_relations if r.path == ("Wr", "weight")]
    assert rel.crossed_weight_paths == (("Wh", "weight"),)
    assert rel.path_classification == {("h",): "all_through_other_etp"}
    assert DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT not in kinds(learner)
    assert DiagnosticKind.TAIL_RELABELS_POSITIONS not in kinds(learner)
    assert any("through the trainable operation(s) of [('Wh', 'weight')]" in r.message
               for r in learner.graph.diagnostics if r.kind is DiagnosticKind.RELATION_INCLUDED)


# --- saturated SnAp is exact ------------------------------------------------------------------


@pytest.mark.parametrize("make", [gru, mgu, Rolled], ids=["gru", "mgu", "rolled-tail"])
@pytest.mark.parametrize("chunk", [None, 2], ids=["single-step", "windows-of-2"])
def test_saturated_snap_equals_bptt_on_every_weight(f64: None, make: Any, chunk: int | None) -> None:
    xs, ys = data(4)
    ref = reference(make(), xs, ys)
    method = "single-step" if chunk is None else "multi-step"
    learner = compiled(make(), braintrace.SnAp, xs[0], n=2, vjp_method=method)
    assert learner.graph.hidden_groups[0].snap.is_saturated  # dense recurrences: n = 2 covers the group
    assert max(errors(ref, sequence_grads(learner, xs, ys, chunk)).values()) < 1e-10
    # Negative control: D_RTRL misses on every weight it keeps and cannot train Wr / the rolled drive.
    d_rtrl = compiled(make(), braintrace.D_RTRL, xs[0], vjp_method=method)
    assert min(errors(ref, sequence_grads(d_rtrl, xs, ys, chunk)).values()) > 1e-3


# --- UORO is unbiased -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: gru(2), lambda: Rolled(2)], ids=["gru", "rolled-tail"])
def test_uoro_mean_over_every_draw_equals_bptt_on_every_weight(f64: None, make: Any) -> None:
    xs, ys = normal(2, (3, 3)), normal(3, (3, 2), 0.5)
    ref = reference(make(), xs, ys)
    learner = compiled(make(), TableUORO, xs[0])

    @brainstate.transform.jit
    def run(table: jax.Array) -> Any:
        learner.draws = table
        return sequence_grads(learner, xs, ys)

    runs = [run(jnp.asarray(t)) for t in sign_tables(1, 3, 2)]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *runs)
    assert max(errors(ref, mean).values()) < 1e-10
    assert min(max(errors(ref, r).values()) for r in runs) > 1e-3  # no single draw is the answer


def test_a_batch_axis_stays_outside_the_neighbourhoods_of_the_reset_gate(f64: None) -> None:
    # The tail's probes run over the mixing axis only; each sample's reset gate stays its own.
    batch = 2
    xs, ys = normal(2, (T, batch, 3)), normal(3, (T, batch, 4), 0.5)
    model = gru()
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)
    ref = brainstate.transform.grad(lambda: sum(jnp.sum((model(xs[t]) - ys[t]) ** 2) for t in range(T)), params)()
    learner = compiled(gru(), "snap", xs[0], batch_size=batch, n=2)
    assert learner.graph.hidden_groups[0].snap.num_neighbour == 4  # not batch · 4
    assert max(errors(ref, sequence_grads(learner, xs, ys)).values()) < 1e-10

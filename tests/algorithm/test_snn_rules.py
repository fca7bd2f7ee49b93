"""The SNN-family learners: exactness regimes against BPTT, equivalences, closed forms, errors.

Pinned (float64, relative max error < 1e-10 unless noted):

* EProp(κ=0, symmetric) ≡ D_RTRL, step by step, also where D_RTRL is approximate;
* EProp on one linear leaky layer: the per-step gradient is ``⟨s^t, ē^t⟩`` (the classical
  e-prop form), symmetric and random feedback; one window over the whole sequence == BPTT;
* OSTLRecurrent ≡ D_RTRL on element-wise models; exact vs BPTT when the recurrent mixing is
  position-diagonal (where D_RTRL is not), approximate with dense mixing;
* OSTLFeedforward(d) ≡ pp_prop(d);
* OTTT(A, λ) exact on ``h ← λ h + matmul(x, W) + b`` (also with a ``weight_fn``); OTTT(O) is the
  truncated (one-step) gradient;
* OTPE(full, λ) exact on ``h ← λ h + tanh(matmul(x, W) + b)``; equal to D_RTRL at one step;
* OSTTP: finite, target-driven (the relation-weight gradient does not depend on the loss).
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.engine.learning_signal import project_feedback
from tests.algorithm.bptt import (
    Grads,
    bptt_grads,
    cosine,
    max_rel_err,
    norm_ratio,
    normal,
    single_step_grads,
    window_grads,
    x64,
)

__all__ = ["x64"]  # the fixture is used by name

EXACT = 1e-10


# --- models ---------------------------------------------------------------------------------


class _Layer(brainstate.nn.Module):
    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__()
        self.n_hid = n_hid
        self.w = brainstate.ParamState(normal(0, (n_in, n_hid), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((self.n_hid,) if batch_size is None else (batch_size, self.n_hid)))


class LeakyLinear(_Layer):
    """``h = λ h + matmul(x, W, b)`` (optionally ``W -> tanh(W)`` inside the op)."""

    def __init__(self, lam: float = 0.9, hook: bool = False) -> None:
        super().__init__()
        self.lam, self.hook = lam, hook
        self.b = brainstate.ParamState(normal(1, (4,), 0.1))

    def update(self, x: Any) -> Any:
        fn = jnp.tanh if self.hook else None
        self.h.value = self.lam * self.h.value + braintrace.matmul(x, self.w.value, self.b.value, weight_fn=fn)
        return self.h.value


class LeakyTanh(_Layer):
    """``h = λ h + tanh(matmul(x, W, b))``: ``D ≡ λ`` but ``df = tanh'``."""

    def __init__(self, lam: float = 0.9) -> None:
        super().__init__()
        self.lam = lam
        self.b = brainstate.ParamState(normal(1, (4,), 0.1))

    def update(self, x: Any) -> Any:
        self.h.value = self.lam * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value))
        return self.h.value


class ElementwiseLeaky(_Layer):
    """``h = σ(τ) h + tanh(matmul(x, W))`` with a trainable element-wise leak; readout ``h W_out``."""

    def __init__(self) -> None:
        super().__init__()
        self.tau = brainstate.ParamState(normal(2, (4,), 0.5))
        self.w_out = brainstate.ParamState(normal(3, (4, 2), 0.5))

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value))
        return self.h.value @ self.w_out.value


class MixedLeaky(_Layer):
    """``h = 0.5 h + tanh(matmul(x, W)) + h @ R`` with a constant ``R`` (diagonal or dense)."""

    def __init__(self, dense: bool) -> None:
        super().__init__()
        r = normal(4, (4, 4), 0.3)
        self.r = r if dense else jnp.diag(jnp.diag(r))

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value)) + self.h.value @ self.r
        return self.h.value


class TwoState(brainstate.nn.Module):
    """``v = .9 v + matmul(x, W) − .1 a``, ``a = .95 a + v``: one group with two states."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (3, 4), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4)))
        self.a = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4)))

    def update(self, x: Any) -> Any:
        v = 0.9 * self.v.value + braintrace.matmul(x, self.w.value) - 0.1 * self.a.value
        self.a.value = 0.95 * self.a.value + v
        self.v.value = v
        return v


class FanOut(_Layer):
    """One matmul driving two hidden states (one relation, two groups)."""

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        super().init_state(batch_size)
        self.h2 = brainstate.HiddenState(jnp.zeros_like(self.h.value))

    def update(self, x: Any) -> Any:
        y = braintrace.matmul(x, self.w.value)
        self.h.value = 0.9 * self.h.value + y
        self.h2.value = 0.5 * self.h2.value + y
        return self.h.value + self.h2.value


class TwoLayers(brainstate.nn.Module):
    """Two leaky layers in series (two groups, a relation each)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = LeakyLinear(), LeakyLinear()
        self.l2.w = brainstate.ParamState(normal(5, (4, 4), 0.5))

    def update(self, x: Any) -> Any:
        return self.l2(self.l1(x))


def inputs(n_steps: int, batch: int | None, n_in: int = 3) -> jax.Array:
    return normal(7, (n_steps, n_in) if batch is None else (n_steps, batch, n_in))


def compile_(
    model: brainstate.nn.Module, algorithm: Any, x0: Any, batch_size: int | None = None, **options: Any
) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, x0, batch_size=batch_size, **options)


def per_step_grads(learner: Any, xs: jax.Array, loss: Any = None) -> list[Grads]:
    """The gradient of every step separately (one jit for the whole run)."""
    params = learner.param_states
    loss = loss or (lambda out: jnp.sum(out * normal(11, out.shape)))

    def run() -> Any:
        return [brainstate.transform.grad(lambda t=t: loss(learner(xs[t])), params)() for t in range(xs.shape[0])]

    return [{p: np.asarray(v) for p, v in g.items()} for g in brainstate.transform.jit(run)()]


# --- names, exports and argument errors -----------------------------------------------------


_CLASSES = ["EProp", "OSTLRecurrent", "OSTLFeedforward", "OTTT", "OTPE", "OSTTP",
            "FixedRandomFeedback", "KappaFilter", "PresynapticTrace"]


def test_exports_and_module_names() -> None:
    for name in [*_CLASSES, "GradExpon"]:
        assert name in braintrace.__all__
    for name in _CLASSES:
        assert getattr(braintrace, name).__module__ == "braintrace"
    assert issubclass(braintrace.EProp, braintrace.ParamDimVjpAlgorithm)
    assert issubclass(braintrace.OSTLFeedforward, braintrace.pp_prop)
    assert braintrace.OSTLRecurrent.regime == "with-H" and braintrace.OSTLFeedforward.regime == "without-H"
    assert not hasattr(braintrace, "OSTL")


@pytest.mark.parametrize("name, cls", [
    ("eprop", "EProp"), ("E_Prop", "EProp"), (" ostl_recurrent ", "OSTLRecurrent"),
    ("OSTL_feedforward", "OSTLFeedforward"), ("otpe", "OTPE"), ("ottt", "OTTT"), ("osttp", "OSTTP"),
])
def test_compile_names(name: str, cls: str) -> None:
    options = {"OTPE": {"leak": 0.9}, "OTTT": {"leak": 0.9}, "OSTTP": {"B_list": [jnp.ones((2, 4))]}}.get(cls, {})
    learner = compile_(LeakyLinear(), name, jnp.ones(3), **options)
    assert type(learner) is getattr(braintrace, cls)


def test_bare_ostl_is_not_a_name() -> None:
    with pytest.raises(ValueError, match="ostl_recurrent"):
        braintrace.compile(LeakyLinear(), "ostl", jnp.ones(3))


@pytest.mark.parametrize("build, match", [
    (lambda m: braintrace.EProp(m, feedback="dense"), "feedback must be 'symmetric' or 'random'"),
    (lambda m: braintrace.EProp(m, feedback="random"), "random_feedback_key"),
    (lambda m: braintrace.EProp(m, kappa_filter_decay=1.0), "0 <= kappa < 1"),
    (lambda m: braintrace.EProp(m, kappa_filter_decay=-0.1), "0 <= kappa < 1"),
    (lambda m: braintrace.OTTT(m, "B", leak=0.9), r"mode must be one of \['A', 'O'\]"),
    (lambda m: braintrace.OTTT(m, leak=1.0), "0 < leak < 1"),
    (lambda m: braintrace.OTTT(m, leak=0.9, vjp_method="multi-step"), "single-step"),
    (lambda m: braintrace.OTPE(m, "exact", leak=0.9), r"mode must be one of \['full', 'approx'\]"),
    (lambda m: braintrace.OTPE(m, leak=0.0), "0 < leak < 1"),
    (lambda m: braintrace.OTPE(m, leak=0.9, vjp_method="multi-step"), "single-step"),
    (lambda m: braintrace.OTPE(m, leak=0.9, trace_clip_abs=-1.0), "trace_clip_abs"),
    (lambda m: braintrace.OSTTP(m, [jnp.ones((2, 4))], target_timing="end"), "target_timing"),
    (lambda m: braintrace.OSTTP(m, [jnp.ones(4)]), r"B_list\[0\] must be a \(n_target, n_hidden\) matrix"),
    (lambda m: braintrace.OSTLFeedforward(m, 1.5), "decay_or_rank=1.5"),
])
def test_constructor_errors(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(LeakyLinear())


def test_leak_is_a_required_keyword() -> None:
    with pytest.raises(TypeError, match="leak"):
        braintrace.OTTT(LeakyLinear())  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        braintrace.OTPE(LeakyLinear(), "full", 0.9)  # type: ignore[misc]


# --- EProp ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [ElementwiseLeaky, lambda: MixedLeaky(dense=True)], ids=["exact", "approximate"])
def test_eprop_kappa_zero_symmetric_is_d_rtrl_step_by_step(x64: None, model: Any) -> None:
    xs = inputs(4, 2)
    ref = per_step_grads(compile_(model(), braintrace.D_RTRL, xs[0], 2), xs)
    got = per_step_grads(compile_(model(), braintrace.EProp, xs[0], 2), xs)
    for r, g in zip(ref, got):
        assert max_rel_err(r, g) < EXACT


class ReadsDrive(_Layer):
    """``y = matmul(x, W)``, ``h = 0.8 h + tanh(y)``, output ``h + y / 2``: ``W`` also reaches the
    output past ``h``, so its one-step gradient is more than ``⟨g, x ⊗ df⟩``."""

    def update(self, x: Any) -> Any:
        y = braintrace.matmul(x, self.w.value)
        self.h.value = 0.8 * self.h.value + jnp.tanh(y)
        return self.h.value + 0.5 * y


@pytest.mark.parametrize("model", [ElementwiseLeaky, ReadsDrive, TwoState], ids=["readout", "reads-drive", "two-state"])
def test_eprop_filtered_single_step_matches_the_general_solve(x64: None, model: Any) -> None:
    """The closed-form kernels read the history off the new filter (``ē^t − x ⊗ df``); the
    general rules contract ``Dᵀ g`` with ``ε^{t-1}`` and ``κ g`` with ``ē^{t-1}``."""
    xs = inputs(4, 2)
    ref = per_step_grads(compile_(model(), braintrace.EProp, xs[0], 2, kappa_filter_decay=0.6, fast_solve=False), xs)
    got = per_step_grads(compile_(model(), braintrace.EProp, xs[0], 2, kappa_filter_decay=0.6), xs)
    for r, g in zip(ref, got):
        assert max_rel_err(r, g) < EXACT


def _eligibility(xs: np.ndarray, lam: float, kappa: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """ε^t = λ ε^{t-1} + x^t and ē^t = κ ē^{t-1} + ε^t for a linear leaky layer (per batch row)."""
    eps, filt, out_e, out_f = 0.0, 0.0, [], []
    for x in xs:
        eps = lam * eps + x
        filt = kappa * filt + eps
        out_e.append(eps)
        out_f.append(filt)
    return out_e, out_f


@pytest.mark.parametrize("feedback", ["symmetric", "random"])
def test_eprop_closed_form_on_one_layer(x64: None, feedback: str) -> None:
    """Loss ``Σ c ⊙ h^t``: the per-step weight gradient is ``Σ_b ē^t[b, i] s^t[b, o]``."""
    xs = inputs(4, 2)
    c = normal(11, (2, 4))
    learner = compile_(LeakyLinear(lam=0.8), braintrace.EProp, xs[0], 2, kappa_filter_decay=0.5,
                       feedback=feedback, random_feedback_key=3)
    got = per_step_grads(learner, xs, loss=lambda out: jnp.sum(c * out))
    signal = np.asarray(c)
    if feedback == "random":
        signal = np.asarray(project_feedback(c[..., None], learner._feedback_matrices[0].B))[..., 0]
    _, filt = _eligibility(np.asarray(xs), 0.8, 0.5)
    for t, g in enumerate(got):
        np.testing.assert_allclose(g[("w",)], np.einsum("bi,bo->io", filt[t], signal), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(g[("b",)], _bias_filter(t) * signal.sum(0), rtol=1e-12, atol=1e-12)


def _bias_filter(t: int, lam: float = 0.8, kappa: float = 0.5) -> float:
    _, filt = _eligibility(np.ones((t + 1, 1)), lam, kappa)
    return float(filt[t][0])


def test_eprop_filter_advances_in_the_forward_pass(x64: None) -> None:
    xs = inputs(2, None)
    learner = compile_(LeakyLinear(lam=0.8), braintrace.EProp, xs[0], kappa_filter_decay=0.5)
    brainstate.transform.jit(lambda: [learner(xs[t]) for t in range(2)])()  # no gradient taken
    (filt,) = learner._trace_filters.values()
    eps, ref = _eligibility(np.asarray(xs), 0.8, 0.5)
    np.testing.assert_allclose(filt.value["weight"][..., 0], np.outer(ref[1], np.ones(4)), rtol=1e-12)
    learner.reset_state()
    assert not np.any(filt.value["weight"])


def test_eprop_random_feedback_is_seeded_and_differs_from_symmetric(x64: None) -> None:
    xs = inputs(3, 2)
    grads = {}
    for name, opts in {"sym": {}, "r0": {"random_feedback_key": 0}, "r0b": {"random_feedback_key": 0},
                       "r1": {"random_feedback_key": 1}}.items():
        fb = "random" if opts else "symmetric"
        learner = compile_(ElementwiseLeaky(), braintrace.EProp, xs[0], 2, feedback=fb, **opts)
        grads[name] = single_step_grads(learner, xs)
    assert max_rel_err(grads["r0"], grads["r0b"]) == 0.0
    assert max_rel_err(grads["r0"], grads["r1"]) > 1e-3
    assert max_rel_err(grads["sym"], grads["r0"]) > 1e-3
    # The readout is outside every relation: its gradient stays exact.
    np.testing.assert_allclose(grads["r0"][("w_out",)], grads["sym"][("w_out",)], rtol=1e-12)


@pytest.mark.parametrize("options", [{"kappa_filter_decay": 0.5},
                                     {"feedback": "random", "random_feedback_key": 0, "kappa_filter_decay": 0.3}])
def test_eprop_one_window_over_the_sequence_equals_bptt(x64: None, options: dict) -> None:
    xs = inputs(4, 2)
    ref = bptt_grads(ElementwiseLeaky(), xs, batch_size=2)
    learner = compile_(ElementwiseLeaky(), braintrace.EProp, xs[0], 2, vjp_method="multi-step", **options)
    assert max_rel_err(ref, window_grads(learner, xs, [4])) < EXACT
    learner = compile_(ElementwiseLeaky(), braintrace.EProp, xs[0], 2, vjp_method="multi-step", **options)
    assert max_rel_err(ref, window_grads(learner, xs, [2, 2])) > 1e-6  # the filtered entry trace


# --- OSTLRecurrent / OSTLFeedforward --------------------------------------------------------


def test_ostl_recurrent_equals_d_rtrl_on_element_wise_models(x64: None) -> None:
    xs = inputs(4, 2)
    ref = single_step_grads(compile_(ElementwiseLeaky(), braintrace.D_RTRL, xs[0], 2), xs)
    learner = compile_(ElementwiseLeaky(), braintrace.OSTLRecurrent, xs[0], 2)
    assert all(not g.is_diagonal_recurrence for g in learner.graph.hidden_groups)
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT
    assert max_rel_err(bptt_grads(ElementwiseLeaky(), xs, batch_size=2), ref) < EXACT


def test_ostl_recurrent_is_exact_with_position_diagonal_mixing(x64: None) -> None:
    xs = inputs(4, 2)
    ref = bptt_grads(MixedLeaky(dense=False), xs, batch_size=2)
    ostl = single_step_grads(compile_(MixedLeaky(dense=False), braintrace.OSTLRecurrent, xs[0], 2), xs)
    d_rtrl = single_step_grads(compile_(MixedLeaky(dense=False), braintrace.D_RTRL, xs[0], 2), xs)
    assert max_rel_err(ref, ostl) < EXACT
    assert max_rel_err(ref, d_rtrl) > 1e-3  # D_RTRL cuts h @ R from D


def test_ostl_recurrent_approximates_dense_mixing(x64: None) -> None:
    xs = inputs(6, 2)
    ref = bptt_grads(MixedLeaky(dense=True), xs, batch_size=2)
    ostl = single_step_grads(compile_(MixedLeaky(dense=True), braintrace.OSTLRecurrent, xs[0], 2), xs)
    d_rtrl = single_step_grads(compile_(MixedLeaky(dense=True), braintrace.D_RTRL, xs[0], 2), xs)
    assert max_rel_err(ref, ostl) > 1e-6  # the off-diagonal coupling of h @ R is dropped
    # Measured: cosine .833 (OSTLRecurrent) vs .805 (D_RTRL, which also drops the diagonal).
    assert cosine(ref, ostl) > cosine(ref, d_rtrl) > 0.75


@pytest.mark.parametrize("vjp_method, windows", [("single-step", None), ("multi-step", [2, 2])])
def test_ostl_feedforward_equals_pp_prop(x64: None, vjp_method: str, windows: Any) -> None:
    xs = inputs(4, 2)
    results = []
    for cls, opts in ((braintrace.OSTLFeedforward, {}), (braintrace.pp_prop, {"decay_or_rank": 1e-6})):
        learner = compile_(ElementwiseLeaky(), cls, xs[0], 2, vjp_method=vjp_method, **opts)
        results.append(single_step_grads(learner, xs) if windows is None else window_grads(learner, xs, windows))
    assert max_rel_err(results[1], results[0]) < EXACT
    learner = braintrace.OSTLFeedforward(LeakyLinear(), 0.9)
    assert learner.decay == 0.9 and braintrace.OSTLFeedforward(LeakyLinear()).num_rank == 1


# --- OTTT -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [None, 2])
@pytest.mark.parametrize("hook", [False, True])
def test_ottt_is_exact_on_a_leaky_integrator(x64: None, batch: int | None, hook: bool) -> None:
    xs = inputs(4, batch)
    ref = bptt_grads(LeakyLinear(hook=hook), xs, batch_size=batch)
    got = single_step_grads(compile_(LeakyLinear(hook=hook), braintrace.OTTT, xs[0], batch, leak=0.9), xs)
    assert max_rel_err(ref, got) < EXACT


def test_ottt_mode_o_is_the_one_step_gradient_and_ignores_df_history(x64: None) -> None:
    xs = inputs(4, 2)
    truncated = bptt_grads(LeakyTanh(), xs, batch_size=2, truncated=True)
    got = single_step_grads(compile_(LeakyTanh(), braintrace.OTTT, xs[0], 2, mode="O", leak=0.9), xs)
    assert max_rel_err(truncated, got) < EXACT
    # Mode A on a tanh layer: the history misses tanh' (upstream's df-free estimate).
    ref = bptt_grads(LeakyTanh(), xs, batch_size=2)
    approx = single_step_grads(compile_(LeakyTanh(), braintrace.OTTT, xs[0], 2, leak=0.9), xs)
    assert max_rel_err(ref, approx) > 1e-3 and cosine(ref, approx) > 0.9


def test_ottt_traces_and_reset(x64: None) -> None:
    xs = inputs(2, 2)
    learner = compile_(LeakyLinear(), braintrace.OTTT, xs[0], 2, leak=0.5)
    brainstate.transform.jit(lambda: [learner(xs[t]) for t in range(2)])()
    traces = learner.get_etrace_of(learner.param_states[("w",)])
    bias = learner.get_etrace_of(("b",))[-1]
    np.testing.assert_allclose(next(v for k, v in traces.items() if k != -1), 0.5 * xs[0] + xs[1], rtol=1e-12)
    assert float(bias) == 1.5
    learner.reset_state(batch_size=5)
    assert next(iter(learner._pre_traces.values())).value.shape == (5, 3) and float(learner._bias_trace.value) == 0.0


# --- OTPE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [None, 2])
def test_otpe_full_is_exact_when_d_is_the_leak(x64: None, batch: int | None) -> None:
    xs = inputs(4, batch)
    ref = bptt_grads(LeakyTanh(), xs, batch_size=batch)
    got = single_step_grads(compile_(LeakyTanh(), braintrace.OTPE, xs[0], batch, leak=0.9), xs)
    assert max_rel_err(ref, got) < EXACT


@pytest.mark.parametrize("batch", [None, 2])
def test_otpe_full_with_a_clip_no_trace_reaches_is_exact(x64: None, batch: int | None) -> None:
    """With a clip, the gradient is the estimate at the new trace minus its same-step term
    (``x ⊗ (L ⊙ df)``, taken from the factors); a clip no value reaches leaves it exact."""
    xs = inputs(4, batch)
    ref = bptt_grads(LeakyTanh(), xs, batch_size=batch)
    learner = compile_(LeakyTanh(), braintrace.OTPE, xs[0], batch, leak=0.9, trace_clip_abs=1e6)
    assert not learner._plain_history
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


def test_otpe_full_equals_d_rtrl_at_one_step(x64: None) -> None:
    xs = inputs(1, 2)
    ref = single_step_grads(compile_(MixedLeaky(dense=True), braintrace.D_RTRL, xs[0], 2), xs)
    got = single_step_grads(compile_(MixedLeaky(dense=True), braintrace.OTPE, xs[0], 2, leak=0.5), xs)
    assert max_rel_err(ref, got) < EXACT


def test_otpe_approx_inflates_and_clipping_shrinks(x64: None) -> None:
    xs = inputs(6, 2)
    ref = bptt_grads(LeakyTanh(), xs, batch_size=2)
    approx = single_step_grads(compile_(LeakyTanh(), braintrace.OTPE, xs[0], 2, mode="approx", leak=0.9), xs)
    # Measured: cosine .765, magnitude 2.82 x BPTT (the product of two filtered factors).
    assert cosine(ref, approx) > 0.7 and norm_ratio(ref, approx) > 2
    full = single_step_grads(compile_(LeakyTanh(), braintrace.OTPE, xs[0], 2, leak=0.9), xs)
    clipped = single_step_grads(compile_(LeakyTanh(), braintrace.OTPE, xs[0], 2, leak=0.9, trace_clip_abs=0.01), xs)
    assert norm_ratio(full, clipped) < 0.9  # measured .836: the clipped history shrinks


def test_otpe_stores_and_reset(x64: None) -> None:
    learner = compile_(LeakyLinear(), braintrace.OTPE, jnp.ones((2, 3)), 2, leak=0.9)
    (store,) = learner.get_etrace_of(("w",)).values()
    assert store["R"].shape == (2, 3, 4) and store["R_b"].shape == (2, 4) and store["R"].dtype == jnp.float64
    learner.reset_state(batch_size=3)
    (store,) = learner.get_etrace_of(("w",)).values()
    assert store["R"].shape == (3, 3, 4)
    approx = compile_(LeakyLinear(), braintrace.OTPE, jnp.ones(3), mode="approx", leak=0.9)
    (store,) = approx.get_etrace_of(("w",)).values()
    assert store["Rx"].shape == (3,) and store["Rg"].shape == (4,)


def test_otpe_approx_with_several_groups_warns() -> None:
    with pytest.warns(UserWarning, match="approx"):
        braintrace.compile(TwoLayers(), braintrace.OTPE, jnp.ones(3), mode="approx", leak=0.9)


# --- errors at compilation and call ---------------------------------------------------------


@pytest.mark.parametrize("algorithm", [braintrace.OTTT, braintrace.OTPE])
def test_dense_rules_refuse_what_they_cannot_learn(algorithm: Any) -> None:
    with pytest.raises(NotImplementedError, match=r"etp_elemwise.*D_RTRL"):
        compile_(ElementwiseLeaky(), algorithm, jnp.ones(3), leak=0.9)
    model = TwoState()
    brainstate.nn.init_all_states(model)
    learner = algorithm(model, leak=0.9)
    with pytest.raises(ValueError, match="num_state == 1"):
        learner.compile_graph(jnp.ones((1, 3)))
    assert not learner.is_compiled
    learner = compile_(LeakyLinear(), algorithm, jnp.ones(3), leak=0.9)
    with pytest.raises(NotImplementedError, match="supports single-step only"):
        learner(braintrace.MultiStepData(jnp.ones((2, 3))))


def test_otpe_refuses_a_relation_driving_two_groups() -> None:
    learner = braintrace.OTPE(FanOut(), leak=0.9)
    brainstate.nn.init_all_states(learner.model4compile)
    with pytest.raises(ValueError, match="exactly one hidden group"):
        learner.compile_graph(jnp.ones(3))
    assert not learner.is_compiled


# --- OSTTP ----------------------------------------------------------------------------------


def test_osttp_is_target_driven_and_finite(x64: None) -> None:
    xs = inputs(3, 2)
    y = normal(12, (2, 2))
    B = normal(13, (2, 4), 0.3)
    grads = []
    for loss in (lambda out: jnp.sum(out), lambda out: jnp.sum(out ** 3)):
        learner = compile_(ElementwiseLeaky(), braintrace.OSTTP, xs[0], 2, B_list=[B])
        params = learner.param_states

        def run(learner: Any = learner, params: Any = params, loss: Any = loss) -> list:
            return [brainstate.transform.grad(lambda t=t: loss(learner(xs[t], y)), params)() for t in range(3)]

        grads.append(brainstate.transform.jit(run)()[-1])
    for g in grads:
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in g.values())
    # Relation weights follow the target projection whatever the loss; the readout follows the loss.
    for path in (("w",), ("tau",)):
        np.testing.assert_allclose(grads[0][path], grads[1][path], rtol=1e-10, atol=1e-12)
    assert not np.allclose(grads[0][("w_out",)], grads[1][("w_out",)])


def test_osttp_errors_and_sequence_end_timing() -> None:
    B = jnp.ones((2, 4))
    with pytest.raises(ValueError, match="2 matrices but the model has 1 hidden groups"):
        compile_(LeakyLinear(), braintrace.OSTTP, jnp.ones(3), B_list=[B, B])
    learner = braintrace.OSTTP(LeakyLinear(), [jnp.ones((2, 5))])
    brainstate.nn.init_all_states(learner.model4compile)
    with pytest.raises(ValueError, match=r"has 4 units on its last axis; use shape \(n_target, 4\)"):
        learner.compile_graph(jnp.ones(3))
    assert not learner.is_compiled
    learner = compile_(LeakyLinear(), braintrace.OSTTP, jnp.ones(3), B_list=[B])
    with pytest.raises(ValueError, match="needs a target at every call"):
        learner(jnp.ones(3))
    learner = compile_(LeakyLinear(), braintrace.OSTTP, jnp.ones(3), B_list=[B], target_timing="sequence-end")
    g = brainstate.transform.grad(lambda: learner(jnp.ones(3)).sum(), learner.param_states)()
    np.testing.assert_allclose(g[("w",)], 0.0)  # no target: zero signal replaces the same-step path


@pytest.mark.parametrize("algorithm, options", [
    (braintrace.EProp, {"kappa_filter_decay": 0.5, "feedback": "random", "random_feedback_key": 0}),
    (braintrace.OTTT, {"leak": 0.9}),
    (braintrace.OSTTP, {"B_list": [jnp.ones((2, 4))]}),
], ids=["eprop", "ottt", "osttp"])
def test_vmapped_learners_give_per_parameter_gradients(algorithm: Any, options: dict) -> None:
    x = jnp.ones((2, 3))
    vmapped = compile_(LeakyLinear(), algorithm, x, 2, vmap=True, **options)
    args = (x, jnp.ones((2, 2))) if algorithm is braintrace.OSTTP else (x,)
    grads = brainstate.transform.grad(lambda: vmapped(*args).sum(), vmapped.module.param_states)()
    assert grads[("w",)].shape == (3, 4) and bool(jnp.all(jnp.isfinite(grads[("w",)])))


@pytest.mark.parametrize("kappa", [0.0, 0.5])
def test_eprop_random_feedback_single_step_equals_its_definition(x64: None, kappa: float) -> None:
    """Single step, random feedback: a relation weight's gradient is ``Σ_t ⟨s^t, ē^t⟩`` (the
    learning signal ``s = ŝ B`` met by the filtered trace), the readout's its one-step gradient.

    The reference rolls the traces of ``h = σ(τ) h + tanh(x W)`` by hand in float64.
    """
    xs = inputs(3, 2)
    learner = compile_(ElementwiseLeaky(), braintrace.EProp, xs[0], 2, feedback="random",
                       random_feedback_key=0, kappa_filter_decay=kappa)
    w, tau, w_out = (np.asarray(learner.param_states[(k,)].value, np.float64) for k in ("w", "tau", "w_out"))
    (feedback,) = learner._feedback_matrices.values()
    B = np.asarray(feedback.B, np.float64)
    grads = single_step_grads(learner, xs)

    leak = 1 / (1 + np.exp(-tau))
    h = np.zeros((2, 4))
    eps_w, filt_w, eps_tau, filt_tau = np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), np.zeros((2, 4)), np.zeros((2, 4))
    ref = {"w": np.zeros_like(w), "tau": np.zeros_like(tau), "w_out": np.zeros_like(w_out)}
    for t in range(3):
        x = np.asarray(xs[t], np.float64)
        pre = x @ w
        eps_w = leak * eps_w + x[:, :, None] * (1 - np.tanh(pre) ** 2)[:, None, :]
        eps_tau = leak * eps_tau + h * leak * (1 - leak)
        filt_w, filt_tau = kappa * filt_w + eps_w, kappa * filt_tau + eps_tau
        h = leak * h + np.tanh(pre)
        out = h @ w_out
        d_out = 2 * (out - np.asarray(normal(1000 + 7 * t, out.shape), np.float64))  # target_loss
        g = d_out @ w_out.T
        s = (g / (np.linalg.norm(g, axis=-1, keepdims=True) + 1e-8)) @ B
        ref["w"] += np.einsum("bio,bo->io", filt_w, s)
        ref["tau"] += np.einsum("bo,bo->o", filt_tau, s)
        ref["w_out"] += h.T @ d_out
    for k, v in ref.items():
        np.testing.assert_allclose(grads[(k,)], v, rtol=1e-9, atol=1e-12)

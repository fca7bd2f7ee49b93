"""Exactness labels of ``learner.report`` against the gradient audit, in float64.

For every (model, learner) of a small zoo the labels are pinned, and ``check_gradients``
(single step, ``T = 6``, from a fresh start) measures each relation's weights against BPTT of
the same objective: a relation labelled exact measures a relative error below ``1e-8``, and a
weight measuring above ``1e-6`` has an approximate label. On this zoo the labels are also tight:
every approximate label measures above ``1e-6``, except the listed conservative ones.

The zoo: an element-wise leaky RNN, a dense ``ValinaRNNCell``, a ``GRUCell``, a LIF layer with a
trainable element-wise leak, two stacked leaky layers (group 2 reads group 1), a leaky RNN whose
drive is rolled, a dense RNN whose input drive is rolled, and SnAp's sparse ring (saturated at
``n = 6``). The heavier half of the grid is marked ``exhaustive`` (``make test`` runs it too).
The report's labels per weight (``weight_exactness``, printed by ``verbose=2``), plain weights
included, are checked the same way; ``test_exactness_labels_nn.py`` does so for ``braintrace.nn``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.engine.exactness import relation_labels
from braintrace._audit import GradientAudit, check_gradients
from braintrace._compiler.exactness_label import ExactnessLabel
from tests.algorithm.bptt import normal, x64
from tests.algorithm.snap_ring import Ring
from tests.compiler.models import spike

__all__ = ["x64"]  # the fixture is used by name (through f64)

T, I, H, O = 6, 3, 4, 2
#: A relation labelled exact measures below this (float64).
EXACT = 1e-8
#: A weight measuring above this must carry an approximate label.
APPROXIMATE = 1e-6


@pytest.fixture
def f64(x64: None) -> Iterator[None]:
    """float64 arrays (``x64``) and float64 brainstate defaults (the cells' parameters) for one test."""
    with brainstate.environ.context(precision=64):
        yield


# --- the zoo ------------------------------------------------------------------------------------


class _Readout(brainstate.nn.Module):
    """A plain ``ParamState`` readout ``… @ readout`` (no relation)."""

    def __init__(self, seed: int, width: int = H) -> None:
        super().__init__()
        self.readout = brainstate.ParamState(normal(seed, (width, O)))


class Leaky(_Readout):
    """``h = a ⊙ h + matmul(x, W)``: an element-wise recurrence."""

    def __init__(self) -> None:
        super().__init__(20)
        self.w = brainstate.ParamState(normal(1, (I, H), 0.6))
        self.decay = jnp.linspace(0.5, 0.9, H)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, H) if batch_size else (H,)))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = self.decay * self.h.value + braintrace.matmul(x, self.w.value)
        return jnp.tanh(self.h.value) @ self.readout.value


class Dense(_Readout):
    """``braintrace.nn.ValinaRNNCell``: ``h = tanh([x, h] @ W + b)``, the recurrence mixes units."""

    def __init__(self) -> None:
        super().__init__(21)
        self.cell = braintrace.nn.ValinaRNNCell(I, H)

    def update(self, x: jax.Array) -> jax.Array:
        return self.cell(x) @ self.readout.value


class GRU(_Readout):
    """``braintrace.nn.GRUCell``: the reset gate's weight reaches ``h`` through another one."""

    def __init__(self) -> None:
        super().__init__(22)
        self.cell = braintrace.nn.GRUCell(I, H)

    def update(self, x: jax.Array) -> jax.Array:
        return self.cell(x) @ self.readout.value


class LIF(_Readout):
    """``v = σ(τ) ⊙ v ⊙ (1 - s) + matmul(x, W)``, ``s`` a surrogate spike: element-wise leak and reset."""

    def __init__(self) -> None:
        super().__init__(23)
        self.tau = brainstate.ParamState(normal(3, (H,)))
        self.w_in = brainstate.ParamState(normal(4, (I, H), 1.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros(H))

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        s = spike(self.v.value - 1.0)
        self.v.value = leak * self.v.value * (1 - s) + braintrace.matmul(x, self.w_in.value)
        return spike(self.v.value - 1.0) @ self.readout.value


class Stacked(_Readout):
    """Two leaky layers; the second reads the first's new value through ``matmul(tanh(h1), W2)``."""

    def __init__(self) -> None:
        super().__init__(24)
        self.w1 = brainstate.ParamState(normal(5, (I, H), 0.6))
        self.w2 = brainstate.ParamState(normal(6, (H, H), 0.6))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h1 = brainstate.HiddenState(jnp.zeros(H))
        self.h2 = brainstate.HiddenState(jnp.zeros(H))

    def update(self, x: jax.Array) -> jax.Array:
        self.h1.value = 0.7 * self.h1.value + braintrace.matmul(x, self.w1.value)
        self.h2.value = 0.8 * self.h2.value + braintrace.matmul(jnp.tanh(self.h1.value), self.w2.value)
        return self.h2.value @ self.readout.value


class Rolled(_Readout):
    """``h = 0.8 h + roll(matmul(x, W), 1)`` along the units: the drive lands one unit over."""

    def __init__(self) -> None:
        super().__init__(25)
        self.w = brainstate.ParamState(normal(7, (I, H), 0.6))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, H) if batch_size else (H,)))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = 0.8 * self.h.value + jnp.roll(braintrace.matmul(x, self.w.value), 1, axis=-1)
        return jnp.tanh(self.h.value) @ self.readout.value


class RolledDense(_Readout):
    """``h = tanh(roll(matmul(x, W_in), 1) + matmul(h, W_rec))``: a rolled drive into a dense recurrence."""

    def __init__(self) -> None:
        super().__init__(26)
        self.w_in = brainstate.ParamState(normal(8, (I, H), 0.6))
        self.w_rec = brainstate.ParamState(normal(9, (H, H), 0.4))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(H))

    def update(self, x: jax.Array) -> jax.Array:
        drive = jnp.roll(braintrace.matmul(x, self.w_in.value), 1) + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = jnp.tanh(drive)
        return self.h.value @ self.readout.value


class RingRNN(_Readout):
    """SnAp's six-unit sparse ring (each unit reads itself and its predecessor), read out."""

    def __init__(self) -> None:
        super().__init__(27, width=6)
        self.ring = Ring()

    def update(self, x: jax.Array) -> jax.Array:
        return self.ring(x) @ self.readout.value


MODELS: dict[str, Callable[[], brainstate.nn.Module]] = {
    "leaky": Leaky, "dense": Dense, "gru": GRU, "lif": LIF, "stacked": Stacked, "rolled": Rolled,
    "rolled_dense": RolledDense, "ring": RingRNN,
}

LEARNERS: dict[str, tuple[str, dict[str, Any]]] = {
    "d_rtrl": ("d_rtrl", {}),
    "pp_prop": ("pp_prop", {"decay_or_rank": 0.9}),
    "eprop": ("eprop", {"kappa_filter_decay": 0.5}),
    "ostl": ("ostl_recurrent", {}),
    "snap2": ("snap", {"n": 2}),
    "snap6": ("snap", {"n": 6}),  # saturates every group of the zoo (the ring at n = 6)
    "uoro": ("uoro", {}),
    "three_factor": ("three_factor", {}),
}

_PER_POSITION_EXACT = {"d_rtrl", "ostl", "snap2", "snap6"}
_SATURATED = {"snap2", "snap6"}

FACTORISED = "factorised trace (pp_prop keeps x̄ ⊗ ε_f, a rank-one summary of the per-parameter trace)"

#: ``model -> weight -> the learners that label its relation exact`` (every other learner: approximate).
EXACT_LEARNERS: dict[str, dict[str, set[str]]] = {
    "leaky": {"w": _PER_POSITION_EXACT},
    "dense": {"cell.W.weight": _SATURATED},
    "gru": {"cell.Wz.weight": _SATURATED, "cell.Wr.weight": _SATURATED, "cell.Wh.weight": _SATURATED},
    "lif": {"tau": _PER_POSITION_EXACT, "w_in": _PER_POSITION_EXACT},
    "stacked": {"w1": _SATURATED, "w2": {"d_rtrl", "snap2", "snap6"}},
    "rolled": {"w": set()},
    "rolled_dense": {"w_in": _SATURATED, "w_rec": _SATURATED},
    "ring": {"ring.w_in": {"snap6"}, "ring.w": {"snap6"}},
}

#: ``(model, learner, weight)`` labelled approximate that measure exact: under the coupled scope the
#: stacked layers form one group whose recurrence mixes units (h1 -> h2), which ``w2``'s influence
#: (on ``h2`` only, element-wise) never crosses.
CONSERVATIVE = {("stacked", "ostl", "w2")}

#: Each label rule once, measured; the rest of the grid is marked ``exhaustive``.
FAST = {
    ("leaky", learner) for learner in LEARNERS
} | {
    ("dense", "d_rtrl"), ("dense", "ostl"), ("lif", "d_rtrl"), ("stacked", "d_rtrl"),
    ("stacked", "ostl"), ("rolled", "d_rtrl"), ("rolled", "snap6"), ("rolled_dense", "snap2"), ("ring", "snap6"),
}


def _case(model: str, learner: str) -> Any:
    marks = () if (model, learner) in FAST else (pytest.mark.exhaustive,)
    return pytest.param(model, learner, id=f"{model}-{learner}", marks=marks)


GRID = [_case(model, learner) for model in MODELS for learner in LEARNERS]


# --- helpers --------------------------------------------------------------------------------


def build(model: str, learner: str) -> braintrace.ETraceAlgorithm:
    """The learner of ``model`` (float64 parameters under the ``f64`` fixture).

    The compiler's warnings about what the labels report are expected: a rolled tail under a
    non-diagonal scope, and the GRU's reset gate left out by the per-position scopes.
    """
    algorithm, kwargs = LEARNERS[learner]
    brainstate.random.seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The y -> h tail of .* moves values to other positions", UserWarning)
        warnings.filterwarnings("ignore", "The output of .* reaches hidden states only through another", UserWarning)
        return braintrace.compile(MODELS[model](), algorithm, jnp.ones(I), **kwargs)


def audit(learner: braintrace.ETraceAlgorithm, learner_name: str) -> GradientAudit:
    xs, ys = normal(11, (T, I)), normal(12, (T, O))
    if learner_name == "three_factor":
        modulators = normal(13, (T,))
        return check_gradients(learner, xs, ys, modulators,
                               step_fn=lambda x, y, m: jnp.sum((learner(x, modulator=m) - y) ** 2))
    return check_gradients(learner, xs, ys, step_fn=lambda x, y: jnp.sum((learner(x) - y) ** 2))


def relation_weights(model: str, learner: str) -> list[str]:
    """The weights with a relation: the GRU's reset gate reaches ``h`` only through ``Wh``, which only
    SnAp (n >= 2) and UORO follow."""
    follows = learner in _SATURATED or learner == "uoro"
    return sorted(w for w in EXACT_LEARNERS[model] if follows or w != "cell.Wr.weight")


def name(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path)


def errors_per_weight(result: GradientAudit) -> dict[tuple[Any, ...], float]:
    """The largest relative error over each weight's leaves."""
    errors: dict[tuple[Any, ...], float] = {}
    for row in result.rows:
        errors[row.path] = max(errors.get(row.path, 0.0), row.relative_error)
    return errors


def violations(labels: tuple[ExactnessLabel, ...], errors: dict[tuple[Any, ...], float]) -> list[str]:
    """What contradicts the measurement: an exact label off BPTT, or a weight off BPTT without an approximate label."""
    found = []
    for label in labels:
        error = max(errors[p] for p in label.weight_paths)
        if label.exact and not error < EXACT:
            found.append(f"{name(label.weight_path)} is labelled exact but measures {error:.2e}")
    approximate = {p for label in labels if not label.exact for p in label.weight_paths}
    labelled = {p for label in labels for p in label.weight_paths}
    for path, error in errors.items():
        if path in labelled and error > APPROXIMATE and path not in approximate:
            found.append(f"{name(path)} measures {error:.2e} without an approximate label")
    return found


# --- the table ------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "learner_name"), GRID)
def test_labels_agree_with_the_audit(model: str, learner_name: str, f64: None) -> None:
    learner = build(model, learner_name)
    labels = learner.report.exactness
    expected = EXACT_LEARNERS[model]
    assert sorted(name(label.weight_path) for label in labels) == relation_weights(model, learner_name)
    for label in labels:
        assert label.exact == (learner_name in expected[name(label.weight_path)]), label.describe()
    errors = errors_per_weight(audit(learner, learner_name))
    assert violations(labels, errors) == []
    for label in labels:
        error = max(errors[p] for p in label.weight_paths)
        conservative = (model, learner_name, name(label.weight_path)) in CONSERVATIVE
        if not label.exact:
            assert (error < EXACT) if conservative else (error > APPROXIMATE), (label.describe(), error)


def test_a_flipped_label_is_caught_by_the_measurement() -> None:
    """Negative control of the table's check: D_RTRL's labels on the stacked layers, and the same swapped,
    against the errors the table measures for them (``w1`` far off BPTT, ``w2`` at rounding)."""
    labels = build("stacked", "d_rtrl").report.exactness
    errors = {("w1",): 0.66, ("w2",): 1e-16, ("readout",): 1e-16}
    assert violations(labels, errors) == []
    flipped = tuple(ExactnessLabel(lab.weight_path, lab.weight_paths, lab.hidden_paths, not lab.exact,
                                   () if not lab.exact else ("flipped",)) for lab in labels)
    assert violations(flipped, errors) == [
        "w1 is labelled exact but measures 6.60e-01", "w1 measures 6.60e-01 without an approximate label"]


# --- the reasons, in words --------------------------------------------------------------------

REASONS = [
    ("dense", "d_rtrl", "cell.W.weight",
     "hidden group 0's recurrence passes through a weight operation (a recurrent weight mixing hidden units), "
     "which the diagonal scope leaves out of D: it keeps only each unit's own element-wise dependence"),
    ("dense", "ostl", "cell.W.weight",
     "hidden group 0's recurrence mixes positions (hidden units) and the coupled scope keeps only each "
     "position's own block of D"),
    ("rolled", "d_rtrl", "w", "the y→h tail moves values between positions of hidden group 0"),
    ("rolled", "snap6", "w", "the y→h tail moves values outside SnAp-6's neighbourhoods of hidden group 0"),
    ("leaky", "pp_prop", "w", FACTORISED),
    ("leaky", "uoro", "w", "random projection (UORO is unbiased, not exact)"),
    ("leaky", "eprop", "w", "filtered trace (EProp's κ: the gradient reads ē ← κ ē + ε, not ε)"),
    ("leaky", "three_factor", "w",
     "a modulator replaces ∂L/∂h (ThreeFactor's third factor, not the loss gradient)"),
    ("stacked", "d_rtrl", "w1",
     "hidden group 0 feeds the states ('h2',) outside it (cross-group coupling is not traced)"),
    ("ring", "snap2", "ring.w",
     "SnAp-2's neighbourhoods do not cover hidden group 0's whole dependence (not saturated at n = 2)"),
]


@pytest.mark.parametrize(("model", "learner_name", "weight", "reason"), REASONS,
                         ids=[f"{m}-{l}-{w}" for m, l, w, _ in REASONS])
def test_each_reason_is_stated(model: str, learner_name: str, weight: str, reason: str) -> None:
    (label,) = [lab for lab in build(model, learner_name).report.exactness if name(lab.weight_path) == weight]
    assert label.reasons == (reason,)
    assert label.describe() == f"approximate: {reason}"


def test_reasons_accumulate() -> None:
    (label,) = build("rolled", "pp_prop").report.exactness
    assert label.reasons == (REASONS[4][3], REASONS[2][3])


@pytest.mark.parametrize(("learner_name", "options", "reason"), [
    ("eprop", {"feedback": "random", "random_feedback_key": 0},
     "random feedback replaces ∂L/∂h (a fixed random projection, not the loss gradient)"),
    ("ottt", {"leak": 0.9}, "presynaptic trace (OTTT's leaky input trace ignores the hidden Jacobian and df)"),
    ("otpe", {"leak": 0.9}, "fixed leak (OTPE's λ stands in for the hidden Jacobian)"),
    ("osttp", {"B_list": [jnp.ones((O, H))]},
     "the target projection replaces ∂L/∂h (OSTTP's y_target @ B, not the loss gradient)"),
    ("ostl_feedforward", {}, FACTORISED),
])
def test_rules_that_never_follow_the_loss_gradient(learner_name: str, options: dict[str, Any], reason: str) -> None:
    brainstate.random.seed(0)
    learner = braintrace.compile(Leaky(), learner_name, jnp.ones(I), **options)
    (label,) = learner.report.exactness
    assert label.reasons == (reason,)  # the leaky model itself is exact for D_RTRL


@pytest.mark.parametrize(("config", "reason"), [
    (braintrace.ETraceConfig(temporal_recursion="scalar_leak", decay=0.5),
     "scalar-leak recursion (the trace rolls with decay·I in place of the hidden Jacobian)"),
    pytest.param(braintrace.ETraceConfig(temporal_recursion="none"),
                 "no trace recursion (the trace keeps only the current step)", marks=pytest.mark.slow),
], ids=["scalar_leak", "none"])
def test_a_recursion_other_than_the_jacobian(config: braintrace.ETraceConfig, reason: str, f64: None) -> None:
    brainstate.random.seed(0)
    learner = braintrace.ParamDimVjpAlgorithm(Leaky(), config=config)
    brainstate.nn.init_all_states(learner.model4compile)
    learner.compile_graph(jnp.ones(I))
    (label,) = learner.report.exactness
    assert label.reasons == (reason,)
    assert errors_per_weight(audit(learner, "d_rtrl"))[("w",)] > APPROXIMATE


def test_a_descended_scan_is_not_analysed() -> None:
    from tests.compiler import control_flow_models as cf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the plain readout weight is reported as excluded
        learner = braintrace.compile(cf.SubstepModel(length=20), "d_rtrl", jnp.ones(I))
    assert learner.graph.explain(kind=braintrace.DiagnosticKind.SCAN_DESCENT_APPLIED)
    assert {label.reasons for label in learner.report.exactness} == {
        ("the relation lives in a descended scan, whose exactness this analysis does not establish",)}


# --- the other structural rules, measured -------------------------------------------------------


class PlainUse(Leaky):
    """The weight also drives ``h`` through a plain ``x @ W``."""

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = self.decay * self.h.value + braintrace.matmul(x, self.w.value) + 0.3 * jnp.sin(x @ self.w.value)
        return jnp.tanh(self.h.value) @ self.readout.value


class Indirect(Leaky):
    """``y = matmul(x, W)`` reaches ``h`` directly and through ``matmul(tanh(y), W2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w2 = brainstate.ParamState(normal(2, (H, H), 0.5))

    def update(self, x: jax.Array) -> jax.Array:
        y = braintrace.matmul(x, self.w.value)
        self.h.value = self.decay * self.h.value + y + braintrace.matmul(jnp.tanh(y), self.w2.value)
        return jnp.tanh(self.h.value) @ self.readout.value


class CumsumRecurrence(Leaky):
    """``h = 0.3 cumsum(h) + matmul(x, W)``: a recurrence without a position rule."""

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = 0.3 * jnp.cumsum(self.h.value) + braintrace.matmul(x, self.w.value)
        return jnp.tanh(self.h.value) @ self.readout.value


class CumsumTail(Leaky):
    """``h = a ⊙ h + cumsum(matmul(x, W))``: a tail without a position rule."""

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = self.decay * self.h.value + jnp.cumsum(braintrace.matmul(x, self.w.value))
        return jnp.tanh(self.h.value) @ self.readout.value


class Accumulated(Leaky):
    """The drive also feeds a non-hidden ``ShortTermState`` accumulator that the output reads."""

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        super().init_state(batch_size)
        self.acc = brainstate.ShortTermState(jnp.zeros(H))

    def update(self, x: jax.Array) -> jax.Array:
        y = braintrace.matmul(x, self.w.value)
        self.h.value = self.decay * self.h.value + y
        self.acc.value = 0.5 * self.acc.value + jnp.tanh(y)
        return jnp.tanh(self.h.value + self.acc.value) @ self.readout.value


STRUCTURAL = [
    (PlainUse, "d_rtrl",
     "the weight also reaches the states ('h',) outside its traced operations (a plain use, not traced)"),
    (Indirect, "d_rtrl", "the operation's output also reaches its hidden states through another trainable operation, "
                         "whose credit the trace does not carry"),
    pytest.param(Indirect, "snap", "the y→h tail moves values outside SnAp-2's neighbourhoods of hidden group 0",
                 marks=pytest.mark.slow),
    (CumsumRecurrence, "d_rtrl", "hidden group 0's recurrence could not be read position by position "
                                 "(`cumsum` has no position rule)"),
    pytest.param(CumsumRecurrence, "ostl_recurrent",
                 "hidden group 0's recurrence could not be read position by position (`cumsum` has no position rule)",
                 marks=pytest.mark.slow),
    (CumsumTail, "d_rtrl", "the y→h tail into hidden group 0 could not be read position by position "
                           "(`cumsum` has no position rule)"),
    (Accumulated, "d_rtrl", "the operation's output reaches the states ('acc',) outside its hidden groups, which no "
                            "trace of it follows"),
]


@pytest.mark.parametrize(("model_cls", "learner_name", "reason"), STRUCTURAL,
                         ids=["PlainUse", "Indirect", "Indirect-snap", "CumsumRecurrence", "CumsumRecurrence-ostl",
                              "CumsumTail", "Accumulated"])
def test_structural_reasons_are_measured(model_cls: type, learner_name: str, reason: str, f64: None) -> None:
    brainstate.random.seed(0)
    with warnings.catch_warnings():  # the compiler's own warnings about the same structures
        warnings.filterwarnings("ignore", "The y -> h tail of .* moves values to other positions", UserWarning)
        warnings.filterwarnings("ignore", "The output of .* both directly and through another", UserWarning)
        learner = braintrace.compile(model_cls(), learner_name, jnp.ones(I))
    label = learner.report.exactness[0]
    assert label.weight_path == ("w",) and label.reasons == (reason,)
    assert errors_per_weight(audit(learner, learner_name))[("w",)] > APPROXIMATE


def test_an_unreadable_recurrence_is_exact_under_saturated_snap(f64: None) -> None:
    """Positive control of the cumsum recurrence: SnAp follows every position where the walk cannot read."""
    brainstate.random.seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "SnAp-2: the neighbourhoods of .* are taken all-to-all", UserWarning)
        learner = braintrace.compile(CumsumRecurrence(), "snap", jnp.ones(I))
    (label,) = learner.report.exactness
    assert label.exact
    assert errors_per_weight(audit(learner, "snap"))[("w",)] < EXACT


class PlainInput(Stacked):
    """The stacked layers behind a plain input projection ``tanh(x @ P)`` (no relation)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = brainstate.ParamState(normal(10, (I, I), 0.8))

    def update(self, x: jax.Array) -> jax.Array:
        return super().update(jnp.tanh(x @ self.p.value))


def test_dni_labels_are_d_rtrl_s(f64: None) -> None:
    """DNI's synthetic gradient reaches only the plain parameters: its relations are D_RTRL's."""
    learners = {}
    for learner_name in ("d_rtrl", "dni"):
        brainstate.random.seed(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The weight .* drives the hidden states", UserWarning)
            learners[learner_name] = braintrace.compile(PlainInput(), learner_name, jnp.ones(I))
    dni = learners["dni"]
    dni.attach_synthesizer(braintrace.SyntheticGradient(dni.group_signal_shapes(), scale=0.5))
    assert dni.report.exactness == learners["d_rtrl"].report.exactness
    assert [label.exact for label in dni.report.exactness] == [False, True]
    audits = {n: audit(learner, "d_rtrl") for n, learner in learners.items()}
    assert violations(dni.report.exactness, errors_per_weight(audits["dni"])) == []
    assert errors_per_weight(audits["dni"])[("w2",)] < EXACT
    online = {n: a.online_grads for n, a in audits.items()}
    np.testing.assert_allclose(online["dni"][("w2",)], online["d_rtrl"][("w2",)], rtol=1e-12)
    assert not np.allclose(online["dni"][("p",)], online["d_rtrl"][("p",)])  # the synthesiser is at work


# --- the report -------------------------------------------------------------------------------


def test_the_report_lists_one_line_per_relation() -> None:
    learner = build("stacked", "d_rtrl")
    text = learner.report.to_str()
    (section,) = [part.splitlines() for part in text.split("\n\n") if part.startswith("Exactness")]
    assert section == [
        "Exactness of the online gradient per relation (single step, or windows with the trace entering each window):",
        f"   Relation 0: ('w1',) -> hidden group 0 [('h1',)]: approximate: {REASONS[8][3]}",
        "   Relation 1: ('w2',) -> hidden group 1 [('h2',)]: exact",
    ]
    bare = braintrace.CompilationReport(learner.graph)
    assert bare.exactness == () and "Exactness" not in bare.to_str()
    assert text.replace("\n\n" + "\n".join(section), "") == bare.to_str()  # nothing else changes


def test_the_report_checks_its_labels() -> None:
    learner = build("stacked", "d_rtrl")
    labels = learner.report.exactness
    with pytest.raises(ValueError, match="do not match the graph's 2 relation"):
        braintrace.CompilationReport(learner.graph, labels=labels[:1])
    with pytest.raises(ValueError, match="one by one"):
        braintrace.CompilationReport(learner.graph, labels=labels[::-1])
    with pytest.raises(TypeError, match="ExactnessLabel objects, got tuple"):
        braintrace.CompilationReport(learner.graph, labels=[tuple(labels[0].reasons), labels[1]])
    readout = learner.report.weight_exactness[("readout",)]
    with pytest.raises(ValueError, match=r"plain label\(s\) do not match the graph's 1 weight\(s\) outside"):
        braintrace.CompilationReport(learner.graph, labels=labels, plain_labels=[readout, readout])
    with pytest.raises(TypeError, match="plain_labels must be ExactnessLabel objects, got str"):
        braintrace.CompilationReport(learner.graph, labels=labels, plain_labels=["exact"])


# --- every weight, at verbose=2 ---------------------------------------------------------------


def _plain_input(verbose: int = 0) -> braintrace.ETraceAlgorithm:
    brainstate.random.seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The weight .* drives the hidden states", UserWarning)
        return braintrace.compile(PlainInput(), "d_rtrl", jnp.ones(I), verbose=verbose)


def test_verbose_2_prints_every_weight_with_its_reasons(capsys: pytest.CaptureFixture[str], f64: None) -> None:
    learner = _plain_input(verbose=2)
    printed = capsys.readouterr().out
    (section,) = [part.splitlines() for part in printed.split("\n\n") if "per weight" in part]
    assert section == [
        "Exactness of the online gradient per weight (single step, or windows with the trace entering each window):",
        "   ('p',): approximate, without an eligibility trace (excluded: weight_drives_hidden_untraced):",
        "      - its value reaches the states ('h1',), ('h2',), where no trace follows it: only its gradient",
        "        within each step (or window) counts, not its influence on later steps",
        "   ('readout',): exact, without an eligibility trace: it reaches no state, so its gradient within each step "
        "is all of BPTT's",
        "   ('w1',): approximate, through its eligibility trace (hidden group 0):",
        "      - hidden group 0 feeds the states ('h2',) outside it (cross-group coupling is not traced)",
        "   ('w2',): exact, through its eligibility trace (hidden group 1), which holds all of its influence on later "
        "steps",
    ]
    assert "per weight" not in learner.report.to_str(1)
    labels = learner.report.weight_exactness
    assert list(labels) == [("p",), ("readout",), ("w1",), ("w2",)]
    errors = errors_per_weight(audit(learner, "d_rtrl"))
    assert violations(tuple(labels.values()), errors) == []
    assert errors[("p",)] > APPROXIMATE and errors[("readout",)] < EXACT


def test_verbose_2_explains_a_model_it_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal's message points at ``verbose=2``, which prints the report before raising."""

    class PlainOnly(Leaky):
        def update(self, x: jax.Array) -> jax.Array:
            self.h.value = self.decay * self.h.value + x @ self.w.value
            return jnp.tanh(self.h.value) @ self.readout.value

    with pytest.raises(braintrace.CompilationError, match=r"verbose=2\) shows why each weight was excluded"):
        braintrace.compile(PlainOnly(), "d_rtrl", jnp.ones(I), verbose=2)
    printed = capsys.readouterr().out
    assert "   ('w',): approximate, without an eligibility trace" in printed
    assert "      - its value reaches the states ('h',), where no trace follows it" in printed


class Shared(Leaky):
    """One weight in two relations: ``h = a ⊙ h + matmul(x, W)`` and ``g = 0.6 g + matmul(sin x, W)``."""

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        super().init_state(batch_size)
        self.g = brainstate.HiddenState(jnp.zeros(H))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = self.decay * self.h.value + braintrace.matmul(x, self.w.value)
        self.g.value = 0.6 * self.g.value + braintrace.matmul(jnp.sin(x), self.w.value)
        return jnp.tanh(self.h.value + self.g.value) @ self.readout.value


@pytest.mark.parametrize(("learner_name", "exact"), [("d_rtrl", True), ("pp_prop", False)])
def test_a_weight_of_two_relations_is_labelled_once(learner_name: str, exact: bool, f64: None) -> None:
    learner = build_model(Shared, learner_name)
    assert len(learner.report.exactness) == 2
    label = learner.report.weight_exactness[("w",)]
    assert (label.exact, label.hidden_paths) == (exact, (("h",), ("g",)))
    assert label.reasons == (() if exact else (FACTORISED,))  # the two relations' reason, once
    verdict = "exact" if exact else "approximate"
    assert f"   ('w',): {verdict}, through its eligibility trace (hidden groups [0, 1])" in learner.report.to_str(2)
    assert violations((label,), errors_per_weight(audit(learner, learner_name))) == []


def build_model(model_cls: type, learner_name: str) -> braintrace.ETraceAlgorithm:
    algorithm, kwargs = LEARNERS[learner_name]
    brainstate.random.seed(0)
    return braintrace.compile(model_cls(), algorithm, jnp.ones(I), **kwargs)


@pytest.mark.parametrize("vmap", [False, True])
def test_a_batch_axis_is_not_a_mixing_axis(vmap: bool) -> None:
    """Batched states (positions ``(B, H)``), or one lane of a vmapped learner (``(H,)``)."""
    brainstate.random.seed(0)
    for model, exact in ((Leaky(), [True]), (Rolled(), [False])):
        learner = braintrace.compile(model, "d_rtrl", jnp.ones((2, I)), batch_size=2, vmap=vmap)
        assert [label.exact for label in learner.report.exactness] == exact


def test_a_batched_roll_along_the_units_is_read() -> None:
    """The position walk joins slices of different lengths along one axis (``roll``) of a batched drive."""
    brainstate.random.seed(0)
    with pytest.warns(UserWarning, match="moves values to other positions of hidden group 0"):
        learner = braintrace.compile(Rolled(), "ostl_recurrent", jnp.ones((2, I)), batch_size=2)
    (label,) = learner.report.exactness
    assert label.reasons == ("the y→h tail moves values between positions of hidden group 0",)


def test_relation_labels_refuses_what_it_cannot_label() -> None:
    with pytest.raises(TypeError, match="expected a compiled braintrace learner, got Leaky"):
        relation_labels(Leaky())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not compiled yet"):
        relation_labels(braintrace.D_RTRL(Leaky()))


@pytest.mark.parametrize(("exact", "reasons", "error", "match"), [
    (True, ("a reason",), ValueError, "an exact label has no reasons"),
    (False, (), ValueError, "needs at least one reason"),
    (1, (), TypeError, "exact must be True or False"),
    (False, ("",), TypeError, "non-empty strings"),
    (False, (3,), TypeError, "non-empty strings"),
])
def test_a_label_is_exact_without_reasons_or_approximate_with_them(
        exact: Any, reasons: tuple[Any, ...], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ExactnessLabel(("w",), (("w",),), (("h",),), exact, reasons)

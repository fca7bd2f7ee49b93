"""Exactness labels of every ``braintrace.nn`` neuron, synapse and cell against the gradient audit.

The canonical layers in their usual wiring, in float64, ``T = 4``: each spiking neuron (with
``braintools.surrogate.Sigmoid``, the primitive ``heaviside_surrogate_gradient``), synaptic
filter and the leaky readout, fed forward (``Linear -> layer``) and recurrently (``Linear`` of
the input and the layer's previous output), and every recurrent cell, under D_RTRL,
OSTLRecurrent and SnAp-2 (and, where listed, D_RTRL in windows of two steps and pp_prop). For
every weight, relation or plain, the label of ``learner.report.weight_exactness`` is pinned and
measured by ``check_gradients`` with the helpers of ``test_exactness_labels.py``: an exact label
measures below ``1e-8``, a weight above ``1e-6`` is labelled approximate and, one call per step,
every approximate label measures above ``1e-6``. In windows of two steps from a zero start the
first window's trace is exact, and some approximate weights (an LSTM's forget gate) measure exact
by that coincidence, so there only the first two checks hold.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterator

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._audit import GradientAudit, check_gradients
from tests.algorithm.bptt import normal, x64
from tests.algorithm.test_exactness_labels import APPROXIMATE, EXACT, errors_per_weight, name, violations

__all__ = ["x64"]  # the fixture is used by name (through f64)

T, I, H, O = 4, 3, 4, 2
#: The input of a spiking neuron is a current, that of a synaptic filter a conductance.
INPUT_UNIT = {"IF": u.mA, "LIF": u.mA, "ALIF": u.mA, "Expon": u.mS, "Alpha": u.mS, "DualExpon": u.mS}


@pytest.fixture
def f64(x64: None) -> Iterator[None]:
    """float64 arrays and parameters, and the simulation step the layers read."""
    with brainstate.environ.context(precision=64, dt=1.0 * u.ms):
        yield


# --- the layers -----------------------------------------------------------------------------


def _taus() -> brainstate.ParamState:
    return brainstate.ParamState(jnp.linspace(4.0, 6.0, H) * u.ms)


def dynamics(layer: str) -> Any:
    """The layer, with one trainable constant where it has one that the step reads."""
    spike = braintools.surrogate.Sigmoid()
    return {
        "IF": lambda: braintrace.nn.IF(H, V_th=brainstate.ParamState(jnp.full(H, 1.0) * u.mV), spk_fun=spike),
        "LIF": lambda: braintrace.nn.LIF(H, tau=_taus(), spk_fun=spike),
        "ALIF": lambda: braintrace.nn.ALIF(H, beta=brainstate.ParamState(jnp.full(H, 0.3) * u.mV), spk_fun=spike,
                                           a_initializer=braintools.init.Constant(0.5)),  # beta acts from step 0
        "Expon": lambda: braintrace.nn.Expon(H, tau=_taus()),
        "Alpha": lambda: braintrace.nn.Alpha(H),
        "DualExpon": lambda: braintrace.nn.DualExpon(H, tau_decay=_taus()),
    }[layer]()


def previous_output(layer: Any) -> jax.Array:
    """What the layer returned at the previous step, read from its states (no extra state)."""
    if isinstance(layer, braintrace.nn.DualExpon):
        return u.get_mantissa(layer.g_decay.value - layer.g_rise.value)
    if isinstance(layer, (braintrace.nn.IF, braintrace.nn.LIF, braintrace.nn.ALIF)):
        return layer.get_spike()
    return u.get_mantissa(layer.g.value)


#: A drive that makes the neurons spike (and reset) within the ``T`` steps, in both wirings.
DRIVE = braintools.init.KaimingNormal(scale=256.0)


class _Readout(brainstate.nn.Module):
    def __init__(self, width: int = H) -> None:
        super().__init__()
        self.readout = brainstate.ParamState(normal(3, (width, O)))


class FeedForward(_Readout):
    """``Linear(x) -> layer -> readout``: every recurrence is the layer's own, unit by unit."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        self.unit = INPUT_UNIT[layer]
        self.lin = braintrace.nn.Linear(I, H, w_init=DRIVE)
        self.layer = dynamics(layer)

    def update(self, x: jax.Array) -> jax.Array:
        return u.get_mantissa(self.layer(self.lin(x) * self.unit)) @ self.readout.value


class Recurrent(FeedForward):
    """``Linear([x, previous output]) -> layer -> readout``: the weight mixes the units over time."""

    def __init__(self, layer: str) -> None:
        super().__init__(layer)
        self.lin = braintrace.nn.Linear(I + H, H, w_init=DRIVE)

    def update(self, x: jax.Array) -> jax.Array:
        drive = self.lin(jnp.concatenate([x, previous_output(self.layer)]))
        return u.get_mantissa(self.layer(drive * self.unit)) @ self.readout.value


class LeakyReadout(_Readout):
    """``LeakyRateReadout`` of the input, and of its own previous rate when ``recurrent``."""

    def __init__(self, recurrent: bool) -> None:
        super().__init__()
        self.recurrent = recurrent
        self.layer = braintrace.nn.LeakyRateReadout(I + H if recurrent else I, H)

    def update(self, x: jax.Array) -> jax.Array:
        if self.recurrent:
            x = jnp.concatenate([x, self.layer.r.value])
        return jnp.tanh(self.layer(x)) @ self.readout.value


class Cell(_Readout):
    """A recurrent cell of ``braintrace.nn`` read out (``LRUCell`` returns the input width)."""

    def __init__(self, cls: str) -> None:
        super().__init__(I if cls == "LRUCell" else H)
        self.cell = getattr(braintrace.nn, cls)(I, H)

    def update(self, x: jax.Array) -> jax.Array:
        return self.cell(x) @ self.readout.value


SPIKING_AND_SYNAPTIC = ("IF", "LIF", "ALIF", "Expon", "Alpha", "DualExpon")
CELLS = ("ValinaRNNCell", "GRUCell", "MGUCell", "LSTMCell", "URLSTMCell", "MinimalRNNCell", "MiniGRU", "MiniLSTM",
         "LRUCell", "CFNCell")

MODELS: dict[str, Callable[[], brainstate.nn.Module]] = {
    **{f"ff-{layer}": functools.partial(FeedForward, layer) for layer in SPIKING_AND_SYNAPTIC},
    **{f"rec-{layer}": functools.partial(Recurrent, layer) for layer in SPIKING_AND_SYNAPTIC},
    "ff-LeakyRateReadout": functools.partial(LeakyReadout, False),
    "rec-LeakyRateReadout": functools.partial(LeakyReadout, True),
    **{f"cell-{cls}": functools.partial(Cell, cls) for cls in CELLS},
}


def test_every_layer_of_nn_is_in_the_table() -> None:
    layers = {"Linear", "GroupedLinear", "SignedWLinear", "ScaledWSLinear", "SparseLinear", "LoRA", "Embedding",
              "Conv1d", "Conv2d", "Conv3d", "VanillaRNNCell"}  # operators, and an alias of ValinaRNNCell
    assert set(braintrace.nn.__all__) - layers == {key.split("-", 1)[1] for key in MODELS}


# --- the learners and what they are exact for -------------------------------------------------

#: ``name -> (algorithm, options, chunk_size)``.
LEARNERS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "d_rtrl": ("d_rtrl", {}, None),
    "d_rtrl_windows": ("d_rtrl", {"vjp_method": "multi-step"}, 2),
    "ostl": ("ostl_recurrent", {}, None),
    "snap2": ("snap", {"n": 2}, None),  # saturated on H = 4 units: every unit reads every unit in one step
    "pp_prop": ("pp_prop", {"decay_or_rank": 0.9}, None),
}
_UNIT_BY_UNIT = {"d_rtrl", "d_rtrl_windows", "ostl", "snap2"}

#: ``model -> the learners that label its relation weights exact`` (all of them, or none).
EXACT_FOR = {model: _UNIT_BY_UNIT if model.startswith("ff-") else {"snap2"} for model in MODELS}
EXACT_FOR["cell-LRUCell"] = _UNIT_BY_UNIT  # a diagonal (complex) recurrence: two states per unit
#: ``model -> relation weight`` that no learner gets exact: ``get_spike()``, feeding the previous
#: spikes back, reads the threshold constant as it is (a plain use, untraced), and they reach ``V``.
PLAIN_USE = {"rec-IF": ("layer", "V_th"), "rec-ALIF": ("layer", "beta")}

#: Each wiring and rule once; the rest of the grid is marked ``exhaustive``.
FAST = {(f"ff-{layer}", "d_rtrl") for layer in SPIKING_AND_SYNAPTIC} | {
    ("rec-LIF", "d_rtrl"), ("rec-Expon", "d_rtrl"), ("ff-LIF", "d_rtrl_windows"), ("ff-LIF", "pp_prop"),
    ("rec-LIF", "snap2"), ("ff-LeakyRateReadout", "ostl"), ("cell-LRUCell", "d_rtrl"), ("cell-GRUCell", "d_rtrl"),
}


def _case(model: str, learner: str) -> Any:
    marks = () if (model, learner) in FAST else (pytest.mark.exhaustive,)
    return pytest.param(model, learner, id=f"{model}-{learner}", marks=marks)


#: Windows where a layer is exact (and one recurrent negative control), and pp_prop's rule reason
#: once per kind of layer: both are read from the same facts on every other model.
ALSO = {(model, "d_rtrl_windows") for model in MODELS if model.startswith("ff-")} | {
    ("rec-LIF", "d_rtrl_windows"), ("cell-LRUCell", "d_rtrl_windows"), ("cell-GRUCell", "d_rtrl_windows"),
    ("ff-LIF", "pp_prop"), ("ff-Expon", "pp_prop"), ("rec-ALIF", "pp_prop"), ("cell-LRUCell", "pp_prop"),
}
GRID = [_case(model, learner) for model in MODELS for learner in LEARNERS
        if learner in ("d_rtrl", "ostl", "snap2") or (model, learner) in ALSO]


def build(model: str, learner: str) -> braintrace.ETraceAlgorithm:
    """The learner of ``model``; the compiler's warnings about the GRU's reset gate, the gates that
    also reach ``h`` through another weight (MGU, MinimalRNN) and the LRU's output projections (ETP
    operations that reach no hidden state) are expected."""
    algorithm, options, _ = LEARNERS[learner]
    brainstate.random.seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The output of .* reaches hidden states only through another", UserWarning)
        warnings.filterwarnings("ignore", "The output of .* reaches no hidden state", UserWarning)
        warnings.filterwarnings("ignore", "The output of .* both directly and through another", UserWarning)
        return braintrace.compile(MODELS[model](), algorithm, jnp.ones(I), **options)


def audit(learner: braintrace.ETraceAlgorithm, chunk: int | None) -> GradientAudit:
    xs, ys = normal(11, (T, I)), normal(12, (T, O))
    if chunk is None:
        return check_gradients(learner, xs, ys, step_fn=lambda x, y: jnp.sum((learner(x) - y) ** 2))

    def window_loss(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.sum((learner(braintrace.MultiStepData(x)) - y) ** 2, axis=-1)

    return check_gradients(learner, xs, ys, chunk_size=chunk, step_fn=window_loss)


@pytest.mark.parametrize(("model", "learner_name"), GRID)
def test_every_weight_label_agrees_with_the_audit(model: str, learner_name: str, f64: None) -> None:
    learner = build(model, learner_name)
    report = learner.report
    traced = {p for label in report.exactness for p in label.weight_paths}
    for label in report.exactness:
        expected = learner_name in EXACT_FOR[model] and label.weight_path != PLAIN_USE.get(model)
        assert label.exact == expected, (name(label.weight_path), label.describe())
    labels = report.weight_exactness
    assert set(labels) == set(learner.param_states)  # every weight is labelled
    assert labels[("readout",)].exact  # a readout reaches no state
    result = audit(learner, LEARNERS[learner_name][2])
    for path, grad in result.bptt_grads.items():  # so that "exact" is not 0 = 0
        assert any(np.any(u.get_mantissa(leaf) != 0) for leaf in jax.tree.leaves(grad)), name(path)
    errors = errors_per_weight(result)
    assert violations(tuple(labels.values()), errors) == []
    for path, label in labels.items():
        assert path in traced or label.exact or errors[path] > APPROXIMATE, (path, label.describe())
        if not label.exact and LEARNERS[learner_name][2] is None:
            assert errors[path] > APPROXIMATE, (name(path), label.describe(), errors[path])
        if label.exact:
            assert errors[path] < EXACT


def test_the_surrogate_spike_is_read_unit_by_unit(f64: None) -> None:
    """The issue's case: a feed-forward LIF with a sigmoid surrogate was labelled approximate
    ("`heaviside_surrogate_gradient` has no position rule") while the audit measured it exact."""
    learner = build("ff-LIF", "d_rtrl")
    assert [(name(label.weight_path), label.exact) for label in learner.report.exactness] == [
        ("lin.weight", True), ("layer.tau", True)]
    assert all("heaviside" not in reason for label in build("rec-LIF", "d_rtrl").report.exactness
               for reason in label.reasons)


# --- a state copied from a group's new value ----------------------------------------------------


class Copied(_Readout):
    """``h = 0.5 h + matmul([x, c], W)`` and ``c = h``: a second hidden state holding ``h``'s new
    value (a member of ``h``'s group), fed back through ``W`` at the next step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(1, (I + H, H), 0.6))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.c = brainstate.HiddenState(jnp.zeros(H))
        self.h = brainstate.HiddenState(jnp.zeros(H))

    def update(self, x: jax.Array) -> jax.Array:
        drive = braintrace.matmul(jnp.concatenate([x, self.c.value]), self.w.value)
        self.h.value = 0.5 * self.h.value + drive
        self.c.value = self.h.value
        return jnp.tanh(self.h.value) @ self.readout.value


def test_a_state_written_with_a_group_s_new_value_is_fed(f64: None) -> None:
    brainstate.random.seed(0)
    learner = braintrace.compile(Copied(), "d_rtrl", jnp.ones(I), vjp_method="multi-step")
    (label,) = learner.report.exactness
    # c is a member of h's group (a copy of its new value), and it feeds the group back through W.
    assert label.reasons == (
        "hidden group 0's recurrence passes through a weight operation (a recurrent weight mixing hidden "
        "units), which the diagonal scope leaves out of D: it keeps only each unit's own element-wise "
        "dependence",)
    assert errors_per_weight(audit(learner, 2))[("w",)] > APPROXIMATE

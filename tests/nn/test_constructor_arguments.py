"""Constructor arguments of ``braintrace.nn``'s layers: a bad size or time constant is refused at
construction with the layer, the argument, the value and the fix named; valid ones still build;
a hidden state read before ``init_state`` names how to create it."""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace.nn._arguments import check_time_constant, positive_int, size_tuple

nn = braintrace.nn

SIZE = "must be a positive int or a tuple of them, got"
INT = "must be a positive int, got"
TAU = "must be positive \\(a time constant\\), got"
TAU_FIX = "; e\\.g\\. {arg}=10\\. \\* brainunit\\.ms$"

CELLS = ["ValinaRNNCell", "GRUCell", "MGUCell", "LSTMCell", "URLSTMCell", "CFNCell",
         "MinimalRNNCell", "MiniGRU", "MiniLSTM"]


def tau_message(layer: str, arg: str, shown: str) -> str:
    return f"^{layer}: {arg} {TAU} {shown}" + TAU_FIX.format(arg=arg)


def negative_param_tau() -> Any:
    return brainstate.ParamState(u.math.full(3, -4.0 * u.ms))


#: (construction, pattern of the ValueError's message). The readout reads dt at construction:
#: every case is built inside ``brainstate.environ.context(dt=1 ms)``.
REFUSED: list[Any] = [
    # dense layers: brainstate's constructor, checked first
    pytest.param(lambda: nn.Linear(0, 3), rf"^Linear: in_size {SIZE} 0\.$", id="Linear-in_size-0"),
    pytest.param(lambda: nn.Linear(2.5, 3), rf"^Linear: in_size {SIZE} 2\.5\.$", id="Linear-in_size-float"),
    pytest.param(lambda: nn.Linear(True, 3), rf"^Linear: in_size {SIZE} True\.$", id="Linear-in_size-bool"),
    pytest.param(lambda: nn.Linear("3", 3), rf"^Linear: in_size {SIZE} '3'\.$", id="Linear-in_size-str"),
    pytest.param(lambda: nn.Linear(3, -1), rf"^Linear: out_size {SIZE} -1\.$", id="Linear-out_size-negative"),
    pytest.param(lambda: nn.Linear(in_size=(2, 0), out_size=(2, 3)), rf"^Linear: in_size {SIZE} \(2, 0\)\.$",
                 id="Linear-in_size-keyword-tuple"),
    pytest.param(lambda: nn.Linear(3, ()), rf"^Linear: out_size {SIZE} \(\)\.$", id="Linear-out_size-empty"),
    pytest.param(lambda: nn.SignedWLinear(3, 0), rf"^SignedWLinear: out_size {SIZE} 0\.$", id="SignedWLinear"),
    pytest.param(lambda: nn.ScaledWSLinear(3.0, 4), rf"^ScaledWSLinear: in_size {SIZE} 3\.0\.$", id="ScaledWSLinear"),
    pytest.param(lambda: nn.GroupedLinear(0, 3, 4), rf"^GroupedLinear: num_groups {INT} 0\.$", id="GroupedLinear"),
    pytest.param(lambda: nn.LoRA(0, 2, 4), rf"^LoRA: in_features {INT} 0\.$", id="LoRA-in_features"),
    pytest.param(lambda: nn.LoRA(3, 0, 4), rf"^LoRA: lora_rank {INT} 0\.$", id="LoRA-lora_rank"),
    pytest.param(lambda: nn.LoRA(3, 2, out_features=-4), rf"^LoRA: out_features {INT} -4\.$", id="LoRA-out_features"),
    pytest.param(lambda: nn.Embedding(0, 3), rf"^Embedding: num_embeddings {INT} 0\.$", id="Embedding-num_embeddings"),
    pytest.param(lambda: nn.Embedding(2.5, 3), rf"^Embedding: num_embeddings {INT} 2\.5\.$", id="Embedding-float"),
    pytest.param(lambda: nn.Embedding(3, 0), rf"^Embedding: embedding_size {SIZE} 0\.$", id="Embedding-size"),
    # convolutions
    pytest.param(lambda: nn.Conv2d((8, 8, 2), 4, kernel_size=0), rf"^Conv2d: kernel_size {SIZE} 0\.$",
                 id="Conv2d-kernel_size"),
    pytest.param(lambda: nn.Conv3d((4, 4, 4, 1), 2, kernel_size=(2, 2, 0)),
                 rf"^Conv3d: kernel_size {SIZE} \(2, 2, 0\)\.$", id="Conv3d-kernel_size-tuple"),
    pytest.param(lambda: nn.Conv2d((8, 8, 2), 0, 3), rf"^Conv2d: out_channels {INT} 0\.$", id="Conv2d-out_channels"),
    pytest.param(lambda: nn.Conv1d((8, 2), 2.5, 3), rf"^Conv1d: out_channels {INT} 2\.5\.$", id="Conv1d-out_channels"),
    pytest.param(lambda: nn.Conv2d((8, 0, 2), 4, 3), rf"^Conv2d: in_size {SIZE} \(8, 0, 2\)\.$", id="Conv2d-in_size"),
    pytest.param(lambda: nn.Conv2d((8, 8, 2), 4, 3, stride=(1, 0)), rf"^Conv2d: stride {SIZE} \(1, 0\)\.$",
                 id="Conv2d-stride"),
    pytest.param(lambda: nn.Conv1d((8, 2), 4, 3, 1, "SAME", -1), rf"^Conv1d: lhs_dilation {SIZE} -1\.$",
                 id="Conv1d-lhs_dilation-positional"),
    pytest.param(lambda: nn.Conv2d((8, 8, 2), 4, 3, rhs_dilation=0), rf"^Conv2d: rhs_dilation {SIZE} 0\.$",
                 id="Conv2d-rhs_dilation"),
    pytest.param(lambda: nn.Conv2d((8, 8, 2), 4, 3, groups=0), rf"^Conv2d: groups {INT} 0\.$", id="Conv2d-groups"),
    # recurrent cells
    *[pytest.param(lambda name=name: getattr(nn, name)(0, 4), rf"^{name}: in_size {SIZE} 0\.$", id=f"{name}-in_size")
      for name in CELLS],
    *[pytest.param(lambda name=name: getattr(nn, name)(3, "4"), rf"^{name}: out_size {SIZE} '4'\.$",
                   id=f"{name}-out_size") for name in CELLS],
    pytest.param(lambda: nn.GRUCell((3, -1), 4), rf"^GRUCell: in_size {SIZE} \(3, -1\)\.$", id="GRUCell-tuple"),
    pytest.param(lambda: nn.LRUCell(np.int64(0), 4), rf"^LRUCell: d_model {INT} np\.int64\(0\)\.$",
                 id="LRUCell-d_model"),
    pytest.param(lambda: nn.LRUCell(3, 2.0), rf"^LRUCell: d_hidden {INT} 2\.0\.$", id="LRUCell-d_hidden"),
    # neurons and synapses: sizes
    pytest.param(lambda: nn.LIF(-3), rf"^LIF: in_size {SIZE} -3\.$", id="LIF-in_size"),
    pytest.param(lambda: nn.IF(0), rf"^IF: in_size {SIZE} 0\.$", id="IF-in_size"),
    pytest.param(lambda: nn.ALIF((3, 0)), rf"^ALIF: in_size {SIZE} \(3, 0\)\.$", id="ALIF-in_size"),
    pytest.param(lambda: nn.Expon(1.5), rf"^Expon: in_size {SIZE} 1\.5\.$", id="Expon-in_size"),
    pytest.param(lambda: nn.Alpha([]), rf"^Alpha: in_size {SIZE} \[\]\.$", id="Alpha-in_size"),
    pytest.param(lambda: nn.DualExpon("2"), rf"^DualExpon: in_size {SIZE} '2'\.$", id="DualExpon-in_size"),
    # neurons and synapses: time constants
    pytest.param(lambda: nn.LIF(3, tau=-1.0), tau_message("LIF", "tau", "-1\\.0"), id="LIF-tau-number"),
    pytest.param(lambda: nn.IF(3, tau=0.0 * u.ms), tau_message("IF", "tau", "0\\.0 ms"), id="IF-tau-zero"),
    pytest.param(lambda: nn.LIF(3, tau=jnp.array([5.0, -2.0, 5.0]) * u.ms),
                 tau_message("LIF", "tau", "-2\\.0 ms at index \\(1,\\) of an array of shape \\(3,\\)"),
                 id="LIF-tau-array-entry"),
    pytest.param(lambda: nn.LIF(3, tau=negative_param_tau()),
                 tau_message("LIF", "tau", "-4\\.0 ms at index \\(0,\\) of an array of shape \\(3,\\)"),
                 id="LIF-tau-ParamState"),
    pytest.param(lambda: nn.LIF(3, tau=braintools.init.Constant(-3.0 * u.ms)),
                 tau_message("LIF", "tau", "-3\\.0 ms at index \\(0,\\) of an array of shape \\(3,\\)"),
                 id="LIF-tau-initialiser-output"),
    pytest.param(lambda: nn.LIF(3, tau=float("nan") * u.ms), tau_message("LIF", "tau", "nan ms"), id="LIF-tau-nan"),
    pytest.param(lambda: nn.ALIF(3, tau_a=-100.0 * u.ms), tau_message("ALIF", "tau_a", "-100\\.0 ms"),
                 id="ALIF-tau_a"),
    pytest.param(lambda: nn.Expon(2, tau=-8.0 * u.ms), tau_message("Expon", "tau", "-8\\.0 ms"), id="Expon-tau"),
    pytest.param(lambda: nn.Alpha(2, tau=-8.0 * u.ms), tau_message("Alpha", "tau", "-8\\.0 ms"), id="Alpha-tau"),
    pytest.param(lambda: nn.DualExpon(2, tau_decay=0.0 * u.ms), tau_message("DualExpon", "tau_decay", "0\\.0 ms"),
                 id="DualExpon-tau_decay"),
    pytest.param(lambda: nn.DualExpon(2, tau_rise=-1.0 * u.ms), tau_message("DualExpon", "tau_rise", "-1\\.0 ms"),
                 id="DualExpon-tau_rise"),
    pytest.param(lambda: nn.Expon(2, tau="5"),
                 "^Expon: tau must be a positive number, array or brainunit quantity \\(a time constant\\), "
                 "got '5'" + TAU_FIX.format(arg="tau"), id="Expon-tau-str"),
    # the leaky readout
    pytest.param(lambda: nn.LeakyRateReadout(0, 2), rf"^LeakyRateReadout: in_size {SIZE} 0\.$", id="Readout-in_size"),
    pytest.param(lambda: nn.LeakyRateReadout(3, (2, -1)), rf"^LeakyRateReadout: out_size {SIZE} \(2, -1\)\.$",
                 id="Readout-out_size"),
    pytest.param(lambda: nn.LeakyRateReadout(3, 2, tau=-5.0 * u.ms),
                 tau_message("LeakyRateReadout", "tau", "-5\\.0 ms"), id="Readout-tau"),
]


@pytest.mark.parametrize("build, pattern", REFUSED)
def test_a_bad_argument_is_refused_at_construction_naming_layer_argument_and_value(
    build: Callable[[], Any], pattern: str
) -> None:
    with brainstate.environ.context(dt=1.0 * u.ms), pytest.raises(ValueError, match=pattern):
        build()


#: Valid constructions: ints, NumPy ints, tuples and lists; time constants as numbers, arrays,
#: quantities, initialisers and ParamStates.
ACCEPTED: list[Any] = [
    pytest.param(lambda: nn.Linear(np.int64(3), np.int64(4)), id="Linear-numpy-ints"),
    pytest.param(lambda: nn.Linear(np.array(3), [4]), id="Linear-0d-array-and-list"),
    pytest.param(lambda: nn.Linear(in_size=(2, 3), out_size=(2, 4)), id="Linear-tuples-keywords"),
    pytest.param(lambda: nn.SignedWLinear(3, 4, w_sign=None), id="SignedWLinear"),
    pytest.param(lambda: nn.ScaledWSLinear((3,), (4,)), id="ScaledWSLinear"),
    pytest.param(lambda: nn.GroupedLinear(np.int64(2), 3, 4), id="GroupedLinear"),
    pytest.param(lambda: nn.LoRA(3, np.int64(2), 4), id="LoRA"),
    pytest.param(lambda: nn.Embedding(np.int64(5), 3), id="Embedding"),
    pytest.param(lambda: nn.Conv2d((8, 8, np.int64(2)), 4, kernel_size=(3, 3), stride=np.int64(1)), id="Conv2d"),
    pytest.param(lambda: nn.Conv1d((8, 2), 4, 3, 1, "SAME", 1, 2, 2), id="Conv1d-positional"),
    pytest.param(lambda: nn.GRUCell(np.int64(3), (4,)), id="GRUCell"),
    pytest.param(lambda: nn.MiniLSTM([3], 4), id="MiniLSTM"),
    pytest.param(lambda: nn.LRUCell(np.int64(3), 4), id="LRUCell"),
    pytest.param(lambda: nn.LIF(np.int64(3), tau=10.0 * u.ms), id="LIF-quantity-tau"),
    pytest.param(lambda: nn.LIF((2, 3), tau=jnp.full((2, 3), 5.0) * u.ms), id="LIF-array-tau"),
    pytest.param(lambda: nn.LIF(3, tau=brainstate.ParamState(u.math.full(3, 10.0 * u.ms))), id="LIF-ParamState-tau"),
    pytest.param(lambda: nn.LIF(3, tau=braintools.init.Constant(5.0 * u.ms)), id="LIF-initialiser-tau"),
    pytest.param(lambda: nn.IF(3, tau=2.0), id="IF-number-tau"),
    pytest.param(lambda: nn.ALIF(3, tau_a=brainstate.ParamState(u.math.full(3, 50.0 * u.ms))), id="ALIF"),
    pytest.param(lambda: nn.DualExpon(2, tau_decay=5.0 * u.ms, tau_rise=0.5 * u.ms), id="DualExpon"),
    pytest.param(lambda: nn.LeakyRateReadout(np.int64(3), (2,), tau=2.0 * u.ms), id="LeakyRateReadout"),
]


@pytest.mark.parametrize("build", ACCEPTED)
def test_valid_arguments_still_build(build: Callable[[], Any]) -> None:
    with brainstate.environ.context(dt=1.0 * u.ms):
        layer = build()
    assert isinstance(layer, brainstate.nn.Module)


@pytest.mark.parametrize(
    "layer, parent",
    [(nn.Linear, brainstate.nn.Linear), (nn.SignedWLinear, brainstate.nn.SignedWLinear),
     (nn.ScaledWSLinear, brainstate.nn.ScaledWSLinear), (nn.LoRA, brainstate.nn.LoRA),
     (nn.Embedding, brainstate.nn.Embedding), (nn.Conv1d, brainstate.nn.Conv1d),
     (nn.Conv2d, brainstate.nn.Conv2d), (nn.Conv3d, brainstate.nn.Conv3d)],
)
def test_checked_constructors_keep_brainstate_signatures(layer: type, parent: type) -> None:
    assert inspect.signature(layer.__init__) == inspect.signature(parent.__init__)


def test_arguments_that_do_not_bind_raise_pythons_type_error() -> None:
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'out_size'"):
        nn.Linear(3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kernel'"):
        nn.Conv2d((8, 8, 2), 4, kernel=3)


# --- the helpers ----------------------------------------------------------------------------


def test_size_helpers_return_plain_ints() -> None:
    assert size_tuple("L", "in_size", np.int64(3)) == (3,)
    assert size_tuple("L", "in_size", [np.int32(2), 3]) == (2, 3)
    assert positive_int("L", "n", np.uint8(7)) == 7
    with pytest.raises(ValueError, match=r"^L: n must be a positive int, got np\.True_\.$"):
        positive_int("L", "n", np.True_)


def test_a_traced_time_constant_is_left_unchecked() -> None:
    # under jit the value is unknown at construction; the check must not fail on the tracer
    def checked(tau: jax.Array) -> jax.Array:
        check_time_constant("LIF", "tau", tau * u.ms)
        return tau

    assert float(jax.jit(checked)(-1.0)) == -1.0


# --- a hidden state read before init_state -------------------------------------------------


def _readout() -> Any:
    with brainstate.environ.context(dt=1.0 * u.ms):
        return nn.LeakyRateReadout(3, 2)


#: (layer, a state it reads first, an input of one step)
BEFORE_INIT: list[Any] = [
    pytest.param(lambda: nn.LIF(3), "V", jnp.ones(3) * u.mA, id="LIF"),
    pytest.param(lambda: nn.IF(3), "V", jnp.ones(3) * u.mA, id="IF"),
    pytest.param(lambda: nn.ALIF(3), "V", jnp.ones(3) * u.mA, id="ALIF"),
    pytest.param(lambda: nn.Expon(3), "g", jnp.ones(3) * u.mS, id="Expon"),
    pytest.param(lambda: nn.Alpha(3), "h", jnp.ones(3) * u.mS, id="Alpha"),
    pytest.param(lambda: nn.DualExpon(3), "g_rise", jnp.ones(3) * u.mS, id="DualExpon"),
    pytest.param(lambda: nn.GRUCell(3, 4), "h", jnp.ones(3), id="GRUCell"),
    pytest.param(lambda: nn.LSTMCell(3, 4), "c", jnp.ones(3), id="LSTMCell"),
    pytest.param(lambda: nn.MiniGRU(3, 4), "h", jnp.ones(3), id="MiniGRU"),
    pytest.param(lambda: nn.LRUCell(3, 4), "h_re", jnp.ones(3), id="LRUCell"),
    pytest.param(_readout, "r", jnp.ones(3), id="LeakyRateReadout"),
]


@pytest.mark.parametrize("build, state, x", BEFORE_INIT)
def test_a_call_before_init_state_names_init_state_and_the_fix(build: Callable[[], Any], state: str, x: Any) -> None:
    layer = build()
    name = type(layer).__name__
    assert not hasattr(layer, state)
    pattern = (
        rf"^{name}: the hidden state {state} does not exist yet: init_state creates it\. "
        r"Call brainstate\.nn\.init_all_states\(model\) .* braintrace\.compile\(model, algorithm, example_input\)"
    )
    with brainstate.environ.context(dt=1.0 * u.ms), pytest.raises(AttributeError, match=pattern):
        layer(x)
    layer.init_state()
    assert all(hasattr(layer, s) for s in layer.state_names)


def test_other_missing_attributes_keep_pythons_message() -> None:
    lif = nn.LIF(3)
    with pytest.raises(AttributeError, match=r"^'LIF' object has no attribute 'Vx'$"):
        lif.Vx
    assert not hasattr(lif, "nonexistent")


def test_a_layer_without_states_copies_and_inits_through_brainstate() -> None:
    # copying probes optional hooks (__deepcopy__, __setstate__) through __getattr__
    lif = copy.deepcopy(nn.LIF(3))
    brainstate.nn.init_all_states(lif)
    assert lif.V.value.shape == (3,)

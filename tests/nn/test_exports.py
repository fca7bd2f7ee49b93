"""The ``braintrace.nn`` namespace: exports, module names, redirects and runnable examples."""

from __future__ import annotations

import importlib.util
import types
import warnings

import brainstate
import pytest

import braintrace
import braintrace.nn as bnn

EXPECTED_ALL = [
    "Conv1d", "Conv2d", "Conv3d", "Linear", "GroupedLinear", "SignedWLinear", "ScaledWSLinear",
    "SparseLinear", "LoRA", "Embedding", "LeakyRateReadout", "ValinaRNNCell", "VanillaRNNCell", "GRUCell",
    "MGUCell", "LSTMCell", "URLSTMCell", "MinimalRNNCell", "MiniGRU", "MiniLSTM", "LRUCell",
    "CFNCell", "IF", "LIF", "ALIF", "Expon", "Alpha", "DualExpon",
]

SPIKING = ["IF", "LIF", "ALIF", "Expon", "Alpha", "DualExpon"]

BRAINSTATE_PARENTS = {
    "Linear": brainstate.nn.Linear,
    "SignedWLinear": brainstate.nn.SignedWLinear,
    "ScaledWSLinear": brainstate.nn.ScaledWSLinear,
    "SparseLinear": brainstate.nn.SparseLinear,
    "LoRA": brainstate.nn.LoRA,
    "Embedding": brainstate.nn.Embedding,
    "Conv1d": brainstate.nn.Conv1d,
    "Conv2d": brainstate.nn.Conv2d,
    "Conv3d": brainstate.nn.Conv3d,
}


def test_all_is_pinned() -> None:
    # upstream's 20 names in upstream order, plus VanillaRNNCell (the correct spelling of
    # ValinaRNNCell), CFNCell (fixed and exported here) and the native neurons and synapse
    # filters (0.2.4 redirected them to a module that did not exist)
    assert bnn.__all__ == EXPECTED_ALL
    assert braintrace.nn is bnn and "nn" in braintrace.__all__


def test_namespace_holds_no_stray_names() -> None:
    # No imported helper (Any, annotations, importlib, warnings, ...) under a public name: every
    # public attribute is exported, every private one is a private helper or implementation module.
    public = {name for name in vars(bnn) if not name.startswith("_")}
    assert public == set(EXPECTED_ALL)
    assert set(EXPECTED_ALL) <= set(dir(bnn))
    modules = {name for name, value in vars(bnn).items() if isinstance(value, types.ModuleType)}
    assert modules and all(name.startswith("_") for name in modules), modules


def test_vanilla_rnn_cell_is_the_misspelt_upstream_class() -> None:
    assert bnn.VanillaRNNCell is bnn.ValinaRNNCell
    assert bnn.VanillaRNNCell.__name__ == "ValinaRNNCell"


@pytest.mark.parametrize("name", EXPECTED_ALL)
def test_every_export_resolves_with_its_public_module(name: str) -> None:
    cls = getattr(bnn, name)
    assert isinstance(cls, type)
    expected = "braintrace.nn._rnn" if name == "LRUCell" else "braintrace.nn"
    assert cls.__module__ == expected
    assert cls.__doc__ and "Examples" in cls.__doc__


@pytest.mark.parametrize("name", sorted(BRAINSTATE_PARENTS))
def test_layers_subclass_their_brainstate_parent(name: str) -> None:
    assert issubclass(getattr(bnn, name), BRAINSTATE_PARENTS[name])


def test_cells_are_brainstate_rnn_cells() -> None:
    for name in ["ValinaRNNCell", "VanillaRNNCell", "GRUCell", "MGUCell", "LSTMCell", "URLSTMCell",
                 "MinimalRNNCell", "MiniGRU", "MiniLSTM", "CFNCell"]:
        assert issubclass(getattr(bnn, name), brainstate.nn.RNNCell), name
    assert issubclass(bnn.LRUCell, brainstate.nn.Module)
    assert issubclass(bnn.GroupedLinear, brainstate.nn.Module)
    assert issubclass(bnn.LeakyRateReadout, brainstate.nn.Module)


@pytest.mark.parametrize("name", ["ReLU", "Dropout", "MaxPool2d", "LayerNorm", "Flatten", "BatchNorm1d"])
def test_moved_layers_redirect_to_brainstate_with_a_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"braintrace\.nn\.{name} is deprecated\. Use brainstate\.nn\.{name} instead\."):
        got = getattr(bnn, name)
    assert got is getattr(brainstate.nn, name)


def test_moved_redirect_warns_on_every_access() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bnn.Tanh
        bnn.Tanh
    assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]


def test_redirect_warning_points_at_the_caller() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bnn.GELU
    assert caught[0].filename == __file__


@pytest.mark.parametrize("name", SPIKING)
def test_neurons_and_synapses_are_native_dynamics_without_a_warning(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls = getattr(bnn, name)
    assert issubclass(cls, brainstate.nn.Dynamics)
    assert cls.__module__ == "braintrace.nn"


@pytest.mark.parametrize("name", ["STP", "STD"])
def test_short_term_plasticity_points_at_brainpy(name: str) -> None:
    if importlib.util.find_spec("brainpy") is None:
        # upstream imports brainstate.state (absent in brainstate 0.5) and crashes; here the
        # error says where the class lives and what to install
        with pytest.raises(AttributeError, match=rf"brainpy\.state\.{name}.*pip install 'braintrace\[brainpy\]'"):
            getattr(bnn, name)
        assert not hasattr(bnn, name)
    else:  # pragma: no cover - brainpy is an optional extra
        with pytest.warns(DeprecationWarning, match=rf"Use brainpy\.state\.{name} instead"):
            getattr(bnn, name)


@pytest.mark.parametrize("name", ["LeakySpikeReadout", "Foo", "ETraceState", "RNNCell"])
def test_unknown_names_raise_attribute_error(name: str) -> None:
    with pytest.raises(AttributeError, match=rf"^module 'braintrace.nn' has no attribute '{name}'$"):
        getattr(bnn, name)

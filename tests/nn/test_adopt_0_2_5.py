"""``braintrace.nn`` in 0.2.5: Embedding refuses unsupported options when built, ``dir`` lists forwards."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Any

import brainstate
import jax.numpy as jnp
import pytest

import braintrace.nn as bnn

OPTIONS = {"padding_idx": 1, "max_norm": 1.0, "scale_grad_by_freq": True, "freeze": True}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_embedding_refuses_an_option_at_construction_naming_only_it(option: str) -> None:
    with pytest.raises(NotImplementedError) as err:
        bnn.Embedding(5, 3, **{option: OPTIONS[option]})
    message = str(err.value)
    assert option in message and "brainstate.nn.Embedding" in message
    assert [name for name in OPTIONS if name in message] == [option]


def test_embedding_names_every_option_set_and_no_other() -> None:
    with pytest.raises(NotImplementedError, match=r"support max_norm, freeze in online learning") as err:
        bnn.Embedding(5, 3, max_norm=2.0, freeze=True)
    assert "padding_idx" not in str(err.value) and "scale_grad_by_freq" not in str(err.value)


@pytest.mark.parametrize("padding_idx", [5, -1])
def test_embedding_out_of_range_padding_idx_keeps_the_parents_value_error(padding_idx: int) -> None:
    with pytest.raises(ValueError, match=r"padding_idx must be within \[0, 5\)"):
        bnn.Embedding(5, 3, padding_idx=padding_idx)


def test_embedding_update_names_an_option_set_after_construction() -> None:
    layer = bnn.Embedding(5, 3)
    assert layer(jnp.array([0, 4])).shape == (2, 3)
    layer.scale_grad_by_freq = True
    with pytest.raises(NotImplementedError, match="support scale_grad_by_freq in online") as err:
        layer(jnp.array([0, 4]))
    assert "max_norm" not in str(err.value)


def test_dir_lists_exports_and_forwarded_names() -> None:
    names = dir(bnn)
    assert names == sorted(names) and set(bnn.__all__) <= set(names)
    for forwarded in ("ReLU", "Dropout", "LayerNorm", "MaxPool2d", "STP", "STD"):
        assert forwarded in names
    assert "warnings" not in names and "annotations" not in names


def _home(name: str) -> Any:
    if name in ("STP", "STD"):
        return importlib.import_module("brainpy.state")
    return brainstate.nn


def test_every_extra_name_in_dir_is_a_deprecated_forward() -> None:
    extras = sorted(set(dir(bnn)) - set(bnn.__all__))
    assert extras
    for name in extras:
        if name in ("STP", "STD") and importlib.util.find_spec("brainpy") is None:
            with pytest.raises(AttributeError, match=rf"{name} lives in brainpy\.state.*pip install"):
                getattr(bnn, name)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            value = getattr(bnn, name)
        assert value is getattr(_home(name), name)
        assert any(issubclass(w.category, DeprecationWarning) and name in str(w.message) for w in caught), name


def test_cfn_cell_is_exported_with_its_input_projection_in_to_out() -> None:
    assert "CFNCell" in bnn.__all__
    cell = brainstate.nn.init_all_states(bnn.CFNCell(3, 5))
    assert cell.Wh.weight.value["weight"].shape == (3, 5)  # in_size -> out_size
    assert cell(jnp.ones(3)).shape == (5,)

"""Top-level access to the deprecated v0.1 names: one warning per name per process."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import jax.numpy as jnp
import pytest

import braintrace
import braintrace._legacy as legacy
from braintrace._legacy import _deprecation

LEGACY = ["MatMulOp", "ElemWiseOp", "ConvOp", "SpMatMulOp", "LoraOp", "ETraceOp", "ETraceParam",
          "ElemWiseParam", "NonTempParam", "FakeETraceParam", "FakeElemWiseParam"]


def test_the_legacy_table_is_pinned() -> None:
    assert list(_deprecation.REPLACEMENTS) == LEGACY
    assert list(braintrace._LEGACY_NAMES) == LEGACY
    assert _deprecation.REPLACEMENTS["NonTempParam"] == (
        "brainstate.ParamState with plain JAX ops (keeps the weight out of the ETP graph)"
    )


@pytest.mark.parametrize("name", LEGACY)
def test_access_warns_once_and_returns_the_shim(name: str, fresh_registry: None) -> None:
    message = (
        f"braintrace.{name} is deprecated since 0.2.0 and will be removed in a future release; "
        f"use {_deprecation.REPLACEMENTS[name]} instead."
    )
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(message)}$"):
        cls = getattr(braintrace, name)
    assert cls is getattr(legacy, name)
    assert cls.__module__ == "braintrace"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(braintrace, name) is cls
    assert caught == []


def test_each_name_has_its_own_latch(fresh_registry: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        braintrace.MatMulOp
        braintrace.MatMulOp
        braintrace.ConvOp
        from braintrace import MatMulOp, LoraOp  # noqa: F401
    assert [str(w.message).split()[0] for w in caught] == ["braintrace.MatMulOp", "braintrace.ConvOp", "braintrace.LoraOp"]
    assert all(w.category is DeprecationWarning for w in caught)


def test_the_warning_points_at_the_caller(fresh_registry: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        braintrace.ETraceParam
    assert caught[0].filename == __file__


def test_private_imports_and_construction_do_not_warn() -> None:
    # pytest turns any warning into an error here
    from braintrace._legacy import ETraceParam, MatMulOp

    ETraceParam({"weight": jnp.ones((2, 2))}, MatMulOp())


def test_legacy_names_are_in_dir_but_not_in_all() -> None:
    assert not set(LEGACY) & set(braintrace.__all__)
    assert dir(braintrace) == sorted([*braintrace.__all__, *LEGACY])


@pytest.mark.parametrize(
    "name",
    ["ETraceState", "ETraceGroupState", "ETraceTreeState", "OSTL", "stop_param_gradients",
     "general_y2w", "DEFAULT_CONTROL_FLOW_POLICY", "ETPPrimitiveSpec", "register_primitive_spec"],
)
def test_other_names_raise_attribute_error(name: str) -> None:
    with pytest.raises(AttributeError, match=f"^module 'braintrace' has no attribute '{name}'$"):
        getattr(braintrace, name)


@pytest.mark.slow
def test_once_per_process_in_a_fresh_interpreter() -> None:
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "import braintrace\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3):\n"
        "        braintrace.MatMulOp\n"
        "    braintrace.ElemWiseParam\n"
        "print([str(w.message).split()[0] for w in caught if w.category is DeprecationWarning])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "['braintrace.MatMulOp', 'braintrace.ElemWiseParam']"

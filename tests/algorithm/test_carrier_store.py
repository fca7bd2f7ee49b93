"""``CarrierStore``: the one place every trace engine keeps its carriers.

The store reads and writes its states in place (through a layout where an engine stores
another one), zeros them with or without a new batch size for the keys a predicate selects,
selects the entries of a weight, grows carriers to the shape one step gives them, and refuses a
bad batch size or an unknown key before writing anything. It is a pytree with a ``dict``'s keys,
so ``brainstate`` (and so checkpoints) find its states at a dict's paths. Every trace engine
keeps its traces in one: a state of a learner outside its model is a counter or sits in a store.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.carriers.carrier_store import CarrierStore

T, B, I, O = 3, 2, 3, 4


def _store() -> CarrierStore[str, braintrace.EligibilityTrace]:
    return CarrierStore.of_zeros({
        "batched": {"weight": jnp.ones((B, I, O)), "bias": jnp.ones((B, O))},
        "shared": jnp.ones((I,)),
        "scalar": jnp.ones(()),
    }, braintrace.EligibilityTrace)


def _shapes(store: CarrierStore[Any, Any]) -> dict[Any, list[tuple[int, ...]]]:
    return {key: [leaf.shape for leaf in jax.tree.leaves(value)] for key, value in store.read().items()}


def test_assign_then_read_round_trips_in_the_same_state_objects() -> None:
    store = _store()
    states = dict(store)
    new: dict[str, Any] = {"batched": {"weight": jnp.full((B, I, O), 2.0), "bias": jnp.full((B, O), 3.0)}, "shared": jnp.arange(I)}
    store.assign(new)
    got = store.read()
    assert all(store[key] is states[key] for key in states) and isinstance(store["shared"], braintrace.EligibilityTrace)
    np.testing.assert_array_equal(got["batched"]["weight"], new["batched"]["weight"])
    np.testing.assert_array_equal(got["shared"], new["shared"])
    np.testing.assert_array_equal(got["scalar"], 1.0)  # a key left out keeps its value


def test_a_layout_converts_on_write_and_back_on_read() -> None:
    store = CarrierStore.of_zeros({"k": jnp.zeros(3)}, braintrace.EligibilityTrace)
    view, stored = (lambda key, v: v[..., None]), (lambda key, v: v[..., 0])
    store.assign({"k": jnp.ones((3, 1))}, stored)
    assert store["k"].value.shape == (3,) and store.read(view)["k"].shape == (3, 1)
    assert store.select(["k"], view)["k"].shape == (3, 1)


def test_reset_without_a_batch_size_zeros_every_carrier_at_its_shape() -> None:
    store = _store()
    before = _shapes(store)
    store.reset(leads_with_batch=lambda key: True)
    assert _shapes(store) == before
    assert not any(np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(store.read()))


def test_reset_with_a_batch_size_resizes_the_keys_the_predicate_selects_only() -> None:
    store = _store()
    store.reset(batch_size=5, leads_with_batch=lambda key: key in ("batched", "scalar"))
    assert _shapes(store) == {"batched": [(5, O), (5, I, O)], "shared": [(I,)], "scalar": [()]}  # no batch axis
    assert not any(np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(store.read()))
    store.reset(batch_size=7)  # no predicate: no key leads with the batch axis
    assert _shapes(store)["batched"] == [(5, O), (5, I, O)]


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_a_bad_batch_size_is_refused_before_any_carrier_is_written(batch_size: Any) -> None:
    store = _store()
    with pytest.raises(ValueError, match=r"reset_state: batch_size must be a positive int .* got"):
        store.reset(batch_size=batch_size, leads_with_batch=lambda key: True)
    assert float(store["shared"].value.sum()) == I  # untouched


def test_an_unknown_key_is_an_internal_error_and_nothing_is_written() -> None:
    store = _store()
    with pytest.raises(RuntimeError, match=r"internal error: CarrierStore.assign: no carrier under the key\(s\) \['x'\]"):
        store.assign({"shared": jnp.zeros(I), "x": jnp.zeros(1)})
    assert float(store["shared"].value.sum()) == I
    with pytest.raises(RuntimeError, match="CarrierStore.select"):
        store.select(["shared", "x"])


def test_select_gives_each_key_once_in_the_order_asked() -> None:
    store = _store()
    assert list(store.select(["scalar", "shared", "scalar"])) == ["scalar", "shared"]
    assert store.select([]) == {}


def test_reallocate_grows_only_the_arrays_one_step_reshapes() -> None:
    store = _store()
    shapes = {"shared": jax.ShapeDtypeStruct((B, I), jnp.float32),
              "scalar": jax.ShapeDtypeStruct((), jnp.float32)}
    scalar = store["scalar"].value
    store.reallocate(shapes)
    assert store["shared"].value.shape == (B, I) and not np.any(np.asarray(store["shared"].value))
    assert store["scalar"].value is scalar  # its shape does not change: not written


def test_zeros_like_makes_new_states_of_the_given_type() -> None:
    store = _store()
    filters = store.zeros_like(brainstate.ShortTermState)
    assert type(filters["shared"]) is brainstate.ShortTermState and filters["shared"] is not store["shared"]
    assert _shapes(filters) == _shapes(store) and not np.any(np.asarray(filters["shared"].value))


def test_brainstate_and_jax_see_a_store_as_the_dict_it_holds() -> None:
    class Holder(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.store = CarrierStore.of_zeros({(9, 1): jnp.zeros(2), (3, 0): jnp.zeros(1)}, braintrace.EligibilityTrace)
            self.plain = {(9, 1): braintrace.EligibilityTrace(jnp.zeros(2)),
                          (3, 0): braintrace.EligibilityTrace(jnp.zeros(1))}

    paths = list(brainstate.graph.states(Holder()).keys())
    assert paths == [("plain", (3, 0)), ("plain", (9, 1)), ("store", (3, 0)), ("store", (9, 1))]
    store = Holder().store
    rebuilt = jax.tree.map(lambda state: state, store)
    assert type(rebuilt) is CarrierStore and list(rebuilt) == [(3, 0), (9, 1)] and rebuilt[(9, 1)] is store[(9, 1)]
    keys = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(store)[0]]
    assert keys == [(3, 0), (9, 1)]


# --- every trace engine keeps its traces in a store -------------------------------------------


class Leaky(brainstate.nn.Module):
    """``h ← ½ h + x W + b``: a dense relation every engine accepts."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.full((I, O), 0.1))
        self.b = brainstate.ParamState(jnp.zeros(O))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or B, O)))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value, self.b.value)
        return self.h.value


NO_HISTORY = braintrace.TraceRule(init=lambda info: jnp.zeros(info.y.shape, info.y.dtype),
                                  roll=lambda carrier, step: carrier, solve=lambda carrier, g, step: {})

#: One learner of every engine class that stores traces, and the options it needs.
ENGINES: dict[str, tuple[Any, dict[str, Any]]] = {
    "ParamDimVjpAlgorithm": (braintrace.EProp, {"kappa_filter_decay": 0.5}),
    "IODimVjpAlgorithm": (braintrace.pp_prop, {"decay_or_rank": 0.9}),
    "RandomProjectionVjpAlgorithm": (braintrace.RandomProjectionVjpAlgorithm, {}),
    "OTTT": (braintrace.OTTT, {"leak": 0.5}),
    "OTPE": (braintrace.OTPE, {"leak": 0.5}),
    "RuleLearner": (NO_HISTORY, {}),
}
#: The learner states that are counters, not traces: they live on the learner itself.
COUNTERS = {"running_index", "trace_steps", "projection_rng", "projection_step", "_bias_trace"}


def _container(node: Any, path: tuple[Any, ...]) -> Any:
    """The object holding the state at ``path`` (an attribute's or a mapping's entry)."""
    for key in path[:-1]:
        node = node[key] if isinstance(node, Mapping) else getattr(node, key)
    return node


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_trace_engine_keeps_its_traces_in_a_carrier_store(engine: str) -> None:
    algorithm, options = ENGINES[engine]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(Leaky(), algorithm, jnp.ones((B, I)), batch_size=B, **options)
    assert engine in {cls.__name__ for cls in type(learner).__mro__}
    in_model = {id(st) for st in brainstate.graph.states(learner.model4compile).values()}
    own = {path: st for path, st in brainstate.graph.states(learner).items() if id(st) not in in_model}
    stored = {path for path in own if isinstance(_container(learner, path), CarrierStore)}
    assert stored, f"{engine} keeps no trace in a CarrierStore"
    elsewhere = sorted(str(path) for path in set(own) - stored if path not in {(name,) for name in COUNTERS})
    assert not elsewhere, f"{engine} keeps states outside a CarrierStore: {elsewhere}"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_reset_state_refuses_a_bad_batch_size_and_leaves_every_state_as_it_was(engine: str) -> None:
    algorithm, options = ENGINES[engine]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(Leaky(), algorithm, jnp.ones((B, I)), batch_size=B, **options)
    for st in brainstate.graph.states(learner).values():  # every state non-zero, as after some steps
        st.value = jax.tree.map(lambda v: jnp.ones_like(v) if v.dtype != jnp.uint32 else v, st.value)
    before = {path: [np.asarray(leaf) for leaf in jax.tree.leaves(st.value)]
              for path, st in brainstate.graph.states(learner).items()}
    with pytest.raises(ValueError, match="reset_state: batch_size must be a positive int"):
        learner.reset_state(batch_size=0)
    for path, st in brainstate.graph.states(learner).items():
        for old, new in zip(before[path], jax.tree.leaves(st.value), strict=True):
            np.testing.assert_array_equal(old, np.asarray(new), err_msg=str(path))

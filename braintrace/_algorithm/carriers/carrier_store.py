"""``CarrierStore``: the states a learner keeps its carriers (eligibility traces) in between steps.

Every trace engine keeps its carriers as states under keys of its own: D_RTRL's
``etrace_bwg`` under ``(id(y_var), group.index)``, pp_prop's ``etrace_xs`` under ``id(x_var)``
and ``etrace_dfs`` under ``(id(y_var), 'hidden_group_i')``, the random projection's factors, OTTT's
presynaptic traces, OTPE's stores, a ``TraceRule``'s carriers. What is done with them is the same
for all and lives here, once: allocate the states from zero values, read every value, write
values back, zero them (giving the keys that lead with a batch axis a new batch size), and read
the entries of one weight for ``get_etrace_of``. An engine keeps only what is its own: its keys,
their shapes, which of them lead with a batch axis, and, where it stores a carrier in another
layout than its rules read (D_RTRL on a TPU), the two conversions, passed as a :data:`Layout`.

A store is a ``dict`` from key to state, and a JAX pytree node with a dict's keys and order, so
``brainstate`` finds its states at the paths a plain dict gives them
(``('etrace_bwg', key)``): checkpoints, shardings and ``learner.states()`` see no difference.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.engine.base import EligibilityTrace
>>> store = CarrierStore.of_zeros({'x': jnp.zeros((2, 3)), 'f': {'w': jnp.zeros(4)}}, EligibilityTrace)
>>> store.assign({'x': jnp.ones((2, 3))})
>>> float(store.read()['x'].sum()), type(store['x']).__name__
(6.0, 'EligibilityTrace')
>>> store.reset(batch_size=5, leads_with_batch=lambda key: key == 'x')  # zeros; 'x' leads with the batch
>>> store.read()['x'].shape, store.read()['f']['w'].shape
((5, 3), (4,))
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Iterator, Mapping, TypeVar

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import EligibilityTrace
from braintrace._algorithm.engine.batch_size import checked_batch_size
from braintrace._algorithm.carriers.trace_storage import fresh_zeros
from braintrace._errors import internal_error
from braintrace._typing import PyTree

__all__ = ["CarrierStore", "TraceStore", "Layout"]

K = TypeVar("K", bound=Hashable)
S = TypeVar("S", bound=brainstate.ShortTermState)
T = TypeVar("T", bound=brainstate.ShortTermState)

#: A per-key conversion of a carrier between the layout a store holds and the one the rules
#: read (``view(key, stored) -> carrier`` or ``stored(key, carrier) -> stored``).
Layout = Callable[[K, PyTree], PyTree]


def _as_it_is(key: Hashable, value: PyTree) -> PyTree:
    return value


def _no_key(key: Hashable) -> bool:
    return False


class CarrierStore(dict[K, S]):
    """A learner's carriers: ``key -> state`` (a ``ShortTermState``, normally an ``EligibilityTrace``).

    Build it with :meth:`of_zeros`; an empty store is ``CarrierStore()``. The store's methods
    never replace a state object, only its value: a compiled learner keeps reading the states
    it was compiled with.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._algorithm.engine.base import EligibilityTrace
    >>> store = CarrierStore.of_zeros({(1, 0): {'weight': jnp.zeros((3, 2))}}, EligibilityTrace)
    >>> store.select([(1, 0)])[(1, 0)]['weight'].shape
    (3, 2)
    >>> store.assign({(2, 0): {'weight': jnp.ones((3, 2))}})
    Traceback (most recent call last):
    ...
    RuntimeError: braintrace internal error: CarrierStore.assign: no carrier under the key(s) [(2, 0)] (the
    store holds [(1, 0)]). This is a bug in braintrace; please report it with the code that triggered it.
    """

    @classmethod
    def of_zeros(cls, zeros: Mapping[K, PyTree], state: Callable[[PyTree], S]) -> CarrierStore[K, S]:
        """A store of one new state per key, made by ``state`` from the key's zero carrier.

        Parameters
        ----------
        zeros : mapping
            ``key -> carrier`` (a pytree of zero arrays), in the order the store keeps.
        state : callable
            The state type (``EligibilityTrace``), or a function making a state of a value.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithm.engine.base import EligibilityTrace
        >>> store = CarrierStore.of_zeros({7: jnp.zeros(3)}, EligibilityTrace)
        >>> list(store), store[7].value.shape
        ([7], (3,))
        """
        return cls((key, state(value)) for key, value in zeros.items())

    def read(self, view: Layout[K] = _as_it_is) -> dict[K, PyTree]:
        """Every carrier, ``key -> view(key, stored value)`` (the stored values themselves by default).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithm.engine.base import EligibilityTrace
        >>> store = CarrierStore.of_zeros({'a': jnp.zeros(2)}, EligibilityTrace)
        >>> store.read(lambda key, value: value[..., None])['a'].shape
        (2, 1)
        """
        return {key: view(key, st.value) for key, st in self.items()}

    def assign(self, values: Mapping[K, PyTree], stored: Layout[K] = _as_it_is) -> None:
        """Write ``stored(key, value)`` into the state of every key of ``values`` (a subset of the store's).

        Raises
        ------
        RuntimeError
            For a key the store does not hold, before any state is written.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithm.engine.base import EligibilityTrace
        >>> store = CarrierStore.of_zeros({'a': jnp.zeros(2), 'b': jnp.zeros(2)}, EligibilityTrace)
        >>> store.assign({'b': jnp.ones(2)})
        >>> [float(v.sum()) for v in store.read().values()]
        [0.0, 2.0]
        """
        self._require(values, "assign")
        for key, value in values.items():
            self[key].value = stored(key, value)

    def select(self, keys: Iterable[K], view: Layout[K] = _as_it_is) -> dict[K, PyTree]:
        """The carriers of ``keys`` (each once, in the order given), ``key -> view(key, stored value)``.

        What ``get_etrace_of`` returns once an engine has found the keys of a weight's relations.

        Raises
        ------
        RuntimeError
            For a key the store does not hold.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithm.engine.base import EligibilityTrace
        >>> store = CarrierStore.of_zeros({'a': jnp.zeros(2), 'b': jnp.ones(3)}, EligibilityTrace)
        >>> {key: value.shape for key, value in store.select(['b', 'b']).items()}
        {'b': (3,)}
        """
        wanted = list(dict.fromkeys(keys))
        self._require(wanted, "select")
        return {key: view(key, self[key].value) for key in wanted}

    def reset(self, batch_size: int | None = None, leads_with_batch: Callable[[K], bool] = _no_key) -> None:
        """Zero every carrier in place, keeping its shapes and dtypes.

        With ``batch_size``, every array of the keys ``leads_with_batch`` selects gets that
        leading size, but a scalar, which has no batch axis (a step count); the others keep
        their shape.

        Raises
        ------
        ValueError
            For a ``batch_size`` that is not a positive int, before any state is written.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from braintrace._algorithm.engine.base import EligibilityTrace
        >>> store = CarrierStore.of_zeros({'a': jnp.ones((2, 3)), 'b': jnp.ones(3)}, EligibilityTrace)
        >>> store.reset(batch_size=4, leads_with_batch=lambda key: key == 'a')
        >>> [(v.shape, float(v.sum())) for v in store.read().values()]
        [((4, 3), 0.0), ((3,), 0.0)]
        >>> store.reset(batch_size=0)
        Traceback (most recent call last):
        ...
        ValueError: reset_state: batch_size must be a positive int (or None for unbatched inputs), got 0;
        pass the number of sequences in a batch, the leading axis of each step's input, e.g. batch_size=32.
        """
        batch_size = checked_batch_size(batch_size, "reset_state")
        for key, st in self.items():
            size = batch_size if batch_size is not None and leads_with_batch(key) else None

            def zeros(v: jax.Array, size: int | None = size) -> jax.Array:
                return fresh_zeros(v.shape if size is None or not v.ndim else (size, *v.shape[1:]), v.dtype)

            st.value = jax.tree.map(zeros, st.value)

    def reallocate(self, shapes: Mapping[K, PyTree], view: Layout[K] = _as_it_is,
                   stored: Layout[K] = _as_it_is) -> None:
        """Replace by zeros, at the shape ``shapes`` gives it, every array that one step would reshape.

        ``shapes`` holds, per key, the carrier one step rolls to (arrays or ``ShapeDtypeStruct``
        of the structure ``view`` gives), so that every carrier starts at the shape it keeps and a
        scan can carry it. Arrays keep their dtype; keys whose shapes do not change are not written.

        Examples
        --------
        >>> import jax, jax.numpy as jnp
        >>> from braintrace._algorithm.engine.base import EligibilityTrace
        >>> store = CarrierStore.of_zeros({'a': jnp.zeros(3)}, EligibilityTrace)
        >>> store.reallocate({'a': jax.ShapeDtypeStruct((2, 3), jnp.float32)})
        >>> store['a'].value.shape
        (2, 3)
        """
        self._require(shapes, "reallocate")
        for key, shape in shapes.items():
            value = view(key, self[key].value)
            if all(v.shape == s.shape for v, s in zip(jax.tree.leaves(value), jax.tree.leaves(shape), strict=True)):
                continue
            grown = jax.tree.map(lambda v, s: v if v.shape == s.shape else jnp.zeros(s.shape, v.dtype), value, shape)
            self[key].value = stored(key, grown)

    def zeros_like(self, state: Callable[[PyTree], T]) -> CarrierStore[K, T]:
        """A new store of zeros shaped like this one's values, one new state per key made by ``state``.

        Examples
        --------
        >>> import brainstate, jax.numpy as jnp
        >>> from braintrace._algorithm.engine.base import EligibilityTrace
        >>> traces = CarrierStore.of_zeros({'a': jnp.ones(2)}, EligibilityTrace)
        >>> filters = traces.zeros_like(brainstate.ShortTermState)
        >>> type(filters['a']).__name__, float(filters['a'].value.sum())
        ('ShortTermState', 0.0)
        """
        return CarrierStore.of_zeros({key: jax.tree.map(jnp.zeros_like, st.value) for key, st in self.items()},
                                     state)

    def _require(self, keys: Iterable[K], call: str) -> None:
        missing = [key for key in keys if key not in self]
        if missing:
            raise internal_error(
                f"CarrierStore.{call}: no carrier under the key(s) {missing} (the store holds {list(self)})")


#: The store of a learner's eligibility traces, by key type.
TraceStore = CarrierStore[K, EligibilityTrace]


def _entries(store: CarrierStore[Hashable, brainstate.ShortTermState]) -> Iterator[tuple[Hashable, PyTree]]:
    """The store's ``(key, state)`` pairs in the order JAX gives a ``dict``'s entries (sorted keys)."""
    plain = dict(store)
    for path, state in jax.tree_util.tree_flatten_with_path(plain, is_leaf=lambda node: node is not plain)[0]:
        (entry,) = path
        if not isinstance(entry, jax.tree_util.DictKey):
            raise internal_error(f"a dict flattened to the key {entry!r}")
        yield entry.key, state


def _flatten_with_keys(
    store: CarrierStore[Hashable, brainstate.ShortTermState],
) -> tuple[list[tuple[jax.tree_util.DictKey, PyTree]], tuple[Hashable, ...]]:
    pairs = list(_entries(store))
    return [(jax.tree_util.DictKey(key), state) for key, state in pairs], tuple(key for key, _ in pairs)


def _flatten(store: CarrierStore[Hashable, brainstate.ShortTermState]) -> tuple[list[PyTree], tuple[Hashable, ...]]:
    pairs = list(_entries(store))
    return [state for _, state in pairs], tuple(key for key, _ in pairs)


def _unflatten(
    keys: tuple[Hashable, ...], states: Iterable[PyTree],
) -> CarrierStore[Hashable, brainstate.ShortTermState]:
    return CarrierStore(zip(keys, states))


jax.tree_util.register_pytree_with_keys(CarrierStore, _flatten_with_keys, _unflatten, _flatten)

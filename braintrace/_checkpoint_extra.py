"""A checkpoint's ``extra``: what it may hold, and how values msgpack cannot hold are kept.

``braintools.file`` stores dicts, lists, tuples, named tuples, ``None``, bools, numbers, strings,
bytes, NumPy and JAX arrays and ``brainunit`` quantities. A run's own bookkeeping also holds three
kinds of value it cannot store, which :func:`encode` turns into a tagged dict before the extra is
written (``{TAG: kind, ...}``) and :func:`decode_raw` / :func:`restore_like` turn back into a value of
the same type:

* ``'prng_key'``: a typed JAX PRNG key array (``jax.random.key``, ``brainstate.random.get_key()``),
  stored as its implementation's name and its ``uint32`` key data. A raw key
  (``jax.random.PRNGKey``) is a plain ``uint32`` array and needs no tag;
* ``'numpy_generator'``: a NumPy ``np.random.Generator``, stored as its bit generator's state
  (``generator.bit_generator.state``, whose 128-bit integers are tagged ``'int'`` in turn);
* ``'int'``: a Python int outside int64 (msgpack's range), stored as its decimal digits.

A ``brainstate.State`` is stored as its value (``brainstate.random.RandomState`` as its key);
restored into a template, the state is given the value in place, once every check has passed.
Any other value is refused with a ``TypeError`` naming its key path inside ``extra``, before
anything is written.

Examples
--------
>>> import jax, numpy as np
>>> from braintrace._checkpoint_extra import decode_raw, encode
>>> stored = encode({'step': 2**70, 'rng': np.random.default_rng(0)}, 'save_checkpoint')
>>> stored['step']
{'__braintrace_extra__': 'int', 'digits': '1180591620717411303424'}
>>> back = decode_raw(stored)
>>> back['step'] == 2**70, back['rng'].random() == np.random.default_rng(0).random()
(True, True)
>>> key = decode_raw(encode(jax.random.key(3), 'save_checkpoint'))
>>> bool((jax.random.key_data(key) == jax.random.key_data(jax.random.key(3))).all())
True
"""

from __future__ import annotations

from typing import Callable, TypeGuard, Union

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compatible_imports import Tracer
from braintrace._typing import PyTree

__all__ = ["TAG", "Leaf", "StateWrites", "ExtraMismatch", "encode", "decode_raw", "restore_like", "without_states"]

#: The key that marks a stored dict as an encoded value; refused as a key of the user's own dicts.
TAG = "__braintrace_extra__"
#: The Python ints msgpack stores as they are.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: ``(state, restored value)`` for each ``State`` of a template, written once every check has passed.
StateWrites = list[tuple[brainstate.State, PyTree]]
#: An array or number leaf of a state or of ``extra``.
Leaf = Union[jax.Array, np.ndarray, np.generic, u.Quantity, bool, int, float, complex]

_STORABLE = (
    "dicts, lists, tuples, named tuples, None, bools, numbers (Python ints of any size), strings, "
    "bytes, NumPy and JAX arrays (typed PRNG keys included), brainunit quantities, brainstate "
    "States and np.random.Generator objects"
)


class ExtraMismatch(ValueError):
    """A stored ``extra`` value does not fit its template leaf (the message names where)."""


# --- saving --------------------------------------------------------------------------------


def encode(extra: PyTree, call: str) -> PyTree:
    """``extra`` with every value msgpack cannot hold tagged; refused (``TypeError``) if it holds
    something no checkpoint stores."""
    return _encode(extra, "extra", call)


def _encode(value: PyTree, where: str, call: str) -> PyTree:
    if isinstance(value, brainstate.State):
        return _encode(value.value, f"{where}.value", call)
    if isinstance(value, Tracer):
        raise TypeError(
            f"{call}: {where} is a traced value (a call inside jit / grad / vmap); save the "
            f"checkpoint outside jit, between steps. Nothing was written."
        )
    if _is_typed_key(value):
        impl, data = str(jax.random.key_impl(value)), np.asarray(jax.random.key_data(value))
        return {TAG: "prng_key", "impl": impl, "data": data}
    if isinstance(value, np.random.Generator):
        state = value.bit_generator.state
        return {TAG: "numpy_generator", "state": _encode(state, f"{where}.bit_generator.state", call)}
    if value is None or isinstance(value, (bool, float, complex, str, bytes, u.Quantity, np.generic)):
        return value
    if isinstance(value, int):
        return value if _INT64_MIN <= value <= _INT64_MAX else {TAG: "int", "digits": str(value)}
    if isinstance(value, (np.ndarray, jax.Array)):
        if value.dtype.hasobject:
            raise TypeError(
                f"{call}: {where} is a NumPy array of Python objects, which a checkpoint cannot store; "
                f"store a numeric array (or a list of the objects, if they are storable). Nothing was written."
            )
        return value
    if isinstance(value, dict):
        if TAG in value:
            raise TypeError(
                f"{call}: {where} is a dict with the key {TAG!r}, which checkpoints reserve to mark the "
                f"values they encode; rename that key. Nothing was written."
            )
        return {key: _encode(item, f"{where}[{key!r}]", call) for key, item in value.items()}
    if _is_namedtuple(value):
        return type(value)(*(_encode(getattr(value, f), f"{where}.{f}", call) for f in value._fields))
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(item, f"{where}[{i}]", call) for i, item in enumerate(value))
    raise TypeError(
        f"{call}: {where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
        f"cannot store. extra may hold {_STORABLE}; convert it to one of those (its state as a dict, "
        f"for instance), or keep it out of extra. Nothing was written."
    )


# --- loading -------------------------------------------------------------------------------


def decode_raw(stored: PyTree) -> PyTree:
    """The stored ``extra`` as it was read, tagged values decoded and arrays copied to NumPy."""
    if isinstance(stored, dict):
        if TAG in stored:
            return _decode_tagged(stored)
        return {key: decode_raw(item) for key, item in stored.items()}
    if isinstance(stored, np.ndarray):
        return np.array(stored)
    return stored


def _decode_tagged(stored: dict[str, PyTree]) -> int | jax.Array | np.random.Generator:
    kind = stored[TAG]
    if kind == "int":
        return int(stored["digits"])
    if kind == "prng_key":
        return jax.random.wrap_key_data(jnp.asarray(stored["data"]), impl=stored["impl"])
    if kind == "numpy_generator":
        state = decode_raw(stored["state"])
        name = state["bit_generator"]
        bit_generator = getattr(np.random, name, None)
        if not (isinstance(bit_generator, type) and issubclass(bit_generator, np.random.BitGenerator)):
            raise ExtraMismatch(f"the stored generator's bit generator {name!r} is not one NumPy has")
        generator = np.random.Generator(bit_generator())
        generator.bit_generator.state = state
        return generator
    raise ExtraMismatch(f"a stored value has the unknown kind {kind!r} (a newer braintrace wrote it)")


def without_states(template: PyTree) -> PyTree:
    """``template`` with each ``State`` replaced by its value (``braintools`` would write into it)."""
    if isinstance(template, brainstate.State):
        return without_states(template.value)
    if isinstance(template, dict):
        return {key: without_states(item) for key, item in template.items()}
    if _is_namedtuple(template):
        return type(template)(*(without_states(item) for item in template))
    if isinstance(template, (list, tuple)):
        return type(template)(without_states(item) for item in template)
    return template


def restore_like(
    template: PyTree, restored: PyTree, leaf: Callable[[Leaf, object], Leaf], writes: StateWrites,
    where: str = "extra",
) -> PyTree:
    """``restored`` (what ``braintools`` restored against ``without_states(template)``) in the
    form of ``template``: tagged values decoded, each array or number leaf given as
    ``leaf(template_leaf, stored_leaf)``, and each ``State`` of the template returned itself, its
    new value appended to ``writes``. Raises :class:`ExtraMismatch` where a stored value is of
    another kind than the template's."""
    if isinstance(template, brainstate.State):
        writes.append((template, restore_like(template.value, restored, leaf, writes, f"{where}.value")))
        return template
    kind = _kind(template)
    found = _stored_kind(restored)
    if kind == "int" and found in ("int", "number"):
        return int(restored["digits"]) if found == "int" else int(restored)
    if kind != found and (kind in _TAGGED or found in (*_TAGGED, "int")):
        raise ExtraMismatch(f"{where}: the template holds {_KIND_NAMES[kind]}, the checkpoint {_KIND_NAMES[found]}")
    if kind in _TAGGED:
        value = _decode_tagged(restored)
        if isinstance(value, jax.Array) and jnp.shape(value) != jnp.shape(template):  # a typed PRNG key
            raise ExtraMismatch(
                f"{where}: PRNG key shape mismatch: expected {jnp.shape(template)}, got {jnp.shape(value)}")
        return value
    if isinstance(template, dict):
        return {key: restore_like(item, restored[key], leaf, writes, f"{where}[{key!r}]")
                for key, item in template.items()}
    if _is_namedtuple(template):
        return type(template)(*(restore_like(getattr(template, f), getattr(restored, f), leaf, writes, f"{where}.{f}")
                                for f in template._fields))
    if isinstance(template, (list, tuple)):
        return type(template)(restore_like(t, r, leaf, writes, f"{where}[{i}]")
                              for i, (t, r) in enumerate(zip(template, restored)))
    if kind == "array" and found not in ("array", "number"):
        raise ExtraMismatch(f"{where}: the template holds {_KIND_NAMES[kind]}, the checkpoint {_KIND_NAMES[found]}")
    return leaf(template, restored) if kind == "array" else restored


_TAGGED = ("prng_key", "numpy_generator")
_KIND_NAMES = {
    "prng_key": "a typed PRNG key",
    "numpy_generator": "an np.random.Generator",
    "int": "a Python int",
    "number": "a number",
    "array": "an array or number",
    "other": "another value",
}


def _kind(template: object) -> str:
    """What a template leaf asks for."""
    if _is_typed_key(template):
        return "prng_key"
    if isinstance(template, np.random.Generator):
        return "numpy_generator"
    if isinstance(template, int) and not isinstance(template, bool):
        return "int"
    if isinstance(template, (np.ndarray, np.generic, jax.Array, u.Quantity, bool, float, complex)):
        return "array"
    return "other"


def _stored_kind(stored: object) -> str:
    """What a stored (``braintools``-restored) value is."""
    if isinstance(stored, dict) and TAG in stored:
        return str(stored[TAG])
    if isinstance(stored, (int, np.integer)) and not isinstance(stored, (bool, np.bool_)):
        return "number"
    if isinstance(stored, (np.ndarray, np.generic, jax.Array, u.Quantity, bool, float, complex)):
        return "array"
    return "other"


def _is_typed_key(value: object) -> TypeGuard[jax.Array]:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")

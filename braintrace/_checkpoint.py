"""Checkpoints: a learner's whole training state, saved mid-stream and resumed elsewhere.

:func:`save_checkpoint` writes every state of a compiled learner (the model's parameters,
hidden states and other states, the eligibility traces, the learner's step counters and
filters), optionally the states of a ``braintools.optim`` optimizer, and a pytree of the user's
own (``extra``). :func:`load_checkpoint` writes them back, in place, into a learner (and
optimizer) built the same way, in this process or another; the run then goes on bit for bit as
if it had not stopped.

Every value is stored under a stable name:

* ``model/<path>``: a state of the model, by its path in the model (``model/W``);
* ``learner/<path>``: a state the learner keeps (``learner/running_index``);
* ``optimizer/<path>``: a state of the optimizer, by attribute (``optimizer/opt_state``);

followed by the key path of the leaf inside the state's value (``model/W['weight']``). Learners
key their trace dicts by the ``id`` of jaxpr variables, which differs from process to process.
In a name such an ``id`` becomes the index of its relation in
``learner.graph.hidden_param_op_relations`` (the same for the same model and example input):
``relation3.y`` (the output of relation 3), ``relation3.x`` (its input), ``relation3.weight``
(its trainable operand ``'weight'``). The other path elements are kept.

The file is a ``braintools.file`` msgpack file holding a header (format and version, the learner
and optimizer classes, the shape, dtype and unit of every entry, and a SHA-256 checksum of the
entries and ``extra``), the entries, and ``extra``. Arrays are stored as raw bytes, so values come
back bit for bit; ``brainunit`` quantities keep their unit, and a unit that differs from the target
state's is refused. A file whose payload does not match its checksum (a flipped bit, a truncated
write) is refused before anything is restored. ``extra`` may also hold typed PRNG keys, NumPy
generators and Python ints of any size (:mod:`braintrace._checkpoint_extra`); a value no
checkpoint stores is refused before anything is written.

Not saved: the global random state (``brainstate.random``); save ``brainstate.random.get_key()``
in ``extra`` and set it back with ``brainstate.random.set_key`` if the run draws from it.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Hashable, NamedTuple, TypeGuard, TypedDict

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm import ETraceAlgorithm, ETraceVmap
from braintrace._atomic_file import write_atomically
from braintrace._compatible_imports import Tracer
from braintrace._checkpoint_extra import Leaf, StateWrites, decode_raw, encode, restore_like, without_states
from braintrace._compile import Learner
from braintrace._errors import NotSupportedError, internal_error
from braintrace._typing import PyTree

if TYPE_CHECKING:
    import braintools

__all__ = ["save_checkpoint", "load_checkpoint"]

#: The ``format`` field of a checkpoint's header.
FORMAT = "braintrace.checkpoint"
#: The version of the checkpoint layout this module writes (3: ``extra`` may hold tagged values).
VERSION = 3
#: The versions it reads (1: without a checksum; 2: with one, ``extra`` as ``braintools`` stores it).
READABLE_VERSIONS = (1, 2, 3)

#: A state's path as brainstate lists it: attribute names, dict keys, list indices.
StatePath = tuple[Hashable, ...]
#: ``id`` of a jaxpr variable -> its stable name in checkpoints (``'relation3.y'``).
StableIds = dict[int, str]
#: A file path.
PathLike = str | os.PathLike[str]

_QUANTITY_FIELDS = frozenset({"mantissa", "scale", "base", "dim", "factor"})
#: Path keys at least this large are object ids (addresses), never a list index or a user key.
_ID_LIKE = 2**32
_PYTHON_SCALARS = (bool, int, float, complex)


class Header(TypedDict, total=False):
    """A checkpoint's header as :func:`save_checkpoint` writes it (read key by key: a file of
    version 1 has no ``checksum``)."""

    format: str
    version: int
    learner: str
    optimizer: str | None
    has_extra: bool
    entries: dict[str, dict[str, str | None]]
    checksum: str


class Stored(TypedDict):
    """A checkpoint file as read: its header, its stored leaves by entry name, and its ``extra``."""

    header: Header
    entries: dict[str, object]
    extra: PyTree


class Entry(NamedTuple):
    """One leaf of one state: what a checkpoint stores under one name."""

    state: brainstate.State
    position: int  # of the leaf among the state's leaves (a Quantity is one leaf)
    leaf: Leaf  # its value as the checkpoint holds it
    #: The state holds the leaf without the trailing state axis of one that the checkpoint keeps
    #: (a trace stored on a TPU; see ``ParamDimVjpAlgorithm._stored``).
    without_state_axis: bool = False


class LeafSpec(NamedTuple):
    """What a stored leaf must match: shape, dtype and unit (``None``: a plain number)."""

    shape: tuple[int, ...]
    dtype: str
    unit: u.Unit | str | None  # a unit of the learner, or its name in a checkpoint's header

    def __str__(self) -> str:
        unit = "" if self.unit is None else f" [{self.unit}]"
        return f"{self.shape} {self.dtype}{unit}"


# --- stable names --------------------------------------------------------------------------


def _algorithm_of(learner: object, call: str) -> ETraceAlgorithm:
    """The compiled :class:`ETraceAlgorithm` of ``learner`` (itself, or the one a vmap wraps)."""
    algo = learner.module if isinstance(learner, ETraceVmap) else learner
    if not isinstance(algo, ETraceAlgorithm):
        raise TypeError(
            f"{call}: the learner must be a compiled braintrace learner (what braintrace.compile "
            f"returns), got {type(learner).__name__}."
        )
    if not algo.is_compiled:
        raise ValueError(
            f"{call}: the {type(algo).__name__} learner is not compiled; build it with "
            f"braintrace.compile(model, algorithm, x0, ...) first."
        )
    return algo


def _learner_kind(learner: Learner) -> str:
    if isinstance(learner, ETraceVmap):
        return f"ETraceVmap({type(learner.module).__name__})"
    return type(learner).__name__


def _stable_ids(algo: ETraceAlgorithm) -> StableIds:
    """Every relation's variables by the relation's index (first use wins, in graph order)."""
    names: StableIds = {}
    for i, rel in enumerate(algo.graph.hidden_param_op_relations):
        names.setdefault(id(rel.y_var), f"relation{i}.y")
        if rel.x_var is not None:
            names.setdefault(id(rel.x_var), f"relation{i}.x")
        for key, var in rel.trainable_vars.items():
            names.setdefault(id(var), f"relation{i}.{key}")
    return names


def _element(e: Hashable, ids: StableIds, path: StatePath, call: str) -> str:
    if isinstance(e, str):
        return e
    if isinstance(e, int) and not isinstance(e, bool):
        if e in ids:
            return ids[e]
        if abs(e) >= _ID_LIKE:
            raise NotSupportedError(
                f"{call}: the state at {path!r} is keyed by {e}, the id() of an object that is no "
                f"relation's input, output or operand; ids differ between processes, so it cannot "
                f"get a stable name. Key the state by a relation's variable or by a fixed name."
            )
        return str(e)
    if isinstance(e, tuple):
        return "(" + ", ".join(_element(x, ids, path, call) for x in e) + ")"
    return repr(e)


def _name(prefix: str, path: StatePath, ids: StableIds, call: str) -> str:
    return prefix + "/" + "/".join(_element(e, ids, path, call) for e in path)


def _is_quantity(x: object) -> bool:
    return isinstance(x, u.Quantity)


def _add_state(
    entries: dict[str, Entry], name: str, state: brainstate.State, call: str, without_state_axis: bool = False,
) -> None:
    flat, _ = jax.tree_util.tree_flatten_with_path(state.value, is_leaf=_is_quantity)
    for position, (keys, leaf) in enumerate(flat):
        full = name + jax.tree_util.keystr(keys)
        if full in entries:
            raise NotSupportedError(
                f"{call}: two states get the checkpoint name {full!r}; give them keys that differ "
                f"in more than their type (such as 1 and '1')."
            )
        if isinstance(leaf, Tracer):
            raise ValueError(
                f"{call}: the state {full!r} holds a traced value; call it outside jit / for_loop, "
                f"between steps."
            )
        if without_state_axis:
            leaf = leaf[..., None]
        entries[full] = Entry(state, position, leaf, without_state_axis)


def _learner_entries(learner: Learner, call: str) -> dict[str, Entry]:
    """``name -> Entry`` of every leaf of every state of the learner."""
    algo = _algorithm_of(learner, call)
    ids = _stable_ids(algo)
    entries: dict[str, Entry] = {}
    in_model: set[int] = set()
    # The model's states by their path in the model: the learner reaches them by several paths
    # (its model, and caches filled on demand), and the first of those is not stable.
    for path, state in brainstate.graph.states(algo.model4compile).items():
        in_model.add(id(state))
        _add_state(entries, _name("model", path, ids, call), state, call)
    compact = {id(st) for st in algo._states_without_state_axis()}
    for path, state in brainstate.graph.states(learner).items():
        if id(state) not in in_model:
            _add_state(entries, _name("learner", path, ids, call), state, call, id(state) in compact)
    return entries


def _optimizer_entries(optimizer: object, skip: set[int], call: str) -> dict[str, Entry]:
    """``name -> Entry`` of the states of a ``braintools.optim`` optimizer and its schedulers.

    States in ``skip`` (the learner's parameters it updates) are left out: they are saved as
    the learner's. The walk goes through the optimizer's and its schedulers' attributes (in name
    order) and through dicts, lists and tuples, so it finds ``opt_state``, ``step_count``, the
    learning rates, the per-group states and every scheduler's counters.
    """
    import braintools

    if not isinstance(optimizer, braintools.optim.Optimizer):
        raise TypeError(
            f"{call}: optimizer must be a braintools.optim optimizer (e.g. braintools.optim.Adam), "
            f"got {type(optimizer).__name__}."
        )
    if getattr(optimizer, "opt_state", True) is None:
        raise ValueError(
            f"{call}: the {type(optimizer).__name__} optimizer has no state yet; call "
            f"optimizer.register_trainable_weights(learner.param_states) first."
        )
    found: dict[StatePath, brainstate.State] = {}
    seen: set[int] = set()
    containers = (dict, list, tuple, braintools.optim.Optimizer, braintools.optim.LRScheduler)

    def visit(obj: object, path: StatePath) -> None:
        if id(obj) in seen:
            return
        if isinstance(obj, brainstate.State):
            seen.add(id(obj))
            if id(obj) not in skip:
                found[path] = obj
        elif isinstance(obj, containers):
            seen.add(id(obj))
            if isinstance(obj, dict):
                items: list[tuple[Hashable, object]] = list(obj.items())
            elif isinstance(obj, (list, tuple)):
                items = list(enumerate(obj))
            else:
                items = [(name, vars(obj)[name]) for name in sorted(vars(obj))]
            for key, value in items:
                visit(value, (*path, key))

    visit(optimizer, ())
    entries: dict[str, Entry] = {}
    for path, state in found.items():
        _add_state(entries, _name("optimizer", path, {}, call), state, call)
    return entries


# --- leaves --------------------------------------------------------------------------------


def _spec(leaf: object) -> LeafSpec:
    unit = None
    if isinstance(leaf, u.Quantity):
        unit, leaf = leaf.unit, leaf.mantissa
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):  # arrays and NumPy scalars
        return LeafSpec(tuple(leaf.shape), np.dtype(leaf.dtype).name, unit)
    if isinstance(leaf, _PYTHON_SCALARS):
        # A Python number is stored as it is; it matches the array JAX would make of it.
        return LeafSpec((), np.dtype(jax.dtypes.canonicalize_dtype(type(leaf))).name, unit)
    return LeafSpec((), type(leaf).__name__, unit)


def _decode(raw: object) -> object:
    """A stored leaf as a value: ``braintools`` writes a Quantity as its mantissa and unit."""
    import braintools

    if isinstance(raw, dict) and set(raw) == _QUANTITY_FIELDS:
        # 'ignore': take the stored unit; the caller compares it with the target's.
        return braintools.file.msgpack_from_state_dict(u.Quantity(0.0), raw, mismatch="ignore")
    return raw


def _restored(template: Leaf, found: object) -> Leaf:
    """``found`` (a checked stored leaf) in the form of the target leaf ``template``."""
    if isinstance(found, u.Quantity):
        # The units are equal (checked); the target's unit object keeps its name ('mV').
        unit = template.unit if isinstance(template, u.Quantity) else found.unit
        mantissa = template.mantissa if isinstance(template, u.Quantity) else template
        return u.Quantity(_restored(mantissa, found.mantissa), unit=unit)
    if isinstance(template, np.ndarray):
        return np.array(found, dtype=template.dtype)
    if isinstance(template, np.generic):
        return template.dtype.type(found)
    if isinstance(template, _PYTHON_SCALARS) and isinstance(found, _PYTHON_SCALARS):
        return found
    if isinstance(found, (np.ndarray, np.generic, *_PYTHON_SCALARS)):
        return jnp.asarray(found, dtype=template.dtype if isinstance(template, jax.Array) else None)
    return found


def _header_entry(spec: LeafSpec) -> dict[str, str | None]:
    # The shape as text: braintools would store a list as a dict of its items.
    return {"shape": str(spec.shape), "dtype": spec.dtype, "unit": None if spec.unit is None else str(spec.unit)}


# --- the public calls ------------------------------------------------------------------------


def save_checkpoint(
    path: PathLike, learner: Learner, *, optimizer: braintools.optim.Optimizer | None = None, extra: PyTree = None,
) -> str:
    """Write the whole training state of ``learner`` (and ``optimizer``) to ``path``.

    Saved: every state of the learner under a stable name (parameters, hidden states, the
    model's other states, eligibility traces, step counters, filters: see
    :mod:`braintrace._checkpoint`), the states of ``optimizer`` (its ``opt_state``, step count,
    learning rates and scheduler counters), and ``extra``. Call it between steps, outside
    ``jit``. The file is written to a temporary name, flushed to disk and renamed (and the
    rename flushed), so a crash or ``SIGKILL`` at any point leaves either the previous
    checkpoint or the new one, whole; an existing file at ``path`` is replaced. A temporary
    file left by a killed process is removed by the next save to the same path.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write (its folder is created if needed).
    learner : ETraceAlgorithm or ETraceVmap
        A compiled learner (what :func:`braintrace.compile` returns).
    optimizer : braintools.optim.Optimizer, optional
        An optimizer registered on ``learner.param_states`` (a ``braintools.optim.Adam``, ...).
    extra : pytree, optional
        Anything else to keep with the run: dicts, lists, tuples, named tuples, ``None``,
        bools, numbers (Python ints of any size), strings, bytes, NumPy or JAX arrays,
        ``brainunit`` quantities, PRNG keys (typed, from ``jax.random.key`` or
        ``brainstate.random.get_key()``, and raw ``uint32`` ones from ``jax.random.PRNGKey``),
        ``np.random.Generator`` objects (their bit generator's state) and ``brainstate``
        states (their value). Anything else is refused.

    Returns
    -------
    str
        The path written.

    Raises
    ------
    TypeError
        If ``learner`` is not a braintrace learner or ``optimizer`` not a ``braintools.optim`` one,
        or ``extra`` holds a value no checkpoint stores (the message names its key path, such as
        ``extra['logger']``); nothing is written, and a checkpoint already at ``path`` is kept.
    IsADirectoryError
        If ``path`` is a folder.
    NotADirectoryError
        If ``path`` lies under a file.
    ValueError
        If the learner is not compiled, the optimizer has no registered weights, or a state
        holds a traced value (a call inside ``jit``).

    Examples
    --------
    >>> import os, tempfile, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL,
    ...                              jnp.ones((2, 3)), batch_size=2)
    >>> _ = learner(jnp.ones((2, 3)))
    >>> path = os.path.join(tempfile.mkdtemp(), 'run.ckpt')
    >>> braintrace.save_checkpoint(path, learner, extra={'epoch': 3}) == path
    True

    Random states travel in ``extra``; what cannot be stored is refused by its key path:

    >>> import brainstate, jax, numpy as np
    >>> extra = {'key': brainstate.random.get_key(), 'rng': np.random.default_rng(0), 'seen': 2**80}
    >>> _ = braintrace.save_checkpoint(path, learner, extra=extra)
    >>> braintrace.save_checkpoint(path, learner, extra={'log': open})
    Traceback (most recent call last):
    ...
    TypeError: save_checkpoint: extra['log'] is a builtins.builtin_function_or_method, which a checkpoint cannot store. ...
    """
    import braintools

    call = "save_checkpoint"
    filename = _file_path(path, call)
    stored_extra = encode(extra, call)
    entries = _learner_entries(learner, call)
    if optimizer is not None:
        entries.update(_optimizer_entries(optimizer, {id(e.state) for e in entries.values()}, call))
    header: Header = {
        "format": FORMAT,
        "version": VERSION,
        "learner": _learner_kind(learner),
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        "has_extra": extra is not None,
        "entries": {name: _header_entry(_spec(e.leaf)) for name, e in entries.items()},
    }
    body = {"entries": {name: e.leaf for name, e in entries.items()}, "extra": stored_extra}
    header["checksum"] = _checksum(braintools.file.msgpack_to_state_dict(body))
    write_atomically(filename, lambda temp: braintools.file.msgpack_save(temp, {"header": header, **body}))
    return filename


def load_checkpoint(
    path: PathLike, learner: Learner, *, optimizer: braintools.optim.Optimizer | None = None, extra: PyTree = None,
) -> PyTree:
    """Restore a checkpoint of :func:`save_checkpoint` into ``learner`` (and ``optimizer``), in place.

    Build the learner (and optimizer) exactly as the saved one was built (the same model,
    algorithm and options, example input and ``batch_size``; the optimizer registered on
    ``learner.param_states``), then load: every state object keeps its identity and gets the
    saved value, bit for bit, so jitted step functions and the optimizer keep working on them.
    Everything is checked before anything is written: on a mismatch nothing is restored.

    Parameters
    ----------
    path : str or os.PathLike
        A file written by :func:`save_checkpoint`.
    learner : ETraceAlgorithm or ETraceVmap
        A compiled learner of the same class, model and shapes as the saved one.
    optimizer : braintools.optim.Optimizer, optional
        Give it exactly when the checkpoint was saved with one: an optimizer of the same class,
        registered on ``learner.param_states``.
    extra : pytree, optional
        A template of the saved ``extra``: the result has its structure and key types, its
        array leaves are JAX or NumPy arrays like the template's, typed PRNG keys, NumPy
        generators and Python ints where the template has them (a new generator: the
        template's is not changed), and the template's ``State`` leaves are given their
        saved values in place, once everything fits. Without it, the stored ``extra`` comes
        back raw: dict keys as strings, tuples and lists as ``{'0': ..., '1': ...}``, arrays as
        NumPy arrays (a raw PRNG key too), typed PRNG keys, generators and ints as such.

    Returns
    -------
    pytree or None
        The restored ``extra`` (``None`` if none was saved and no template given).

    Raises
    ------
    FileNotFoundError
        If there is no file at ``path``.
    IsADirectoryError
        If ``path`` is a folder.
    ValueError
        If the file is truncated, corrupted (its entries do not match its checksum) or no
        braintrace checkpoint, or the checkpoint does not fit: another
        learner class, other state names, shapes, dtypes or units, an optimizer or an
        ``extra`` template given for a checkpoint saved without one (or missing for one saved
        with one). The message lists every mismatching entry.

    Examples
    --------
    >>> import os, tempfile, numpy as np, jax.numpy as jnp, braintrace
    >>> def build():
    ...     return braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL,
    ...                               jnp.ones((2, 3)), batch_size=2, seed=0)
    >>> learner = build()
    >>> _ = learner(jnp.ones((2, 3)))
    >>> path = braintrace.save_checkpoint(os.path.join(tempfile.mkdtemp(), 'run.ckpt'), learner,
    ...                                   extra={'epoch': 3})
    >>> resumed = build()
    >>> braintrace.load_checkpoint(path, resumed, extra={'epoch': 0})
    {'epoch': 3}
    >>> np.array_equal(resumed(jnp.ones((2, 3))), learner(jnp.ones((2, 3))))
    True
    >>> other = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 5), braintrace.D_RTRL,
    ...                            jnp.ones((2, 3)), batch_size=2)
    >>> braintrace.load_checkpoint(path, other)
    Traceback (most recent call last):
    ...
    ValueError: load_checkpoint: the checkpoint ... does not fit this learner; nothing was restored.
      - model/W/weight['bias']: expected (5,) float32, found (4,) float32
      - model/W/weight['weight']: expected (8, 5) float32, found (7, 4) float32
    ...
    """

    call = "load_checkpoint"
    filename = _file_path(path, "load_checkpoint")
    raw = _read(filename)
    header = raw["header"]
    expected = _learner_entries(learner, call)
    problems: list[str] = []
    kind = _learner_kind(learner)
    if header.get("learner") != kind:
        problems.append(f"learner class: expected {kind}, found {header.get('learner')}")
    saved_optimizer = header.get("optimizer")
    if optimizer is not None:
        optimizer_entries = _optimizer_entries(optimizer, {id(e.state) for e in expected.values()}, call)
        if saved_optimizer is None:
            problems.append(
                f"optimizer: an optimizer ({type(optimizer).__name__}) was given, but the checkpoint "
                f"holds no optimizer state (it was saved without optimizer=); load without optimizer="
            )
        else:
            expected.update(optimizer_entries)
            if saved_optimizer != type(optimizer).__name__:
                problems.append(f"optimizer class: expected {type(optimizer).__name__}, found {saved_optimizer}")
    elif saved_optimizer is not None:
        problems.append(
            f"optimizer: the checkpoint holds the states of an optimizer ({saved_optimizer}), but "
            f"none was given; pass optimizer=, a braintools.optim.{saved_optimizer} registered on "
            f"learner.param_states"
        )
    found = {name: _decode(leaf) for name, leaf in raw["entries"].items()}
    if optimizer is None or saved_optimizer is None:
        found = {name: v for name, v in found.items() if not name.startswith("optimizer/")}
    problems += _entry_problems(expected, found, header.get("entries") or {})
    restored_extra, extra_writes = _restore_extra(raw, extra, problems)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"{call}: the checkpoint {filename!r} does not fit this learner; nothing was restored.\n"
            f"{lines}\n"
            f"Build the learner exactly as the saved one was built (the same model and sizes, "
            f"algorithm and options, example input and batch_size), with the same optimizer "
            f"registered on learner.param_states and the same extra template, then load again."
        )
    _write(expected, found)
    for state, value in extra_writes:
        state.value = value
    return restored_extra


def _file_path(path: PathLike, call: str) -> str:
    """``path`` as a string, refused if it names a folder (a checkpoint is one file) or lies
    under a file."""
    filename = os.fspath(path)
    if os.path.isdir(filename):
        raise IsADirectoryError(
            f"{call}: {filename!r} is a folder, but a checkpoint is one file; give a file path, e.g. "
            f"os.path.join({filename!r}, 'run.ckpt')."
        )
    folder = os.path.dirname(os.path.abspath(filename))
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise NotADirectoryError(
            f"{call}: {filename!r} lies under {folder!r}, which is a file, not a folder; give a path in "
            f"a folder (or remove or rename that file)."
        )
    return filename


def _checksum(body: object) -> str:
    """``'sha256:<hex>'`` of a checkpoint's entries and ``extra`` as ``braintools.file`` stores
    them (nested dicts of arrays, numbers and strings), in a canonical order."""
    digest = hashlib.sha256()
    _feed(digest, body)
    return f"sha256:{digest.hexdigest()}"


def _feed(digest: hashlib._Hash, value: object) -> None:
    if isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=str):
            digest.update(repr(str(key)).encode())
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif value is None or isinstance(value, (str, bytes)):
        digest.update(repr(value).encode())
    else:
        array = np.ascontiguousarray(np.asarray(value))
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())


def _is_header(value: object) -> TypeGuard[Header]:
    """Whether ``value`` is the header of a braintrace checkpoint: a dict that names its format."""
    return isinstance(value, dict) and value.get("format") == FORMAT


def _read(filename: str) -> Stored:
    import braintools

    if not os.path.isfile(filename):
        raise FileNotFoundError(
            f"load_checkpoint: there is no checkpoint file at {filename!r}; give the path "
            f"save_checkpoint wrote (it returns it)."
        )
    try:
        raw = braintools.file.msgpack_load(filename, parallel=False)
    except Exception as err:  # msgpack's errors for a truncated or garbled file have no common base
        raise ValueError(
            f"load_checkpoint: {filename!r} cannot be read as a checkpoint: it is truncated, corrupted or "
            f"not a checkpoint ({type(err).__name__}: {err}); nothing was restored. Load an intact copy."
        ) from err
    header = raw.get("header") if isinstance(raw, dict) else None
    if not _is_header(header):
        raise ValueError(
            f"load_checkpoint: {filename!r} is not a braintrace checkpoint (no {FORMAT!r} header); "
            f"write checkpoints with braintrace.save_checkpoint."
        )
    if header.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"load_checkpoint: {filename!r} has checkpoint format version {header.get('version')!r}; "
            f"this braintrace reads versions {list(READABLE_VERSIONS)}. Load it with the braintrace that wrote it."
        )
    if header.get("version", 1) >= 2:
        found = _checksum({"entries": raw.get("entries"), "extra": raw.get("extra")})
        if found != header.get("checksum"):
            raise ValueError(
                f"load_checkpoint: {filename!r} is corrupted: its entries do not match the checksum in its "
                f"header ({header.get('checksum')!r}, computed {found!r}); nothing was restored. Load an "
                f"intact copy (save_checkpoint replaces a file only once the new one is whole)."
            )
    entries = raw.get("entries")
    return Stored(header=header, entries={} if entries is None else entries, extra=raw.get("extra"))


def _entry_problems(
    expected: dict[str, Entry], found: dict[str, object], saved: dict[str, dict[str, str | None]],
) -> list[str]:
    """One line per entry that is missing, unexpected, or of another shape, dtype or unit.

    ``saved`` is the header's description of the stored entries; its unit names (``'mV'``)
    read better than those of units rebuilt from their dimensions and scale.
    """

    def shown(name: str, spec: LeafSpec) -> LeafSpec:
        unit = saved.get(name, {}).get("unit") if spec.unit is not None else None
        return spec if unit is None else spec._replace(unit=unit)

    problems = []
    for name, entry in expected.items():
        want = _spec(entry.leaf)
        if name not in found:
            problems.append(f"{name}: expected {want}, missing from the checkpoint")
        else:
            got = _spec(found[name])
            if got != want:
                problems.append(f"{name}: expected {want}, found {shown(name, got)}")
    for name, value in found.items():
        if name not in expected:
            owner = "optimizer" if name.startswith("optimizer/") else "learner"
            problems.append(f"{name}: not in this {owner}, found {shown(name, _spec(value))}")
    return problems


def _restore_extra(raw: Stored, template: PyTree, problems: list[str]) -> tuple[PyTree, StateWrites]:
    """The restored ``extra`` and the values for the template's ``State`` leaves (written by the
    caller once nothing is amiss)."""
    import braintools

    stored = raw["extra"]
    writes: StateWrites = []
    if template is None:
        return decode_raw(stored), writes
    if not raw["header"].get("has_extra"):
        problems.append("extra: a template was given, but the checkpoint holds no extra (saved without extra=)")
        return None, writes
    try:
        # braintools checks the structure and shapes; States would be written in place, so it gets their values.
        restored = braintools.file.msgpack_from_state_dict(without_states(template), stored, mismatch="error")
        return restore_like(template, restored, _restored, writes), writes
    except (ValueError, TypeError, KeyError, AttributeError) as err:  # ExtraMismatch is a ValueError
        problems.append(f"extra: the saved extra does not fit the template: {err}")
        return None, []


def _write(expected: dict[str, Entry], found: dict[str, object]) -> None:
    per_state: dict[int, tuple[brainstate.State, dict[int, Leaf]]] = {}
    for name, entry in expected.items():
        _, new = per_state.setdefault(id(entry.state), (entry.state, {}))
        value = _restored(entry.leaf, found[name])
        new[entry.position] = _without_state_axis(value) if entry.without_state_axis else value
    for state, new in per_state.values():
        old, treedef = jax.tree.flatten(state.value, is_leaf=_is_quantity)
        state.value = jax.tree.unflatten(treedef, [new.get(i, v) for i, v in enumerate(old)])


def _without_state_axis(value: Leaf) -> Leaf:
    """A restored trace leaf without the trailing state axis the checkpoint keeps (see :class:`Entry`)."""
    if not isinstance(value, (jax.Array, np.ndarray, u.Quantity)):
        raise internal_error(f"a trace leaf stored with a state axis restored as a {type(value).__name__}")
    return value[..., 0]

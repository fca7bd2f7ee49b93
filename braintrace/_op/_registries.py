"""Upstream's rule registries of the ETP operator layer, as views onto one record per primitive.

Every ETP primitive owns one frozen :class:`EtpRules` record (:mod:`braintrace._op._rule_record`):
its family facts (batched, gradient-enabled, where ``x``, ``y`` and the trainable operands sit in
an equation, its batched counterpart) and the eligibility-trace rules the algorithm layer calls.
The records are the single source of truth. Upstream's per-fact tables (``ETP_PRIMITIVES``,
``ETP_RULES_DT_TO_T``, ...) are live views onto them: reading one reads a field of the records,
writing one replaces a record by a copy with that field changed, checked first. This module also
holds the look-ups the compiler and the learners use, and tells the library's rules from a user's.

Every learner needs three rules of a primitive whose weights it traces
(:data:`REQUIRED_RULES`). ``register_etp_rules`` refuses to leave a primitive without one of
them; rules installed one at a time (``register_dt_to_t``, a table write) are checked when a
model is compiled (:func:`required_rules`). A primitive without an optional rule takes the
learner's general path.

Examples
--------
>>> from braintrace._op import etp_mm_p, etp_mv_p, ETP_RULES_DT_TO_T, get_trainable_invars
>>> etp_mm_p in ETP_RULES_DT_TO_T
True
>>> get_trainable_invars(etp_mm_p, {'has_bias': True})
{'weight': 1, 'bias': 2}
>>> get_batched_counterpart(etp_mv_p) is etp_mm_p
True
>>> get_etp_rules(etp_mv_p).dt_to_t is ETP_RULES_DT_TO_T[etp_mv_p]
True
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, MutableSet
from typing import Callable, Generic, TypeVar

from braintrace._compatible_imports import Primitive
from braintrace._op._rule_record import (
    REQUIRED_RULES,
    AdjacencyRule,
    ArrayRule,
    EtpRules,
    FastPathRules,
    RequiredRules,
    TraceRule,
    TrainableInvarsFn,
    add_primitive,
    clear_field,
    etp_primitives,
    get_etp_rules,
    remove_primitive,
    required_rules,
    update_rules,
)
from braintrace._typing import Params

__all__ = [
    "ETP_PRIMITIVES",
    "BATCHED_PRIMITIVES",
    "GRADIENT_ENABLED_PRIMITIVES",
    "ETP_TRAINABLE_INVARS_FNS",
    "ETP_X_INVAR_INDICES",
    "ETP_Y_OUTVAR_INDICES",
    "ETP_RULES_DT_TO_T",
    "ETP_RULES_XY_TO_DW",
    "ETP_RULES_INIT_DRTRL",
    "ETP_RULES_INIT_PP",
    "ETP_RULES_PP_X_REPR",
    "ETP_RULES_INSTANT_DRTRL",
    "ETP_RULES_SOLVE_DRTRL",
    "ETP_FAST_PATH_RULES",
    "ETP_RULES_SNAP_ANCHOR",
    "ETP_RULES_SNAP_ADJACENCY",
    "BATCHED_COUNTERPARTS",
    "FastPathRules",
    "EtpRules",
    "RequiredRules",
    "REQUIRED_RULES",
    "get_etp_rules",
    "required_rules",
    "is_etp_primitive",
    "is_etp_enable_gradient_primitive",
    "is_batched_primitive",
    "get_trainable_invars",
    "get_x_invar_index",
    "get_y_outvar_index",
    "register_batched_counterpart",
    "get_batched_counterpart",
    "get_fast_path_rules",
    "get_instant_drtrl_rule",
    "get_solve_drtrl_rule",
    "get_pp_x_repr",
    "is_snap_anchored",
    "get_snap_adjacency_rule",
    "snap_anchored",
    "freeze_library_rules",
    "has_library_rules",
]

# --- upstream's per-fact tables, as views onto the records --------------------------------

_V = TypeVar("_V")


class _RecordField(MutableMapping[Primitive, _V], Generic[_V]):
    """Upstream's ``dict[primitive, value]`` for one field: a live view onto the records.

    ``table[p] = value`` replaces ``p``'s record by a copy with the field set (checked as
    :func:`update_rules` checks it); ``p`` must already be an ETP primitive. For a rule, ``None``
    in the record means absent and ``del table[p]`` clears it; the positions of ``x`` and ``y``
    are facts of every primitive and cannot be deleted.
    """

    def __init__(self, name: str, field: str, *, optional: bool = True) -> None:
        self._name, self._field, self._optional = name, field, optional

    def __getitem__(self, primitive: Primitive) -> _V:
        record = get_etp_rules(primitive)
        if record is None or (self._optional and getattr(record, self._field) is None):
            raise KeyError(primitive)
        value: _V = getattr(record, self._field)
        return value

    def __setitem__(self, primitive: Primitive, value: _V) -> None:
        update_rules(primitive, f"{self._name}[{primitive!r}] = ...", {self._field: value})

    def __delitem__(self, primitive: Primitive) -> None:
        if not self._optional:
            raise TypeError(
                f"del {self._name}[{primitive!r}]: {self._field} is a fact of every ETP primitive; "
                f"assign another value instead."
            )
        if primitive not in self:
            raise KeyError(primitive)
        clear_field(primitive, self._field)

    def __contains__(self, primitive: object) -> bool:
        record = get_etp_rules(primitive)
        return record is not None and not (self._optional and getattr(record, self._field) is None)

    def __iter__(self) -> Iterator[Primitive]:
        return (p for p in etp_primitives() if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"{self._name}({dict(self)!r})"


class _RecordFlag(MutableSet[Primitive]):
    """Upstream's ``set`` of the primitives with a flag (or, with no flag, of every primitive).

    ``add`` and ``discard`` replace a record by a copy with the flag set or cleared. Adding to
    the set of every primitive makes a primitive an ETP primitive with default facts and no
    rules; discarding from it drops the primitive's record.
    """

    def __init__(self, name: str, flag: str | None) -> None:
        self._name, self._flag = name, flag

    def __contains__(self, primitive: object) -> bool:
        record = get_etp_rules(primitive)
        return record is not None and (self._flag is None or bool(getattr(record, self._flag)))

    def __iter__(self) -> Iterator[Primitive]:
        return (p for p in etp_primitives() if p in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def add(self, value: Primitive) -> None:
        if self._flag is not None:
            update_rules(value, f"{self._name}.add", {self._flag: True})
        elif not isinstance(value, Primitive):
            raise TypeError(f"{self._name}.add: expected a JAX Primitive, got {type(value).__name__}: {value!r}.")
        elif get_etp_rules(value) is None:
            add_primitive(value, EtpRules())

    def discard(self, value: Primitive) -> None:
        if value not in self:
            return
        if self._flag is None:
            remove_primitive(value)
        else:
            clear_field(value, self._flag)

    def __repr__(self) -> str:
        return f"{self._name}({set(self)!r})"


#: Every primitive created by :func:`braintrace.register_primitive`.
ETP_PRIMITIVES: MutableSet[Primitive] = _RecordFlag("ETP_PRIMITIVES", None)
#: Primitives whose ``x`` and ``y`` carry a leading batch axis.
BATCHED_PRIMITIVES: MutableSet[Primitive] = _RecordFlag("BATCHED_PRIMITIVES", "batched")
#: Primitives the compiler may walk through on the ``y -> h`` tail (identity-like ops).
GRADIENT_ENABLED_PRIMITIVES: MutableSet[Primitive] = _RecordFlag("GRADIENT_ENABLED_PRIMITIVES", "gradient_enabled")
#: ``eqn.params -> {trainable_name: invar_index}`` per primitive (``{'weight': 1}`` when absent).
ETP_TRAINABLE_INVARS_FNS: MutableMapping[Primitive, TrainableInvarsFn] = _RecordField(
    "ETP_TRAINABLE_INVARS_FNS", "trainable_invars_fn")
#: Position of the non-trainable input ``x`` in ``eqn.invars`` (``None`` when there is none).
ETP_X_INVAR_INDICES: MutableMapping[Primitive, int | None] = _RecordField(
    "ETP_X_INVAR_INDICES", "x_invar_index", optional=False)
#: Position of the output ``y`` in ``eqn.outvars``.
ETP_Y_OUTVAR_INDICES: MutableMapping[Primitive, int] = _RecordField(
    "ETP_Y_OUTVAR_INDICES", "y_outvar_index", optional=False)
#: :attr:`EtpRules.dt_to_t` per primitive.
ETP_RULES_DT_TO_T: MutableMapping[Primitive, TraceRule] = _RecordField("ETP_RULES_DT_TO_T", "dt_to_t")
#: :attr:`EtpRules.xy_to_dw` per primitive.
ETP_RULES_XY_TO_DW: MutableMapping[Primitive, TraceRule] = _RecordField("ETP_RULES_XY_TO_DW", "xy_to_dw")
#: :attr:`EtpRules.init_drtrl` per primitive.
ETP_RULES_INIT_DRTRL: MutableMapping[Primitive, TraceRule] = _RecordField("ETP_RULES_INIT_DRTRL", "init_drtrl")
#: :attr:`EtpRules.init_pp` per primitive.
ETP_RULES_INIT_PP: MutableMapping[Primitive, ArrayRule] = _RecordField("ETP_RULES_INIT_PP", "init_pp")
#: :attr:`EtpRules.pp_x_repr` per primitive.
ETP_RULES_PP_X_REPR: MutableMapping[Primitive, ArrayRule] = _RecordField("ETP_RULES_PP_X_REPR", "pp_x_repr")
#: :attr:`EtpRules.instant_drtrl` per primitive.
ETP_RULES_INSTANT_DRTRL: MutableMapping[Primitive, TraceRule] = _RecordField(
    "ETP_RULES_INSTANT_DRTRL", "instant_drtrl")
#: :attr:`EtpRules.solve_drtrl` per primitive.
ETP_RULES_SOLVE_DRTRL: MutableMapping[Primitive, TraceRule] = _RecordField("ETP_RULES_SOLVE_DRTRL", "solve_drtrl")
#: :attr:`EtpRules.fast_path` per primitive, see :class:`FastPathRules`.
ETP_FAST_PATH_RULES: MutableMapping[Primitive, FastPathRules] = _RecordField("ETP_FAST_PATH_RULES", "fast_path")
#: :attr:`EtpRules.snap_anchor` per primitive.
ETP_RULES_SNAP_ANCHOR: MutableMapping[Primitive, Callable[[Params], bool]] = _RecordField(
    "ETP_RULES_SNAP_ANCHOR", "snap_anchor")
#: :attr:`EtpRules.snap_adjacency` per primitive.
ETP_RULES_SNAP_ADJACENCY: MutableMapping[Primitive, AdjacencyRule] = _RecordField(
    "ETP_RULES_SNAP_ADJACENCY", "snap_adjacency")
#: Unbatched primitive -> the batched primitive ``vmap`` re-binds it as.
BATCHED_COUNTERPARTS: MutableMapping[Primitive, Primitive] = _RecordField("BATCHED_COUNTERPARTS", "batched_counterpart")

_DEFAULT_TRAINABLE_INVARS: dict[str, int] = {"weight": 1}


def is_etp_primitive(primitive: object) -> bool:
    """Whether ``primitive`` was created by :func:`braintrace.register_primitive`."""
    return get_etp_rules(primitive) is not None


def is_etp_enable_gradient_primitive(primitive: object) -> bool:
    """Whether ``primitive`` is a gradient-enabled (identity-like) ETP primitive."""
    record = get_etp_rules(primitive)
    return record is not None and record.gradient_enabled


def is_batched_primitive(primitive: object) -> bool:
    """Whether ``primitive`` is an ETP primitive with a leading batch axis."""
    record = get_etp_rules(primitive)
    return record is not None and record.batched


def get_trainable_invars(primitive: Primitive, eqn_params: Params) -> dict[str, int]:
    """The ``{trainable_name: invar_index}`` layout of one equation.

    Falls back to the single-weight layout ``{'weight': 1}`` for primitives registered
    without a ``trainable_invars_fn``.
    """
    record = get_etp_rules(primitive)
    fn = None if record is None else record.trainable_invars_fn
    if fn is None:
        return dict(_DEFAULT_TRAINABLE_INVARS)
    return dict(fn(eqn_params))


def get_x_invar_index(primitive: Primitive) -> int | None:
    """Position of ``x`` in ``eqn.invars``; ``0`` for primitives never registered."""
    record = get_etp_rules(primitive)
    return 0 if record is None else record.x_invar_index


def get_y_outvar_index(primitive: Primitive) -> int:
    """Position of ``y`` in ``eqn.outvars``; ``0`` for primitives never registered."""
    record = get_etp_rules(primitive)
    return 0 if record is None else record.y_outvar_index


def register_batched_counterpart(unbatched_p: Primitive, batched_p: Primitive) -> None:
    """Declare that ``vmap`` over ``x`` of ``unbatched_p`` re-binds ``batched_p``.

    Both must be ETP primitives; the first unbatched, the second batched. A second
    registration for the same unbatched primitive replaces the first.

    Raises
    ------
    ValueError
        If either primitive is not an ETP primitive, or the batched flags are the wrong way
        round.
    """
    for role, p in (("unbatched_p", unbatched_p), ("batched_p", batched_p)):
        if not is_etp_primitive(p):
            raise ValueError(
                f"register_batched_counterpart: {role}={p!r} is not an ETP primitive; create it "
                f"with braintrace.register_primitive first."
            )
    if is_batched_primitive(unbatched_p):
        raise ValueError(
            f"register_batched_counterpart: unbatched_p={unbatched_p!r} is registered with "
            f"batched=True; the first argument must be the unbatched primitive."
        )
    if not is_batched_primitive(batched_p):
        raise ValueError(
            f"register_batched_counterpart: batched_p={batched_p!r} is not batched; register "
            f"it with register_primitive(..., batched=True)."
        )
    update_rules(unbatched_p, "register_batched_counterpart", {"batched_counterpart": batched_p})


def get_batched_counterpart(primitive: Primitive) -> Primitive | None:
    """The batched primitive ``vmap`` promotes ``primitive`` to, or ``None``."""
    record = get_etp_rules(primitive)
    return None if record is None else record.batched_counterpart


def get_fast_path_rules(primitive: Primitive) -> FastPathRules | None:
    """The closed-form D-RTRL kernels of ``primitive``, or ``None``.

    ``None`` also when the kernels are the library's but a user replaced another rule of the
    primitive: the kernels compute the library's rules, not the user's.
    """
    return _override(primitive, lambda record: record.fast_path)


def get_instant_drtrl_rule(primitive: Primitive) -> TraceRule | None:
    """The ``instant_drtrl`` override of ``primitive``, or ``None`` (see :func:`get_fast_path_rules`)."""
    return _override(primitive, lambda record: record.instant_drtrl)


def get_solve_drtrl_rule(primitive: Primitive) -> TraceRule | None:
    """The ``solve_drtrl`` override of ``primitive``, or ``None`` (see :func:`get_fast_path_rules`)."""
    return _override(primitive, lambda record: record.solve_drtrl)


def is_snap_anchored(primitive: Primitive, eqn_params: Params) -> bool:
    """Whether SnAp-n may widen the traces of an equation of ``primitive`` (default ``False``).

    Examples
    --------
    >>> from braintrace._op import etp_mm_p, etp_emb_p
    >>> is_snap_anchored(etp_mm_p, {}), is_snap_anchored(etp_emb_p, {})
    (True, False)
    """
    record = get_etp_rules(primitive)
    rule = None if record is None else record.snap_anchor
    return bool(rule(eqn_params)) if rule is not None else False


def get_snap_adjacency_rule(primitive: Primitive) -> AdjacencyRule | None:
    """The ``snap_adjacency`` rule of ``primitive``, or ``None`` (SnAp then reads it as all-to-all)."""
    record = get_etp_rules(primitive)
    return None if record is None else record.snap_adjacency


def snap_anchored(eqn_params: Params) -> bool:
    """The ``snap_anchor`` rule of a family whose every trace slot lands on its ``y`` position."""
    return True


def get_pp_x_repr(primitive: Primitive) -> ArrayRule | None:
    """The IO-dim ``x`` representation rule of ``primitive``, or ``None``."""
    record = get_etp_rules(primitive)
    return None if record is None else record.pp_x_repr


# --- whose rules are in force -------------------------------------------------------------

#: The fields of a record that decide a primitive's gradients (the SnAp rules decide only a
#: sparsity pattern, the family facts no derivative).
_GRADIENT_RULES: tuple[str, ...] = (
    "dt_to_t", "xy_to_dw", "init_drtrl", "init_pp", "pp_x_repr", "instant_drtrl", "solve_drtrl", "fast_path",
)
#: Per library primitive, its record as the library left it (see :func:`freeze_library_rules`).
_LIBRARY_RECORDS: dict[Primitive, EtpRules] = {}


def freeze_library_rules() -> None:
    """Record the rules of every primitive registered so far as the library's own.

    Called once, when :mod:`braintrace._op` has registered its primitives; any later
    registration (by user code) is then told apart by :func:`has_library_rules`.
    """
    for primitive in etp_primitives():
        record = get_etp_rules(primitive)
        if record is not None:
            _LIBRARY_RECORDS.setdefault(primitive, record)


def has_library_rules(primitive: Primitive) -> bool:
    """Whether every rule in force for ``primitive`` is the one the library installed.

    ``False`` for user primitives, and for library primitives on which user code registered a
    rule. Learners take shortcuts that compute a primitive's rules in another way (closed-form
    kernels, JAX's own derivative of the forward pass) only where this holds: a registered rule
    is the contract for its primitive.

    Examples
    --------
    >>> from braintrace._op import etp_mm_p, register_primitive
    >>> has_library_rules(etp_mm_p)
    True
    >>> has_library_rules(register_primitive('doc_own_rules', lambda x, w: x * w))
    False
    """
    frozen, record = _LIBRARY_RECORDS.get(primitive), get_etp_rules(primitive)
    return (frozen is not None and record is not None
            and all(getattr(frozen, f) is getattr(record, f) for f in _GRADIENT_RULES))


def _override(primitive: Primitive, field: Callable[[EtpRules], _V | None]) -> _V | None:
    """The rule ``field`` reads of ``primitive``'s record, unless it is a library rule left in force
    beside a user's rule."""
    record = get_etp_rules(primitive)
    rule = None if record is None else field(record)
    frozen = _LIBRARY_RECORDS.get(primitive)
    if rule is None or frozen is None or has_library_rules(primitive):
        return rule
    return None if rule is field(frozen) else rule

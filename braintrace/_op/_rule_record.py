"""The rule record of an ETP primitive: one frozen :class:`EtpRules` per primitive, and its checks.

This module owns the table ``primitive -> EtpRules`` that is the single source of truth of the
operator layer, and the only ways to change it: :func:`add_primitive` (what
``register_primitive`` does) and :func:`remove_primitive`, :func:`update_rules` (every rule
installation, each value checked before anything is stored) and :func:`clear_field`. A change
replaces a record by a copy, so a record read once stays what it was. :func:`required_rules` is
how learners read the rules every one of them needs: typed as present, or a
:class:`braintrace.CompilationError` that names the primitive and the missing rules. Upstream's
per-fact tables, views onto these records, live in :mod:`braintrace._op._registries`.

Examples
--------
>>> from braintrace._op import etp_mm_p
>>> get_etp_rules(etp_mm_p).batched, get_etp_rules(etp_mm_p).missing_rules()
(True, ())
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple, Protocol, TypeVar

import numpy as np

from braintrace._compatible_imports import Primitive
from braintrace._errors import CompilationError
from braintrace._typing import Array, Params

__all__ = [
    "TraceRule",
    "ArrayRule",
    "AdjacencyRule",
    "FastSolve",
    "FilteredRoll",
    "TrainableInvarsFn",
    "FastPathRules",
    "REQUIRED_RULES",
    "EtpRules",
    "RequiredRules",
    "get_etp_rules",
    "etp_primitives",
    "add_primitive",
    "remove_primitive",
    "update_rules",
    "clear_field",
    "required_rules",
]

#: A rule that returns arrays by trainable (or trace) name: ``dt_to_t``, ``xy_to_dw``, ``init_drtrl``,
#: ``instant_drtrl``, ``solve_drtrl`` and the fast-path kernels ``instant``, ``solve_instant`` and
#: ``chunk``. Their arguments differ per rule (``x`` is ``None`` for a primitive without one, and the
#: equation's static params come as keywords), so only the result is fixed.
TraceRule = Callable[..., dict[str, Array]]
#: A rule that returns one array: ``init_pp(x_var, y_var, weight_vars, S)`` and
#: ``pp_x_repr(x, weight_avals)``.
ArrayRule = Callable[..., Array]
#: ``snap_adjacency(x_shape, y_shape, *, operand_shapes, **params)``: per axis of ``y`` a boolean
#: ``(y axis, x axis)`` pattern or ``None`` (the identity); ``None`` overall when it cannot tell.
AdjacencyRule = Callable[..., tuple[np.ndarray | None, ...] | None]
#: ``eqn.params -> {trainable_name: invar_index}``: where the trainable operands of an equation sit.
TrainableInvarsFn = Callable[[Params], dict[str, int]]

_V = TypeVar("_V")


class FastSolve(Protocol):
    """``solve(signal, trace, *, fold_batch=False) -> grads`` of :class:`FastPathRules`."""

    def __call__(self, signal: Array, trace: dict[str, Array], /, *, fold_batch: bool = ...) -> dict[str, Array]:
        ...


#: What a filtered trace's roll returns: the new trace, the new filter and the gradients.
FilteredRoll = tuple[dict[str, Array], dict[str, Array], dict[str, Array]]


class FastPathRules(NamedTuple):
    """Closed-form D-RTRL kernels of one primitive family.

    Shapes use ``S`` for the number of states of the hidden group (the trailing trace axis),
    ``...`` for the primitive's leading axes (a batch axis for batched primitives) and
    ``T`` for the steps of a multi-step window.

    Attributes
    ----------
    instant : callable
        ``instant(x, df, has_bias) -> dict``: the ``diag(D_f) ⊗ x`` term, trace-shaped
        (trailing ``S`` kept). ``df`` is ``(..., *y, S)``.
    recurrent : callable
        ``recurrent(diag, old, num_state) -> dict``: the ``D^t ε^{t-1}`` term, with
        ``diag`` the per-position hidden Jacobian ``(*varshape, S, S)``.
    solve : callable
        ``solve(signal, trace, *, fold_batch=False) -> dict``: contract the learning signal
        ``(..., S)`` with the trace over ``S`` (and over the leading batch axis when
        ``fold_batch``), giving parameter-shaped gradients in the promoted dtype of the two
        (the trace may be stored in a lower precision than the signal).
    applicable : callable
        ``applicable(eqn_params) -> bool``: whether the kernels apply to an equation. It is
        ``False`` whenever a transform hook (``weight_fn``, ``bias_fn``, ...) is active.
    chunk : callable or None
        ``chunk(x_seq, df_seq, p_seq, m_full, old, num_state) -> dict``: the closed-form
        update of a whole window, ``ε_end = M ε_start + Σ_s x_s ⊗ (P_s df_s)`` where
        ``P_s = D_{T-1}…D_{s+1}`` and ``M = D_{T-1}…D_0``.
    solve_instant : callable or None
        ``solve_instant(signal, x, df, has_bias, *, fold_batch=False) -> dict``: what ``solve``
        gives on the ``instant`` term, contracted from its factors without forming the
        trace-shaped product. ``None``: ``solve(signal, instant(x, df, has_bias))``.
    roll_and_solve : callable or None
        ``roll_and_solve(old, diag, x, df, signal, has_bias) -> (new, grads)``: for a batched
        primitive's trace of a one-state group stored without its state axis, the roll
        ``diag ⊙ old + instant`` and the contraction ``Σ_b signal ⊙ old`` in one pass over
        ``old`` (``diag``, ``df``, ``signal``: ``(B, *y)``). ``None``: the engine rolls and
        contracts apart.
    roll_and_solve_steps : callable or None
        ``roll_and_solve_steps(old, diag, x, df, signal, has_bias[, own=]) -> (new, grads)``:
        ``roll_and_solve`` over ``K`` steps at once (``diag``, ``x``, ``df``, ``signal`` with a
        leading axis of ``K``; step ``s`` contracts the trace it entered with): the last trace
        and the gradients summed over the steps, reading ``old`` once. Given ``own`` (shaped
        as ``signal``), the gradients also hold the steps' own terms, what ``solve_instant``
        gives on ``(own_s, x_s, df_s)`` folded over the batch; a kernel without an ``own``
        parameter is never given it (the engine adds those terms call by call). ``old`` comes
        in the factors' dtype, whatever the trace's storage (``trace_dtype``), and the engine
        rounds ``new`` to that storage. ``None``: the engine takes the steps one by one.
    roll_filter_and_solve : callable or None
        ``roll_filter_and_solve(old, filt, diag, x, df, signal, filt_signal, kappa, has_bias) ->
        (new, new_filt, grads)``: ``roll_and_solve`` for a trace with a low-pass filter: also
        ``new_filt = kappa ⊙ filt + new`` and ``grads`` the contraction
        ``Σ_b signal ⊙ old + filt_signal ⊙ filt``, in one pass over each. ``None``: the engine
        rolls, filters and contracts apart.
    roll_filter_and_solve_steps : callable or None
        ``roll_filter_and_solve_steps(old, filt, diag, x, df, signal, filt_signal, kappa,
        has_bias[, own=]) -> (new, new_filt, grads)``: ``roll_filter_and_solve`` over ``K`` steps
        at once, as ``roll_and_solve_steps`` is ``roll_and_solve``'s (``own`` and the dtypes
        too). ``None``: the engine takes the steps one by one.
    """

    instant: TraceRule
    recurrent: Callable[[Array, dict[str, Array], int], dict[str, Array]]
    solve: FastSolve
    applicable: Callable[[Params], bool]
    chunk: TraceRule | None = None
    solve_instant: TraceRule | None = None
    roll_and_solve: Callable[..., tuple[dict[str, Array], dict[str, Array]]] | None = None
    roll_and_solve_steps: Callable[..., tuple[dict[str, Array], dict[str, Array]]] | None = None
    roll_filter_and_solve: Callable[..., FilteredRoll] | None = None
    roll_filter_and_solve_steps: Callable[..., FilteredRoll] | None = None


#: The rules every learner needs of a primitive whose weights it traces: ``D_RTRL`` and the
#: learners built on its traces start them with ``init_drtrl`` and roll them with ``dt_to_t``,
#: and every learner pulls a cotangent of ``y`` back to the weights with ``xy_to_dw``.
REQUIRED_RULES: tuple[str, ...] = ("dt_to_t", "xy_to_dw", "init_drtrl")


@dataclass(frozen=True)
class EtpRules:
    """Everything registered for one ETP primitive: its family facts and its rules.

    A change never edits a record: it replaces the primitive's record by a copy with the field
    changed (``dataclasses.replace``), so a record read once stays what it was.

    Attributes
    ----------
    batched : bool
        Whether ``x`` and ``y`` carry a leading batch axis.
    gradient_enabled : bool
        Whether the compiler may walk through the primitive on the ``y -> h`` tail (identity-like
        primitives such as ``etp_elemwise``).
    x_invar_index : int or None
        Position of the non-trainable input ``x`` in ``eqn.invars`` (``None``: there is none).
    y_outvar_index : int
        Position of the output ``y`` in ``eqn.outvars``.
    trainable_invars_fn : callable or None
        ``eqn.params -> {trainable_name: invar_index}`` (``None``: ``{'weight': 1}``).
    batched_counterpart : Primitive or None
        The batched primitive that ``vmap`` over ``x`` re-binds this one as.
    dt_to_t : callable or None
        ``dt_to_t(hidden_dim, trace, **params) -> trace``, the ``y -> W`` link of
        ``D^t ε^{t-1}``. Required.
    xy_to_dw : callable or None
        ``xy_to_dw(x, hidden_dim, weights, **params) -> grads``, the pullback of ``hidden_dim``.
        Required.
    init_drtrl : callable or None
        ``init_drtrl(x_var, y_var, weight_vars, num_hidden_state) -> {key: zeros}``. Required.
    init_pp : callable or None
        ``init_pp(x_var, y_var, weight_vars, num_hidden_state) -> zeros((*y, S))``; pp_prop
        refuses a primitive without it.
    pp_x_repr : callable or None
        ``pp_x_repr(x, weight_avals) -> array``, what the IO-dim x-trace low-pass filters
        (``None``: ``x`` itself).
    instant_drtrl : callable or None
        ``instant_drtrl(x, hidden_dim, weights, **params) -> trace slice``: the D-RTRL
        instantaneous term in place of ``xy_to_dw``, for a trace that is not parameter-shaped or
        lives in the space of the transformed (hooked) parameters.
    solve_drtrl : callable or None
        ``solve_drtrl(signal, trace, weights, **params) -> grads``: the D-RTRL gradient solve in
        place of ``dt_to_t``, in the same cases (the solve then applies each hook's VJP).
    fast_path : FastPathRules or None
        Closed-form D-RTRL kernels.
    snap_anchor : callable or None
        ``snap_anchor(eqn_params) -> bool``: whether every D-RTRL trace slot of the equation
        lands on the one hidden position it is rolled at, so that SnAp-n may widen it onto that
        position's neighbours (``None``: not anchored, SnAp refuses the primitive).
    snap_adjacency : callable or None
        ``snap_adjacency(x_shape, y_shape, *, operand_shapes, **params) -> patterns or None``:
        for a primitive that mixes positions inside a recurrent transition, per axis of ``y`` a
        boolean ``(y axis, x axis)`` array (``[o, i]``: ``y`` at ``o`` reads ``x`` at ``i``) or
        ``None`` for the identity; ``None`` overall when the shapes are not ones the rule
        describes. ``operand_shapes``: the shape of every operand, in order (``None``: SnAp
        reads the primitive as all-to-all).

    Notes
    -----
    The required rules (:data:`REQUIRED_RULES`) are typed ``X | None`` here only because
    upstream's API installs rules one at a time; learners read them through
    :func:`required_rules`, which hands them over typed as present or names what is missing.

    Examples
    --------
    >>> from braintrace._op import etp_mm_p, etp_mv_p
    >>> record = get_etp_rules(etp_mv_p)
    >>> record.batched, record.batched_counterpart is etp_mm_p, record.missing_rules()
    (False, True, ())
    """

    batched: bool = False
    gradient_enabled: bool = False
    x_invar_index: int | None = 0
    y_outvar_index: int = 0
    trainable_invars_fn: TrainableInvarsFn | None = None
    batched_counterpart: Primitive | None = None
    dt_to_t: TraceRule | None = None
    xy_to_dw: TraceRule | None = None
    init_drtrl: TraceRule | None = None
    init_pp: ArrayRule | None = None
    pp_x_repr: ArrayRule | None = None
    instant_drtrl: TraceRule | None = None
    solve_drtrl: TraceRule | None = None
    fast_path: FastPathRules | None = None
    snap_anchor: Callable[[Params], bool] | None = None
    snap_adjacency: AdjacencyRule | None = None

    def missing_rules(self) -> tuple[str, ...]:
        """The :data:`REQUIRED_RULES` this record lacks, in that order."""
        return tuple(name for name in REQUIRED_RULES if getattr(self, name) is None)


class RequiredRules(NamedTuple):
    """The rules every learner needs of one primitive, all present (see :func:`required_rules`)."""

    dt_to_t: TraceRule
    xy_to_dw: TraceRule
    init_drtrl: TraceRule


#: The records, keyed by primitive identity, in registration order.
_RECORDS: dict[Primitive, EtpRules] = {}
#: The record of a primitive registered with every default and no rule.
_DEFAULTS = EtpRules()


def get_etp_rules(primitive: object) -> EtpRules | None:
    """The record of ``primitive``, or ``None`` when it is not an ETP primitive.

    Examples
    --------
    >>> import jax
    >>> from braintrace._op import etp_elemwise_p
    >>> get_etp_rules(etp_elemwise_p).gradient_enabled, get_etp_rules(jax.lax.add_p)
    (True, None)
    """
    return _RECORDS.get(primitive) if isinstance(primitive, Primitive) else None


def etp_primitives() -> list[Primitive]:
    """Every ETP primitive, in the order they were registered.

    Examples
    --------
    >>> from braintrace._op import etp_mm_p
    >>> etp_mm_p in etp_primitives()
    True
    """
    return list(_RECORDS)


def add_primitive(primitive: Primitive, record: EtpRules) -> None:
    """Make ``primitive`` an ETP primitive described by ``record`` (what ``register_primitive`` does).

    Examples
    --------
    >>> from jax.extend.core import Primitive
    >>> p = Primitive('doc_added')
    >>> add_primitive(p, EtpRules(x_invar_index=None))
    >>> get_etp_rules(p).x_invar_index is None
    True
    """
    _RECORDS[primitive] = record


def remove_primitive(primitive: Primitive) -> None:
    """Drop the record of ``primitive``: it is no ETP primitive any more (nothing when it was none).

    Examples
    --------
    >>> from jax.extend.core import Primitive
    >>> p = Primitive('doc_removed')
    >>> add_primitive(p, EtpRules())
    >>> remove_primitive(p)
    >>> get_etp_rules(p) is None
    True
    """
    _RECORDS.pop(primitive, None)


def update_rules(primitive: Primitive, caller: str, changes: dict[str, Any], *, complete: bool = False) -> None:
    """Replace the record of ``primitive`` by a copy with ``changes``, every change checked first.

    Parameters
    ----------
    primitive : Primitive
        An ETP primitive.
    caller : str
        The public call that asks for the change, named in the errors.
    changes : dict
        ``{field of EtpRules: new value}``.
    complete : bool
        Also refuse a record that would lack one of the :data:`REQUIRED_RULES`.

    Raises
    ------
    ValueError
        If ``primitive`` is not an ETP primitive, a new counterpart is not one, or (with
        ``complete``) a required rule would be missing. The record is then left as it was.
    TypeError
        If a rule is not callable, an index not a non-negative int, or a ``fast_path`` not a
        :class:`FastPathRules`.

    Examples
    --------
    >>> from braintrace import register_primitive
    >>> p = register_primitive('doc_half', lambda x, w: x @ w)
    >>> update_rules(p, 'register_etp_rules', {'dt_to_t': lambda hd, tr, **kw: tr}, complete=True)
    Traceback (most recent call last):
        ...
    ValueError: register_etp_rules: ETP primitive 'doc_half' has no xy_to_dw or init_drtrl rule; ...
    >>> get_etp_rules(p).dt_to_t is None
    True
    """
    record = get_etp_rules(primitive)
    if record is None:
        raise ValueError(
            f"{caller}: {primitive!r} is not an ETP primitive; create it with "
            f"braintrace.register_primitive first."
        )
    checked = {field: _checked(caller, field, value) for field, value in changes.items()}
    new = replace(record, **checked)
    missing = new.missing_rules() if complete else ()
    if missing:
        raise ValueError(
            f"{caller}: {_lacks(primitive, missing)}. Pass the missing rules in the same call, "
            f"register_etp_rules({_keywords(missing)}, ...), or install them first with "
            f"{' / '.join(f'register_{name}' for name in missing)}; nothing was registered."
        )
    _RECORDS[primitive] = new


def required_rules(primitive: Primitive, *, used_at: str | None = None) -> RequiredRules:
    """The rules every learner needs of ``primitive``, or a :class:`CompilationError` naming the missing.

    The compiler calls this once per relation, so a primitive whose rules were installed one at
    a time is refused when a model using it is compiled, not deep inside a learner.

    Parameters
    ----------
    primitive : Primitive
        An ETP primitive.
    used_at : str, optional
        Where the primitive was met (a weight, a source line), added to the error.

    Examples
    --------
    >>> from braintrace import register_primitive
    >>> from braintrace._op import etp_mm_p
    >>> required_rules(etp_mm_p).xy_to_dw is get_etp_rules(etp_mm_p).xy_to_dw
    True
    >>> p = register_primitive('doc_piecemeal', lambda x, w: x @ w)
    >>> p.register_dt_to_t(lambda hidden_dim, trace, **params: trace)
    >>> required_rules(p)
    Traceback (most recent call last):
        ...
    braintrace.CompilationError: ETP primitive 'doc_piecemeal' has no xy_to_dw or init_drtrl rule; ...
    """
    record = get_etp_rules(primitive)
    missing = REQUIRED_RULES if record is None else record.missing_rules()
    if record is None or record.dt_to_t is None or record.xy_to_dw is None or record.init_drtrl is None:
        raise CompilationError(
            f"{_lacks(primitive, missing, used_at)}. Register the missing rules on the primitive "
            f"before compiling: register_etp_rules({_keywords(missing)})."
        )
    return RequiredRules(record.dt_to_t, record.xy_to_dw, record.init_drtrl)


def _lacks(primitive: object, missing: tuple[str, ...], used_at: str | None = None) -> str:
    name = getattr(primitive, "name", primitive)
    where = f" (met at {used_at})" if used_at else ""
    return (
        f"ETP primitive {name!r}{where} has no {' or '.join(missing)} rule; every learner needs "
        f"{', '.join(REQUIRED_RULES[:-1])} and {REQUIRED_RULES[-1]} to trace the weights of an ETP "
        f"operation"
    )


def _keywords(missing: tuple[str, ...]) -> str:
    return ", ".join(f"{name}=..." for name in missing)


_RULE_FIELDS = frozenset({
    "dt_to_t", "xy_to_dw", "init_drtrl", "init_pp", "pp_x_repr", "instant_drtrl", "solve_drtrl",
    "snap_anchor", "snap_adjacency", "trainable_invars_fn",
})


def _checked(caller: str, field: str, value: _V) -> _V:
    """``value`` if it may be stored in ``field``; otherwise the error that says why not."""
    if field in _RULE_FIELDS:
        if not callable(value):
            raise TypeError(f"{caller}: the {field} rule must be callable, got {type(value).__name__}: {value!r}.")
    elif field == "fast_path":
        if not isinstance(value, FastPathRules):
            raise TypeError(
                f"{caller}: fast_path must be a braintrace._op.FastPathRules, got {type(value).__name__}."
            )
    elif field in ("x_invar_index", "y_outvar_index"):
        if not (_is_index(value) or (value is None and field == "x_invar_index")):
            none = " or None" if field == "x_invar_index" else ""
            raise TypeError(f"{caller}: {field} must be a non-negative int{none}, got {value!r}.")
    elif field == "batched_counterpart":
        if get_etp_rules(value) is None:
            raise ValueError(
                f"{caller}: the batched counterpart {value!r} is not an ETP primitive; create it "
                f"with braintrace.register_primitive(..., batched=True) first."
            )
    elif not isinstance(value, bool):
        raise TypeError(f"{caller}: {field} must be a bool, got {value!r}.")
    return value


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def clear_field(primitive: Primitive, field: str) -> None:
    """Replace the record of ``primitive`` by a copy with ``field`` at its default (no rule, flag off).

    Examples
    --------
    >>> from braintrace import register_primitive
    >>> p = register_primitive('doc_cleared', lambda x, w: x @ w, batched=True)
    >>> clear_field(p, 'batched')
    >>> get_etp_rules(p).batched
    False
    """
    changes: dict[str, Any] = {field: getattr(_DEFAULTS, field)}
    _RECORDS[primitive] = replace(_RECORDS[primitive], **changes)

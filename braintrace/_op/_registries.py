"""The rule registries of the ETP operator layer.

Every ETP primitive is a key, by object identity, in a handful of module-level tables: which
primitives exist, which are batched or gradient-enabled, where their ``x`` and trainable
inputs sit in ``eqn.invars``, and the eligibility-trace rules the algorithm layer calls.
These tables are the single source of truth; ``braintrace._op`` re-exports the same objects.

The rules are looked up by consumers with ``table.get(primitive)``, so a primitive that lacks
an optional rule simply takes the algorithm's general path.

Examples
--------
>>> from braintrace._op import etp_mm_p, etp_mv_p, ETP_RULES_DT_TO_T, get_trainable_invars
>>> etp_mm_p in ETP_RULES_DT_TO_T
True
>>> get_trainable_invars(etp_mm_p, {'has_bias': True})
{'weight': 1, 'bias': 2}
>>> from braintrace._op._registries import get_batched_counterpart
>>> get_batched_counterpart(etp_mv_p) is etp_mm_p
True
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from braintrace._compatible_imports import Primitive
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

Rule = Callable[..., Any]


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
    """

    instant: Rule
    recurrent: Rule
    solve: Rule
    applicable: Callable[[Params], bool]
    chunk: Rule | None = None
    solve_instant: Rule | None = None
    roll_and_solve: Rule | None = None


#: Every primitive created by :func:`braintrace.register_primitive`.
ETP_PRIMITIVES: set[Primitive] = set()
#: Primitives whose ``x`` and ``y`` carry a leading batch axis.
BATCHED_PRIMITIVES: set[Primitive] = set()
#: Primitives the compiler may walk through on the ``y -> h`` tail (identity-like ops).
GRADIENT_ENABLED_PRIMITIVES: set[Primitive] = set()
#: ``eqn.params -> {trainable_name: invar_index}`` per primitive (``{'weight': 1}`` when absent).
ETP_TRAINABLE_INVARS_FNS: dict[Primitive, Callable[[Params], dict[str, int]]] = {}
#: Position of the non-trainable input ``x`` in ``eqn.invars`` (``None`` when there is none).
ETP_X_INVAR_INDICES: dict[Primitive, int | None] = {}
#: Position of the output ``y`` in ``eqn.outvars``.
ETP_Y_OUTVAR_INDICES: dict[Primitive, int] = {}

#: ``dt_to_t(hidden_dim, trace, **params) -> trace``, the ``y -> W`` link of ``D^t ε^{t-1}``.
ETP_RULES_DT_TO_T: dict[Primitive, Rule] = {}
#: ``xy_to_dw(x, hidden_dim, weights, **params) -> grads``, the pullback of ``hidden_dim``.
ETP_RULES_XY_TO_DW: dict[Primitive, Rule] = {}
#: ``init_drtrl(x_var, y_var, weight_vars, num_hidden_state) -> {key: zeros}``.
ETP_RULES_INIT_DRTRL: dict[Primitive, Rule] = {}
#: ``init_pp(x_var, y_var, weight_vars, num_hidden_state) -> zeros((*y, S))``.
ETP_RULES_INIT_PP: dict[Primitive, Rule] = {}
#: ``pp_x_repr(x, weight_avals) -> array``, what the IO-dim x-trace low-pass filters.
ETP_RULES_PP_X_REPR: dict[Primitive, Rule] = {}
#: ``instant_drtrl(x, hidden_dim, weights, **params) -> trace slice`` overrides ``xy_to_dw``
#: for the D-RTRL instantaneous term when the trace is not parameter-shaped or lives in the
#: space of the transformed (hooked) parameters.
ETP_RULES_INSTANT_DRTRL: dict[Primitive, Rule] = {}
#: ``solve_drtrl(signal, trace, weights, **params) -> grads`` overrides ``dt_to_t`` for the
#: D-RTRL gradient solve when the trace is not parameter-shaped or lives in the transformed
#: space (the solve then applies each hook's VJP).
ETP_RULES_SOLVE_DRTRL: dict[Primitive, Rule] = {}
#: Closed-form D-RTRL kernels, see :class:`FastPathRules`.
ETP_FAST_PATH_RULES: dict[Primitive, FastPathRules] = {}
#: ``snap_anchor(eqn_params) -> bool``: whether every D-RTRL trace slot of the equation lands on
#: one hidden position (the ``y`` position it is rolled at), so SnAp-n may widen it onto that
#: position's neighbours. Absent: not anchored (SnAp refuses the primitive).
ETP_RULES_SNAP_ANCHOR: dict[Primitive, Callable[[Params], bool]] = {}
#: ``snap_adjacency(x_shape, y_shape, *, operand_shapes, **params) -> per-axis patterns or None``:
#: for a primitive that mixes positions inside a recurrent transition, per axis of ``y`` a boolean
#: ``(y axis, x axis)`` array (``[o, i]``: ``y`` at ``o`` reads ``x`` at ``i``) or ``None`` for
#: the identity; ``None`` overall when the shapes are not ones the rule describes.
#: ``operand_shapes``: the shape of every operand of the equation, in order.
ETP_RULES_SNAP_ADJACENCY: dict[Primitive, Rule] = {}
#: Unbatched primitive -> the batched primitive ``vmap`` re-binds it as.
BATCHED_COUNTERPARTS: dict[Primitive, Primitive] = {}

_DEFAULT_TRAINABLE_INVARS: dict[str, int] = {"weight": 1}


def is_etp_primitive(primitive: Any) -> bool:
    """Whether ``primitive`` was created by :func:`braintrace.register_primitive`."""
    return primitive in ETP_PRIMITIVES


def is_etp_enable_gradient_primitive(primitive: Any) -> bool:
    """Whether ``primitive`` is a gradient-enabled (identity-like) ETP primitive."""
    return primitive in GRADIENT_ENABLED_PRIMITIVES


def is_batched_primitive(primitive: Any) -> bool:
    """Whether ``primitive`` is an ETP primitive with a leading batch axis."""
    return primitive in BATCHED_PRIMITIVES


def get_trainable_invars(primitive: Primitive, eqn_params: Params) -> dict[str, int]:
    """The ``{trainable_name: invar_index}`` layout of one equation.

    Falls back to the single-weight layout ``{'weight': 1}`` for primitives registered
    without a ``trainable_invars_fn``.
    """
    fn = ETP_TRAINABLE_INVARS_FNS.get(primitive)
    if fn is None:
        return dict(_DEFAULT_TRAINABLE_INVARS)
    return dict(fn(eqn_params))


def get_x_invar_index(primitive: Primitive) -> int | None:
    """Position of ``x`` in ``eqn.invars``; ``0`` for primitives never registered."""
    return ETP_X_INVAR_INDICES.get(primitive, 0)


def get_y_outvar_index(primitive: Primitive) -> int:
    """Position of ``y`` in ``eqn.outvars``; ``0`` for primitives never registered."""
    return ETP_Y_OUTVAR_INDICES.get(primitive, 0)


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
        if p not in ETP_PRIMITIVES:
            raise ValueError(
                f"register_batched_counterpart: {role}={p!r} is not an ETP primitive; create it "
                f"with braintrace.register_primitive first."
            )
    if unbatched_p in BATCHED_PRIMITIVES:
        raise ValueError(
            f"register_batched_counterpart: unbatched_p={unbatched_p!r} is registered with "
            f"batched=True; the first argument must be the unbatched primitive."
        )
    if batched_p not in BATCHED_PRIMITIVES:
        raise ValueError(
            f"register_batched_counterpart: batched_p={batched_p!r} is not batched; register "
            f"it with register_primitive(..., batched=True)."
        )
    BATCHED_COUNTERPARTS[unbatched_p] = batched_p


def get_batched_counterpart(primitive: Primitive) -> Primitive | None:
    """The batched primitive ``vmap`` promotes ``primitive`` to, or ``None``."""
    return BATCHED_COUNTERPARTS.get(primitive)


def get_fast_path_rules(primitive: Primitive) -> FastPathRules | None:
    """The closed-form D-RTRL kernels of ``primitive``, or ``None``.

    ``None`` also when the kernels are the library's but a user replaced another rule of the
    primitive: the kernels compute the library's rules, not the user's.
    """
    return _override(ETP_FAST_PATH_RULES, primitive)


def get_instant_drtrl_rule(primitive: Primitive) -> Rule | None:
    """The ``instant_drtrl`` override of ``primitive``, or ``None`` (see :func:`get_fast_path_rules`)."""
    return _override(ETP_RULES_INSTANT_DRTRL, primitive)


def get_solve_drtrl_rule(primitive: Primitive) -> Rule | None:
    """The ``solve_drtrl`` override of ``primitive``, or ``None`` (see :func:`get_fast_path_rules`)."""
    return _override(ETP_RULES_SOLVE_DRTRL, primitive)


def is_snap_anchored(primitive: Primitive, eqn_params: Params) -> bool:
    """Whether SnAp-n may widen the traces of an equation of ``primitive`` (default ``False``).

    Examples
    --------
    >>> from braintrace._op import etp_mm_p, etp_emb_p
    >>> is_snap_anchored(etp_mm_p, {}), is_snap_anchored(etp_emb_p, {})
    (True, False)
    """
    rule = ETP_RULES_SNAP_ANCHOR.get(primitive)
    return bool(rule(eqn_params)) if rule is not None else False


def get_snap_adjacency_rule(primitive: Primitive) -> Rule | None:
    """The ``snap_adjacency`` rule of ``primitive``, or ``None`` (SnAp then reads it as all-to-all)."""
    return ETP_RULES_SNAP_ADJACENCY.get(primitive)


def snap_anchored(eqn_params: Params) -> bool:
    """The ``snap_anchor`` rule of a family whose every trace slot lands on its ``y`` position."""
    return True


# --- whose rules are in force -------------------------------------------------------------

#: Every table of eligibility-trace rules, in a fixed order (the layout of a rule snapshot).
_RULE_TABLES: tuple[dict[Primitive, Any], ...] = (
    ETP_RULES_DT_TO_T,
    ETP_RULES_XY_TO_DW,
    ETP_RULES_INIT_DRTRL,
    ETP_RULES_INIT_PP,
    ETP_RULES_PP_X_REPR,
    ETP_RULES_INSTANT_DRTRL,
    ETP_RULES_SOLVE_DRTRL,
    ETP_FAST_PATH_RULES,
)
#: Per library primitive, its rules as the library installed them (see :func:`freeze_library_rules`).
_LIBRARY_RULES: dict[Primitive, tuple[Any, ...]] = {}


def _rules_of(primitive: Primitive) -> tuple[Any, ...]:
    return tuple(table.get(primitive) for table in _RULE_TABLES)


def freeze_library_rules() -> None:
    """Record the rules of every primitive registered so far as the library's own.

    Called once, when :mod:`braintrace._op` has registered its primitives; any later
    registration (by user code) is then told apart by :func:`has_library_rules`.
    """
    for primitive in ETP_PRIMITIVES:
        _LIBRARY_RULES.setdefault(primitive, _rules_of(primitive))


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
    frozen = _LIBRARY_RULES.get(primitive)
    return frozen is not None and all(a is b for a, b in zip(frozen, _rules_of(primitive)))


def _override(table: dict[Primitive, Any], primitive: Primitive) -> Any:
    """``table[primitive]``, unless it is a library rule left in force beside a user's rule."""
    rule = table.get(primitive)
    frozen = _LIBRARY_RULES.get(primitive)
    if rule is None or frozen is None or has_library_rules(primitive):
        return rule
    position = next(i for i, t in enumerate(_RULE_TABLES) if t is table)
    return None if rule is frozen[position] else rule


def get_pp_x_repr(primitive: Primitive) -> Rule | None:
    """The IO-dim ``x`` representation rule of ``primitive``, or ``None``."""
    return ETP_RULES_PP_X_REPR.get(primitive)

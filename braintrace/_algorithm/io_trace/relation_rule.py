"""pp_prop's rule for one relation: the input trace ``x̄``, the output trace ``ε_f``, and the estimate they give.

The per-relation maths of the IO-dim learner (:class:`~braintrace.pp_prop`, and
:class:`~braintrace.OSTLFeedforward` at a vanishing decay), as a :class:`~braintrace.TraceRule`
record (:func:`pp_prop_rule`) and the functions it is made of:

* the roll: ``x̄ ← α_x x̄ + x̃`` (:func:`roll_input`, ``x̃`` the input as the primitive's
  ``pp_x_repr`` represents it, :func:`represent_input`), ``ε_f ← α_f (D ⊙ ε_f) + (1 − α_f) df``
  (:func:`roll_output`) and the count ``k`` of steps absorbed since the last reset
  (:func:`advance`);
* the estimate ``xy_to_dw(x̄, Σ_a (ε_f / c)[..., a] g[..., a])``: :func:`bias_corrected` (with
  ``c = 1 − α_f^k``, :func:`correction`), pulled back through the primitive
  (:func:`pull_back`); a single step adds it to its exact one-step gradient less the same-step
  term ``xy_to_dw(x̃_t, Σ_a df_t[..., a] g[..., a])`` that gradient already holds
  (:func:`without_same_step`).

The learner (:mod:`~braintrace._algorithm.io_trace.pp_prop`) stores one input trace per input
variable, shared by the relations that read it, and one step counter: its roll
(:mod:`~braintrace._algorithm.io_trace.roll`) and its solves
(:mod:`~braintrace._algorithm.io_trace.solve`) call these functions on its own storage. The
record keeps all three per relation and, run by
``braintrace.compile(model, braintrace.pp_prop_rule(decay_or_rank), x0)``, gives pp_prop's
single-step gradients (``tests/algorithm/test_pp_prop_rule.py``). This module also parses the
decays (:func:`parse_decay_or_rank`, :func:`parse_decay_pair`).

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.io_trace.relation_rule import roll_output
>>> roll_output(jnp.ones((2, 1)), jnp.full((2, 1, 1), 0.5), jnp.ones((2, 1)), 0.5)  # 0.5 · 0.5 + 0.5
Array([[0.75],
       [0.75]], dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from braintrace._algorithm.carriers.trace_storage import math_dtype
from braintrace._algorithm.engine.rule_contract import (
    RelationInfo,
    RelationStep,
    TraceRule,
    abstract_var,
    info_primitive,
    step_info,
)
from braintrace._compatible_imports import Primitive
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import mix_states, sum_states
from braintrace._op.elemwise import etp_elemwise_p
from braintrace._typing import Trace

__all__ = [
    "pp_prop_rule", "PPCarrier", "DecayOrRank", "XRepr", "parse_decay_or_rank", "parse_decay_pair",
    "input_representation", "represent_input", "represented_spec", "output_trace_zeros", "unfit_output_error",
    "roll_input", "roll_output", "advance", "correction", "bias_corrected", "pull_back", "without_same_step",
]

#: A decay (float in ``[0, 1)``) or a rank (int ``>= 1``), or a pair of them ``(x side, f side)``.
DecayOrRank = float | int | tuple[float | int, float | int] | list[float | int]
_DECAY_OR_RANK_MSG = 'Please provide "num_rank" (int) or "decay" (float, 0 <= decay < 1). '

#: An input's ``pp_x_repr`` rule (``None``: the input as it is) and the weight avals it reads.
XRepr = tuple[Callable[..., jax.Array] | None, Mapping[str, Any]]

# The step counter saturates here instead of wrapping around; α^k has long underflowed.
_MAX_STEPS = 2**30


def parse_decay_or_rank(decay_or_rank: object) -> float:
    """The decay ``α`` given a decay (float in ``[0, 1)``) or a rank (int ``r > 0``).

    A rank ``r`` means ``α = (r − 1) / (r + 1)``, the decay whose filter has the same mean
    memory as a window of ``r`` steps.

    Raises
    ------
    ValueError
        For any other type (``np.float32``, arrays, strings, ...) or a value out of range.

    Examples
    --------
    >>> parse_decay_or_rank(19), parse_decay_or_rank(0.5), parse_decay_or_rank(0.0)
    (0.9, 0.5, 0.0)
    """
    # np.float64 subclasses float and bool subclasses int; np.float32 and arrays are neither.
    if isinstance(decay_or_rank, float):
        if not 0.0 <= decay_or_rank < 1.0:
            raise ValueError(
                f"decay_or_rank={decay_or_rank!r}: a float is the decay and must satisfy "
                f"0 <= decay < 1. Pass e.g. 0.9, or an int rank such as 19."
            )
        return float(decay_or_rank)
    if isinstance(decay_or_rank, int):
        if decay_or_rank <= 0:
            raise ValueError(
                f"decay_or_rank={decay_or_rank!r}: an int is the rank and must be > 0. Pass e.g. "
                f"19, or a float decay such as 0.9."
            )
        return (decay_or_rank - 1) / (decay_or_rank + 1)
    raise ValueError(_DECAY_OR_RANK_MSG + f"Got {decay_or_rank!r} of type {type(decay_or_rank).__name__}.")


def parse_decay_pair(decay_or_rank: object) -> tuple[float, float]:
    """``(α_x, α_f)`` given one decay or rank (both sides) or a pair of them (tuple or list of 2).

    Raises
    ------
    ValueError
        For a pair of another length, or an entry :func:`parse_decay_or_rank` refuses.

    Examples
    --------
    >>> parse_decay_pair(0.9), parse_decay_pair((19, 0.0))
    ((0.9, 0.9), (0.9, 0.0))
    """
    if isinstance(decay_or_rank, (tuple, list)):
        if len(decay_or_rank) != 2:
            raise ValueError(
                f"decay_or_rank={decay_or_rank!r}: a pair is (x side, f side), two entries; got "
                f"{len(decay_or_rank)}.")
        return parse_decay_or_rank(decay_or_rank[0]), parse_decay_or_rank(decay_or_rank[1])
    decay = parse_decay_or_rank(decay_or_rank)
    return decay, decay


# --- the carrier's shapes ------------------------------------------------------------------


def input_representation(etp: Primitive, weight_avals: Mapping[str, Any]) -> XRepr:
    """How the input trace of an equation of ``etp`` represents its input: the primitive's
    ``pp_x_repr`` rule (``None``: as it is) and the weights' avals (shapes and dtypes) it reads."""
    return reg.get_pp_x_repr(etp), weight_avals


def represent_input(x: jax.Array, x_repr: XRepr) -> jax.Array:
    """``x̃``: the input as the input trace filters it (``pp_x_repr`` where registered).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> represent_input(jnp.ones(2), (None, {}))  # an input without a pp_x_repr is filtered as it is
    Array([1., 1.], dtype=float32)
    """
    rule, avals = x_repr
    return x if rule is None else rule(x, avals)


def represented_spec(x: jax.ShapeDtypeStruct, x_repr: XRepr) -> jax.ShapeDtypeStruct:
    """The shape and dtype of ``x̃`` for an input of ``x``'s (that of its trace)."""
    spec: jax.ShapeDtypeStruct = jax.eval_shape(lambda v: represent_input(v, x_repr), x)
    return spec


def output_trace_zeros(
    etp: Primitive, x: Any, y: Any, weights: Mapping[str, Any], num_state: int, group: HiddenGroup | None = None,
) -> jax.Array:
    """The zero output trace of an equation of ``etp``, by its ``init_pp`` rule: ``(*y.shape, S)``
    (an element-wise weight's, given the ``group``: over the group's positions).

    ``x``, ``y`` and ``weights`` are the equation's variables (anything with an ``aval``).

    Raises
    ------
    ValueError
        If ``etp`` has no ``init_pp`` rule.
    """
    record = reg.get_etp_rules(etp)
    init = None if record is None else record.init_pp
    if init is None:
        raise ValueError(
            f"{etp.name} has no init_pp rule, so pp_prop cannot trace it; register one "
            f"with register_etp_rules(init_pp=...) or use D_RTRL."
        )
    extra = {"group": group} if etp is etp_elemwise_p and group is not None else {}
    return jnp.asarray(init(x, y, weights, num_state, **extra))


def unfit_output_error(primitive: str, y_shape: tuple[int, ...], hidden: str) -> ValueError:
    """The refusal of an operation whose output is not the shape of the ``hidden`` group it drives."""
    return ValueError(
        f"The shape of the hidden states should be the same as the output of the ETP "
        f"operation for pp_prop: {primitive} outputs {y_shape} but drives {hidden}. Make the "
        f"operation produce the hidden shape, or train this weight with D_RTRL."
    )


# --- the roll ------------------------------------------------------------------------------


def roll_input(old: jax.Array, x_tilde: jax.Array, decay_x: float) -> jax.Array:
    """``α_x x̄ + x̃``, in the step's precision, rounded once to ``old``'s storage dtype."""
    # A stored trace is upcast to the step's precision, filtered, and rounded once on write,
    # by astype: these factors are vectors, and on them trace_storage.rounded's split (for
    # trace-sized updates) measured slower (leaky64 bf16/f32 1.46 against 1.05-1.08).
    return (decay_x * old.astype(math_dtype(old, x_tilde)) + x_tilde).astype(old.dtype)


def roll_output(old: jax.Array, diag: jax.Array, df: jax.Array, decay_f: float) -> jax.Array:
    """``α_f (D ⊙ ε_f) + (1 − α_f) df``, ``(D ⊙ ε_f)[..., a] = Σ_c D[..., a, c] ε_f[..., c]``.

    ``diag`` is what the f side's recursion reads (``D``, or the executor's substitute for it),
    ``(..., S, S)``; ``old`` and ``df`` are ``(..., S)`` over the same positions.
    """
    math = math_dtype(old, df)
    # (1 − α) rounded like the bias correction's 1 − α^1, so they cancel at step one.
    gain = 1 - jnp.asarray(decay_f, math)
    new = decay_f * mix_states(diag, old.astype(math)) + gain * df
    return new.astype(old.dtype)


def advance(steps: jax.Array) -> jax.Array:
    """The count of steps absorbed, one more (saturating, never wrapping around)."""
    return jnp.minimum(steps + 1, _MAX_STEPS).astype(steps.dtype)


# --- the estimate --------------------------------------------------------------------------


def correction(steps: jax.Array, dtype: DTypeLike, decay_f: float) -> jax.Array:
    """``max(1 − α_f^k, 1e-8)`` for a trace that absorbed ``k = steps`` steps (no gradient).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> correction(jnp.asarray(1), jnp.float32, 0.5), correction(jnp.asarray(0), jnp.float32, 0.5)  # k = 1, k = 0
    (Array(0.5, dtype=float32), Array(1.e-08, dtype=float32))
    """
    # An integer power: exact repeated products, so 1 − α^1 rounds like the (1 − α) gain.
    c = 1 - jax.lax.pow(jnp.asarray(decay_f, dtype), steps)
    return jax.lax.stop_gradient(jnp.maximum(c, jnp.asarray(1e-8, dtype)))


def bias_corrected(eps_f: jax.Array, steps: jax.Array, signal: jax.Array, decay_f: float) -> jax.Array:
    """``(ε_f / c) ⊙ g``: the output trace, bias-corrected (:func:`correction`), met by the signal."""
    c = correction(steps, jnp.result_type(eps_f, signal), decay_f)
    return (eps_f / c) * signal


def pull_back(
    etp: Primitive, params: Mapping[str, Any], x: jax.Array | None, delta: jax.Array, weights: Trace,
    fast_solve: bool,
) -> Trace:
    """``xy_to_dw(x, Σ_a delta[..., a])``: the VJP of the primitive at input ``x``.

    ``delta`` is laid out over ``y``'s positions, ``(*y.shape, S)``. ``xy_to_dw`` is linear in
    its cotangent, so with ``fast_solve`` the hidden states are summed first (one call);
    otherwise one call per state, summed.
    """
    if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(math_dtype(x, delta))  # a stored input trace meets delta in its precision
    rule = reg.required_rules(etp).xy_to_dw
    if fast_solve:
        return rule(x, sum_states(delta), weights, **params)
    parts = [rule(x, delta[..., a], weights, **params) for a in range(delta.shape[-1])]
    return {k: sum((p[k] for p in parts[1:]), parts[0][k]) for k in parts[0]}


def without_same_step(estimate: Trace, same_step: Trace, covered: frozenset[str] = frozenset()) -> Trace:
    """The history of a single step: ``estimate`` less the same-step term its exact one-step
    gradient already holds, except for the ``covered`` operands (left out of that gradient,
    whose whole gradient is the estimate)."""
    return {k: v if k in covered else v - same_step[k] for k, v in estimate.items()}


# --- the record ----------------------------------------------------------------------------


class PPCarrier(NamedTuple):
    """pp_prop's carrier for one relation and a hidden group it drives."""

    #: ``x̄``, shaped like ``x̃`` (``None``: the operation has no input, such as ``element_wise``).
    x: jax.Array | None
    #: ``ε_f``, ``(*y.shape, S)`` (an element-wise weight's: over the group's positions).
    df: jax.Array
    #: ``k``, the steps absorbed since the last reset: an int32 scalar, as the learner keeps it.
    steps: jax.Array


def pp_prop_rule(decay_or_rank: DecayOrRank, fast_solve: bool = True) -> TraceRule:
    """pp_prop as a :class:`~braintrace.TraceRule`: the input and output traces of one relation.

    ``init`` allocates the zero traces (the output trace by the primitive's ``init_pp``);
    ``roll`` filters ``x̄ ← α_x x̄ + x̃`` and ``ε_f ← α_f (D ⊙ ε_f) + (1 − α_f) df`` and counts
    the step; ``residual`` keeps the rolled carrier; ``solve`` adds to the exact one-step
    gradient the estimate ``xy_to_dw(x̄, Σ_a (ε_f / c)[..., a] g[..., a])`` at the new traces
    (``c = 1 − α_f^k``) less its same-step term ``xy_to_dw(x̃_t, Σ_a df_t[..., a] g[..., a])``.
    The learner :class:`~braintrace.pp_prop` rolls and solves its traces with the same functions.

    Run by ``braintrace.compile(model, pp_prop_rule(d), x0)``, it gives the gradients of
    ``braintrace.compile(model, braintrace.pp_prop, x0, decay_or_rank=d)`` called one step at a
    time (``vjp_method='single-step'``, the symmetric learning signal), step after step, on
    models where no hidden group is read past its update (an output or an operation that reads
    ``h^{t-1}`` other than through ``h``'s own update: pp_prop then takes that group's history
    from the traces entering the step, which a carrier rolled to the step's end does not hold).
    Like pp_prop, it equals backpropagation through time on the first step after a reset, and
    estimates the history after it.

    Parameters
    ----------
    decay_or_rank : float, int or pair
        As :class:`~braintrace.pp_prop`: the filter decay ``α`` (a float, ``0 <= α < 1``) or a
        rank ``r`` (an int ``> 0``, ``α = (r − 1) / (r + 1)``), for both traces, or a pair
        ``(x side, f side)`` of them.
    fast_solve : bool
        Pull the learning signal back with one ``xy_to_dw`` call (summed over the hidden
        states) instead of one call per state; the results agree.

    Returns
    -------
    TraceRule
        Its carrier is a :class:`PPCarrier`; the same record for the same decays and ``fast_solve``.

    Raises
    ------
    ValueError
        For a bad ``decay_or_rank`` (see :func:`parse_decay_pair`); at compile time, for an
        operation without an ``init_pp`` rule or whose output is not the shape of the hidden
        group it drives (as pp_prop refuses them).
    TypeError
        For a ``fast_solve`` that is not a bool.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> def grads(learner):
    ...     g = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)
    ...     return [g(jnp.ones(3))[('W', 'weight')]['weight'] for _ in range(3)]
    >>> brainstate.random.seed(0)
    >>> by_record = grads(braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.pp_prop_rule(0.9), jnp.ones(3)))
    >>> brainstate.random.seed(0)
    >>> by_engine = grads(braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.pp_prop, jnp.ones(3),
    ...                                      decay_or_rank=0.9))
    >>> all(bool(jnp.allclose(a, b, atol=1e-6)) for a, b in zip(by_record, by_engine))
    True
    >>> braintrace.pp_prop_rule(19) is braintrace.pp_prop_rule(0.9)
    True
    """
    if not isinstance(fast_solve, bool):
        raise TypeError(f"pp_prop_rule: fast_solve must be a bool, got {fast_solve!r}.")
    decay_x, decay_f = parse_decay_pair(decay_or_rank)
    return _pp_prop_rule(decay_x, decay_f, fast_solve)


@functools.cache
def _pp_prop_rule(decay_x: float, decay_f: float, fast_solve: bool) -> TraceRule:

    def init(info: RelationInfo) -> PPCarrier:
        etp = info_primitive(info, "pp_prop_rule")
        weights = {k: abstract_var(v) for k, v in info.weights.items()}
        x = None if info.x is None else abstract_var(info.x)
        df = output_trace_zeros(etp, x, abstract_var(info.y), weights, info.num_state)
        x_trace = None
        if info.x is not None:
            spec = represented_spec(info.x, input_representation(etp, info.weights))
            x_trace = jnp.zeros(spec.shape, spec.dtype)
        return PPCarrier(x_trace, df, jnp.zeros((), jnp.int32))

    def roll(carrier: PPCarrier, step: RelationStep) -> PPCarrier:
        info = step_info(step, "pp_prop_rule")
        _require_fit(info, step.df)
        x = None
        if carrier.x is not None and step.x is not None:
            x = roll_input(carrier.x, represent_input(step.x, _representation(info)), decay_x)
        df = roll_output(carrier.df, step.diag, step.df, decay_f)
        return PPCarrier(x, df, advance(carrier.steps))

    def residual(entering: PPCarrier, new: PPCarrier, step: RelationStep) -> PPCarrier:
        return new

    def solve(new: PPCarrier, signal: jax.Array, step: RelationStep) -> Trace:
        info = step_info(step, "pp_prop_rule")
        etp, params = info_primitive(info, "pp_prop_rule"), info.params
        estimate = pull_back(etp, params, new.x, bias_corrected(new.df, new.steps, signal, decay_f), step.weights,
                             fast_solve)
        x_t = None if step.x is None else represent_input(step.x, _representation(info))
        same_step = pull_back(etp, params, x_t, step.df * signal, step.weights, fast_solve)
        return without_same_step(estimate, same_step)

    return TraceRule(init, roll, solve, residual)


def _representation(info: RelationInfo) -> XRepr:
    return input_representation(info_primitive(info, "pp_prop_rule"), info.weights)


def _require_fit(info: RelationInfo, df: jax.Array) -> None:
    """Refuse, as pp_prop does, an output that is not the shape of the group it drives (an
    element-wise weight may broadcast over the group's leading axes)."""
    positions, y_shape = tuple(df.shape[:-1]), tuple(info.y.shape)
    elementwise = info.etp is etp_elemwise_p
    fits = positions[len(positions) - len(y_shape):] == y_shape if elementwise else positions == y_shape
    if not fits:
        raise unfit_output_error(info.primitive, y_shape, f"a hidden group of shape {positions}")


pp_prop_rule.__module__ = "braintrace"

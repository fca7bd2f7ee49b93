"""ETP tensor contraction: ``einsum`` and its primitive ``etp_einsum`` (batched only).

``y = einsum('x_spec,w_spec->y_spec', x, f_W(W))`` where the first letter of ``x_spec`` and of
``y_spec`` is the batch letter. The letters of an equation fall into classes
(:func:`parse_etp_einsum`):

* *diagonal*: weight letters kept in the output (``n`` in ``'bk,kn->bn'``, ``h`` and ``n`` in
  ``'bhk,hkn->bhn'``); weight entry ``W[w]`` reaches only outputs on its own diagonal index;
* *contracted*: weight letters summed away (``k`` above);
* *shared*: output letters other than the batch letter that the weight does not carry
  (``t`` in ``'btk,kn->btn'``); every shared position reuses the same weight entry.

Trace geometry. The D-RTRL trace keeps one entry per batch row, per *shared position* and
per weight entry, like the per-output-position kernel trace of ``etp_conv``::

    ε[b, *s, *w] = ∂h[b, y(d(w), s)] / ∂V[w]       V = f_W(W)

with ``s`` running over the shared letters in output order and ``d(w)`` the diagonal letters
of weight index ``w``. ``init_drtrl`` gives ``(B, *shared_sizes, *W.shape, S)``; without
shared letters this is ``(B, *W.shape, S)`` exactly as upstream. Propagating through a hidden
Jacobian slice ``hd`` (shaped like ``y``) multiplies every entry by ``hd`` at its own output
position: broadcast over contracted letters, aligned on batch, shared and diagonal letters.
No sum over shared positions happens, so the trace is exact for any diagonal hidden
recurrence. (Upstream keeps ``(B, *W.shape, S)`` for shared-axis equations too and sums
``hd`` over the shared positions, which is wrong whenever the recurrence is non-zero.)

The trace lives in the space of the *transformed* weight ``V = f_W(W)``: the instantaneous
term (``instant_drtrl``) is ``hd`` times ``x`` at each shared position, and the transform's
Jacobian is applied once, when the learning signal is pulled back to the raw weight
(``solve_drtrl``: sum over shared positions of ``g · ε``, then the exact VJP of ``f_W``).
This keeps D-RTRL exact for any shape-preserving transform, including ones that couple
entries (``w / norm(w)``). ``xy_to_dw`` (the IO-dim pullback) is the VJP of the impl with
respect to the raw weight.

``init_drtrl`` needs the equation to know the shared sizes: the algorithm passes
``eqn_params=eqn.params`` (as for ``etp_conv``). Called without it, it returns the
shared-free layout ``(B, *W.shape, S)``, correct only for equations without shared letters;
the trace rules then reject a trace whose rank does not fit the equation.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> x, w = jnp.ones((2, 5, 3)), jnp.ones((3, 4))
>>> braintrace.einsum('btk,kn->btn', x, w).shape
(2, 5, 4)
>>> from braintrace._op.einsum import parse_etp_einsum
>>> spec = parse_etp_einsum('bthk, hkn -> bhtn')
>>> spec.batch, spec.diagonal, spec.contracted, spec.shared
('b', 'hn', 'k', 't')
"""

from __future__ import annotations

import functools
import string
from typing import Callable, NamedTuple

import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._compatible_imports import Var
from braintrace._errors import OperandShapeError
from braintrace._op._operands import check_hook, split_units, with_unit
from braintrace._op._primitive import register_primitive
from braintrace._op._rule_helpers import (
    apply_hook,
    drtrl_dtype,
    pullback,
    shape_of,
    zeros_pp,
)
from braintrace._typing import Array, ArrayLike, Params, WeightFn

__all__ = ["EinsumSpec", "parse_etp_einsum", "etp_einsum_p", "einsum"]

_HIGHEST = jax.lax.Precision.HIGHEST
_LETTERS = frozenset(string.ascii_lowercase)


class EinsumSpec(NamedTuple):
    """A parsed batched ETP einsum equation ``'x_spec,w_spec->y_spec'``.

    Attributes
    ----------
    x_spec, w_spec, y_spec : str
        The letters of ``x``, the weight and the output.
    batch : str
        The batch letter, ``x_spec[0] == y_spec[0]``.
    diagonal : str
        Weight letters kept in the output, in weight order.
    contracted : str
        Weight letters summed away, in weight order.
    shared : str
        Output letters other than the batch letter that the weight does not carry, in
        output order: every position along them reuses the same weight entry.
    """

    x_spec: str
    w_spec: str
    y_spec: str
    batch: str
    diagonal: str
    contracted: str
    shared: str


def parse_etp_einsum(equation: str) -> EinsumSpec:
    """Parse and classify a batched ETP einsum equation (spaces are ignored).

    Parameters
    ----------
    equation : str
        ``'x_spec,w_spec->y_spec'`` with lowercase letters only, ``x_spec`` and ``y_spec``
        starting with the same batch letter, e.g. ``'btk,kn->btn'``.

    Returns
    -------
    EinsumSpec
        The three specs and the letter classes.

    Raises
    ------
    TypeError
        If ``equation`` is not a string.
    ValueError
        Checked in this order: no ``'->'``; not exactly two operands; an empty spec or one
        with anything but lowercase letters; a letter repeated within one spec; ``x`` and the
        output not starting with the same (batch) letter; the batch letter in the weight; an
        output letter in neither operand; a weight letter in neither ``x`` nor the output; a
        shared output letter missing from ``x``.

    Examples
    --------
    >>> from braintrace._op.einsum import parse_etp_einsum
    >>> spec = parse_etp_einsum('bhk,hkn->bhn')
    >>> spec.diagonal, spec.contracted, spec.shared
    ('hn', 'k', '')
    """
    if not isinstance(equation, str):
        raise TypeError(
            f"einsum equation must be a str such as 'btk,kn->btn', got "
            f"{type(equation).__name__}: {equation!r}."
        )
    return _parse(equation.replace(" ", ""), equation)


@functools.lru_cache(maxsize=256)
def _parse(eq: str, shown: str) -> EinsumSpec:
    def fail(rule: str) -> ValueError:
        return ValueError(f"einsum equation {shown!r}: {rule}")

    if "->" not in eq:
        raise fail(
            "missing '->'. Write the output explicitly, 'x_spec,w_spec->y_spec', e.g. "
            "'btk,kn->btn'."
        )
    lhs, _, y_spec = eq.partition("->")
    operands = lhs.split(",")
    if len(operands) != 2:
        raise fail(
            f"names {len(operands)} operand(s) before '->'; braintrace.einsum takes exactly "
            f"two, the input x and the weight."
        )
    x_spec, w_spec = operands
    for role, spec in (("x", x_spec), ("weight", w_spec), ("output", y_spec)):
        if not spec or not set(spec) <= _LETTERS:
            raise fail(
                f"the {role} spec {spec!r} must be a non-empty run of lowercase letters a-z "
                f"(no ellipsis '...', digits, uppercase or other symbols)."
            )
    for role, spec in (("x", x_spec), ("weight", w_spec), ("output", y_spec)):
        repeated = sorted({c for c in spec if spec.count(c) > 1})
        if repeated:
            raise fail(
                f"letter {repeated[0]!r} is repeated in the {role} spec {spec!r}; traces and "
                f"diagonals within one operand are not supported."
            )
    return _classify(x_spec, w_spec, y_spec, fail)


def _classify(
    x_spec: str, w_spec: str, y_spec: str, fail: Callable[[str], ValueError]
) -> EinsumSpec:
    batch = x_spec[0]
    if y_spec[0] != batch:
        raise fail(
            f"x starts with {batch!r} but the output starts with {y_spec[0]!r}; batched form "
            f"required: the first letter of x and of the output is the batch letter, e.g. "
            f"'btk,kn->btn'."
        )
    if batch in w_spec:
        raise fail(
            f"the batch letter {batch!r} appears in the weight spec {w_spec!r}; the weight is "
            f"shared by every batch row and must not carry the batch axis."
        )
    for c in y_spec:
        if c not in x_spec and c not in w_spec:
            raise fail(
                f"output letter {c!r} appears in neither x {x_spec!r} nor the weight {w_spec!r}."
            )
    for c in w_spec:
        if c not in x_spec and c not in y_spec:
            raise fail(
                f"weight letter {c!r} appears in neither x {x_spec!r} nor the output "
                f"{y_spec!r}; sum that weight axis before calling einsum."
            )
    shared = "".join(c for c in y_spec[1:] if c not in w_spec)
    for c in shared:
        if c not in x_spec:
            raise fail(f"shared output letter {c!r} must appear in x {x_spec!r}.")
    return EinsumSpec(
        x_spec=x_spec,
        w_spec=w_spec,
        y_spec=y_spec,
        batch=batch,
        diagonal="".join(c for c in w_spec if c in y_spec),
        contracted="".join(c for c in w_spec if c not in y_spec),
        shared=shared,
    )


def _normalised(spec: EinsumSpec) -> str:
    return f"{spec.x_spec},{spec.w_spec}->{spec.y_spec}"


def _sample_specs(spec: EinsumSpec, batched: bool) -> tuple[str, str, str]:
    """``(x, y, trace)`` letters with or without the batch letter (trace without ``S``)."""
    trace = spec.shared + spec.w_spec
    if batched:
        return spec.x_spec, spec.y_spec, spec.batch + trace
    return spec.x_spec[1:], spec.y_spec[1:], trace


# --- primitive ----------------------------------------------------------------------------


def _etp_einsum_impl(
    x: Array, weight: Array, *, equation: str, weight_fn: WeightFn | None = None
) -> Array:
    """``einsum(equation, x, f_W(W))``; a batch-free ``x`` replays it without the batch letter."""
    spec = parse_etp_einsum(equation)
    x_letters, y_letters, _ = _sample_specs(spec, x.ndim == len(spec.x_spec))
    return jnp.einsum(f"{x_letters},{spec.w_spec}->{y_letters}", x, apply_hook(weight_fn, weight))


def _einsum_trainable_invars(eqn_params: Params) -> dict[str, int]:
    return {"weight": 1}


etp_einsum_p = register_primitive(
    "etp_einsum",
    _etp_einsum_impl,
    batched=True,
    trainable_invars_fn=_einsum_trainable_invars,
    x_invar_index=0,
)


# --- ETP rules --------------------------------------------------------------------------


def _checked_trace(spec: EinsumSpec, trace: Array, letters: str, rule: str) -> Array:
    if trace.ndim != len(letters):
        raise ValueError(
            f"etp_einsum {rule}: the weight trace of {_normalised(spec)!r} has shape "
            f"{tuple(trace.shape)}, but this equation keeps one trace entry per "
            f"({', '.join(letters)}) (rank {len(letters)}). Allocate it with the einsum "
            f"init_drtrl rule called with eqn_params=eqn.params."
        )
    return trace


def _einsum_dt_to_t(
    hidden_dim: Array, trace: dict[str, Array], *, equation: str, **params: object
) -> dict[str, Array]:
    """``ε[b, s, w] · hd[b, y(d(w), s)]``: each entry is discounted at its own output position.

    ``hd`` is shaped like ``y`` (with the batch axis, context R) or like one sample of it.
    """
    spec = parse_etp_einsum(equation)
    _, y_letters, t_letters = _sample_specs(spec, hidden_dim.ndim == len(spec.y_spec))
    eps = _checked_trace(spec, trace["weight"], t_letters, "dt_to_t")
    return {"weight": jnp.einsum(f"{y_letters},{t_letters}->{t_letters}", hidden_dim, eps)}


def _einsum_xy_to_dw(
    x: Array, hidden_dim: Array, weights: dict[str, Array], **params: object
) -> dict[str, Array]:
    """The exact pullback of ``hidden_dim`` to the raw weight, through ``weight_fn``.

    A batch-free ``x`` and ``hidden_dim`` (one sample) replay the equation without the batch
    letter; with the batch, it is reduced inside the VJP.
    """
    return pullback(_etp_einsum_impl, x, hidden_dim, weights, params, order=("weight",))


def _einsum_instant_drtrl(
    x: Array, hidden_dim: Array, weights: dict[str, Array], *, equation: str, **params: object
) -> dict[str, Array]:
    """The trace of ``hd · y`` with respect to ``V = f_W(W)``, per shared position.

    ``ε[s, w] = hd[y(d(w), s)] · Σ_{x-only letters} x[...]``: ``x`` broadcast over the
    diagonal letters it lacks, multiplied by ``hd`` on the diagonal and shared letters.
    Per sample (``x`` and ``hd`` without the batch axis) or batched.
    """
    spec = parse_etp_einsum(equation)
    x_letters, y_letters, t_letters = _sample_specs(spec, x.ndim == len(spec.x_spec))
    eps = jnp.einsum(
        f"{x_letters},{y_letters}->{t_letters}", x, hidden_dim, precision=_HIGHEST
    )
    return {"weight": eps}


def _pull_through_hook(weight_fn: WeightFn | None, w: Array, grads: Array) -> Array:
    """``f_W'(w)ᵀ g`` for every leading index of ``grads`` (``(*lead, *w.shape)``)."""
    if weight_fn is None:
        return grads
    lead = grads.shape[: grads.ndim - w.ndim]
    v, vjp = jax.vjp(weight_fn, w)
    cotangents = jnp.reshape(grads, (-1, *w.shape)).astype(v.dtype)
    out = jax.vmap(lambda c: vjp(c)[0])(cotangents)
    return jnp.reshape(out, (*lead, *w.shape))


def _einsum_solve_drtrl(
    signal: Array,
    trace: dict[str, Array],
    weights: dict[str, Array],
    *,
    equation: str,
    weight_fn: WeightFn | None = None,
) -> dict[str, Array]:
    """``∇W = f_W'(W)ᵀ Σ_s g[y(d(w), s)] · ε[s, w]``: the signal meets the ``V``-space trace.

    Per sample (``g`` shaped like one sample of ``y``, the usual call) or batched (``g``
    shaped like ``y``; the result then keeps the batch axis for the caller to sum).
    """
    spec = parse_etp_einsum(equation)
    batched = signal.ndim == len(spec.y_spec)
    _, y_letters, t_letters = _sample_specs(spec, batched)
    eps = _checked_trace(spec, trace["weight"], t_letters, "solve_drtrl")
    out_letters = (spec.batch if batched else "") + spec.w_spec
    grads = jnp.einsum(
        f"{y_letters},{t_letters}->{out_letters}", signal, eps, precision=_HIGHEST
    )
    return {"weight": _pull_through_hook(weight_fn, weights["weight"], grads)}


def _einsum_init_drtrl(
    x_var: Var,
    y_var: Var,
    weight_vars: dict[str, Var],
    num_hidden_state: int,
    *,
    eqn_params: Params | None = None,
) -> dict[str, Array]:
    """``(B, *shared_sizes, *W.shape, S)``; ``(B, *W.shape, S)`` without ``eqn_params``."""
    y_shape = shape_of(y_var)
    shared_sizes: tuple[int, ...] = ()
    if eqn_params is not None:
        spec = parse_etp_einsum(eqn_params["equation"])
        shared_sizes = tuple(y_shape[spec.y_spec.index(c)] for c in spec.shared)
    batch = shape_of(x_var)[0]
    shape = (batch, *shared_sizes, *shape_of(weight_vars["weight"]), num_hidden_state)
    return {"weight": jnp.zeros(shape, drtrl_dtype(x_var, y_var, weight_vars))}


def _einsum_init_pp(
    x_var: Var,
    y_var: Var,
    weight_vars: dict[str, Var],
    num_hidden_state: int,
    **unused: object,
) -> Array:
    """``zeros((*y.shape, S), y.dtype)``; extra keywords (``eqn_params``) are ignored."""
    return zeros_pp(x_var, y_var, weight_vars, num_hidden_state)


def _einsum_snap_anchor(eqn_params: Params) -> bool:
    """Anchored only without shared letters (upstream's rule): SnAp refuses shared-axis equations."""
    return not parse_etp_einsum(eqn_params["equation"]).shared


etp_einsum_p.register_etp_rules(
    dt_to_t=_einsum_dt_to_t,
    xy_to_dw=_einsum_xy_to_dw,
    init_drtrl=_einsum_init_drtrl,
    init_pp=_einsum_init_pp,
    instant_drtrl=_einsum_instant_drtrl,
    solve_drtrl=_einsum_solve_drtrl,
    snap_anchor=_einsum_snap_anchor,
)


# --- user function ------------------------------------------------------------------------


def _check_operands(spec: EinsumSpec, x: Array, w: Array, equation: str, op: str) -> None:
    for role, value, letters in (("x", x, spec.x_spec), ("weight", w, spec.w_spec)):
        if value.ndim != len(letters):
            raise ValueError(
                f"{op}: {role} has shape {tuple(value.shape)} (rank {value.ndim}) but the "
                f"equation {equation!r} gives it {len(letters)} axes {letters!r}; pass an "
                f"operand of rank {len(letters)} or fix the equation."
            )
    sizes = dict(zip(spec.x_spec, x.shape))
    for c, n in zip(spec.w_spec, w.shape):
        if c in sizes and sizes[c] != n:
            raise OperandShapeError(
                f"{op}: letter {c!r} of {equation!r} has size {sizes[c]} in x "
                f"{tuple(x.shape)} but {n} in weight {tuple(w.shape)}; sizes must agree."
            )


def _check_weight_fn(weight_fn: WeightFn | None, w: Array, op: str) -> None:
    check_hook(weight_fn, "weight_fn", op)
    if weight_fn is None:
        return
    out = jax.eval_shape(weight_fn, jax.ShapeDtypeStruct(w.shape, w.dtype))
    if getattr(out, "shape", None) != tuple(w.shape):
        raise ValueError(
            f"{op}: weight_fn must preserve the weight's shape {tuple(w.shape)}, but it "
            f"returns {getattr(out, 'shape', type(out).__name__)}. Reshape outside einsum, or "
            f"change the equation."
        )


def einsum(
    equation: str, x: ArrayLike, weight: ArrayLike, *, weight_fn: WeightFn | None = None
) -> Array | u.Quantity:
    """Batched tensor contraction ``einsum(equation, x, weight)`` whose weight learns online.

    Use it for contractions :func:`braintrace.matmul` cannot express: per-head weights
    (``'bhk,hkn->bhn'``), a weight shared across positions (``'btk,kn->btn'``) and so on.

    Parameters
    ----------
    equation : str
        ``'x_spec,w_spec->y_spec'`` in lowercase letters (spaces ignored). The first letter
        of ``x_spec`` and of ``y_spec`` is the batch letter, absent from ``w_spec``. Every
        weight letter appears in ``x`` or in the output. See :func:`parse_etp_einsum`.
    x : array or Quantity
        Input with one axis per letter of ``x_spec``.
    weight : array or Quantity
        Weight with one axis per letter of ``w_spec``.
    weight_fn : callable, optional
        Shape-preserving transform applied to the stored weight inside the primitive,
        ``einsum(equation, x, weight_fn(weight))``. Traces and gradients stay with respect to
        the raw stored weight.

    Returns
    -------
    array or Quantity
        One axis per letter of ``y_spec``, in the unit of ``x·weight``.

    Raises
    ------
    TypeError
        If an operand is not an array, the equation is not a string, or ``weight_fn`` is not
        callable.
    ValueError
        If the equation breaks a rule of :func:`parse_etp_einsum`, an operand's rank differs
        from its spec, a letter's size differs between ``x`` and ``weight``, or ``weight_fn``
        changes the weight's shape.

    Notes
    -----
    With shared letters the D-RTRL trace keeps one entry per shared position,
    ``(batch, *shared, *weight.shape, S)``, which keeps online learning exact under a hidden
    recurrence; memory grows with the number of shared positions.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> x, w = jnp.ones((2, 4, 3)), jnp.ones((4, 3, 5))
    >>> braintrace.einsum('bhk,hkn->bhn', x, w, weight_fn=lambda v: 0.5 * v)[0, 0]
    Array([1.5, 1.5, 1.5, 1.5, 1.5], dtype=float32)
    """
    op = "braintrace.einsum"
    spec = parse_etp_einsum(equation)
    x_m, x_unit = split_units(x, "x", op)
    w_m, w_unit = split_units(weight, "weight", op)
    _check_operands(spec, x_m, w_m, equation, op)
    _check_weight_fn(weight_fn, w_m, op)
    y = etp_einsum_p.bind(x_m, w_m, equation=_normalised(spec), weight_fn=weight_fn)
    return with_unit(y, x_unit * w_unit)

"""``ETPPrimitive`` and ``register_primitive``: one impl, every JAX rule derived from it.

An ETP primitive is an ordinary JAX primitive whose equation the eligibility-trace compiler
can recognise in a jaxpr. Its author writes one implementation function; this module derives
the eager impl, abstract evaluation, lowering, JVP (reverse mode follows by JAX's transpose of
the standard ops the JVP is written in) and an identity-preserving batching rule from it.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from braintrace import register_primitive
>>> def _impl(x, w, *, scale=1.0):
...     return scale * (x @ w)
>>> p = register_primitive('doc_scaled_mm', _impl, batched=True)
>>> p.bind(jnp.ones((2, 3)), jnp.ones((3, 4)), scale=2.0)[0]
Array([6., 6., 6., 6.], dtype=float32)
>>> jax.grad(lambda w: p.bind(jnp.ones((2, 3)), w, scale=2.0).sum())(jnp.ones((3, 4))).shape
(3, 4)
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from braintrace._compatible_imports import Primitive, ShapedArray, ad, batching, mlir
from braintrace._op import _registries as reg
from braintrace._op._rule_record import (
    AdjacencyRule,
    ArrayRule,
    EtpRules,
    FastPathRules,
    TraceRule,
    add_primitive,
    update_rules,
)
from braintrace._typing import Array, Params

__all__ = ["ETPPrimitive", "register_primitive"]


class ETPPrimitive(Primitive):
    """A JAX primitive that the eligibility-trace compiler recognises.

    Create one with :func:`register_primitive`; it behaves like any other JAX primitive
    (``bind``, ``jit``, ``grad``, ``vmap``, ``jvp``). The methods below install its
    eligibility-trace rules in its record (:class:`braintrace._op._rule_record.EtpRules`),
    overwriting any earlier entry. ``register_etp_rules`` installs several at once and refuses
    to leave the primitive without a rule every learner needs; rules installed one at a time are
    checked when a model using the primitive is compiled.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace import register_primitive
    >>> from braintrace._op import ETP_RULES_DT_TO_T
    >>> p = register_primitive('doc_gain', lambda w: 2.0 * w, x_invar_index=None)
    >>> p.register_dt_to_t(lambda hidden_dim, trace, **params: {'weight': trace['weight'] * hidden_dim})
    >>> p in ETP_RULES_DT_TO_T
    True
    """

    def register_dt_to_t(self, fn: TraceRule) -> None:
        """Install the trace-propagation rule ``dt_to_t(hidden_dim, trace, **params)``."""
        update_rules(self, "register_dt_to_t", {"dt_to_t": fn})

    def register_xy_to_dw(self, fn: TraceRule) -> None:
        """Install the pullback rule ``xy_to_dw(x, hidden_dim, weights, **params)``."""
        update_rules(self, "register_xy_to_dw", {"xy_to_dw": fn})

    def register_init_drtrl(self, fn: TraceRule) -> None:
        """Install the D-RTRL trace initialiser ``init_drtrl(x_var, y_var, weight_vars, S)``."""
        update_rules(self, "register_init_drtrl", {"init_drtrl": fn})

    def register_init_pp(self, fn: ArrayRule) -> None:
        """Install the pp_prop df-trace initialiser ``init_pp(x_var, y_var, weight_vars, S)``."""
        update_rules(self, "register_init_pp", {"init_pp": fn})

    def register_etp_rules(
        self,
        *,
        dt_to_t: TraceRule | None = None,
        xy_to_dw: TraceRule | None = None,
        init_drtrl: TraceRule | None = None,
        init_pp: ArrayRule | None = None,
        fast_path: FastPathRules | None = None,
        pp_x_repr: ArrayRule | None = None,
        instant_drtrl: TraceRule | None = None,
        solve_drtrl: TraceRule | None = None,
        snap_anchor: Callable[[Params], bool] | None = None,
        snap_adjacency: AdjacencyRule | None = None,
    ) -> None:
        """Install several rules at once; ``None`` leaves an existing entry untouched.

        The primitive must end up with every rule the learners need (``dt_to_t``, ``xy_to_dw``
        and ``init_drtrl``): given in this call or installed before it.

        Parameters
        ----------
        dt_to_t, xy_to_dw, init_drtrl : callable, optional
            The rules every learner needs (see :class:`braintrace._op._rule_record.EtpRules`).
        init_pp : callable, optional
            The pp_prop output-trace initialiser (pp_prop refuses a primitive without it).
        fast_path : FastPathRules, optional
            Closed-form D-RTRL kernels.
        pp_x_repr : callable, optional
            The representation of ``x`` the IO-dim x-trace filters (e.g. one-hot indices).
        instant_drtrl, solve_drtrl : callable, optional
            D-RTRL overrides for primitives whose trace is not parameter-shaped, or is kept in
            the space of the transformed (hooked) parameters.
        snap_anchor : callable, optional
            ``snap_anchor(eqn_params) -> bool``: whether each D-RTRL trace slot of the equation
            lands on the one hidden position it is rolled at, so that SnAp-n may widen it
            (default: not anchored, SnAp refuses the primitive).
        snap_adjacency : callable, optional
            ``snap_adjacency(x_shape, y_shape, *, operand_shapes, **params)``: for an operation
            that mixes hidden positions inside a recurrent transition, per axis of ``y`` a
            boolean ``(y axis, x axis)`` pattern (``None`` for the identity), or ``None`` when it
            cannot describe the shapes. ``operand_shapes`` holds the shape of every operand of
            the equation, in order (a kernel's extent is not among its params). Without it SnAp
            reads the operation as all-to-all.

        Raises
        ------
        TypeError
            If a rule is not callable, or ``fast_path`` is not a :class:`FastPathRules`.
        ValueError
            If the primitive would still lack ``dt_to_t``, ``xy_to_dw`` or ``init_drtrl``. A
            refused call installs nothing.

        Examples
        --------
        >>> from braintrace import register_primitive
        >>> p = register_primitive('doc_incomplete', lambda x, w: x @ w)
        >>> p.register_etp_rules(xy_to_dw=lambda x, hidden_dim, weights, **params: {})
        Traceback (most recent call last):
            ...
        ValueError: register_etp_rules: ETP primitive 'doc_incomplete' has no dt_to_t or init_drtrl rule; ...
        """
        given = dict(
            dt_to_t=dt_to_t, xy_to_dw=xy_to_dw, init_drtrl=init_drtrl, init_pp=init_pp,
            fast_path=fast_path, pp_x_repr=pp_x_repr, instant_drtrl=instant_drtrl,
            solve_drtrl=solve_drtrl, snap_anchor=snap_anchor, snap_adjacency=snap_adjacency,
        )
        changes = {name: fn for name, fn in given.items() if fn is not None}
        update_rules(self, "register_etp_rules", changes, complete=True)


def register_primitive(
    name: str,
    impl_fn: Callable[..., Array],
    *,
    batched: bool = False,
    gradient_enabled: bool = False,
    trainable_invars_fn: Callable[[Params], dict[str, int]] | None = None,
    x_invar_index: int | None = 0,
    y_outvar_index: int = 0,
) -> ETPPrimitive:
    """Create an :class:`ETPPrimitive` with every standard JAX rule derived from ``impl_fn``.

    Only the eligibility-trace rules need hand-writing; install them with the returned
    primitive's ``register_etp_rules`` (``dt_to_t``, ``xy_to_dw`` and ``init_drtrl`` at least).

    Parameters
    ----------
    name : str
        Primitive name, e.g. ``'etp_mm'``. Names need not be unique.
    impl_fn : callable
        ``impl_fn(*operands, **params) -> array``, written in plain JAX. Every static
        parameter passed to ``bind`` reaches it as a keyword argument.
    batched : bool
        Whether ``x`` and ``y`` carry a leading batch axis.
    gradient_enabled : bool
        Whether the compiler may walk through this primitive on the ``y -> h`` tail. Use it
        only for identity-like primitives such as ``etp_elemwise``.
    trainable_invars_fn : callable, optional
        ``eqn.params -> {trainable_name: invar_index}``. Without it the compiler assumes
        ``{'weight': 1}``.
    x_invar_index : int or None
        Position of the input ``x`` in ``eqn.invars``; ``None`` for primitives without one.
    y_outvar_index : int
        Position of the output ``y`` in ``eqn.outvars``.

    Returns
    -------
    ETPPrimitive
        The registered primitive.

    Raises
    ------
    TypeError
        For a non-string ``name``, a non-callable ``impl_fn`` or ``trainable_invars_fn``, an
        index that is not an integer, or an unknown keyword.

    Notes
    -----
    Derived rules: impl (``impl_fn`` eagerly); abstract eval (``jax.eval_shape`` of the impl);
    lowering (``mlir.lower_fun``); JVP (``jax.jvp`` of the impl after materialising symbolic
    zero tangents, ``float0`` for integer and boolean operands); batching (when only ``x`` is
    mapped and a batched counterpart is registered, that primitive is bound with the batch axis
    leading; otherwise ``jax.vmap`` of the impl, with a ``UserWarning`` because the decomposed
    weight no longer takes part in eligibility-trace compilation).

    Under ``jvp``/``grad`` the primitive is expressed in standard JAX ops; the eligibility-trace
    compiler reads the undifferentiated forward jaxpr, where it stays a single equation.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace import register_primitive
    >>> p = register_primitive(
    ...     'doc_affine', lambda x, w, b, **kw: x @ w + b, batched=True,
    ...     trainable_invars_fn=lambda params: {'weight': 1, 'bias': 2})
    >>> p.bind(jnp.ones((1, 2)), jnp.ones((2, 3)), jnp.zeros(3))
    Array([[2., 2., 2.]], dtype=float32)
    """
    if not isinstance(name, str):
        raise TypeError(f"register_primitive: name must be a str, got {type(name).__name__}.")
    if not callable(impl_fn):
        raise TypeError(
            f"register_primitive({name!r}): impl_fn must be callable, got {type(impl_fn).__name__}."
        )
    if trainable_invars_fn is not None and not callable(trainable_invars_fn):
        raise TypeError(
            f"register_primitive({name!r}): trainable_invars_fn must be callable or None, got "
            f"{type(trainable_invars_fn).__name__}."
        )
    if x_invar_index is not None and not _is_index(x_invar_index):
        raise TypeError(
            f"register_primitive({name!r}): x_invar_index must be a non-negative int or None, "
            f"got {x_invar_index!r}."
        )
    if not _is_index(y_outvar_index):
        raise TypeError(
            f"register_primitive({name!r}): y_outvar_index must be a non-negative int, got "
            f"{y_outvar_index!r}."
        )

    prim = ETPPrimitive(name)
    prim.def_impl(partial(_impl, impl_fn))
    prim.def_abstract_eval(partial(_abstract_eval, impl_fn))
    mlir.register_lowering(prim, mlir.lower_fun(impl_fn, multiple_results=False))
    ad.primitive_jvps[prim] = partial(_jvp, impl_fn)
    batching.primitive_batchers[prim] = partial(_batch, prim, impl_fn)

    add_primitive(prim, EtpRules(
        batched=batched, gradient_enabled=gradient_enabled, x_invar_index=x_invar_index,
        y_outvar_index=y_outvar_index, trainable_invars_fn=trainable_invars_fn,
    ))
    return prim


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _impl(impl_fn: Callable[..., Array], *args: Array, **params: object) -> Array:
    return impl_fn(*args, **params)


def _abstract_eval(impl_fn: Callable[..., Array], *avals: ShapedArray, **params: object) -> ShapedArray:
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    out = jax.eval_shape(partial(impl_fn, **params), *structs)
    return ShapedArray(out.shape, out.dtype)


def _jvp(
    impl_fn: Callable[..., Array], primals: Sequence[Array], tangents: Sequence[Array], **params: object
) -> tuple[Array, Array]:
    # Symbolic zeros become real zeros (float0 for integer/boolean operands) so that jax.jvp
    # sees one tangent per primal.
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(partial(impl_fn, **params), tuple(primals), tuple(tangents))


def _batch(
    prim: ETPPrimitive,
    impl_fn: Callable[..., Array],
    args: Sequence[Array],
    dims: Sequence[int | None],
    **params: object,
) -> tuple[Array, int]:
    counterpart = reg.get_batched_counterpart(prim)
    xi = reg.get_x_invar_index(prim)
    if counterpart is not None and xi is not None:
        x_dim = dims[xi]
        others_unmapped = all(d is None for i, d in enumerate(dims) if i != xi)
        if x_dim is not None and others_unmapped:
            args = list(args)
            args[xi] = jnp.moveaxis(args[xi], x_dim, 0)
            return counterpart.bind(*args, **params), 0
    warnings.warn(
        f"ETP primitive '{prim.name}' was decomposed into standard JAX ops under vmap (batch "
        f"dims {tuple(dims)}). Its trainable parameters will NOT be recognized by the "
        f"eligibility-trace compiler inside this vmap; map only the input x of an unbatched op "
        f"(e.g. braintrace.matmul on a 1-D x), or compile the per-sample model with "
        f"braintrace.compile(..., vmap=True).",
        UserWarning,
        stacklevel=2,
    )
    out = jax.vmap(partial(impl_fn, **params), in_axes=tuple(dims))(*args)
    return out, 0

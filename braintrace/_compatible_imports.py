"""The one place that reaches into JAX's internals.

Everything else in braintrace reads JAX's interpreter names, the split of a jaxpr's inputs and
the parameters of JAX's own primitives (scan, while, cond, jit, the custom-derivative calls, and
the lax operations the compiler looks inside: ``dot_general``, ``slice``, ``concatenate``, ``rev``,
the reductions) through this module, so that a JAX release that moves or renames one of them
touches a single file. Each read is feature-detected — whichever module exports a name,
whichever parameter a primitive carries — never branched on a version number;
``tests/test_jax_compat.py`` pins every one of them, so a JAX that moves one fails there first.

The jaxpr helpers never rely on a jaxpr storing which of its inputs are constants: newer JAX
(0.11 on) builds symbol-only jaxprs whose constant inputs sit at the front of one input list,
and derives the boundary from the constant *values* attached. So the split is derived from a
count the caller knows: the number of ordinary inputs it feeds (:func:`split_jaxpr_invars`), or
the number of values a closed jaxpr carries (:func:`closed_jaxpr_constvars`).

Examples
--------
>>> import jax
>>> from braintrace._compatible_imports import jaxpr_all_invars, split_jaxpr_invars
>>> jaxpr = jax.make_jaxpr(lambda a, b: a * b)(1.0, 2.0).jaxpr
>>> consts, hidden = split_jaxpr_invars(jaxpr, 1)
>>> len(jaxpr_all_invars(jaxpr)), len(consts), hidden == [jaxpr.invars[-1]]
(2, 1, True)
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence, TypeGuard, TypeVar, Union

import jax
import jax.extend.core as _extend_core
import jax.numpy as jnp
from jax.core import ShapedArray, Tracer
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Primitive, Var
from jax.interpreters import ad, batching, mlir
from jax.typing import ArrayLike

__all__ = [
    # names
    "Atom",
    "ClosedJaxpr",
    "CustomVJPPrimal",
    "DebugInfo",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "ShapedArray",
    "SymbolicZero",
    "Tracer",
    "Var",
    "ad",
    "is_var",
    "batching",
    "mlir",
    "new_jaxpr_eqn",
    # evaluation
    "bind_equation",
    "call_pullback",
    "eval_jaxpr",
    "pullback_takes_symbolic_zeros",
    "source_line",
    # jaxpr inputs
    "closed_jaxpr_constvars",
    "jaxpr_all_invars",
    "jaxpr_constvars",
    "split_jaxpr_invars",
    # primitives and their parameters
    "CALL_PRIMITIVES",
    "CONTROL_FLOW_PRIMITIVES",
    "CUSTOM_VJP_PRIMITIVES",
    "JIT_PRIMITIVES",
    "ScanParams",
    "WhileParams",
    "call_body",
    "cond_branches",
    "is_jit",
    "jit_body",
    "map_closed_subjaxprs",
    "replace_scan_body",
    "scan_params",
    "subjaxprs",
    "while_params",
    # the parameters of lax primitives
    "DotDims",
    "SliceParams",
    "concatenate_axis",
    "dot_general_dims",
    "reduction_axes",
    "rev_axes",
    "slice_params",
]


# --- names --------------------------------------------------------------------------------


def _core_name(name: str) -> object:
    """``name`` from ``jax.extend.core`` where JAX exports it there, else from its core module.

    JAX 0.8 and 0.9 export ``DropVar``, ``DebugInfo`` and ``new_jaxpr_eqn`` only from
    ``jax.core`` (later releases deprecate that path in favour of ``jax.extend.core``).
    """
    if hasattr(_extend_core, name):
        return getattr(_extend_core, name)
    return getattr(importlib.import_module("jax._src.core"), name)


if TYPE_CHECKING:
    from jax.extend.core import DebugInfo, DropVar, new_jaxpr_eqn
else:
    DebugInfo = _core_name("DebugInfo")
    DropVar = _core_name("DropVar")
    new_jaxpr_eqn = _core_name("new_jaxpr_eqn")

_eval_jaxpr: Callable[..., list[Any]] = getattr(_extend_core, "eval_jaxpr", None) or jax.core.eval_jaxpr

#: An operand of an equation: a variable, or a literal constant.
Atom = Union[Var, Literal]


def is_var(atom: object) -> TypeGuard[Var]:
    """Whether ``atom`` is a jaxpr variable, not a literal constant (JAX keeps the two classes apart).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from braintrace._compatible_imports import is_var
    >>> eqn = jax.make_jaxpr(lambda x: x + 1.0)(jnp.ones(2)).jaxpr.eqns[0]
    >>> [is_var(atom) for atom in eqn.invars]
    [True, False]
    """
    return isinstance(atom, Var) and not isinstance(atom, Literal)


# --- evaluation ---------------------------------------------------------------------------


@functools.cache
def pullback_takes_symbolic_zeros() -> bool:
    """Whether this JAX's ``jax.vjp`` pullbacks accept ``ad.Zero`` cotangents (and skip their work).

    Found by tracing a two-output pullback given one symbolic zero, once per process; no array
    is computed.
    """
    def probe(x: jax.Array) -> tuple[jax.Array, ...]:
        _, vjp_fn = jax.vjp(lambda a: (a, a), x)
        return vjp_fn((x, ad.Zero(jax.typeof(x))))

    try:
        jax.eval_shape(probe, jax.ShapeDtypeStruct((), jnp.float32))
    except (TypeError, ValueError):
        return False
    return True


Cotangents = TypeVar("Cotangents")
PulledBack = TypeVar("PulledBack")


def call_pullback(vjp_fn: Callable[[Cotangents], PulledBack], cotangents: Cotangents) -> PulledBack:
    """``vjp_fn(cotangents)`` for a ``jax.vjp`` pullback, where ``cotangents`` may hold ``ad.Zero``.

    The symbolic zeros pass through where JAX takes them (:func:`pullback_takes_symbolic_zeros`)
    and become arrays of zeros where it does not, so the result is the same on every supported JAX.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> _, vjp_fn = jax.vjp(lambda a: (2.0 * a, a), jnp.ones(2))
    >>> call_pullback(vjp_fn, (jnp.ones(2), ad.Zero(jax.typeof(jnp.ones(2)))))
    (Array([2., 2.], dtype=float32),)
    """
    if not pullback_takes_symbolic_zeros():
        cotangents = jax.tree.map(lambda c: ad.instantiate_zeros(c) if isinstance(c, ad.Zero) else c,
                                  cotangents, is_leaf=lambda c: isinstance(c, ad.Zero))
    return vjp_fn(cotangents)


def bind_equation(eqn: JaxprEqn, operands: Sequence[ArrayLike]) -> list[jax.Array]:
    """The outputs of ``eqn`` at ``operands``, bound as JAX's own evaluator binds it.

    ``Primitive.get_bind_params`` gives the parameters to bind with, and in some releases also
    the sub-functions to pass ahead of the operands (``(subfuns, params)``): both forms are read.

    Examples
    --------
    >>> import jax
    >>> eqn = jax.make_jaxpr(lambda a, b: a * b)(1.0, 2.0).jaxpr.eqns[0]
    >>> bind_equation(eqn, [3.0, 4.0])
    [Array(12., dtype=float32, weak_type=True)]
    """
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):
        subfuns, params = bind_params
        outs = eqn.primitive.bind(*subfuns, *operands, **params)
    else:
        outs = eqn.primitive.bind(*operands, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[ArrayLike], *args: ArrayLike) -> list[Any]:
    """Evaluate ``jaxpr`` with ``[*consts, *args]`` bound to its inputs, constants first.

    Only the total count has to match: the values are re-split by however many constant inputs
    the jaxpr stores, so a symbol-only jaxpr whose constants JAX folds into its ordinary inputs
    evaluates the same as one that keeps them apart.

    Returns
    -------
    list
        The outputs: arrays (or tracers), and for an output the jaxpr holds as a literal, the
        literal's Python or NumPy value, as JAX's evaluator returns it.

    Raises
    ------
    ValueError
        If the number of values is not the number of inputs.

    Examples
    --------
    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda a, b: a - b)(1.0, 2.0).jaxpr
    >>> eval_jaxpr(jaxpr, [5.0], 2.0)
    [Array(3., dtype=float32, weak_type=True)]
    """
    values = [*consts, *args]
    every = jaxpr_all_invars(jaxpr)
    if len(values) != len(every):
        raise ValueError(
            f"eval_jaxpr: {len(consts)} constants and {len(args)} arguments were given to a jaxpr with "
            f"{len(every)} inputs; pass one value per input, constants first."
        )
    cut = len(jaxpr_constvars(jaxpr))
    return list(_eval_jaxpr(jaxpr, values[:cut], *values[cut:]))


def jaxpr_constvars(jaxpr: Jaxpr) -> list[Var]:
    """The inputs ``jaxpr`` stores as constants (none where JAX keeps no such split).

    Examples
    --------
    >>> import jax
    >>> jaxpr_constvars(jax.make_jaxpr(lambda a: a + 1.0)(1.0).jaxpr)
    []
    """
    return list(getattr(jaxpr, "constvars", ()))


def jaxpr_all_invars(jaxpr: Jaxpr) -> list[Var]:
    """Every input of ``jaxpr``, constants first: the order ``eval_jaxpr`` binds values in.

    Examples
    --------
    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda a, b: a - b)(1.0, 2.0).jaxpr
    >>> jaxpr_all_invars(jaxpr) == list(jaxpr.invars)
    True
    """
    return [*jaxpr_constvars(jaxpr), *jaxpr.invars]


def split_jaxpr_invars(jaxpr: Jaxpr, n_invars: int) -> tuple[list[Var], list[Var]]:
    """``(constant inputs, the last n_invars inputs)`` of ``jaxpr``.

    Raises
    ------
    ValueError
        If ``n_invars`` is not an ``int`` between 0 and the number of inputs.

    Examples
    --------
    >>> import jax
    >>> jaxpr = jax.make_jaxpr(lambda a, b, c: a * b + c)(1.0, 2.0, 3.0).jaxpr
    >>> [len(part) for part in split_jaxpr_invars(jaxpr, 2)]
    [1, 2]
    >>> split_jaxpr_invars(jaxpr, 4)
    Traceback (most recent call last):
        ...
    ValueError: split_jaxpr_invars: n_invars=4 is out of range for a jaxpr with 3 inputs; ...
    """
    every = jaxpr_all_invars(jaxpr)
    if not isinstance(n_invars, int) or isinstance(n_invars, bool) or not 0 <= n_invars <= len(every):
        raise ValueError(
            f"split_jaxpr_invars: n_invars={n_invars!r} is out of range for a jaxpr with "
            f"{len(every)} inputs; pass the number of non-constant inputs, an int in [0, {len(every)}]."
        )
    cut = len(every) - n_invars
    return every[:cut], every[cut:]


def source_line(source_info: source_info_util.SourceInfo | None) -> str | None:
    """``file:line (function)`` of the user code that created an equation, or ``None``."""
    if source_info is None:
        return None
    try:
        summary = source_info_util.summarize(source_info)
    except (AttributeError, IndexError, TypeError):  # no user frame recorded
        return None
    return summary if isinstance(summary, str) and summary else None


def closed_jaxpr_constvars(closed: ClosedJaxpr) -> list[Var]:
    """The inputs of ``closed.jaxpr`` that ``closed.consts`` are bound to: the leading ``len(consts)``.

    Derived from the number of constant values ``closed`` carries, so it reads the same whether
    JAX stores the split beside the symbols or derives it from the values.

    Raises
    ------
    ValueError
        If ``closed`` carries more values than its jaxpr has inputs.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> w = jnp.arange(3.0)
    >>> closed = jax.make_jaxpr(lambda x: x * w)(jnp.ones(3))
    >>> closed_jaxpr_constvars(closed) == list(closed.jaxpr.constvars)
    True
    """
    constvars, _ = split_jaxpr_invars(closed.jaxpr, len(jaxpr_all_invars(closed.jaxpr)) - len(closed.consts))
    return constvars


# --- primitives and their parameters ------------------------------------------------------

#: JAX's structured control flow: the compiler reads their bodies.
CONTROL_FLOW_PRIMITIVES = ("scan", "while", "cond")
#: A call of a ``jax.jit`` function (``pjit`` in releases before the rename).
JIT_PRIMITIVES = frozenset({"jit", "pjit"})
#: A call of a ``jax.custom_vjp`` function (``custom_vjp_call_jaxpr`` in older releases).
CUSTOM_VJP_PRIMITIVES = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})
#: Primitives that apply one body to their operands as they are: ``jit``, the custom-derivative
#: calls, ``jax.checkpoint`` and ``closed_call``.
CALL_PRIMITIVES = JIT_PRIMITIVES | CUSTOM_VJP_PRIMITIVES | frozenset(
    {"custom_jvp_call", "closed_call", "core_call", "remat", "checkpoint", "remat2"})

# The parameter holding a call primitive's body, in the order they are looked for.
_CALL_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def is_jit(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a call of a user ``jax.jit`` function."""
    return eqn.primitive.name in JIT_PRIMITIVES


def _missing_param(eqn: JaxprEqn, wanted: str) -> NotImplementedError:
    return NotImplementedError(
        f"braintrace cannot read {wanted} of this JAX's `{eqn.primitive.name}` equation, whose parameters "
        f"are {sorted(eqn.params)}; install a JAX in braintrace's tested range (docs/compatibility.md, "
        f"'Supported versions') or report the JAX version."
    )


class ScanParams(NamedTuple):
    """What the compiler reads of a ``scan`` equation.

    Its operands are ``num_consts`` constants, ``num_carry`` carries and then the scanned
    ``xs``; its outputs are the carries and then the stacked ``ys``.
    """

    body: ClosedJaxpr  # (consts, carry, x) -> (carry, y), run `length` times
    length: int
    reverse: bool
    num_consts: int
    num_carry: int


def scan_params(eqn: JaxprEqn) -> ScanParams:
    """The parameters of a ``scan`` equation, its constant and carry counts read from whichever
    parameters the primitive carries: ``num_consts`` / ``num_carry``, or the input tree ``ft_in``
    (constants, carries, xs) of releases that describe the operands by a tree.

    Raises
    ------
    NotImplementedError
        If the equation carries neither form.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> f = lambda c, xs: jax.lax.scan(lambda c, x: (c + x, 2 * x), c, xs)
    >>> p = scan_params(jax.make_jaxpr(f)(0.0, jnp.ones(4)).jaxpr.eqns[0])
    >>> p.length, p.reverse, p.num_consts, p.num_carry
    (4, False, 0, 1)
    """
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:
        num_consts, num_carry = int(params["num_consts"]), int(params["num_carry"])
    elif hasattr(params.get("ft_in"), "unpack"):
        consts, carry, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    else:
        raise _missing_param(eqn, "the constant and carry counts")
    return ScanParams(params["jaxpr"], int(params["length"]), bool(params["reverse"]), num_consts, num_carry)


def replace_scan_body(eqn: JaxprEqn, body: ClosedJaxpr, outvars: Sequence[Var]) -> JaxprEqn:
    """The scan ``eqn`` running ``body``, whose outputs are ``outvars``: the old ones and extra ``ys``.

    Where the primitive describes its outputs by a tree (``ft_out``: carries, ys), the ys part
    grows by the extra outputs; the operands are unchanged.

    Raises
    ------
    ValueError
        If ``outvars`` or ``body`` drops an output.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda c: jax.lax.scan(lambda c, _: (c * 2.0, None), c, None, length=3))(1.0).jaxpr.eqns[0]
    >>> len(replace_scan_body(eqn, scan_params(eqn).body, eqn.outvars).outvars)
    1
    """
    extra = len(outvars) - len(eqn.outvars)
    if extra < 0 or len(body.jaxpr.outvars) - len(scan_params(eqn).body.jaxpr.outvars) != extra:
        raise ValueError(
            f"replace_scan_body: the scan has {len(eqn.outvars)} outputs; the new body has "
            f"{len(body.jaxpr.outvars)} and {len(outvars)} outer variables were given. Only extra ys may be added."
        )
    params = {**eqn.params, "jaxpr": body}
    if extra and "ft_out" in params:
        flattree = importlib.import_module("jax._src.flattree")
        carry, ys = params["ft_out"].unpack()
        params["ft_out"] = flattree.pack((carry, flattree.nones(len(ys) + extra)))
    return eqn.replace(params=params, outvars=list(outvars))


class WhileParams(NamedTuple):
    """What the compiler reads of a ``while`` equation.

    Its operands are ``cond_nconsts`` constants of ``cond``, ``body_nconsts`` constants of
    ``body`` and then the carries; its outputs are the carries.
    """

    cond: ClosedJaxpr  # (cond consts, carry) -> bool
    body: ClosedJaxpr  # (body consts, carry) -> carry
    cond_nconsts: int
    body_nconsts: int


def while_params(eqn: JaxprEqn) -> WhileParams:
    """The parameters of a ``while`` equation.

    Examples
    --------
    >>> import jax
    >>> eqn = jax.make_jaxpr(lambda c: jax.lax.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, c))(0.0).jaxpr.eqns[0]
    >>> p = while_params(eqn)
    >>> p.cond_nconsts, p.body_nconsts, len(p.body.jaxpr.outvars)
    (0, 0, 1)
    """
    params = eqn.params
    try:
        return WhileParams(params["cond_jaxpr"], params["body_jaxpr"], int(params["cond_nconsts"]),
                           int(params["body_nconsts"]))
    except KeyError:
        raise _missing_param(eqn, "the condition, body and their constant counts") from None


def cond_branches(eqn: JaxprEqn) -> tuple[ClosedJaxpr, ...]:
    """The branches of a ``cond`` equation, indexed by its first operand; the rest are theirs.

    Examples
    --------
    >>> import jax
    >>> f = lambda i, x: jax.lax.switch(i, [lambda x: x, lambda x: 2 * x, lambda x: x + 1], x)
    >>> eqn = [e for e in jax.make_jaxpr(f)(0, 1.0).jaxpr.eqns if e.primitive.name == 'cond'][0]
    >>> len(cond_branches(eqn))
    3
    """
    if "branches" not in eqn.params:
        raise _missing_param(eqn, "the branches")
    return tuple(eqn.params["branches"])


def call_body(eqn: JaxprEqn) -> ClosedJaxpr | Jaxpr:
    """The body a call primitive (:data:`CALL_PRIMITIVES`) applies to its operands.

    Closed for ``jit``, ``closed_call`` and the custom-derivative calls, open for
    ``jax.checkpoint``; its inputs are the equation's operands, in order.

    Examples
    --------
    >>> import jax
    >>> g = jax.jit(lambda x: 2 * x)
    >>> eqn = jax.make_jaxpr(lambda x: g(x))(1.0).jaxpr.eqns[0]
    >>> [e.primitive.name for e in call_body(eqn).jaxpr.eqns]
    ['mul']
    """
    for name in _CALL_BODY_PARAMS:
        body = eqn.params.get(name)
        if isinstance(body, (ClosedJaxpr, Jaxpr)):
            return body
    raise _missing_param(eqn, "the called body")


def jit_body(eqn: JaxprEqn) -> ClosedJaxpr:
    """The closed body of a ``jax.jit`` call (:func:`is_jit`), applied to the equation's operands.

    Examples
    --------
    >>> import jax
    >>> g = jax.jit(lambda x: x + 1.0)
    >>> eqn = jax.make_jaxpr(lambda x: g(x))(1.0).jaxpr.eqns[0]
    >>> [e.primitive.name for e in jit_body(eqn).jaxpr.eqns]
    ['add']
    """
    body = call_body(eqn)
    if not isinstance(body, ClosedJaxpr):
        raise _missing_param(eqn, "the closed jit body")
    return body


def _jaxprs_in(value: object) -> Iterator[Jaxpr]:
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs_in(item)


def subjaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """The (open) jaxprs held in ``eqn``'s parameters: jit, scan, while, cond bodies and the like.

    Examples
    --------
    >>> import jax
    >>> f = lambda p, x: jax.lax.cond(p, lambda x: x, lambda x: -x, x)
    >>> eqn = [e for e in jax.make_jaxpr(f)(True, 1.0).jaxpr.eqns if e.primitive.name == 'cond'][0]
    >>> len(list(subjaxprs(eqn)))
    2
    """
    for value in eqn.params.values():
        yield from _jaxprs_in(value)


def map_closed_subjaxprs(eqn: JaxprEqn, fn: Callable[[ClosedJaxpr], ClosedJaxpr]) -> JaxprEqn:
    """``eqn`` with ``fn`` applied to each closed jaxpr among its parameters (alone or in a tuple).

    Returns ``eqn`` itself when ``fn`` returns every body unchanged.

    Examples
    --------
    >>> import jax
    >>> eqn = jax.make_jaxpr(lambda c: jax.lax.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, c))(0.0).jaxpr.eqns[0]
    >>> map_closed_subjaxprs(eqn, lambda body: body) is eqn
    True
    """
    params: dict[str, object] = {}
    for key, value in eqn.params.items():
        if isinstance(value, ClosedJaxpr):
            params[key] = fn(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, ClosedJaxpr) for v in value):
            new = tuple(fn(v) for v in value)
            params[key] = value if all(a is b for a, b in zip(new, value)) else new
        else:
            params[key] = value
    if all(params[k] is eqn.params[k] for k in params):
        return eqn
    return eqn.replace(params=params)


# --- the parameters of lax primitives -----------------------------------------------------

#: Reductions whose ``axes`` parameter names the reduced axes of their one operand.
_AXES_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin",
})


def _lax_param(eqn: JaxprEqn, reader: str, primitives: frozenset[str], name: str) -> Any:
    """The parameter ``name`` of ``eqn``, an equation of one of ``primitives``.

    Raises
    ------
    ValueError
        If ``eqn`` is an equation of another primitive.
    NotImplementedError
        If this JAX's equation does not carry ``name``.
    """
    if eqn.primitive.name not in primitives:
        raise ValueError(
            f"{reader}: got a `{eqn.primitive.name}` equation, which has no `{name}`; call it only on "
            f"{' / '.join(f'`{p}`' for p in sorted(primitives))} equations (check `eqn.primitive.name` first)."
        )
    if name not in eqn.params:
        raise _missing_param(eqn, f"`{name}`")
    return eqn.params[name]


class DotDims(NamedTuple):
    """The ``dimension_numbers`` of a ``dot_general`` equation: which axes of each operand it
    contracts and which it batches over (operand 0 is ``lhs``, operand 1 ``rhs``)."""

    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]


def dot_general_dims(eqn: JaxprEqn) -> DotDims:
    """The contracted and batch axes of a ``dot_general`` equation.

    Raises
    ------
    ValueError
        If ``eqn`` is not a ``dot_general`` equation.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda h, w: h @ w)(jnp.ones((2, 3)), jnp.ones((3, 4))).jaxpr.eqns[0]
    >>> dot_general_dims(eqn)
    DotDims(lhs_contracting=(1,), rhs_contracting=(0,), lhs_batch=(), rhs_batch=())
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = _lax_param(eqn, "dot_general_dims", frozenset({"dot_general"}),
                                                "dimension_numbers")
    return DotDims(tuple(lhs_c), tuple(rhs_c), tuple(lhs_b), tuple(rhs_b))


class SliceParams(NamedTuple):
    """Where a ``slice`` equation cuts its operand, per axis: ``operand[start:limit:stride]``."""

    start: tuple[int, ...]
    limit: tuple[int, ...]
    strides: tuple[int, ...]  # ones where the equation records no strides


def slice_params(eqn: JaxprEqn) -> SliceParams:
    """The start, limit and stride per axis of a ``slice`` equation.

    Raises
    ------
    ValueError
        If ``eqn`` is not a ``slice`` equation.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda x: jax.lax.slice(x, (0, 1), (2, 5), (1, 2)))(jnp.ones((2, 6))).jaxpr.eqns[0]
    >>> slice_params(eqn)
    SliceParams(start=(0, 1), limit=(2, 5), strides=(1, 2))
    """
    kinds = frozenset({"slice"})
    start = tuple(_lax_param(eqn, "slice_params", kinds, "start_indices"))
    limit = tuple(_lax_param(eqn, "slice_params", kinds, "limit_indices"))
    strides = _lax_param(eqn, "slice_params", kinds, "strides")
    return SliceParams(start, limit, tuple(strides) if strides is not None else (1,) * len(start))


def concatenate_axis(eqn: JaxprEqn) -> int:
    """The axis a ``concatenate`` equation joins its operands along.

    Raises
    ------
    ValueError
        If ``eqn`` is not a ``concatenate`` equation.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda a: jnp.concatenate([a, a], axis=1))(jnp.ones((2, 3))).jaxpr.eqns[0]
    >>> concatenate_axis(eqn)
    1
    """
    return int(_lax_param(eqn, "concatenate_axis", frozenset({"concatenate"}), "dimension"))


def rev_axes(eqn: JaxprEqn) -> tuple[int, ...]:
    """The axes a ``rev`` equation reverses.

    Raises
    ------
    ValueError
        If ``eqn`` is not a ``rev`` equation.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda x: jax.lax.rev(x, (0, 2)))(jnp.ones((2, 3, 4))).jaxpr.eqns[0]
    >>> rev_axes(eqn)
    (0, 2)
    """
    return tuple(_lax_param(eqn, "rev_axes", frozenset({"rev"}), "dimensions"))


def reduction_axes(eqn: JaxprEqn) -> tuple[int, ...]:
    """The axes a reduction equation (``reduce_sum``, ``reduce_max``, ..., ``argmax``) reduces.

    Raises
    ------
    ValueError
        If ``eqn`` is not such a reduction.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda x: x.sum(axis=(0, 2)))(jnp.ones((2, 3, 4))).jaxpr.eqns[0]
    >>> reduction_axes(eqn)
    (0, 2)
    """
    return tuple(_lax_param(eqn, "reduction_axes", _AXES_REDUCTIONS, "axes"))

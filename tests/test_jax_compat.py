"""Every read of a JAX internal that braintrace makes, one test each, through ``_compatible_imports``.

A JAX release that moves a name, renames a primitive or changes a primitive's parameters fails
here, next to the read that has to follow it. The layout JAX 0.11 gives symbol-only jaxprs
(constant inputs folded into the ordinary ones) is built on this JAX and read the same way.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace import _compatible_imports as compat

W = jnp.arange(3.0)


def _eqn(fn: Any, *args: Any, name: str) -> Any:
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == name]
    return eqn


def _scan_eqn() -> Any:
    def body(c: Any, x: Any) -> Any:
        return c * W + x, c.sum()

    return _eqn(lambda c, xs: jax.lax.scan(body, c, xs), jnp.ones(3), jnp.ones((4, 3)), name="scan")


@jax.custom_jvp
def _smooth(x: Any) -> Any:
    return jnp.sin(x)


_smooth.defjvp(lambda primals, tangents: (_smooth(primals[0]), jnp.cos(primals[0]) * tangents[0]))


@jax.custom_vjp
def _clipped(x: Any) -> Any:
    return jnp.tanh(x)


_clipped.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))


# --- names ----------------------------------------------------------------------------------


def test_the_jaxpr_types_are_what_make_jaxpr_builds() -> None:
    closed = jax.make_jaxpr(lambda x: x * W + 1.0)(jnp.ones(3))
    assert isinstance(closed, compat.ClosedJaxpr) and isinstance(closed.jaxpr, compat.Jaxpr)
    eqn = closed.jaxpr.eqns[-1]
    assert isinstance(eqn, compat.JaxprEqn) and isinstance(eqn.primitive, compat.Primitive)
    assert isinstance(eqn.outvars[0], compat.Var)
    assert any(isinstance(a, compat.Literal) for a in eqn.invars)  # the 1.0
    assert [compat.is_var(a) for a in eqn.invars] == [True, False]  # the product, the 1.0
    assert compat.is_var(eqn.outvars[0]) and not compat.is_var(1.0)
    assert isinstance(jax.typeof(W), compat.ShapedArray)


def test_dropvar_debuginfo_and_new_jaxpr_eqn_build_a_jaxpr_jax_evaluates() -> None:
    x, y = compat.Var(compat.ShapedArray((), jnp.float32)), compat.Var(compat.ShapedArray((), jnp.float32))
    dropped = compat.DropVar(compat.ShapedArray((), jnp.float32))
    assert isinstance(dropped, compat.Var)
    eqns = [compat.new_jaxpr_eqn([x, x], [y], jax.lax.mul_p, {}, set()),
            compat.new_jaxpr_eqn([x], [dropped], jax.lax.neg_p, {}, set())]
    info = compat.DebugInfo("test", "square", ("x",), ("out",))
    jaxpr = compat.Jaxpr([], [x], [y], eqns, frozenset(), info)
    assert jaxpr.debug_info is info
    assert compat.eval_jaxpr(jaxpr, [], 3.0) == [9.0]


def test_tracer_is_what_a_traced_function_sees() -> None:
    seen = []
    jax.jit(lambda a: seen.append(isinstance(a, compat.Tracer)) or a)(1.0)
    assert seen == [True] and not isinstance(W, compat.Tracer)


def test_the_custom_derivative_names_are_jaxs() -> None:
    got: list[Any] = []

    @jax.custom_vjp
    def f(x: Any) -> Any:
        return x

    def fwd(x: Any) -> Any:
        got.append(x)
        return x.value, None

    f.defvjp(fwd, lambda _, g: (g,), symbolic_zeros=True)
    jax.grad(f)(1.0)
    assert isinstance(got[0], compat.CustomVJPPrimal)
    assert compat.SymbolicZero is jax.custom_derivatives.SymbolicZero


def test_a_primitive_registers_through_the_interpreter_modules() -> None:
    """The tables and helpers ``braintrace._op._primitive`` registers its primitives with."""
    prim = compat.Primitive("compat_test_double")
    prim.def_impl(lambda x: 2 * x)
    prim.def_abstract_eval(lambda x: compat.ShapedArray(x.shape, x.dtype))
    compat.mlir.register_lowering(prim, compat.mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
    compat.ad.primitive_jvps[prim] = lambda p, t: (prim.bind(*p), 2 * compat.ad.instantiate_zeros(t[0]))
    compat.batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), dims[0])
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(lambda x: prim.bind(x).sum())))(jnp.ones((2, 3))), 2.0)


def test_source_line_names_the_user_code() -> None:
    eqn = jax.make_jaxpr(lambda a: a * 2.0)(1.0).jaxpr.eqns[0]
    line = compat.source_line(eqn.source_info)
    assert line is not None and "test_jax_compat.py" in line
    assert compat.source_line(None) is None


# --- evaluation -----------------------------------------------------------------------------


def test_eval_jaxpr_binds_constants_first_and_checks_the_count() -> None:
    closed = jax.make_jaxpr(lambda x: x * W)(jnp.ones(3))
    (out,) = compat.eval_jaxpr(closed.jaxpr, closed.consts, jnp.full(3, 2.0))
    np.testing.assert_allclose(out, 2.0 * W)
    with pytest.raises(ValueError, match="1 constants and 2 arguments were given to a jaxpr with 2 inputs"):
        compat.eval_jaxpr(closed.jaxpr, closed.consts, jnp.ones(3), jnp.ones(3))


def test_eval_jaxpr_reads_a_jaxpr_whose_constants_are_folded_into_its_inputs() -> None:
    """JAX 0.11's layout of a symbol-only jaxpr: one input list, constants leading."""
    closed = jax.make_jaxpr(lambda x: x * W)(jnp.ones(3))
    jaxpr = closed.jaxpr
    folded = compat.Jaxpr([], [*jaxpr.constvars, *jaxpr.invars], jaxpr.outvars, jaxpr.eqns, jaxpr.effects,
                          compat.DebugInfo("test", "folded", ("w", "x"), ("out",)))
    for layout in (jaxpr, folded):
        (out,) = compat.eval_jaxpr(layout, closed.consts, jnp.full(3, 2.0))
        np.testing.assert_allclose(out, 2.0 * W)
        constvars, (x,) = compat.split_jaxpr_invars(layout, 1)
        assert constvars == list(jaxpr.constvars) and x is jaxpr.invars[0]


def test_bind_equation_evaluates_every_kind_of_equation_as_jax_does() -> None:
    g = jax.jit(lambda a: a * 2.0)

    def fn(p: Any, x: Any) -> Any:
        y = g(_smooth(x)) + _clipped(x)
        y = jax.lax.cond(p, lambda v: v + 1.0, lambda v: v - 1.0, y)
        y = jax.lax.while_loop(lambda v: v.sum() < 10.0, lambda v: v + 1.0, y)
        y = jax.checkpoint(jnp.sin)(y)
        return jax.lax.scan(lambda c, z: (c + z, c), y, jnp.ones((2, 3)))

    closed = jax.make_jaxpr(fn)(True, W)
    assert {"jit", "custom_jvp_call", "cond", "while", "scan"} <= {e.primitive.name for e in closed.jaxpr.eqns} | {"jit"}
    env = dict(zip(closed.jaxpr.invars, [True, W]))
    env.update(zip(closed.jaxpr.constvars, closed.consts))
    for eqn in closed.jaxpr.eqns:
        outs = compat.bind_equation(eqn, [a.val if isinstance(a, compat.Literal) else env[a] for a in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    got = [env[v] for v in closed.jaxpr.outvars]
    for a, b in zip(got, jax.tree.leaves(fn(True, W))):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("takes_zeros", [True, False])
def test_call_pullback_gives_the_same_cotangents_on_either_kind_of_jax(
    monkeypatch: pytest.MonkeyPatch, takes_zeros: bool,
) -> None:
    if takes_zeros and not compat.pullback_takes_symbolic_zeros():
        pytest.skip("this JAX's pullbacks refuse symbolic zeros")
    monkeypatch.setattr(compat, "pullback_takes_symbolic_zeros", lambda: takes_zeros)
    x = jnp.arange(3.0)
    _, vjp_fn = jax.vjp(lambda a: (jnp.sin(a), {"h": 3.0 * a}), x)
    (got,) = compat.call_pullback(vjp_fn, (jnp.ones(3), {"h": compat.ad.Zero(jax.typeof(x))}))
    np.testing.assert_allclose(got, jnp.cos(x), rtol=1e-6)
    (both,) = compat.call_pullback(vjp_fn, (jnp.ones(3), {"h": jnp.ones(3)}))
    np.testing.assert_allclose(both, jnp.cos(x) + 3.0, rtol=1e-6)


def test_the_symbolic_zero_probe_agrees_with_a_real_pullback() -> None:
    _, vjp_fn = jax.vjp(lambda a: (a, a), 1.0)
    try:
        vjp_fn((1.0, compat.ad.Zero(jax.typeof(1.0))))
    except (TypeError, ValueError):
        accepted = False
    else:
        accepted = True
    assert compat.pullback_takes_symbolic_zeros() is accepted


# --- jaxpr inputs ---------------------------------------------------------------------------


def test_the_input_split_of_a_closed_jaxpr_comes_from_its_constant_values() -> None:
    closed = jax.make_jaxpr(lambda a, b: a * b + W.sum())(1.0, 2.0)
    jaxpr = closed.jaxpr
    assert compat.jaxpr_constvars(jaxpr) == list(jaxpr.constvars) and len(closed.consts) == 1
    assert compat.jaxpr_all_invars(jaxpr) == [*jaxpr.constvars, *jaxpr.invars]
    assert compat.closed_jaxpr_constvars(closed) == list(jaxpr.constvars)
    assert compat.jaxpr_constvars(types.SimpleNamespace(invars=[])) == []  # no stored split: none


# --- primitives and their parameters --------------------------------------------------------


def test_the_primitive_names_are_the_ones_jax_traces() -> None:
    g = jax.jit(lambda a: a + 1.0)
    names = {e.primitive.name for e in jax.make_jaxpr(
        lambda x: jax.checkpoint(jnp.cos)(g(_smooth(x)) + _clipped(x)))(1.0).jaxpr.eqns}
    jit_name, = names & compat.JIT_PRIMITIVES
    vjp_name, = names & compat.CUSTOM_VJP_PRIMITIVES
    assert {jit_name, vjp_name, "custom_jvp_call"} <= compat.CALL_PRIMITIVES
    assert len(names & compat.CALL_PRIMITIVES) == 4, names  # jit, custom_jvp, custom_vjp, checkpoint
    flow = {e.primitive.name for e in jax.make_jaxpr(lambda p, x: jax.lax.while_loop(
        lambda v: v < 3.0, lambda v: jax.lax.cond(p, lambda u: u + 1.0, lambda u: u + 2.0, v), x))(True, 0.0).jaxpr.eqns}
    flow |= {_scan_eqn().primitive.name}
    assert set(compat.CONTROL_FLOW_PRIMITIVES) == flow | {"cond"}


def test_is_jit_and_jit_body() -> None:
    g = jax.jit(lambda a: a * W)
    eqn = jax.make_jaxpr(lambda x: g(x))(jnp.ones(3)).jaxpr.eqns[0]
    assert compat.is_jit(eqn)
    body = compat.jit_body(eqn)
    assert isinstance(body, compat.ClosedJaxpr) and [e.primitive.name for e in body.jaxpr.eqns] == ["mul"]


def test_scan_params_read_the_counts_the_primitive_carries() -> None:
    eqn = _scan_eqn()
    p = compat.scan_params(eqn)
    assert (p.length, p.reverse, p.num_consts, p.num_carry) == (4, False, 1, 1)
    assert len(p.body.jaxpr.invars) == len(eqn.invars) == 3 and isinstance(p.body, compat.ClosedJaxpr)


def test_scan_params_read_the_counts_from_an_input_tree() -> None:
    """Releases that describe a scan's operands by a tree (``ft_in``: constants, carries, xs)."""
    eqn = _scan_eqn()

    class InputTree:
        def unpack(self) -> tuple[list[None], ...]:
            return [None], [None], [None]

    params = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry", "ft_in")}
    described = eqn.replace(params={**params, "ft_in": InputTree()})
    assert compat.scan_params(described)[3:] == (1, 1)
    with pytest.raises(NotImplementedError, match="cannot read the constant and carry counts of this JAX's `scan`"):
        compat.scan_params(eqn.replace(params=params))


def test_replace_scan_body_adds_stacked_outputs() -> None:
    eqn = _scan_eqn()
    body = compat.scan_params(eqn).body
    carry_in = body.jaxpr.invars[1]
    extra_body = body.jaxpr.replace(outvars=[*body.jaxpr.outvars, carry_in])
    stacked = compat.Var(compat.ShapedArray((4, 3), jnp.float32))
    new = compat.replace_scan_body(eqn, compat.ClosedJaxpr(extra_body, body.consts), [*eqn.outvars, stacked])
    assert compat.scan_params(new)[1:] == compat.scan_params(eqn)[1:]
    carry, ys, seen = compat.bind_equation(new, [W, jnp.ones(3), jnp.ones((4, 3))])
    np.testing.assert_allclose(seen, jax.lax.scan(lambda c, x: (c * W + x, c), jnp.ones(3), jnp.ones((4, 3)))[1])
    with pytest.raises(ValueError, match="Only extra ys may be added"):
        compat.replace_scan_body(eqn, body, eqn.outvars[:1])


def test_while_params() -> None:
    eqn = _eqn(lambda x: jax.lax.while_loop(lambda v: v.sum() < W.sum(), lambda v: v + W, x), jnp.zeros(3),
               name="while")
    p = compat.while_params(eqn)
    assert (p.cond_nconsts, p.body_nconsts) == (1, 1) and len(eqn.invars) == 3
    assert isinstance(p.cond, compat.ClosedJaxpr) and isinstance(p.body, compat.ClosedJaxpr)
    assert p.cond.jaxpr.outvars[0].aval.dtype == jnp.bool_ and len(p.body.jaxpr.outvars) == 1


def test_cond_branches() -> None:
    eqn = _eqn(lambda i, x: jax.lax.switch(i, [lambda v: v, lambda v: v * W, lambda v: v - 1.0], x), 1,
               jnp.ones(3), name="cond")
    branches = compat.cond_branches(eqn)
    assert len(branches) == 3 and all(len(b.jaxpr.invars) == len(eqn.invars) - 1 for b in branches)


@pytest.mark.parametrize("call", ["jit", "custom_jvp", "custom_vjp", "checkpoint"])
def test_call_body_is_applied_to_the_equations_operands(call: str) -> None:
    fn = {"jit": jax.jit(jnp.sin), "custom_jvp": _smooth, "custom_vjp": _clipped, "checkpoint": jax.checkpoint(jnp.sin)}[call]
    (eqn,) = jax.make_jaxpr(fn)(W).jaxpr.eqns
    assert eqn.primitive.name in compat.CALL_PRIMITIVES
    body = compat.call_body(eqn)
    jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, compat.ClosedJaxpr) else (body, [])
    assert len(jaxpr.invars) == len(eqn.invars)
    np.testing.assert_allclose(compat.eval_jaxpr(jaxpr, consts, W)[0], fn(W), rtol=1e-6)
    assert list(compat.subjaxprs(eqn)) == [jaxpr]


def test_map_closed_subjaxprs_rewrites_every_body() -> None:
    eqn = _eqn(lambda p, x: jax.lax.cond(p, lambda v: v + 1.0, lambda v: v * 2.0, x), True, 1.0, name="cond")
    assert compat.map_closed_subjaxprs(eqn, lambda body: body) is eqn
    swapped = compat.map_closed_subjaxprs(eqn, lambda body: compat.cond_branches(eqn)[0])
    assert all(b is compat.cond_branches(eqn)[0] for b in compat.cond_branches(swapped))


# --- the parameters of lax primitives -------------------------------------------------------

X = jnp.arange(24.0).reshape(2, 3, 4)


def test_dot_general_dims_rebuild_the_product() -> None:
    a, b = X, jnp.arange(40.0).reshape(2, 4, 5)
    dims = ((2,), (1,)), ((0,), (0,))
    got = compat.dot_general_dims(_eqn(lambda u, v: jax.lax.dot_general(u, v, dims), a, b, name="dot_general"))
    assert got == compat.DotDims((2,), (1,), (0,), (0,))
    np.testing.assert_allclose(jax.lax.dot_general(a, b, ((got.lhs_contracting, got.rhs_contracting),
                                                          (got.lhs_batch, got.rhs_batch))), a @ b)
    matmul = compat.dot_general_dims(_eqn(lambda h, w: h @ w, jnp.ones((2, 3)), jnp.ones((3, 4)), name="dot_general"))
    assert matmul == ((1,), (0,), (), ()) and all(isinstance(axes, tuple) for axes in matmul)


@pytest.mark.parametrize("strides", [(1, 2, 3), None])
def test_slice_params_cut_what_the_slice_cuts(strides: tuple[int, ...] | None) -> None:
    eqn = _eqn(lambda x: jax.lax.slice(x, (0, 1, 1), (2, 3, 4), strides), X, name="slice")
    cut = compat.slice_params(eqn)
    assert cut == compat.SliceParams((0, 1, 1), (2, 3, 4), strides or (1, 1, 1))
    np.testing.assert_array_equal(X[tuple(slice(*axis) for axis in zip(*cut))],
                                  jax.lax.slice(X, (0, 1, 1), (2, 3, 4), strides))


def test_concatenate_axis() -> None:
    eqn = _eqn(lambda x: jnp.concatenate([x, 2 * x], axis=1), X, name="concatenate")
    assert compat.concatenate_axis(eqn) == 1 and eqn.outvars[0].aval.shape == (2, 6, 4)


def test_rev_axes() -> None:
    eqn = _eqn(lambda x: jax.lax.rev(x, (0, 2)), X, name="rev")
    assert compat.rev_axes(eqn) == (0, 2)
    np.testing.assert_array_equal(jax.lax.rev(X, compat.rev_axes(eqn)), X[::-1, :, ::-1])


#: Per reduction that reads ``axes``: a function tracing it on ``X`` and the axes it reduces.
_REDUCTIONS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "reduce_sum": (lambda x: x.sum(axis=(0, 2)), (0, 2)),
    "reduce_max": (lambda x: x.max(axis=1), (1,)),
    "reduce_min": (lambda x: x.min(axis=(1, 2)), (1, 2)),
    "reduce_prod": (lambda x: x.prod(axis=0), (0,)),
    "reduce_and": (lambda x: jnp.all(x > 3.0, axis=2), (2,)),
    "reduce_or": (lambda x: jnp.any(x > 3.0, axis=(0, 1)), (0, 1)),
    "reduce_xor": (lambda x: jax.lax.reduce(x > 3.0, False, jax.lax.bitwise_xor, (0, 2)), (0, 2)),
    "argmax": (lambda x: jnp.argmax(x, axis=1), (1,)),
    "argmin": (lambda x: jnp.argmin(x, axis=2), (2,)),
}


def test_every_reduction_the_adapter_reads_is_traced_below() -> None:
    assert set(_REDUCTIONS) == compat._AXES_REDUCTIONS


@pytest.mark.parametrize("name", sorted(_REDUCTIONS))
def test_reduction_axes(name: str) -> None:
    fn, axes = _REDUCTIONS[name]
    assert compat.reduction_axes(_eqn(fn, X, name=name)) == axes


#: Per lax accessor: the primitive it reads and a function tracing one on a ``(2, 2)`` array.
_LAX_EQUATIONS: dict[str, tuple[Any, str, Any]] = {
    "dot_general_dims": (compat.dot_general_dims, "dot_general", lambda x: x @ x),
    "slice_params": (compat.slice_params, "slice", lambda x: jax.lax.slice(x, (1, 0), (2, 2))),
    "concatenate_axis": (compat.concatenate_axis, "concatenate", lambda x: jnp.concatenate([x, x])),
    "rev_axes": (compat.rev_axes, "rev", lambda x: jax.lax.rev(x, (0,))),
    "reduction_axes": (compat.reduction_axes, "reduce_sum", lambda x: x.sum(0)),
}


@pytest.mark.parametrize("reader", sorted(_LAX_EQUATIONS))
def test_a_lax_accessor_names_a_parameter_this_jax_does_not_carry(reader: str) -> None:
    accessor, name, fn = _LAX_EQUATIONS[reader]
    eqn = _eqn(fn, jnp.ones((2, 2)), name=name)
    with pytest.raises(NotImplementedError, match=rf"cannot read `\w+` of this JAX's `{name}` equation"):
        accessor(eqn.replace(params={}))


@pytest.mark.parametrize("reader", sorted(_LAX_EQUATIONS))
def test_a_lax_accessor_refuses_another_primitive(reader: str) -> None:
    eqn = _eqn(lambda x: jnp.sin(x), X, name="sin")
    with pytest.raises(ValueError, match=rf"{reader}: got a `sin` equation, .* call it only on"):
        _LAX_EQUATIONS[reader][0](eqn)


# --- the boundary ---------------------------------------------------------------------------

# What only the adapter may read: JAX's private and interpreter modules, the names JAX 0.8 and 0.9
# keep in jax.core, the parameters of JAX's own control-flow and call primitives, the bind
# parameters of a primitive, and the parameters of lax primitives. Those braintrace's own
# ``etp_conv`` shares with ``conv_general_dilated`` (strides, padding, ...) are read from its rule
# keywords, so for them only a read off an equation (``eqn.params[...]``) is refused.
_LAX_PARAMS = (
    "axes|dimension|dimensions|start_indices|limit_indices|permutation|new_sizes|broadcast_dimensions|shape"
    "|sharding|padding_config|slice_sizes|new_dtype|weak_type|window_strides|precision|preferred_element_type"
    "|index_dtype|mode|fill_value|indices_are_sorted|unique_indices|update_jaxpr|update_consts|axis"
)
_SHARED_CONV_PARAMS = (
    "strides|padding|lhs_dilation|rhs_dilation|dimension_numbers|feature_group_count|batch_group_count"
)
_INTERNAL_READS = (
    r"jax\._src", r"\bjax\.core\b", r"from jax\.extend", r"jax\.interpreters", r"jax\.custom_derivatives",
    r"get_bind_params", r"jaxprs_in_params",
    r"params\[[\"'](?:jaxpr|num_consts|num_carry|ft_in|ft_out|linear|branches|cond_jaxpr|body_jaxpr"
    r"|cond_nconsts|body_nconsts|call_jaxpr|fun_jaxpr|length|reverse)[\"']\]",
    rf"params(?:\[|\.get\()[\"'](?:{_LAX_PARAMS})[\"']",
    rf"eqn\.params(?:\[|\.get\()[\"'](?:{_SHARED_CONV_PARAMS})[\"']",
)


def test_only_the_adapter_reads_jax_internals() -> None:
    import pathlib
    import re

    import braintrace

    root = pathlib.Path(braintrace.__file__).parent
    pattern = re.compile("|".join(_INTERNAL_READS))
    found = [
        f"{path.relative_to(root.parent)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py")) if path.name != "_compatible_imports.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line.split("#", 1)[0]) and not line.lstrip().startswith((">>>", "..."))
    ]
    assert found == [], "read these through braintrace/_compatible_imports.py:\n" + "\n".join(found)

"""``braintrace.einsum`` / ``etp_einsum`` beyond the generic rule oracles.

Covers the public signature, the equation parser (every rule, in order), the letter
classification, operand checks, units, vmap, the equivalence of ``'bk,kn->bn'`` with
``braintrace.matmul``, the per-position trace layout for shared letters, and end-to-end
D-RTRL == BPTT with a non-zero hidden recurrence.
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace._op import _registries as reg
from braintrace._op.dense import _matmul_xy_to_dw, _mm_dt_to_t, etp_mm_p
from braintrace._op.dense import matmul as dense_matmul
from braintrace._op.einsum import EinsumSpec, einsum, etp_einsum_p, parse_etp_einsum
from tests.op.cases.einsum import mix_last
from tests.op.opcase import close, rand

DT_TO_T = reg.ETP_RULES_DT_TO_T[etp_einsum_p]
XY_TO_DW = reg.ETP_RULES_XY_TO_DW[etp_einsum_p]
INSTANT = reg.ETP_RULES_INSTANT_DRTRL[etp_einsum_p]
SOLVE = reg.ETP_RULES_SOLVE_DRTRL[etp_einsum_p]


def _eqn(fn: Any, *args: Any) -> Any:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive in reg.ETP_PRIMITIVES]
    return eqn


def _init(table: dict, eqn: Any, num_state: int, **kwargs: Any) -> Any:
    """Call the ``table`` init rule of ``eqn``'s primitive with its jaxpr variables."""
    rule = table[eqn.primitive]
    return rule(eqn.invars[0], eqn.outvars[0], {"weight": eqn.invars[1]}, num_state, **kwargs)


# --- signature and registration ----------------------------------------------------------


def test_signature_has_no_bias_and_a_keyword_only_hook() -> None:
    sig = inspect.signature(einsum)
    kinds = {name: p.kind for name, p in sig.parameters.items()}
    assert list(kinds) == ["equation", "x", "weight", "weight_fn"]
    assert kinds["weight_fn"] is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["weight_fn"].default is None
    with pytest.raises(TypeError):
        einsum("bk,kn->bn", jnp.ones((2, 3)), jnp.ones((3, 4)), None)  # type: ignore[call-arg]


def test_registration_flags() -> None:
    assert etp_einsum_p.name == "etp_einsum"
    assert etp_einsum_p in reg.BATCHED_PRIMITIVES
    assert etp_einsum_p not in reg.GRADIENT_ENABLED_PRIMITIVES
    assert etp_einsum_p not in reg.BATCHED_COUNTERPARTS.values()
    assert reg.get_fast_path_rules(etp_einsum_p) is None
    assert reg.get_x_invar_index(etp_einsum_p) == 0
    assert reg.get_trainable_invars(etp_einsum_p, {"equation": "bk,kn->bn"}) == {"weight": 1}


def test_bound_params_are_the_normalised_equation_and_the_hook_object() -> None:
    x, w = jnp.ones((2, 5, 3)), jnp.ones((3, 4))
    eqn = _eqn(lambda a, b: einsum(" b t k , k n -> b t n ", a, b, weight_fn=mix_last), x, w)
    assert eqn.primitive is etp_einsum_p
    assert dict(eqn.params) == {"equation": "btk,kn->btn", "weight_fn": mix_last}
    assert [v.aval.shape for v in eqn.invars] == [(2, 5, 3), (3, 4)]


def test_jit_keeps_one_primitive_and_matches_jnp_einsum() -> None:
    x, w = rand(1, (2, 5, 3)), rand(2, (3, 4))
    jaxpr = jax.make_jaxpr(lambda a, b: einsum("btk,kn->btn", a, b))(x, w).jaxpr
    prims = [e.primitive.name for e in jaxpr.eqns]
    assert prims.count("etp_einsum") == 1 and "dot_general" not in prims
    close(jax.jit(lambda a, b: einsum("btk,kn->btn", a, b))(x, w), jnp.einsum("btk,kn->btn", x, w))


def test_integer_input_differentiates_with_respect_to_the_weight() -> None:
    x = jnp.arange(6).reshape(2, 3)
    w = rand(2, (3, 4))
    got = jax.grad(lambda v: einsum("bk,kn->bn", x, v).sum())(w)
    close(got, jax.grad(lambda v: (x.astype(jnp.float32) @ v).sum())(w))


# --- parsing: one test per rule, each equation also breaking the later rules -------------


def _parse_error(equation: str, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        parse_etp_einsum(equation)
    assert repr(equation) in str(info.value)  # the message names the equation as written
    return str(info.value)


def test_parse_rule_1_missing_arrow() -> None:
    _parse_error("bK,kn", "missing '->'")
    _parse_error("bk,kn=>bn", "missing '->'")


def test_parse_rule_2_exactly_two_operands() -> None:
    _parse_error("bK->bK", r"names 1 operand\(s\)")
    _parse_error("bk,kn,nm->bm", r"names 3 operand\(s\)")


@pytest.mark.parametrize(
    "equation, role",
    [
        (",kn->bn", "x"),
        ("...k,kn->...n", "x"),
        ("b1,kn->bn", "x"),
        ("bK,kn->bn", "x"),
        ("bkk,kN->bn", "weight"),  # letters before repeats, even of an earlier spec
        ("bk,->bn", "weight"),
        ("bk,kn->", "output"),
        ("bk,kn->b->n", "output"),
        ("bé,kn->bn", "x"),
    ],
)
def test_parse_rule_3_specs_are_nonempty_lowercase_letters(equation: str, role: str) -> None:
    _parse_error(equation, f"the {role} spec .* lowercase letters")


@pytest.mark.parametrize(
    "equation, role, letter",
    [("bkk,kn->nb", "x", "k"), ("bk,knn->nb", "weight", "n"), ("bk,kn->bnn", "output", "n")],
)
def test_parse_rule_4_no_repeated_letter_within_a_spec(
    equation: str, role: str, letter: str
) -> None:
    _parse_error(equation, f"letter '{letter}' is repeated in the {role} spec")


def test_parse_rule_5_batched_form_required() -> None:
    msg = _parse_error("bk,bn->nb", "batched form required")
    assert "'b'" in msg and "'n'" in msg


def test_parse_rule_6_batch_letter_not_in_weight() -> None:
    _parse_error("bk,bkn->bnz", "batch letter 'b' appears in the weight spec 'bkn'")


def test_parse_rule_7_output_letters_come_from_an_operand() -> None:
    _parse_error("bk,knm->bnz", "output letter 'z' appears in neither x")


def test_parse_rule_8_weight_letters_reach_x_or_the_output() -> None:
    _parse_error("bk,knm->bn", "weight letter 'm' appears in neither x")


def test_parse_rule_9_shared_letters_are_implied_by_rule_7() -> None:
    # Rule 9 (a shared output letter missing from x) cannot fire after rule 7: a shared
    # letter is an output letter outside the weight, so rule 7 already put it in x.
    rng = random.Random(0)
    letters = "bcdef"
    parsed = 0
    for _ in range(3000):
        specs = ["".join(rng.sample(letters, rng.randint(1, 4))) for _ in range(3)]
        try:
            spec = parse_etp_einsum("{},{}->{}".format(*specs))
        except ValueError:
            continue
        parsed += 1
        assert set(spec.shared) <= set(spec.x_spec)
        assert sorted(spec.diagonal + spec.contracted) == sorted(spec.w_spec)
        assert set(spec.y_spec) == set(spec.batch + spec.diagonal + spec.shared)
    assert parsed > 50


def test_parse_rejects_a_non_string_equation() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        parse_etp_einsum(["bk", "kn"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "equation, want",
    [
        ("bk,kn->bn", ("bk", "kn", "bn", "b", "n", "k", "")),
        ("bhk,hkn->bhn", ("bhk", "hkn", "bhn", "b", "hn", "k", "")),
        ("btk,kn->btn", ("btk", "kn", "btn", "b", "n", "k", "t")),
        (" b t s k , k n -> b s t n ", ("btsk", "kn", "bstn", "b", "n", "k", "st")),
        ("bcthk,khn->bnht", ("bcthk", "khn", "bnht", "b", "hn", "k", "t")),
        ("btk,kn->bn", ("btk", "kn", "bn", "b", "n", "k", "")),  # t only in x: summed
        ("bi,o->bio", ("bi", "o", "bio", "b", "o", "", "i")),  # outer product
    ],
)
def test_classification(equation: str, want: tuple[str, ...]) -> None:
    spec = parse_etp_einsum(equation)
    assert isinstance(spec, EinsumSpec)
    assert EinsumSpec._fields == (
        "x_spec", "w_spec", "y_spec", "batch", "diagonal", "contracted", "shared",
    )
    assert tuple(spec) == want


# --- operand checks and units ------------------------------------------------------------


def test_einsum_parses_before_looking_at_operands() -> None:
    with pytest.raises(ValueError, match="missing '->'"):
        einsum("bk,kn", [1.0], [2.0])


@pytest.mark.parametrize(
    "x_shape, w_shape, role",
    [((2, 5, 3), (3, 4), "x"), ((2, 3), (4, 3, 4), "weight"), ((2,), (3, 4), "x")],
)
def test_operand_rank_must_match_its_spec(x_shape: tuple, w_shape: tuple, role: str) -> None:
    with pytest.raises(ValueError, match=f"{role} has shape .* 'bk,kn->bn'"):
        einsum("bk,kn->bn", jnp.ones(x_shape), jnp.ones(w_shape))


def test_letter_sizes_must_agree() -> None:
    with pytest.raises(ValueError, match="letter 'k' .* size 3 in x .* but 5 in weight"):
        einsum("bk,kn->bn", jnp.ones((2, 3)), jnp.ones((5, 4)))


def test_operand_types_and_hooks_are_checked() -> None:
    with pytest.raises(TypeError, match="x must be a JAX/NumPy array"):
        einsum("bk,kn->bn", [[1.0, 2.0]], jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="weight_fn must be a callable"):
        bad_hook: Any = 3
        einsum("bk,kn->bn", jnp.ones((1, 2)), jnp.ones((2, 3)), weight_fn=bad_hook)
    with pytest.raises(ValueError, match="weight_fn must preserve the weight's shape"):
        einsum("bk,kn->bn", jnp.ones((1, 2)), jnp.ones((2, 3)), weight_fn=lambda w: w.T)


def test_units_multiply_and_unitless_inputs_give_plain_arrays() -> None:
    x, w = rand(1, (2, 3, 4)), rand(2, (4, 5))
    want = jnp.einsum("btk,kn->btn", x, w)
    y = einsum("btk,kn->btn", x * u.mV, w * u.siemens)
    assert isinstance(y, u.Quantity)
    assert y.unit == u.mV * u.siemens
    close(y.to_decimal(u.mV * u.siemens), want)
    y_w = einsum("btk,kn->btn", x, w * u.mS)
    close(y_w.to_decimal(u.mS), want)
    plain = einsum("btk,kn->btn", x, w)
    assert isinstance(plain, jax.Array) and not isinstance(plain, u.Quantity)
    close(plain, want)


def test_vmap_decomposes_with_a_warning() -> None:
    xs, w = rand(1, (3, 2, 5, 4)), rand(2, (4, 6))
    with pytest.warns(UserWarning, match="decomposed"):
        got = jax.vmap(lambda x: einsum("btk,kn->btn", x, w))(xs)
    close(got, jnp.einsum("vbtk,kn->vbtn", xs, w))


# --- dense equivalence -------------------------------------------------------------------


@pytest.mark.parametrize("weight_fn", [None, jnp.tanh], ids=["plain", "tanh"])
def test_dense_equation_equals_matmul(weight_fn: Any) -> None:
    x, w = rand(1, (2, 3)), rand(2, (3, 4))
    hd, g = rand(3, (2, 4)), rand(4, (2, 4))
    e_params = dict(equation="bk,kn->bn", weight_fn=weight_fn)
    m_params = dict(has_bias=False, weight_fn=weight_fn, bias_fn=None)

    close(einsum("bk,kn->bn", x, w, weight_fn=weight_fn), dense_matmul(x, w, weight_fn=weight_fn))
    grads = [
        jax.grad(lambda v: jnp.sum(g * f(x, v)))(w)
        for f in (
            lambda a, v: einsum("bk,kn->bn", a, v, weight_fn=weight_fn),
            lambda a, v: dense_matmul(a, v, weight_fn=weight_fn),
        )
    ]
    close(*grads)

    ws = {"weight": w}
    for a, d in ((x, hd), (x[0], hd[0])):  # batched and per-sample pullbacks
        want = _matmul_xy_to_dw(a, d, ws, **m_params)["weight"]
        close(XY_TO_DW(a, d, ws, **e_params)["weight"], want)
    trace = {"weight": rand(5, (2, 3, 4))}
    close(DT_TO_T(hd, trace, **e_params)["weight"], _mm_dt_to_t(hd, trace)["weight"])

    e_eqn = _eqn(lambda a, v: einsum("bk,kn->bn", a, v, weight_fn=weight_fn), x, w)
    m_eqn = _eqn(lambda a, v: dense_matmul(a, v, weight_fn=weight_fn), x, w)
    assert m_eqn.primitive is etp_mm_p
    for extra in ({}, {"eqn_params": e_eqn.params}):
        e_init = _init(reg.ETP_RULES_INIT_DRTRL, e_eqn, 2, **extra)
        m_init = _init(reg.ETP_RULES_INIT_DRTRL, m_eqn, 2)
        assert e_init["weight"].shape == m_init["weight"].shape == (2, 3, 4, 2)
        assert e_init["weight"].dtype == m_init["weight"].dtype

    # The D-RTRL learner built from either rule set gives the same gradient.
    xs, leak, cs = rand(6, (4, 2, 3)), jnp.full((2, 4), 0.7), rand(7, (4, 2, 4))
    close(
        _drtrl_grad("bk,kn->bn", xs, w, leak, cs, weight_fn),
        _dense_drtrl_grad(xs, w, leak, cs, weight_fn),
    )


def test_dense_equation_rule_outputs_equal_matmul_without_a_hook() -> None:
    # Without a transform the einsum trace is the dense trace entry by entry.
    x, w, hd, g = rand(1, (2, 3)), rand(2, (3, 4)), rand(3, (2, 4)), rand(4, (2, 4))
    params = dict(equation="bk,kn->bn", weight_fn=None)
    ws = {"weight": w}
    fast = reg.get_fast_path_rules(etp_mm_p)
    assert fast is not None
    inst = jax.vmap(lambda a, d: INSTANT(a, d, ws, **params))(x, hd)["weight"]
    close(inst, fast.instant(x, hd[..., None], False)["weight"][..., 0])
    trace = {"weight": rand(5, (2, 3, 4))}
    solved = jax.vmap(lambda s, t: SOLVE(s, t, ws, **params))(g, trace)["weight"]
    close(solved, _mm_dt_to_t(g, trace)["weight"])


# --- overrides equal the plain path without shared letters -------------------------------


@pytest.mark.parametrize("equation", ["bk,kn->bn", "bhk,hkn->bhn"])
def test_overrides_equal_the_plain_path_without_shared_letters(equation: str) -> None:
    spec = parse_etp_einsum(equation)
    sizes = {"b": 2, "h": 2, "k": 3, "n": 4}
    x = rand(1, tuple(sizes[c] for c in spec.x_spec))
    w = rand(2, tuple(sizes[c] for c in spec.w_spec))
    y_shape = tuple(sizes[c] for c in spec.y_spec)
    hd, g = rand(3, y_shape), rand(4, y_shape)
    ws = {"weight": w}
    for weight_fn in (None, jnp.tanh):
        params = dict(equation=equation, weight_fn=weight_fn)
        inst = jax.vmap(lambda a, d: INSTANT(a, d, ws, **params))(x, hd)["weight"]
        plain_inst = jax.vmap(lambda a, d: XY_TO_DW(a, d, ws, **params))(x, hd)["weight"]
        solved = jax.vmap(lambda s, t: SOLVE(s, t, ws, **params))(g, {"weight": inst})["weight"]
        plain = jax.vmap(lambda s, t: DT_TO_T(s, t, **params))(g, {"weight": plain_inst})["weight"]
        close(solved, plain)  # the gradient contribution agrees in every case
        if weight_fn is None:  # and without a transform the rule outputs are identical
            close(inst, plain_inst)
            trace = {"weight": rand(5, plain_inst.shape)}
            close(
                jax.vmap(lambda s, t: SOLVE(s, t, ws, **params))(g, trace)["weight"],
                jax.vmap(lambda s, t: DT_TO_T(s, t, **params))(g, trace)["weight"],
            )


# --- trace layout ------------------------------------------------------------------------


def test_shared_axis_trace_keeps_one_entry_per_position() -> None:
    x, w, hd = rand(1, (2, 3, 4)), rand(2, (4, 5)), rand(3, (2, 3, 5))
    eqn = _eqn(lambda a, v: einsum("btk,kn->btn", a, v), x, w)
    init = _init(reg.ETP_RULES_INIT_DRTRL, eqn, 2, eqn_params=eqn.params)
    assert init["weight"].shape == (2, 3, 4, 5, 2)
    # ε[b, t, k, n] = ∂(hd·y)[b, t, n] / ∂W[k, n] = hd[b, t, n] · x[b, t, k]
    inst = jax.vmap(lambda a, d: INSTANT(a, d, {"weight": w}, **eqn.params))(x, hd)["weight"]
    close(inst, hd[:, :, None, :] * x[:, :, :, None])
    prop = DT_TO_T(hd, {"weight": inst}, **eqn.params)["weight"]
    close(prop, hd[:, :, None, :] ** 2 * x[:, :, :, None])


@pytest.mark.parametrize("weight_fn", [None, mix_last], ids=["plain", "coupled"])
def test_rules_accept_batched_and_per_sample_operands_alike(weight_fn: Any) -> None:
    params = dict(equation="bcthk,khn->bnht", weight_fn=weight_fn)
    x, w = rand(1, (2, 2, 3, 2, 3)), rand(2, (3, 2, 4))
    hd, g = rand(3, (2, 4, 2, 3)), rand(4, (2, 4, 2, 3))
    ws = {"weight": w}
    per_sample = jax.vmap(lambda a, d: INSTANT(a, d, ws, **params))(x, hd)["weight"]
    assert per_sample.shape == (2, 3, 3, 2, 4)  # (B, t, k, h, n)
    close(INSTANT(x, hd, ws, **params)["weight"], per_sample)
    trace = {"weight": per_sample}
    close(
        SOLVE(g, trace, ws, **params)["weight"],
        jax.vmap(lambda s, t: SOLVE(s, t, ws, **params))(g, trace)["weight"],
    )
    close(
        DT_TO_T(hd, trace, **params)["weight"],
        jax.vmap(lambda d, t: DT_TO_T(d, t, **params))(hd, trace)["weight"],
    )
    close(
        XY_TO_DW(x, hd, ws, **params)["weight"],
        jax.vmap(lambda a, d: XY_TO_DW(a, d, ws, **params))(x, hd)["weight"].sum(0),
    )


def test_init_dtype_promotes_every_operand() -> None:
    x, w = jnp.ones((2, 3, 4), jnp.float16), jnp.ones((4, 5), jnp.float32)
    eqn = _eqn(lambda a, v: einsum("btk,kn->btn", a, v), x, w)
    init = _init(reg.ETP_RULES_INIT_DRTRL, eqn, 1, eqn_params=eqn.params)
    assert init["weight"].dtype == jnp.float32
    pp = _init(reg.ETP_RULES_INIT_PP, eqn, 3)
    assert pp.shape == (2, 3, 5, 3) and pp.dtype == eqn.outvars[0].aval.dtype


def test_a_shared_free_trace_for_a_shared_equation_is_rejected() -> None:
    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    eqn = _eqn(lambda a, v: einsum("btk,kn->btn", a, v), x, w)
    legacy = _init(reg.ETP_RULES_INIT_DRTRL, eqn, 1)
    assert legacy["weight"].shape == (2, 4, 5, 1)  # the four-argument call knows no equation
    trace = {"weight": legacy["weight"][..., 0]}
    with pytest.raises(ValueError, match="eqn_params"):
        DT_TO_T(jnp.ones((2, 3, 5)), trace, **eqn.params)
    with pytest.raises(ValueError, match="eqn_params"):
        SOLVE(jnp.ones((3, 5)), {"weight": trace["weight"][0]}, {"weight": w}, **eqn.params)


# --- end to end: D-RTRL from the rules equals BPTT ---------------------------------------


def _drtrl_grad(
    equation: str, xs: Any, w: Any, leak: Any, cs: Any, weight_fn: Any = None
) -> Any:
    """``h_t = leak ⊙ h_{t-1} + einsum(x_t, W)``, ``L = Σ_t <c_t, h_t>``, learnt online."""
    eqn = _eqn(lambda a, v: einsum(equation, a, v, weight_fn=weight_fn), xs[0], w)
    params = dict(eqn.params)
    init = _init(reg.ETP_RULES_INIT_DRTRL, eqn, 1, eqn_params=params)

    @jax.jit
    def run(xs: Any, w: Any, leak: Any, cs: Any) -> Any:
        ws = {"weight": w}
        hd = jnp.broadcast_to(leak, cs.shape[1:])  # the hidden Jacobian slice, shaped like y

        def step(carry: Any, inputs: Any) -> Any:
            eps, grad = carry
            x_t, c_t = inputs
            df = jnp.ones_like(c_t)  # ∂h/∂y of the tail
            inst = jax.vmap(lambda a, d: INSTANT(a, d, ws, **params))(x_t, df)["weight"]
            eps = {"weight": DT_TO_T(hd, eps, **params)["weight"] + inst}
            solved = jax.vmap(lambda g, e: SOLVE(g, e, ws, **params))(c_t, eps)["weight"]
            return (eps, grad + solved.sum(0)), None

        eps0 = {"weight": init["weight"][..., 0]}  # S = 1: the rules see S-free slices
        (_, grad), _ = jax.lax.scan(step, (eps0, jnp.zeros_like(w)), (xs, cs))
        return grad

    return run(xs, w, leak, cs)


def _dense_drtrl_grad(xs: Any, w: Any, leak: Any, cs: Any, weight_fn: Any) -> Any:
    """The same learner from the dense rules (plain path: ``xy_to_dw`` per sample, ``dt_to_t``)."""
    params = dict(has_bias=False, weight_fn=weight_fn, bias_fn=None)

    @jax.jit
    def run(xs: Any, w: Any, leak: Any, cs: Any) -> Any:
        ws = {"weight": w}
        eps = {"weight": jnp.zeros((xs.shape[1], *w.shape))}
        grad = jnp.zeros_like(w)
        for x_t, c_t in zip(xs, cs):
            df = jnp.ones_like(c_t)
            inst = jax.vmap(lambda a, d: _matmul_xy_to_dw(a, d, ws, **params))(x_t, df)
            eps = {"weight": _mm_dt_to_t(leak, eps)["weight"] + inst["weight"]}
            grad = grad + jax.vmap(lambda s, t: _mm_dt_to_t(s, t))(c_t, eps)["weight"].sum(0)
        return grad

    return run(xs, w, leak, cs)


def _bptt_grad(equation: str, xs: Any, w: Any, leak: Any, cs: Any, weight_fn: Any = None) -> Any:
    def loss(v: Any, xs: Any, leak: Any, cs: Any) -> Any:
        def step(h: Any, inputs: Any) -> Any:
            x_t, c_t = inputs
            h = leak * h + einsum(equation, x_t, v, weight_fn=weight_fn)
            return h, jnp.sum(c_t * h)

        _, losses = jax.lax.scan(step, jnp.zeros_like(cs[0]), (xs, cs))
        return losses.sum()

    return jax.jit(jax.grad(loss))(w, xs, leak, cs)


def _exact(got: Any, want: Any) -> None:
    """Element-wise agreement to float32 precision: 1e-5 relative to the gradient scale."""
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)


def _problem(equation: str, sizes: dict[str, int], steps: int = 4) -> tuple[Any, Any, Any]:
    spec = parse_etp_einsum(equation)
    xs = rand(31, (steps, *(sizes[c] for c in spec.x_spec)))
    w = 0.5 * rand(32, tuple(sizes[c] for c in spec.w_spec))
    cs = rand(33, (steps, *(sizes[c] for c in spec.y_spec)))
    return xs, w, cs


SHARED = "btk,kn->btn"
SHARED_SIZES = {"b": 2, "t": 2, "k": 3, "n": 4}


def test_drtrl_equals_bptt_on_a_shared_axis_equation_with_a_leak() -> None:
    xs, w, cs = _problem(SHARED, SHARED_SIZES)
    leak = 0.5  # h = 0.5 h + einsum('btk,kn->btn', x, W), two positions, four steps
    _exact(_drtrl_grad(SHARED, xs, w, leak, cs), _bptt_grad(SHARED, xs, w, leak, cs))
    leak_map = 0.3 + 0.6 * jax.random.uniform(jax.random.PRNGKey(5), cs.shape[1:])
    _exact(_drtrl_grad(SHARED, xs, w, leak_map, cs), _bptt_grad(SHARED, xs, w, leak_map, cs))


def _upstream_drtrl_grad(xs: Any, w: Any, leak: Any, cs: Any) -> Any:
    """Upstream's shared-axis scheme: a ``(B, K, N)`` trace, ``hd`` summed over ``t``."""
    params = dict(equation=SHARED, weight_fn=None)

    @jax.jit
    def run(xs: Any, w: Any, cs: Any) -> Any:
        ws = {"weight": w}
        eps = jnp.zeros((xs.shape[1], *w.shape))
        grad = jnp.zeros_like(w)
        leak_sum = jnp.broadcast_to(leak, cs.shape[1:]).sum(1)
        for x_t, c_t in zip(xs, cs):
            inst = jax.vmap(lambda a, d: XY_TO_DW(a, d, ws, **params))(x_t, jnp.ones_like(c_t))
            eps = jnp.einsum("bn,bkn->bkn", leak_sum, eps) + inst["weight"]
            grad = grad + jnp.einsum("bn,bkn->kn", c_t.sum(1), eps)
        return grad

    return run(xs, w, cs)


def test_upstream_scheme_is_measurably_wrong_on_the_same_problem() -> None:
    # The oracle above discriminates: upstream's summed recurrence factor misses BPTT by a
    # large fraction of the gradient scale, while one position (no sharing) is exact.
    xs, w, cs = _problem(SHARED, SHARED_SIZES)
    want = _bptt_grad(SHARED, xs, w, 0.5, cs)
    err = jnp.max(jnp.abs(_upstream_drtrl_grad(xs, w, 0.5, cs) - want)) / jnp.max(jnp.abs(want))
    assert float(err) > 0.2
    xs1, cs1 = xs[:, :, :1], cs[:, :, :1]
    _exact(_upstream_drtrl_grad(xs1, w, 0.5, cs1), _bptt_grad(SHARED, xs1, w, 0.5, cs1))


@pytest.mark.parametrize(
    "equation, weight_fn",
    [
        ("bhk,hkn->bhn", None),
        ("bhk,hkn->bhn", jnp.tanh),
        ("bcthk,khn->bnht", None),
        ("btk,kn->btn", jnp.tanh),
        # A transform coupling entries stays exact: the trace lives in the space of f_W(W).
        ("bcthk,khn->bnht", lambda v: v / jnp.linalg.norm(v)),
    ],
    ids=["per-head", "per-head-tanh", "mixed", "shared-tanh", "mixed-normalised"],
)
def test_drtrl_equals_bptt_with_a_leak(equation: str, weight_fn: Any) -> None:
    sizes = {"b": 2, "c": 2, "t": 2, "h": 2, "k": 3, "n": 4}
    xs, w, cs = _problem(equation, sizes)
    leak = 0.3 + 0.6 * jax.random.uniform(jax.random.PRNGKey(6), cs.shape[1:])
    _exact(
        _drtrl_grad(equation, xs, w, leak, cs, weight_fn),
        _bptt_grad(equation, xs, w, leak, cs, weight_fn),
    )

"""``sparse_matmul``: what the generic rule oracles do not cover.

The public signature, structure validation, dispatch by rank, operand errors, units, hooks
against a dense first-principles reference, the column indexing of ``dt_to_t``, ``vmap``
promotion ``etp_sp_mv -> etp_sp_mm``, the kernel choice on an install without numba, and
D-RTRL built from the rules alone equalling BPTT.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from typing import Any

import brainevent
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from braintrace._errors import OperandShapeError
from braintrace._op import _registries as reg
from braintrace._op import sparse as sp
from braintrace._op.sparse import _HashableSparseMat, etp_sp_mm_p, etp_sp_mv_p, sparse_matmul
from tests.op.cases.sparse import CSC, CSR, DENSE, MASK, I, O
from tests.op.opcase import close, rand

B = 3
#: ``(row(p), col(p))`` of CSR entry ``p``: CSR stores its entries in row-major order.
ROWS, COLS = np.nonzero(MASK)
P = ROWS.size


def _dense_w(data: jax.Array) -> jax.Array:
    """The ``(in, out)`` dense weight holding ``data[p]`` at ``(row(p), col(p))``."""
    return jnp.zeros((I, O), data.dtype).at[ROWS, COLS].set(data)


def _sp_eqns(fn: Any, *args: Any) -> list[Any]:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e for e in jaxpr.eqns if e.primitive in reg.ETP_PRIMITIVES]


# --- signature, structure, dispatch -----------------------------------------------------


def test_signature_is_exact() -> None:
    params = inspect.signature(sparse_matmul).parameters
    assert list(params) == ["x", "weight", "sparse_mat", "bias", "weight_fn", "bias_fn"]
    kinds = [p.kind for p in params.values()]
    assert kinds[:2] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2
    assert kinds[2:] == [inspect.Parameter.KEYWORD_ONLY] * 4
    assert params["sparse_mat"].default is inspect.Parameter.empty
    assert all(params[k].default is None for k in ("bias", "weight_fn", "bias_fn"))
    with pytest.raises(TypeError):
        sparse_matmul(jnp.ones(I), CSR.data, CSR)  # type: ignore[misc]


class _DuckSparse:
    """Everything the protocol names, but not a brainevent structure."""

    shape = (I, O)
    data = CSR.data

    def with_data(self, data: Any) -> Any:
        return CSR.with_data(data)

    def yw_to_w(self, y: Any, w: Any) -> Any:
        return w

    def yw_to_w_transposed(self, y: Any, w: Any) -> Any:
        return w

    dt2t_transposed = yw_to_w_transposed


@pytest.mark.parametrize(
    "structure, type_name",
    [
        (jnp.asarray(DENSE), "ArrayImpl"),
        (DENSE, "numpy.ndarray"),
        (_DuckSparse(), "_DuckSparse"),
        (u.sparse.CSR((CSR.data, CSR.indices, CSR.indptr), shape=(I, O)), "saiunit.sparse"),
    ],
    ids=["jax-array", "numpy-array", "duck-typed", "brainunit-csr"],
)
def test_only_brainevent_structures_are_accepted(structure: Any, type_name: str) -> None:
    with pytest.raises(TypeError, match="brainevent.DataRepresentation") as err:
        sparse_matmul(jnp.ones(I), CSR.data, sparse_mat=structure)
    assert type_name in str(err.value)
    assert "with_data" in str(err.value)


def test_rank_selects_the_primitive_and_binds_the_documented_params() -> None:
    w, b = rand(1, (P,)), rand(2, (O,))
    (eqn,) = _sp_eqns(lambda x: sparse_matmul(x, w, sparse_mat=CSR), jnp.ones((B, I)))
    assert eqn.primitive is etp_sp_mm_p
    assert set(eqn.params) == {"sparse_mat", "has_bias", "weight_fn", "bias_fn"}
    assert isinstance(eqn.params["sparse_mat"], _HashableSparseMat)
    assert eqn.params["sparse_mat"].mat is CSR  # matching dtype and no unit: the user's object
    assert eqn.params["has_bias"] is False and len(eqn.invars) == 2
    (eqn,) = _sp_eqns(lambda x: sparse_matmul(x, w, sparse_mat=CSR, bias=b), jnp.ones(I))
    assert eqn.primitive is etp_sp_mv_p
    assert eqn.params["has_bias"] is True and len(eqn.invars) == 3
    assert reg.get_trainable_invars(etp_sp_mv_p, eqn.params) == {"weight": 1, "bias": 2}
    assert reg.get_x_invar_index(etp_sp_mm_p) == 0
    assert reg.get_batched_counterpart(etp_sp_mv_p) is etp_sp_mm_p
    assert reg.get_fast_path_rules(etp_sp_mm_p) is None
    assert reg.get_fast_path_rules(etp_sp_mv_p) is None


def test_the_structure_holder_hashes_by_identity_and_is_fresh_per_call() -> None:
    h1, h2 = _HashableSparseMat(CSR), _HashableSparseMat(CSR)
    assert h1 != h2 and h1 == h1 and hash(h1) != hash(h2)
    assert h1.__slots__ == ("mat", "coordinates")
    with pytest.raises(TypeError):
        hash(CSR)  # why the holder exists
    w = rand(1, (P,))
    jaxpr = jax.make_jaxpr(
        lambda x: sparse_matmul(x, w, sparse_mat=CSR) + sparse_matmul(x, w, sparse_mat=CSR)
    )(jnp.ones(I)).jaxpr
    holders = [e.params["sparse_mat"] for e in jaxpr.eqns if e.primitive is etp_sp_mv_p]
    assert len(holders) == 2 and holders[0] is not holders[1]


# --- operand errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(x=jnp.ones(())), ValueError, "x must have rank 1 or 2"),
        (dict(x=jnp.ones((2, B, I))), ValueError, "x must have rank 1 or 2"),
        (dict(x=jnp.ones(I + 1)), OperandShapeError, "input size 4"),
        (dict(weight=jnp.ones(P + 1)), OperandShapeError, "one value per stored entry"),
        (dict(weight=jnp.ones((I, O))), OperandShapeError, "one value per stored entry"),
        (dict(weight=jnp.ones(P, jnp.int32)), TypeError, "floating-point"),
        (dict(bias=jnp.ones(O + 1)), OperandShapeError, "bias of shape"),
        (dict(weight_fn=3.0), TypeError, "weight_fn must be a callable"),
        (dict(bias=jnp.ones(O), bias_fn="tanh"), TypeError, "bias_fn must be a callable"),
        (dict(x=[1.0, 2.0, 3.0, 4.0]), AttributeError, "x must be a JAX/NumPy array"),
    ],
    ids=[
        "x-rank0", "x-rank3", "x-size", "weight-length", "weight-rank", "weight-int",
        "bias-shape", "weight_fn", "bias_fn", "x-list",
    ],
)
def test_bad_operands_fail_at_the_call_with_a_clear_message(
    kwargs: dict[str, Any], exc: type, match: str
) -> None:
    args: dict[str, Any] = dict(x=jnp.ones(I), weight=CSR.data, sparse_mat=CSR)
    args.update(kwargs)
    with pytest.raises(exc, match=match) as err:
        sparse_matmul(**args)
    assert "braintrace.sparse_matmul" in str(err.value)


def test_procedural_connectivity_is_rejected() -> None:
    """JITC matrices are DataRepresentations but hold no per-connection values to train."""
    jitc = brainevent.JITCScalarR((1.5, 0.5, 42), shape=(I, O))
    with pytest.raises(TypeError, match="procedurally generated .*tocsr") as err:
        sparse_matmul(jnp.ones(I), jnp.asarray(1.5), sparse_mat=jitc)
    assert not isinstance(err.value, ValueError)


# --- units, hooks, first principles -------------------------------------------------------


def test_result_carries_the_product_unit_and_unitless_inputs_give_plain_arrays() -> None:
    x, w, b = rand(1, (B, I)), rand(2, (P,)), rand(3, (O,))
    y = sparse_matmul(x * u.mV, w * u.mS, sparse_mat=CSR, bias=b * u.uA)
    assert isinstance(y, u.Quantity) and u.get_unit(y) == u.get_unit(u.mV * u.mS)
    close(y.to_decimal(u.uA), x @ _dense_w(w) + b)
    plain = sparse_matmul(x, w, sparse_mat=CSR)
    assert isinstance(plain, jax.Array) and not isinstance(plain, u.Quantity)
    with pytest.raises(u.UnitMismatchError):
        sparse_matmul(x * u.mV, w, sparse_mat=CSR, bias=b)


def test_only_the_pattern_of_the_structure_is_used() -> None:
    """Stored values, their unit and dtype do not matter: ``weight`` supplies the values."""
    x, w = rand(1, (I,)), rand(2, (P,))
    with_unit = brainevent.CSR.fromdense(jnp.asarray(DENSE) * u.mS)
    half = brainevent.CSR.fromdense(jnp.asarray(DENSE, jnp.float16))
    mask = brainevent.CSR.fromdense(jnp.asarray(MASK, jnp.int32))  # a 0/1 pattern
    for structure in (with_unit, half, mask):
        y = sparse_matmul(x * u.mV, w * u.mS, sparse_mat=structure)
        close(y.to_decimal(u.uA), x @ _dense_w(w))


@pytest.mark.parametrize("batched", [True, False], ids=["mm", "mv"])
@pytest.mark.parametrize(
    "weight_fn, bias_fn", [(None, None), (jnp.tanh, lambda b: b**2)], ids=["plain", "hooked"]
)
def test_values_and_raw_parameter_gradients_equal_the_dense_reference(
    batched: bool, weight_fn: Any, bias_fn: Any
) -> None:
    x = rand(1, (B, I) if batched else (I,))
    ws = {"weight": rand(2, (P,)), "bias": rand(3, (O,))}
    ct = rand(4, (B, O) if batched else (O,))
    fw = weight_fn or (lambda w: w)
    fb = bias_fn or (lambda b: b)

    def sparse(ws: dict[str, jax.Array]) -> jax.Array:
        return sparse_matmul(
            x, ws["weight"], sparse_mat=CSR, bias=ws["bias"], weight_fn=weight_fn, bias_fn=bias_fn
        )

    def dense(ws: dict[str, jax.Array]) -> jax.Array:
        return x @ _dense_w(fw(ws["weight"])) + fb(ws["bias"])

    close(sparse(ws), dense(ws))
    got = jax.jit(jax.grad(lambda ws: jnp.sum(ct * sparse(ws))))(ws)
    want = jax.jit(jax.grad(lambda ws: jnp.sum(ct * dense(ws))))(ws)
    jax.tree.map(close, got, want)


def test_gradient_with_an_integer_input_equals_the_float_cast() -> None:
    x = jnp.arange(B * I, dtype=jnp.int32).reshape(B, I)
    w = rand(2, (P,))
    got = jax.jit(jax.grad(lambda w: sparse_matmul(x, w, sparse_mat=CSR).sum()))(w)
    want = jax.jit(jax.grad(lambda w: (x.astype(jnp.float32) @ _dense_w(w)).sum()))(w)
    close(got, want)


@pytest.mark.parametrize("wrap", [True, False], ids=["wrapped", "bare"])
def test_dt_to_t_gathers_hd_at_the_output_column_of_each_entry(wrap: bool) -> None:
    """``ε[p] · hd[col(p)]`` with ``col`` from the mask alone (CSR: row-major entry order)."""
    rule = reg.ETP_RULES_DT_TO_T[etp_sp_mv_p]
    structure = _HashableSparseMat(CSR) if wrap else CSR
    hd, eps = rand(5, (O,)), rand(6, (P,))
    got = rule(hd, {"weight": eps}, sparse_mat=structure, has_bias=False)["weight"]
    close(got, eps * hd[COLS])
    assert not np.allclose(got, eps * hd[ROWS])  # the input index would be wrong
    hd_b, eps_b, eps_bias = rand(7, (B, O)), rand(8, (B, P)), rand(9, (B, O))
    out = reg.ETP_RULES_DT_TO_T[etp_sp_mm_p](
        hd_b, {"weight": eps_b, "bias": eps_bias}, sparse_mat=structure, has_bias=True
    )
    close(out["weight"], eps_b * hd_b[:, COLS])
    close(out["bias"], eps_bias * hd_b)
    # a trace without the batch axis broadcasts against a batched hd
    close(rule(hd_b, {"weight": eps}, sparse_mat=structure)["weight"], eps * hd_b[:, COLS])


def test_dt_to_t_follows_the_storage_order_of_a_csc_structure() -> None:
    """CSC stores column-major: entry ``p`` sits in the ``p``-th nonzero of the mask's transpose."""
    csc_cols, _ = np.nonzero(MASK.T)
    hd, eps = rand(5, (O,)), rand(6, (P,))
    got = reg.ETP_RULES_DT_TO_T[etp_sp_mv_p](hd, {"weight": eps}, sparse_mat=CSC)["weight"]
    close(got, eps * hd[csc_cols])


def test_xy_to_dw_is_x_at_the_row_times_hd_at_the_column() -> None:
    x, hd, w = rand(1, (B, I)), rand(2, (B, O)), rand(3, (P,))
    rule = reg.ETP_RULES_XY_TO_DW[etp_sp_mm_p]
    got = rule(x, hd, {"weight": w}, sparse_mat=CSR, has_bias=False)["weight"]
    close(got, jnp.sum(x[:, ROWS] * hd[:, COLS], axis=0))
    got = rule(x, hd, {"weight": w}, sparse_mat=CSR, weight_fn=jnp.tanh)["weight"]
    close(got, jnp.sum(x[:, ROWS] * hd[:, COLS], axis=0) * (1 - jnp.tanh(w) ** 2))


# --- vmap promotion -------------------------------------------------------------------------


def test_vmap_over_x_promotes_sp_mv_to_sp_mm_without_warning() -> None:
    w, b = rand(2, (P,)), rand(3, (O,))
    xs = rand(1, (I, B))  # mapped along axis 1

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return sparse_matmul(x, w, sparse_mat=CSR, bias=b, weight_fn=jnp.tanh)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqns = _sp_eqns(jax.vmap(f, in_axes=(1, None)), xs, w)
        got = jax.vmap(f, in_axes=(1, None))(xs, w)
        grad = jax.grad(lambda w: jax.vmap(f, in_axes=(1, None))(xs, w).sum())(w)
    assert [e.primitive for e in eqns] == [etp_sp_mm_p]
    assert eqns[0].params["weight_fn"] is jnp.tanh
    assert eqns[0].params["sparse_mat"].mat is CSR
    close(got, xs.T @ _dense_w(jnp.tanh(w)) + b)
    close(grad, jax.grad(lambda w: (xs.T @ _dense_w(jnp.tanh(w))).sum())(w))


def test_vmap_over_the_weight_decomposes_with_a_warning() -> None:
    x, ws = rand(1, (I,)), rand(2, (2, P))
    with pytest.warns(UserWarning, match="decomposed"):
        got = jax.vmap(lambda w: sparse_matmul(x, w, sparse_mat=CSR))(ws)
    close(got[1], x @ _dense_w(ws[1]))


# --- kernels on an install without numba -----------------------------------------------------


def test_without_numba_products_run_on_pure_jax_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "_NUMBA_AVAILABLE", False)
    chosen = sp._structure(_HashableSparseMat(CSR))
    assert chosen is not CSR and chosen.backend == "jax_raw"
    assert CSR.backend is None  # the user's structure is not modified
    np.testing.assert_array_equal(chosen.indices, CSR.indices)


def test_an_explicit_kernel_choice_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "_NUMBA_AVAILABLE", False)
    pinned = brainevent.CSR((CSR.data, CSR.indices, CSR.indptr), shape=(I, O), backend="numba")
    assert sp._structure(pinned) is pinned
    jitc = brainevent.JITCScalarR((1.5, 0.5, 42), shape=(I, O))
    assert sp._structure(jitc) is jitc  # numba-only kernels: nothing to switch to
    monkeypatch.setattr(brainevent.config, "get_backend", lambda platform: "numba")
    assert sp._structure(CSR) is CSR  # a global brainevent backend wins
    monkeypatch.setattr(sp, "_NUMBA_AVAILABLE", True)
    monkeypatch.setattr(brainevent.config, "get_backend", lambda platform: None)
    assert sp._structure(CSR) is CSR  # numba present: brainevent's defaults stand


@pytest.mark.skipif(
    importlib.util.find_spec("numba") is not None, reason="the fresh-install case lacks numba"
)
def test_sparse_matmul_works_where_a_bare_brainevent_product_needs_numba() -> None:
    x, w = rand(1, (I,)), rand(2, (P,))
    with pytest.raises(brainevent.KernelCompilationError, match="numba"):
        x @ CSR.with_data(w)
    close(sparse_matmul(x, w, sparse_mat=CSR), x @ _dense_w(w))


# --- D-RTRL from the rules equals BPTT --------------------------------------------------------

T = 4


def _bptt_grads(x_seq: jax.Array, ws: dict[str, jax.Array], a: jax.Array, c_seq: jax.Array) -> Any:
    def loss(ws: dict[str, jax.Array]) -> jax.Array:
        h = jnp.zeros(c_seq.shape[1:])
        total = jnp.zeros(())
        for t in range(T):
            y = sparse_matmul(
                x_seq[t], ws["weight"], sparse_mat=CSR, bias=ws["bias"], weight_fn=jnp.tanh
            )
            h = a * h + y
            total = total + jnp.sum(c_seq[t] * h)
        return total

    return jax.grad(loss)(ws)


def _drtrl_grads(
    prim: Any, x_seq: jax.Array, ws: dict[str, jax.Array], a: jax.Array, c_seq: jax.Array
) -> dict[str, jax.Array]:
    """ε_t = dt_to_t(a, ε_{t-1}) + instant(x_t, df=1); ∇ = Σ_t solve(c_t, ε_t) (S = 1)."""
    params = dict(
        sparse_mat=_HashableSparseMat(CSR), has_bias=True, weight_fn=jnp.tanh, bias_fn=None
    )
    dt_to_t, xy_to_dw = reg.ETP_RULES_DT_TO_T[prim], reg.ETP_RULES_XY_TO_DW[prim]
    batched = prim in reg.BATCHED_PRIMITIVES
    df = jnp.ones(O)

    def instant(x: jax.Array) -> dict[str, jax.Array]:
        if batched:  # context I: per sample
            return jax.vmap(lambda xb: xy_to_dw(xb, df, ws, **params))(x)
        return xy_to_dw(x, df, ws, **params)

    def solve(g: jax.Array, eps: dict[str, jax.Array]) -> dict[str, jax.Array]:
        if batched:  # context G: batch-free slices, the batch summed afterwards
            per_sample = jax.vmap(lambda gb, eb: dt_to_t(gb, eb, **params))(g, eps)
            return jax.tree.map(lambda v: v.sum(axis=0), per_sample)
        return dt_to_t(g, eps, **params)

    eps = jax.tree.map(jnp.zeros_like, instant(x_seq[0]))
    grads = jax.tree.map(jnp.zeros_like, ws)
    for t in range(T):
        eps = jax.tree.map(jnp.add, dt_to_t(a, eps, **params), instant(x_seq[t]))  # context R
        grads = jax.tree.map(jnp.add, grads, solve(c_seq[t], eps))
    return grads


@pytest.mark.parametrize("batched", [True, False], ids=["sp_mm", "sp_mv"])
def test_drtrl_from_the_rules_equals_bptt(batched: bool) -> None:
    """Exact for a diagonal recurrence; float32, compared at rtol 1e-5 / atol 1e-6."""
    lead = (B,) if batched else ()
    x_seq = rand(1, (T, *lead, I))
    c_seq = rand(2, (T, *lead, O))
    a = jax.random.uniform(jax.random.PRNGKey(3), (*lead, O), minval=0.3, maxval=0.95)
    ws = {"weight": rand(4, (P,)), "bias": rand(5, (O,))}
    prim = etp_sp_mm_p if batched else etp_sp_mv_p
    # one compilation each instead of many small eager dispatches
    got = jax.jit(lambda *args: _drtrl_grads(prim, *args))(x_seq, ws, a, c_seq)
    want = jax.jit(_bptt_grads)(x_seq, ws, a, c_seq)
    for k in ws:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)

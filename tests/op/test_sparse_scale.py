"""``sparse_matmul`` at scale: how it is differentiated and which kernels it runs.

Differentiating a CSR/CSC product with respect to its values goes through host-side entry
coordinates, not brainevent's in-program row reconstruction (a cumulative sum over every
stored entry, folded by XLA in O(nnz²) at compile time when the pattern is constant); the JVP
and VJP still equal the dense product's. Reverse mode through a time loop keeps the inputs,
not one value per stored entry, per step. With brainevent's numba kernels a batch goes through
the vector kernel row by row; where its pure-JAX kernels would run (no numba), the product itself
goes over the host coordinates, for the same reason. Over the coordinates, the connectome's D_RTRL
step gathers the input at the rows once for the product and its trace (counted in its compiled
program), and equals BPTT where the recurrence is diagonal.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from typing import Any

import brainevent
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from benchmarks import connectome
from braintrace._op import sparse as sp
from braintrace._op.sparse import sparse_matmul
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, x64
from tests.op.cases.sparse import CSC, CSR, MASK, I, O
from tests.op.opcase import close

__all__ = ["x64"]  # the fixture is used by name

ROWS, COLS = np.nonzero(MASK)
P = ROWS.size
HAS_NUMBA = importlib.util.find_spec("numba") is not None


def _dense(values: jax.Array) -> jax.Array:
    return jnp.zeros((I, O), values.dtype).at[ROWS, COLS].set(values)


def _csc_values(values: jax.Array) -> jax.Array:
    """Row-major values reordered into the CSC structure's (column-major) storage order."""
    return values[np.lexsort((ROWS, COLS))]


def _x(batched: bool) -> jax.Array:
    shape = (3, I) if batched else (I,)
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.result_type(float))


def _values() -> jax.Array:
    return jnp.asarray(np.random.default_rng(1).standard_normal(P), jnp.result_type(float))


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("structure", ["csr", "csc"])
def test_value_gradient_builds_no_row_index_scan(structure: str, batched: bool) -> None:
    mat = CSR if structure == "csr" else CSC
    x = _x(batched)
    ours = jax.make_jaxpr(jax.grad(lambda w: sparse_matmul(x, w, sparse_mat=mat).sum()))(_values())
    assert "cumsum" not in str(ours)
    # Negative control: brainevent's own rule rebuilds the rows with a cumulative sum.
    plain = sp._structure(mat)
    theirs = jax.make_jaxpr(jax.grad(lambda w: (x @ plain.with_data(w)).sum()))(_values())
    assert "cumsum" in str(theirs)


@pytest.mark.parametrize("structure, batched", [("csr", True), ("csc", False)])
def test_jvp_and_vjp_equal_the_dense_product(x64: None, structure: str, batched: bool) -> None:
    mat = CSR if structure == "csr" else CSC
    order = (lambda v: v) if structure == "csr" else _csc_values
    x, w = _x(batched), _values()
    dx, dw = 0.5 * x[::-1], jnp.cos(w)
    hook = jnp.tanh

    def ours(x: jax.Array, w: jax.Array) -> jax.Array:
        return sparse_matmul(x, order(w), sparse_mat=mat, weight_fn=hook)

    def dense(x: jax.Array, w: jax.Array) -> jax.Array:
        return x @ _dense(hook(w))

    y, ty = jax.jvp(ours, (x, w), (dx, dw))
    y_ref, ty_ref = jax.jvp(dense, (x, w), (dx, dw))
    np.testing.assert_allclose(y, y_ref, rtol=1e-12)
    np.testing.assert_allclose(ty, ty_ref, rtol=1e-12)
    ct = jnp.sin(y_ref)
    got, ref = jax.vjp(ours, x, w)[1](ct), jax.vjp(dense, x, w)[1](ct)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)


def test_reverse_mode_through_time_keeps_inputs_not_one_value_per_entry() -> None:
    n, nnz = 64, 2000
    rng = np.random.default_rng(0)
    flat = np.sort(rng.choice(n * n, nnz, replace=False))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(flat // n, minlength=n))]).astype(np.int32)
    mat = brainevent.CSR((jnp.zeros(nnz), jnp.asarray((flat % n).astype(np.int32)), jnp.asarray(indptr)),
                         shape=(n, n))

    def loss(w: jax.Array, h0: jax.Array, steps: int) -> jax.Array:
        def body(h: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return jnp.tanh(sparse_matmul(h, w, sparse_mat=mat)), None

        return jax.lax.scan(body, h0, None, length=steps)[0].sum()

    def temp_bytes(steps: int) -> int:
        step = jax.jit(jax.grad(lambda w, h0: loss(w, h0, steps)))
        return int(step.lower(jnp.ones(nnz), jnp.ones((1, n))).compile().memory_analysis().temp_size_in_bytes)

    per_step = (temp_bytes(40) - temp_bytes(20)) / 20
    assert 0 < per_step < 0.25 * nnz * 4  # a few (1, 64) arrays, not a (1, 2000) one


@pytest.mark.skipif(not HAS_NUMBA, reason="brainevent's numba kernels need numba")
def test_a_batch_runs_through_the_numba_vector_kernel_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _x(True), _values()

    def fn(x: jax.Array, w: jax.Array) -> Any:
        return jax.value_and_grad(lambda x, w: sparse_matmul(x, w, sparse_mat=CSR).sum(), argnums=(0, 1))(x, w)

    text = str(jax.make_jaxpr(fn)(x, w))
    assert "csrmv" in text and "csrmm" not in text
    (value, grads), ref = fn(x, w), jax.value_and_grad(lambda x, w: (x @ _dense(w)).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(value, ref[0], rtol=1e-5)
    for g, r in zip(grads, ref[1]):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    # Negative control: brainevent's matrix kernel, where the row loop is switched off.
    monkeypatch.setattr(sp, "_numba_kernels", lambda mat: False)
    impl = jax.make_jaxpr(lambda x, w: sp._etp_sp_matmul_impl(x, w, sparse_mat=sp._HashableSparseMat(CSR)))(x, w)
    assert "csrmm" in str(impl) and "csrmv" not in str(impl)


def test_only_numba_kernels_take_the_row_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "_NUMBA_AVAILABLE", False)
    assert not sp._numba_kernels(sp._structure(CSR))  # brainevent's pure-JAX kernels
    pinned = brainevent.CSR((CSR.data, CSR.indices, CSR.indptr), shape=(I, O), backend="numba")
    assert sp._numba_kernels(pinned)


def _on_pure_jax_kernels(structure: Any) -> Any:
    """``structure`` (a CSR or CSC) with brainevent's pure-JAX kernels chosen on it."""
    return type(structure)((structure.data, structure.indices, structure.indptr), shape=structure.shape,
                           backend="jax_raw")


def _cumulative_sums(structure: Any) -> int:
    """The cumulative sums (``reduce_window``) in the program of ``sparse_matmul`` and its
    gradient, on brainevent's pure-JAX kernels."""
    pure = _on_pure_jax_kernels(structure)
    loss = lambda x, w: jnp.sum(sparse_matmul(x, w, sparse_mat=pure) ** 2)  # noqa: E731
    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(_x(True), _values()).as_text()
    return program.count("reduce_window")


@pytest.mark.parametrize("structure", [CSR, CSC], ids=["csr", "csc"])
def test_pure_jax_kernels_leave_xla_no_structure_to_fold(structure: Any) -> None:
    """brainevent's pure-JAX kernels find each entry's row by a cumulative sum over the index
    arrays, which XLA folds at compile time (tens of seconds at millions of entries): the
    products go over the host coordinates instead, with the same values and gradients.
    Negative control: brainevent's own kernels bring the cumulative sums back."""
    assert _cumulative_sums(structure) == 0
    pure = _on_pure_jax_kernels(structure)
    x, w = _x(True), _values()
    dense = lambda w: pure.with_data(w).todense()  # noqa: E731
    close(sparse_matmul(x, w, sparse_mat=pure), x @ dense(w))
    got = jax.grad(lambda x, w: jnp.sum(jnp.sin(sparse_matmul(x, w, sparse_mat=pure))), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ dense(w))), argnums=(0, 1))(x, w)
    close(got[0], want[0])
    close(got[1], want[1])


def test_brainevents_pure_jax_kernels_sum_over_the_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "_by_coordinates", lambda mat: False)
    assert _cumulative_sums(CSR) > 0


def test_off_the_cpu_products_go_over_the_coordinates_unless_a_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """brainevent's default kernels on an accelerator are its pure-JAX ones, whose structure XLA
    folds: an unnamed backend there takes the coordinates; a named one is respected."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert sp._by_coordinates(CSR)
    named = type(CSR)((CSR.data, CSR.indices, CSR.indptr), shape=CSR.shape, backend="pallas")
    assert not sp._by_coordinates(named)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(sp, "_NUMBA_AVAILABLE", True)
    assert not sp._by_coordinates(CSR)  # numba's kernels on CPU


# --- the connectome steps, by coordinates ------------------------------------------------------

CONNECTOME_NEURONS, CONNECTOME_SYNAPSES = 300, 3_000
#: The per-entry gathers and scatter-adds of the connectome's forward and D_RTRL steps, per
#: platform XLA compiles them for (a TPU's XLA also folds the gather of ``df``, a constant here).
CONNECTOME_ENTRY_OPS = {"cpu": {"forward": 2, "D_RTRL": 5}, "tpu": {"forward": 2, "D_RTRL": 4}}


def _entry_gathers_and_scatters(text: str, nnz: int) -> int:
    """The gathers of one value per stored entry and the scatter-adds of such values in an
    optimised HLO module (what a TPU does one index at a time)."""
    shapes = dict(re.findall(r"%([\w.\-]+) = (\w+\[[\d,]*\])", text))

    def per_entry(shape: str) -> bool:
        return nnz in [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[1])]

    count = 0
    for shape, op, operands in re.findall(r"= (\w+\[[\d,]*\])\S* (gather|scatter)\(([^)]*)\)", text):
        read = shape if op == "gather" else shapes[operands.split(",")[2].strip().lstrip("%")]
        count += per_entry(read)
    return count


def _connectome_step_entry_ops(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Per step of ``benchmarks/connectome.py`` (forward, one-step D_RTRL) on a small connectome,
    compiled as on a TPU (the products over the host coordinates): its per-entry gathers and
    scatter-adds (:func:`_entry_gathers_and_scatters`)."""
    monkeypatch.setattr(sp, "_by_coordinates", lambda mat: True)
    indptr, indices = connectome.generate_connectome(CONNECTOME_NEURONS, CONNECTOME_SYNAPSES, seed=1)

    def model() -> connectome.ConnectomeLIF:
        return connectome.ConnectomeLIF(indptr, indices, n_sensory=16, n_readout=16)

    xs, ys = jnp.ones((4, 1, 16)), jnp.ones((4, 1, 8))
    steps = {"forward": connectome.forward_step(model(), 1), "D_RTRL": connectome.online_step(model(), 1, "d_rtrl")[0]}
    return {name: _entry_gathers_and_scatters(step.lower(xs, ys).compile().as_text(), indices.size)
            for name, step in steps.items()}


@pytest.mark.skipif(jax.default_backend() not in CONNECTOME_ENTRY_OPS, reason="counts read on CPU and TPU only")
def test_the_connectome_d_rtrl_step_gathers_the_input_at_the_rows_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a TPU a gather or scatter costs about one access per index, and the connectome's steps
    are mostly these. The forward step gathers the spikes at the rows and scatter-adds to the
    columns; D_RTRL's adds the Jacobian and ``df`` at the columns (the roll) and the signal at the
    columns (the gradient). Its instantaneous term reads the product's own gather of the
    spikes: gathering them again (through the product's rematerialised VJP) cost one more, and
    on a TPU v5e the fly-sized step took 3.4× the forward one instead of 2.05×."""
    assert _connectome_step_entry_ops(monkeypatch) == CONNECTOME_ENTRY_OPS[jax.default_backend()]


def test_sparse_d_rtrl_by_coordinates_equals_bptt(x64: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connectome's LIF network with detached spikes (a diagonal hidden Jacobian, where one-step
    D-RTRL is exact), the products over the host coordinates as on a TPU."""
    monkeypatch.setattr(sp, "_by_coordinates", lambda mat: True)
    indptr, indices = connectome.generate_connectome(40, 400, seed=2)

    def model() -> connectome.ConnectomeLIF:
        return connectome.ConnectomeLIF(indptr, indices, n_in=3, n_sensory=8, n_readout=8, n_out=2,
                                        detach_spikes=True)

    xs = 2.0 * normal(3, (5, 2, 3))
    ref = bptt_grads(model(), xs, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(model(), braintrace.D_RTRL, xs[0], batch_size=2)
    got = single_step_grads(learner, xs)
    assert set(got) == set(ref) and all(np.any(ref[p] != 0) for p in ref)
    assert max_rel_err(ref, got) < 1e-10

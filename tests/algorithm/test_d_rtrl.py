"""D_RTRL against the BPTT oracle: the exact class, multi-step windows, the approximate class.

The exact class is a diagonal recurrence ``h_t = leak ⊙ h_{t-1} + tail(op(x_t, W))`` with a
learnable ``element_wise`` leak: the true hidden Jacobian is the compiled per-position ``D``,
so summing the single-step online gradients over ``T`` steps must equal BPTT of the summed
loss, for every operator family and every transform hook (table :data:`ROWS`). The
approximate class (a tanh RNN with a dense recurrent weight) is checked for alignment and for
learning.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.param_trace import window as param_trace_window
from tests.algorithm.bptt import (
    bptt_grads,
    cosine,
    max_rel_err,
    norm_ratio,
    normal,
    single_step_grads,
    window_grads,
    x64,
)
from tests.compiler.models import soft_spike

__all__ = ["x64"]  # the fixture is used by name

T, B, I, O = 4, 2, 3, 4
EXACT = 1e-10


def _optional(module: str) -> Any:
    """An operator module that may not exist yet (conv, sparse, einsum)."""
    return pytest.importorskip(f"braintrace._op.{module}")


def compile_quiet(model: brainstate.nn.Module, x0: Any, batch_size: int | None, **options: Any) -> Any:
    """``braintrace.compile`` with the compiler's diagnostics (e.g. a plain readout) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, braintrace.D_RTRL, x0, batch_size=batch_size, **options)


# --- the family table ---------------------------------------------------------------------


def identity(y: Any) -> Any:
    return y


@dataclass(frozen=True)
class Row:
    """One operator family with one transform hook, driving a leaky hidden state.

    Attributes
    ----------
    id : str
    params : callable
        ``() -> {name: initial value}``: the ``ParamState`` s the op reads (besides the leak).
    op : callable
        ``(model, x) -> y``: the ETP operation; parameters are read as ``model.<name>.value``.
    inputs : callable
        ``(batch or None) -> xs`` with a leading time axis ``T``.
    tail : callable
        The element-wise ``y -> drive`` map (identity or tanh).
    batched : tuple of bool
        Which layouts the family supports (batch of ``B`` and/or no batch axis).
    readout : bool
        Add a plain readout weight and a direct ``y -> loss`` path to the output.
    """

    id: str
    params: Callable[[], dict[str, Any]]
    op: Callable[[Any, Any], Any]
    inputs: Callable[[int | None], Any]
    tail: Callable[[Any], Any] = jnp.tanh
    batched: tuple[bool, ...] = (True, False)
    readout: bool = False


def dense_x(batch: int | None, n_in: int = I, seed: int = 7) -> jax.Array:
    return normal(seed, (T, n_in) if batch is None else (T, batch, n_in))


def hidden_x(batch: int | None) -> jax.Array:
    return normal(8, (T, O) if batch is None else (T, batch, O))


def tokens(batch: int | None) -> jax.Array:
    vals = np.random.default_rng(9).integers(0, 5, size=(T,) if batch is None else (T, batch))
    return jnp.asarray(vals, dtype=jnp.int32)


def w(seed: int, *shape: int, scale: float = 0.5) -> Callable[[], jax.Array]:
    return lambda: normal(seed, shape, scale)


def params(**makers: Callable[[], jax.Array]) -> Callable[[], dict[str, Any]]:
    return lambda: {name: make() for name, make in makers.items()}


def normalised(v: jax.Array) -> jax.Array:
    """A coupling transform: every entry depends on every other one."""
    return v / jnp.sqrt(jnp.sum(v**2))


@functools.cache
def csr() -> Any:
    brainevent = pytest.importorskip("brainevent")
    mask = np.array([[1, 0, 1, 0], [0, 1, 1, 1], [1, 0, 0, 1]], dtype=bool)
    return brainevent.CSR.fromdense(jnp.asarray(np.where(mask, 1.0, 0.0), dtype=jnp.float32))


def conv_op(m: Any, x: Any, **kw: Any) -> Any:
    return _optional("conv").conv(x, m.k.value, *([m.b.value] if hasattr(m, "b") else []), **kw)


def sparse_params(bias: bool) -> Callable[[], dict[str, Any]]:
    """The CSR structure is built here, eagerly (``fromdense`` needs a concrete mask)."""

    def make() -> dict[str, Any]:
        csr()
        return params(w=w(23, 7), **({"b": w(24, O, scale=0.1)} if bias else {}))()

    return make


def sparse_op(m: Any, x: Any, bias: bool = False) -> Any:
    sparse = _optional("sparse")
    return sparse.sparse_matmul(x, m.w.value, sparse_mat=csr(), bias=m.b.value if bias else None)


def einsum_op(eq: str) -> Callable[[Any, Any], Any]:
    return lambda m, x: _optional("einsum").einsum(eq, x, m.w.value)


NHWC = ("NHWC", "HWIO", "NHWC")
MM = params(w=w(1, I, O))
MM_B = params(w=w(1, I, O), b=w(2, O, scale=0.1))

ROWS = [
    Row("mm", MM, lambda m, x: braintrace.matmul(x, m.w.value), dense_x),
    Row("mm-identity-tail", MM, lambda m, x: braintrace.matmul(x, m.w.value), dense_x, tail=identity),
    Row("mm-bias", MM_B, lambda m, x: braintrace.matmul(x, m.w.value, m.b.value), dense_x),
    Row("mm-fn-square", MM, lambda m, x: braintrace.matmul(x, m.w.value, weight_fn=lambda v: v**2), dense_x),
    Row("mm-fn-tanh", MM, lambda m, x: braintrace.matmul(x, m.w.value, weight_fn=jnp.tanh), dense_x),
    Row("mm-fn-abs", MM, lambda m, x: braintrace.matmul(x, m.w.value, weight_fn=jnp.abs), dense_x),
    Row("mm-bias-fn", MM_B, lambda m, x: braintrace.matmul(x, m.w.value, m.b.value, bias_fn=jnp.tanh), dense_x),
    Row("mm-bias-readout", MM_B, lambda m, x: braintrace.matmul(x, m.w.value, m.b.value), dense_x, readout=True),
    Row("elemwise", params(w=w(3, O)), lambda m, x: x * braintrace.element_wise(m.w.value), hidden_x),
    Row(
        "elemwise-fn-sigmoid", params(w=w(3, O)),
        lambda m, x: x * braintrace.element_wise(m.w.value, weight_fn=jax.nn.sigmoid), hidden_x,
    ),
    Row(
        "elemwise-fn-normalised", params(w=w(3, O)),
        lambda m, x: x * braintrace.element_wise(m.w.value, weight_fn=normalised), hidden_x,
    ),
    Row(
        "grouped-bias", params(w=w(4, 2, I, O), b=w(5, 2, O, scale=0.1)),
        lambda m, x: braintrace.grouped_matmul(x, m.w.value, m.b.value),
        lambda batch: normal(10, (T, 2, I) if batch is None else (T, batch, 2, I)),
    ),
    Row(
        "grouped-fn-tanh", params(w=w(4, 2, I, O)),
        lambda m, x: braintrace.grouped_matmul(x, m.w.value, weight_fn=jnp.tanh),
        lambda batch: normal(10, (T, 2, I) if batch is None else (T, batch, 2, I)),
    ),
    Row("embedding", params(w=w(6, 5, O)), lambda m, x: braintrace.embedding(x, m.w.value), tokens),
    Row(
        "embedding-fn-tanh", params(w=w(6, 5, O)),
        lambda m, x: braintrace.embedding(x, m.w.value, weight_fn=jnp.tanh), tokens,
    ),
    Row(
        "lora-alpha2-bias-hooks", params(lb=w(11, I, 2), la=w(12, 2, O), b=w(13, O, scale=0.1)),
        lambda m, x: braintrace.lora_matmul(
            x, m.lb.value, m.la.value, alpha=2.0, bias=m.b.value, b_fn=jnp.tanh, a_fn=jnp.tanh
        ),
        dense_x,
    ),
    Row(
        "einsum-per-head-diagonal", params(w=w(14, 2, I, O)), einsum_op("bhk,hkn->bhn"),
        lambda batch: normal(15, (T, batch or B, 2, I)), batched=(True,),
    ),
    Row(
        "einsum-shared-axis", params(w=w(16, I, O)), einsum_op("btk,kn->btn"),
        lambda batch: normal(17, (T, batch or B, 3, I)), batched=(True,),
    ),
    Row(
        "conv1d-kernel-fn", params(k=w(18, 3, 2, 3)),
        lambda m, x: conv_op(m, x, padding="SAME", kernel_fn=jnp.tanh),
        lambda batch: normal(19, (T, batch or B, 2, 5)), batched=(True,),
    ),
    Row(
        "conv2d-nhwc-bias", params(k=w(20, 2, 2, 2, 3), b=w(21, 3, scale=0.1)),
        lambda m, x: conv_op(m, x, padding="SAME", dimension_numbers=NHWC),
        lambda batch: normal(22, (T, batch or B, 3, 3, 2)), batched=(True,),
    ),
    Row("sparse-csr", sparse_params(False), sparse_op, dense_x),
    Row("sparse-csr-bias", sparse_params(True), lambda m, x: sparse_op(m, x, bias=True), dense_x),
]


#: Rows by id, for the tests that reuse one family.
ROW = {row.id: row for row in ROWS}


class Leaky(brainstate.nn.Module):
    """``h = sigmoid(leak) ⊙ h + tail(op(x, W))`` for one table row (optionally with a readout)."""

    def __init__(self, row: Row, x0: Any, batched: bool) -> None:
        super().__init__()
        self.row = row
        for name, value in row.params().items():
            setattr(self, name, brainstate.ParamState(value))
        self.y_shape = tuple(jax.eval_shape(lambda: row.op(self, x0)).shape)
        leak_shape = self.y_shape[1:] if batched else self.y_shape
        self.leak = brainstate.ParamState(normal(30, leak_shape))
        if row.readout:
            self.w_out = brainstate.ParamState(normal(31, (self.y_shape[-1], 2), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros(self.y_shape))

    def update(self, x: Any) -> Any:
        y = self.row.op(self, x)
        leak = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + self.row.tail(y)
        if not self.row.readout:
            return self.h.value
        return self.h.value @ self.w_out.value + 0.3 * jnp.sum(y, axis=-1, keepdims=True)


def _cases() -> list[Any]:
    return [
        pytest.param(row, batched, id=f"{row.id}-{'batched' if batched else 'unbatched'}")
        for row in ROWS for batched in row.batched
    ]


def _setup(row: Row, batched: bool) -> tuple[Callable[[], Leaky], Any, int | None]:
    batch = B if batched else None
    xs = row.inputs(batch)
    x0 = jax.tree.map(lambda a: a[0], xs)
    return (lambda: Leaky(row, x0, batched)), xs, batch


@pytest.mark.parametrize("row, batched", _cases())
def test_single_step_equals_bptt_for_diagonal_recurrence(x64: None, row: Row, batched: bool) -> None:
    make, xs, batch = _setup(row, batched)
    ref = bptt_grads(make(), xs, batch_size=batch)
    learner = compile_quiet(make(), xs[0], batch)
    got = single_step_grads(learner, xs)
    assert set(got) == set(ref)
    assert all(np.any(ref[p] != 0) for p in ref), "every parameter must be exercised"
    assert max_rel_err(ref, got) < EXACT


@pytest.mark.slow
def test_single_step_equals_bptt_eagerly(x64: None) -> None:
    """The same identity without ``jit`` (the learner's own eager code path)."""
    make, xs, batch = _setup(ROW["mm-bias-readout"], True)  # + readout + direct y path
    ref = bptt_grads(make(), xs, batch_size=batch, jit=False)
    got = single_step_grads(compile_quiet(make(), xs[0], batch), xs, jit=False)
    assert max_rel_err(ref, got) < EXACT


def test_float32_single_step_matches_bptt() -> None:
    make, xs, batch = _setup(ROW["mm-bias-readout"], True)
    ref = bptt_grads(make(), xs, batch_size=batch)
    got = single_step_grads(compile_quiet(make(), xs[0], batch), xs)
    assert max_rel_err(ref, got) < 1e-5


# --- multi-step windows -------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "scan"])
@pytest.mark.parametrize("row", [ROW["mm-bias-readout"], ROW["lora-alpha2-bias-hooks"]], ids=["mm-readout", "lora"])
def test_one_window_over_the_sequence_equals_bptt(x64: None, row: Row, chunked: bool) -> None:
    make, xs, batch = _setup(row, True)
    ref = bptt_grads(make(), xs, batch_size=batch)
    learner = compile_quiet(make(), xs[0], batch, vjp_method="multi-step", chunked_trace=chunked)
    got = window_grads(learner, xs, [T])
    assert max_rel_err(ref, got) < EXACT


def _traces(learner: Any, weight: Any) -> dict[tuple[int, str], np.ndarray]:
    """``{(group index, key): trace}`` of ``weight`` (trace keys hold var ids, unique per learner)."""
    found = learner.get_etrace_of(weight)
    return {(k[1], name): np.asarray(v, np.float64) for k, leaves in found.items() for name, v in leaves.items()}


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "scan"])
def test_windows_roll_the_trace_like_single_steps(chunked: bool) -> None:
    """Windows of 2, 2 and 1 steps leave the same traces as 5 single steps (float32)."""
    row = ROW["mm-bias"]  # matmul + bias: the closed-form chunk kernel when chunked
    steps = 5
    xs = normal(40, (steps, B, I))
    make = lambda: Leaky(row, xs[0], True)  # noqa: E731
    single = compile_quiet(make(), xs[0], B)
    multi = compile_quiet(make(), xs[0], B, vjp_method="multi-step", chunked_trace=chunked)
    g_single = single_step_grads(single, xs)
    g_multi = window_grads(multi, xs, [2, 2, 1])
    for weight in (("w",), ("b",), ("leak",)):
        a, b = _traces(single, weight), _traces(multi, weight)
        assert a.keys() == b.keys() and a
        for key in a:
            assert np.any(a[key] != 0)
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6)
    for p in g_single:
        np.testing.assert_allclose(g_multi[p], g_single[p], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_windows_equal_bptt_for_diagonal_model(x64: None, batched: bool) -> None:
    make, xs, batch = _setup(ROW["mm-bias"], batched)
    ref = bptt_grads(make(), xs, batch_size=batch)
    learner = compile_quiet(make(), xs[0], batch, vjp_method="multi-step")
    assert max_rel_err(ref, window_grads(learner, xs, [2, 1, 1])) < EXACT


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_every_operation_rolls_a_window_in_closed_form_and_equals_bptt(
    x64: None, row: Row, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the fast path the window is rolled through the operation's own rules in closed form
    (``general_chunk``), its per-step terms summed all at once or, past ``CHUNK_TERM_BYTES``,
    one step at a time; both equal BPTT."""
    make, xs, batch = _setup(row, row.batched[0])
    ref = bptt_grads(make(), xs, batch_size=batch)
    for term_bytes in (param_trace_window.CHUNK_TERM_BYTES, 1):
        monkeypatch.setattr(param_trace_window, "CHUNK_TERM_BYTES", term_bytes)
        learner = compile_quiet(make(), xs[0], batch, vjp_method="multi-step")
        chunked, stepped = param_trace_window.chunk_split(learner)
        assert not stepped and any(learner._fast_path(rel) is None for rel in chunked)
        assert max_rel_err(ref, window_grads(learner, xs, [3, 1])) < EXACT


def test_multi_step_learner_called_step_by_step_equals_bptt(x64: None) -> None:
    """Bare (unmarked) inputs are one-step windows of the multi-step VJP."""
    make, xs, batch = _setup(ROW["mm-bias-readout"], True)
    ref = bptt_grads(make(), xs, batch_size=batch)
    learner = compile_quiet(make(), xs[0], batch, vjp_method="multi-step")
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


# --- weights shared between relations and relations reaching several groups ---------------


class FanOutTied(brainstate.nn.Module):
    """``W`` drives two independent leaky states, once through each of two matmuls (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(80, (I, O), 0.5))
        self.leak1 = brainstate.ParamState(normal(81, (O,)))
        self.leak2 = brainstate.ParamState(normal(82, (O,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h1 = brainstate.HiddenState(jnp.zeros((batch_size, O)))
        self.h2 = brainstate.HiddenState(jnp.zeros((batch_size, O)))

    def update(self, x: Any) -> Any:
        y = braintrace.matmul(x, self.w.value)  # reaches both h1 and h2
        z = braintrace.matmul(jnp.sin(x), self.w.value)  # the same weight again
        a1 = braintrace.element_wise(self.leak1.value, weight_fn=jax.nn.sigmoid)
        a2 = braintrace.element_wise(self.leak2.value, weight_fn=jax.nn.sigmoid)
        self.h1.value = a1 * self.h1.value + jnp.tanh(y)
        self.h2.value = a2 * self.h2.value + 0.5 * y + jnp.tanh(z)
        return self.h1.value * self.h2.value


def test_tied_weight_and_fan_out_relation_equal_bptt(x64: None) -> None:
    xs = normal(83, (T, B, I))
    ref = bptt_grads(FanOutTied(), xs, batch_size=B)
    learner = compile_quiet(FanOutTied(), xs[0], B)
    assert len(learner.graph.hidden_groups) == 2
    assert sorted(len(r.hidden_groups) for r in learner.graph.hidden_param_op_relations if r.x_var is not None) == [1, 2]
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


# --- two-state hidden groups --------------------------------------------------------------


class AdaptiveLeaky(brainstate.nn.Module):
    """Two coupled states per neuron, ``v`` and an adaptation ``a`` (a smooth adaptive LIF)."""

    def __init__(self, grouped: bool) -> None:
        super().__init__()
        self.grouped = grouped
        self.w = brainstate.ParamState(normal(50, (I, O), 0.5))
        self.tau_v = brainstate.ParamState(normal(51, (O,)))
        self.beta = brainstate.ParamState(normal(52, (O,), 0.3))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (O,) if batch_size is None else (batch_size, O)
        if self.grouped:
            self.s = brainstate.HiddenGroupState(jnp.zeros((*shape, 2)))
        else:
            self.v = brainstate.HiddenState(jnp.zeros(shape))
            self.a = brainstate.HiddenState(jnp.zeros(shape))

    def _read(self) -> tuple[Any, Any]:
        if self.grouped:
            return self.s.value[..., 0], self.s.value[..., 1]
        return self.v.value, self.a.value

    def update(self, x: Any) -> Any:
        v, a = self._read()
        alpha = braintrace.element_wise(self.tau_v.value, weight_fn=jax.nn.sigmoid)
        beta = braintrace.element_wise(self.beta.value)
        v_new = alpha * v + jnp.tanh(braintrace.matmul(x, self.w.value)) - beta * a
        a_new = 0.8 * a + 0.5 * jnp.tanh(v)
        if self.grouped:
            self.s.value = jnp.stack([v_new, a_new], axis=-1)
        else:
            self.v.value, self.a.value = v_new, a_new
        # Read the output back from the state: the learning signal is the cotangent of the
        # state's stored value, so a loss path through the pre-stack ``v_new`` would bypass it.
        return self._read()[0]


@pytest.mark.parametrize(
    "grouped",
    [True, False],
    ids=["HiddenGroupState", "two-HiddenStates"],
)
def test_two_state_group_single_step_equals_bptt(x64: None, grouped: bool) -> None:
    xs = normal(53, (T, B, I))
    ref = bptt_grads(AdaptiveLeaky(grouped), xs, batch_size=B)
    learner = compile_quiet(AdaptiveLeaky(grouped), xs[0], B)
    (group,) = learner.graph.hidden_groups
    assert group.num_state == 2
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


# --- the approximate class ----------------------------------------------------------------


class TanhRNN(brainstate.nn.Module):
    """``h = tanh(x @ W_in + h @ W_rec)``, both weights ETP: the recurrence mixes positions."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = brainstate.ParamState(normal(60, (I, O), 0.6))
        self.w_rec = brainstate.ParamState(normal(61, (O, O), 0.4))
        self.w_out = brainstate.ParamState(normal(62, (O, 1), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, O)))

    def update(self, x: Any) -> Any:
        drive = braintrace.matmul(x, self.w_in.value) + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = jnp.tanh(drive)
        return self.h.value @ self.w_out.value


#: Measured float64 cosine between D_RTRL and BPTT on :class:`TanhRNN`, T=6 (see the report).
TANH_RNN_COSINE_FLOOR = 0.70


@pytest.mark.slow
def test_dense_recurrence_is_aligned_with_bptt(x64: None) -> None:
    xs = normal(63, (6, B, I))
    ref = bptt_grads(TanhRNN(), xs, batch_size=B)
    learner = compile_quiet(TanhRNN(), xs[0], B)
    got = single_step_grads(learner, xs)
    assert max_rel_err(ref, got) > 1e-3, "a dense recurrence is outside the exact class"
    assert cosine(ref, got) > TANH_RNN_COSINE_FLOOR
    assert 0.5 < norm_ratio(ref, got) < 2.0
    # The compiled D cuts the weight mixing and there is no leak, so D = 0: the trace keeps no
    # history and the online gradient is exactly the sum of one-step (truncated) gradients.
    assert max_rel_err(bptt_grads(TanhRNN(), xs, batch_size=B, truncated=True), got) < EXACT


@pytest.mark.slow
def test_training_lowers_the_loss() -> None:
    """SGD on D_RTRL gradients fits a fixed sequence (each step: the previous input's first feature)."""
    steps, lr = 6, 0.05
    xs = normal(64, (steps, B, I))
    targets = jnp.roll(xs[..., :1], 1, axis=0)
    model = TanhRNN()
    learner = compile_quiet(model, xs[0], B)
    params = learner.param_states

    def loss(t: int, out: Any) -> Any:
        return jnp.mean((out - targets[t]) ** 2)

    @brainstate.transform.jit
    def epoch() -> Any:
        learner.reset_state()
        model.h.value = jnp.zeros_like(model.h.value)
        total = jnp.zeros(())
        for t in range(steps):
            grads, value = brainstate.transform.grad(
                lambda t=t: loss(t, learner(xs[t])), params, return_value=True
            )()
            for p, g in grads.items():
                params[p].value = params[p].value - lr * g
            total = total + value
        return total

    losses = [float(epoch()) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]  # measured: 4.94 -> 1.19


# --- trace dtype --------------------------------------------------------------------------


def test_bfloat16_traces_store_in_bfloat16_and_stay_close() -> None:
    row = ROW["mm-bias"]
    xs = row.inputs(B)
    make = lambda: Leaky(row, xs[0], True)  # noqa: E731
    fp32 = compile_quiet(make(), xs[0], B)
    bf16 = compile_quiet(make(), xs[0], B, trace_dtype=jnp.bfloat16)

    def dtypes(learner: Any, weight: tuple[str, ...]) -> set[Any]:
        return {v.dtype for leaves in learner.get_etrace_of(weight).values() for v in leaves.values()}

    # The matmul (a fast-path relation) stores bf16; the hooked leak (general path) stays native.
    assert dtypes(bf16, ("w",)) == dtypes(bf16, ("b",)) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(bf16, ("leak",)) == {jnp.dtype(jnp.float32)}
    g32, g16 = single_step_grads(fp32, xs), single_step_grads(bf16, xs)
    assert dtypes(bf16, ("w",)) == {jnp.dtype(jnp.bfloat16)}, "stepping keeps the storage dtype"
    for p in g32:
        assert g16[p].dtype == g32[p].dtype == np.float32
    err = max_rel_err(g32, g16)
    assert 0 < err < 0.03


# --- reset_state and get_etrace_of --------------------------------------------------------


class WithReadout(brainstate.nn.Module):
    """A leaky layer (separate weight and bias states) and a plain readout (no trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(70, (I, O), 0.5))
        self.b = brainstate.ParamState(normal(71, (O,), 0.1))
        self.leak = brainstate.ParamState(normal(72, (O,)))
        self.r = brainstate.ParamState(normal(73, (O, 2), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((O,) if batch_size is None else (batch_size, O)))

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value))
        return self.h.value @ self.r.value


def _stepped(batch: int | None) -> tuple[Any, WithReadout]:
    model = WithReadout()
    xs = dense_x(batch)
    learner = compile_quiet(model, xs[0], batch)
    brainstate.transform.jit(lambda: [learner(xs[t]) for t in range(2)])()
    return learner, model


def _trace_shapes(learner: Any) -> dict[Any, dict[str, tuple[int, ...]]]:
    return {k: {n: tuple(v.shape) for n, v in st.value.items()} for k, st in learner.etrace_bwg.items()}


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_reset_state_zeros_traces_and_the_step_counter(batched: bool) -> None:
    learner, _ = _stepped(B if batched else None)
    shapes = _trace_shapes(learner)
    assert int(learner.running_index.value) == 2
    assert any(np.any(np.asarray(v) != 0) for st in learner.etrace_bwg.values() for v in st.value.values())
    learner.reset_state()
    assert int(learner.running_index.value) == 0
    assert _trace_shapes(learner) == shapes
    assert all(not np.any(np.asarray(v)) for st in learner.etrace_bwg.values() for v in st.value.values())


def test_reset_state_with_batch_size_resizes_every_trace_that_leads_with_the_batch() -> None:
    batched, _ = _stepped(B)
    learner, _ = _stepped(None)
    batched.reset_state(batch_size=5)
    (mm_key,) = batched.get_etrace_of(("w",))
    (leak_key,) = batched.get_etrace_of(("leak",))
    assert _trace_shapes(batched)[mm_key] == {"weight": (5, I, O, 1), "bias": (5, O, 1)}
    # The element-wise leak broadcasts over the batched hidden state: one trace per sample.
    assert _trace_shapes(batched)[leak_key] == {"weight": (5, O, 1)}
    with pytest.raises(ValueError, match="a new batch size needs a new braintrace.compile"):
        batched(dense_x(B)[0])  # the traces no longer fit the compiled batch

    # An unbatched model's traces have no batch axis: axis 0 is never touched.
    unbatched = _trace_shapes(learner)
    assert {n for s in unbatched.values() for n in s} == {"weight", "bias"}
    learner.reset_state(batch_size=5)
    assert _trace_shapes(learner) == unbatched
    assert sorted(s["weight"] for s in unbatched.values()) == [(I, O, 1), (O, 1)]


def test_get_etrace_of_by_state_by_path_and_for_a_separate_bias_state() -> None:
    learner, model = _stepped(B)
    by_state = learner.get_etrace_of(model.w)
    by_path = learner.get_etrace_of(("w",))
    assert by_state.keys() == by_path.keys() and len(by_state) == 1
    (leaves,) = by_state.values()
    # The relation's whole trace, its bias entry included.
    assert set(leaves) == {"weight", "bias"} and leaves["weight"].shape == (B, I, O, 1)
    assert np.any(np.asarray(leaves["weight"]) != 0)
    # The bias lives in its own ParamState: a secondary key of the same relation.
    bias = learner.get_etrace_of(model.b)
    assert bias.keys() == by_state.keys()
    (bias_leaves,) = bias.values()
    assert set(bias_leaves) == {"weight", "bias"} and bias_leaves["bias"].shape == (B, O, 1)
    (leak_leaves,) = learner.get_etrace_of(model.leak).values()
    assert leak_leaves["weight"].shape == (B, O, 1)


@pytest.mark.parametrize(
    "weight", [lambda m: m.r, lambda m: brainstate.ParamState(jnp.zeros(3)), lambda m: ("nope",)],
    ids=["plain-readout", "foreign-state", "unknown-path"],
)
def test_get_etrace_of_an_untraced_weight(weight: Callable[[Any], Any]) -> None:
    learner, model = _stepped(B)
    with pytest.raises(ValueError, match="etrace of the given weight"):
        learner.get_etrace_of(weight(model))


# --- hooks that mix entries across output columns -------------------------------------------
#
# The dense, grouped, sparse and embedding families keep their D-RTRL traces in the space of
# the transformed parameters and apply each hook's VJP once, in the solve; a hook that couples
# entries feeding different outputs is then exact, like element_wise, lora and einsum.


def softmax_last(v: jax.Array) -> jax.Array:
    """A coupling transform along the last (output) axis."""
    return jax.nn.softmax(v, axis=-1)


def _grouped_x(batch: int | None) -> jax.Array:
    return normal(10, (T, 2, I) if batch is None else (T, batch, 2, I))


def _sparse_hooked(weight_fn: Callable[[Any], Any], bias_fn: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def op(m: Any, x: Any) -> Any:
        sparse = _optional("sparse")
        return sparse.sparse_matmul(
            x, m.w.value, sparse_mat=csr(), bias=m.b.value, weight_fn=weight_fn, bias_fn=bias_fn
        )

    return op


GROUPED_B = params(w=w(4, 2, I, O), b=w(5, 2, O, scale=0.1))
EMB = params(w=w(6, 5, O))

MIXING_ROWS = [
    Row(
        "mm-fn-norm-bias-softmax", MM_B,
        lambda m, x: braintrace.matmul(x, m.w.value, m.b.value, weight_fn=normalised, bias_fn=softmax_last),
        dense_x,
    ),
    Row(
        "mm-fn-softmax-readout", MM_B,
        lambda m, x: braintrace.matmul(x, m.w.value, m.b.value, weight_fn=softmax_last), dense_x, readout=True,
    ),
    Row(
        "grouped-fn-softmax-bias-norm", GROUPED_B,
        lambda m, x: braintrace.grouped_matmul(x, m.w.value, m.b.value, weight_fn=softmax_last, bias_fn=normalised),
        _grouped_x,
    ),
    Row(
        "grouped-fn-norm", GROUPED_B,
        lambda m, x: braintrace.grouped_matmul(x, m.w.value, m.b.value, weight_fn=normalised), _grouped_x,
    ),
    Row("sparse-fn-norm-bias-softmax", sparse_params(True), _sparse_hooked(normalised, softmax_last), dense_x),
    Row("sparse-fn-softmax-bias-norm", sparse_params(True), _sparse_hooked(softmax_last, normalised), dense_x),
    Row(
        "embedding-fn-softmax", EMB,
        lambda m, x: braintrace.embedding(x, m.w.value, weight_fn=softmax_last), tokens,
    ),
    Row(
        "embedding-fn-norm", EMB,
        lambda m, x: braintrace.embedding(x, m.w.value, weight_fn=normalised), tokens, tail=identity,
    ),
]
MIXING_ROW = {row.id: row for row in MIXING_ROWS}


def _mixing_cases(ids: Any = None) -> list[Any]:
    return [
        pytest.param(row, batched, id=f"{row.id}-{'batched' if batched else 'unbatched'}")
        for row in MIXING_ROWS if ids is None or row.id in ids for batched in row.batched
    ]


@pytest.mark.parametrize("row, batched", _mixing_cases())
def test_single_step_equals_bptt_for_column_mixing_hooks(x64: None, row: Row, batched: bool) -> None:
    make, xs, batch = _setup(row, batched)
    ref = bptt_grads(make(), xs, batch_size=batch)
    got = single_step_grads(compile_quiet(make(), xs[0], batch), xs)
    assert set(got) == set(ref)
    assert all(np.any(ref[p] != 0) for p in ref), "every parameter must be exercised"
    assert max_rel_err(ref, got) < EXACT


_WINDOW_ROWS = (
    "mm-fn-norm-bias-softmax", "grouped-fn-softmax-bias-norm", "sparse-fn-norm-bias-softmax", "embedding-fn-softmax",
)


@pytest.mark.parametrize("windows", [[T], [2, 1, 1]], ids=["whole", "split"])
@pytest.mark.parametrize("row, batched", _mixing_cases(_WINDOW_ROWS))
def test_windows_equal_bptt_for_column_mixing_hooks(x64: None, row: Row, batched: bool, windows: list[int]) -> None:
    """Multi-step windows (a whole-sequence window, and windows that hand the trace on)."""
    make, xs, batch = _setup(row, batched)
    ref = bptt_grads(make(), xs, batch_size=batch)
    learner = compile_quiet(make(), xs[0], batch, vjp_method="multi-step")
    assert max_rel_err(ref, window_grads(learner, xs, windows)) < EXACT


class ClippedTraces(braintrace.D_RTRL):
    """A rule defined outside the library that clips every trace when it is rolled."""

    def _update_etrace_data(self, *args: Any, **kwargs: Any) -> Any:
        new = super()._update_etrace_data(*args, **kwargs)
        return jax.tree.map(lambda v: jnp.clip(v, -0.05, 0.05), new)


@pytest.mark.parametrize("fast_solve", [True, False], ids=["fast", "general"])
def test_a_subclass_that_changes_rolled_traces_gets_the_history_of_its_stored_trace(
    x64: None, fast_solve: bool
) -> None:
    # History = ⟨Dᵀ g, ε^{t-1}⟩ with the stored (clipped) trace, whichever kernels roll it.
    xs = normal(90, (T, B, I))
    row = ROWS[0]

    def learner_with(fast: bool) -> Any:
        model = Leaky(row, xs[0], True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return braintrace.compile(model, ClippedTraces, xs[0], batch_size=B, fast_solve=fast)

    learner = learner_with(fast_solve)
    assert not learner._rolls_plainly()
    assert (learner._fast_path(learner.graph.hidden_param_op_relations[0]) is not None) == fast_solve
    clipped = single_step_grads(learner, xs)
    assert max_rel_err(single_step_grads(learner_with(not fast_solve), xs), clipped) < EXACT
    assert max_rel_err(bptt_grads(Leaky(row, xs[0], True), xs, batch_size=B), clipped) > 1e-3


class SpikingDrive(brainstate.nn.Module):
    """``h = 0.8 h + spike(move(x @ W))`` with ``spike`` a ``custom_vjp`` function."""

    def __init__(self, roll: bool = False) -> None:
        super().__init__()
        self.roll = roll
        self.w = brainstate.ParamState(normal(91, (I, O), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, O)))

    def update(self, x: Any) -> Any:
        drive = braintrace.matmul(x, self.w.value)
        self.h.value = 0.8 * self.h.value + soft_spike(jnp.roll(drive, 1, axis=-1) if self.roll else drive)
        return self.h.value


def test_a_custom_vjp_function_between_a_weight_and_the_hidden_state_is_differentiated_by_its_vjp(
    x64: None
) -> None:
    """Forward mode cannot differentiate a ``custom_vjp`` function: the tail's ``df`` is its VJP,
    the user's surrogate slope, and D_RTRL stays exact (one element-wise layer)."""
    xs = normal(92, (T, B, I))
    learner = braintrace.compile(SpikingDrive(), braintrace.D_RTRL, xs[0], batch_size=B)
    assert max_rel_err(bptt_grads(SpikingDrive(), xs, batch_size=B), single_step_grads(learner, xs)) < EXACT


def test_a_custom_vjp_function_on_a_tail_that_moves_values_is_refused_with_the_fix() -> None:
    xs = normal(93, (T, B, I))
    with pytest.raises(braintrace.NotSupportedError, match="may move values between positions.*jax.custom_jvp"):
        braintrace.compile(SpikingDrive(roll=True), braintrace.D_RTRL, xs[0], batch_size=B)

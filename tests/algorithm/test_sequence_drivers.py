"""The sequence drivers ``etrace_grad`` / ``etrace_evolve`` and ``ETraceVmap``.

References: the hand-written blocks the drivers replace (one ``brainstate.transform.grad`` per
call inside a ``scan``, summed), and the BPTT oracle of :mod:`tests.algorithm.bptt` for the cases
where the online estimate is exact (D_RTRL on a diagonal linear recurrence, one window covering
the whole sequence). Groups follow the driver contract: equivalence, modes, masking, vmap,
surface, lifecycle, rule interactions (pp_prop), robustness and argument errors, and the cases
where we go beyond upstream 0.2.5 (exact plain gradients on single-step learners, the pp_prop
correction counted in steps, transactional failure, forwarded introspection). Each test runs its
drivers and references under one ``brainstate.transform.jit`` where it can, so it compiles once.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import braintrace
from braintrace import SequenceDriverMixin
from braintrace._algorithm.engine.input_data import ETraceInputData
from tests.algorithm.bptt import Grads, _to_numpy, bptt_grads, max_rel_err, normal, x64

__all__ = ["x64"]  # the fixture is used by name

N_IN, N_REC, T, K = 3, 4, 6, 2
EXACT = 1e-10
BINARY = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]  # total weight 4
WEIGHTED = [1.0, 0.5, 0.0, 2.0, 0.25, 1.0]  # total weight 4.75


# --- models -----------------------------------------------------------------------------------


class TanhRNN(brainstate.nn.Module):
    """``h = tanh(x W_in + b + h W_rec)``, ``h`` of shape ``(1, n_rec)``: D_RTRL is approximate."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = brainstate.ParamState(normal(0, (N_IN, N_REC), 0.6))
        self.w_rec = brainstate.ParamState(normal(1, (N_REC, N_REC), 0.5))
        self.b = brainstate.ParamState(normal(2, (N_REC,), 0.1))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((1, N_REC)))

    def update(self, x: Any) -> Any:
        y = braintrace.matmul(x, self.w_in.value, self.b.value) + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = jnp.tanh(y)
        return self.h.value


class ReadoutRNN(TanhRNN):
    """:class:`TanhRNN` read out by two plain (non-ETP) heads ``h R`` and ``h R2``."""

    def __init__(self, two_heads: bool = False) -> None:
        super().__init__()
        self.two_heads = two_heads
        self.r = brainstate.ParamState(normal(3, (N_REC, N_REC), 0.7))
        if two_heads:
            self.r2 = brainstate.ParamState(normal(4, (N_REC, 2), 0.7))

    def update(self, x: Any) -> Any:
        h = super().update(x)
        return (h @ self.r.value, h @ self.r2.value) if self.two_heads else h @ self.r.value


class Leaky(brainstate.nn.Module):
    """``h = 0.9 h + x W``, ``h`` of shape ``(n_rec,)``: D_RTRL's trace is the true influence."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(5, (N_IN, N_REC)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((N_REC,)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.9 * self.h.value + braintrace.matmul(x, self.w.value)
        return self.h.value


class LeakyReadout(Leaky):
    """:class:`Leaky` read out by ``h R`` (a plain weight): pp_prop's regime."""

    def __init__(self) -> None:
        super().__init__()
        self.r = brainstate.ParamState(normal(6, (N_REC, N_REC)))

    def update(self, x: Any) -> Any:
        return super().update(x) @ self.r.value


class MilliVolt(brainstate.nn.Module):
    """``v = 0.9 v + x W`` with ``W`` and ``v`` in mV."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(7, (N_IN, N_REC)) * u.mV)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros((1, N_REC)) * u.mV)

    def update(self, x: Any) -> Any:
        self.v.value = 0.9 * self.v.value + braintrace.matmul(x, self.w.value)
        return self.v.value.to_decimal(u.mV)


class VmapNet(brainstate.nn.Module):
    """A ``ValinaRNNCell`` (its state created in ``init_state``) read out by a plain ``h R``."""

    def __init__(self) -> None:
        super().__init__()
        with brainstate.random.seed_context(11):
            self.cell = braintrace.nn.ValinaRNNCell(N_IN, N_REC)
        self.r = brainstate.ParamState(normal(8, (N_REC, 2)))

    def update(self, x: Any) -> Any:
        return self.cell(x) @ self.r.value


def make(model: Callable[[], brainstate.nn.Module] = TanhRNN, vjp: str = "single-step",
         algorithm: Any = braintrace.D_RTRL, **options: Any) -> Any:
    """A freshly compiled unbatched learner (the compiler's notes about plain weights silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model(), algorithm, jnp.zeros(N_IN), vjp_method=vjp, **options)


def make_vmapped(batch: int) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(VmapNet(), braintrace.D_RTRL, jnp.zeros((batch, N_IN)), batch_size=batch,
                                  vmap=True)


def data(n: int = T) -> tuple[jax.Array, jax.Array]:
    """Inputs ``(n, n_in)`` and targets ``(n, 1, n_rec)``."""
    return normal(20, (n, N_IN)), normal(21, (n, 1, N_REC), 0.5)


# --- losses and reference blocks --------------------------------------------------------------


def sq(out: Any, y: Any) -> jax.Array:
    return jnp.sum((out - y) ** 2)


def window_sq(out: Any, y: Any) -> jax.Array:
    """One squared error per step of a window ``(k, ...)``: ``(k,)``."""
    d = jnp.reshape(out, jnp.shape(y)) - y
    return jnp.sum(d ** 2, axis=tuple(range(1, d.ndim)))


def plain_fn(learner: Any) -> Callable[[Any, Any], jax.Array]:
    return lambda x, y: sq(learner(x), y)


def window_fn(learner: Any) -> Callable[[Any, Any], jax.Array]:
    return lambda x, y: window_sq(learner(braintrace.MultiStepData(x)), y)


def step_fn_for(learner: Any, chunk_size: int | None) -> Callable[[Any, Any], jax.Array]:
    return window_fn(learner) if chunk_size is not None and chunk_size >= 2 else plain_fn(learner)


def zeros_like_params(params: Any) -> dict[Any, Any]:
    return {p: jax.tree.map(jnp.zeros_like, st.value) for p, st in params.items()}


def hand_block(learner: Any, xs: Any, ys: Any, mask: Any = None, params: Any = None) -> tuple[Any, Any]:
    """What users wrote before the drivers: one grad per step in a scan, summed; ``(grads, losses)``."""
    params = learner.param_states if params is None else params

    def body(acc: Any, inputs: Any) -> tuple[Any, Any]:
        x, y, w = inputs
        loss_fn = (lambda: sq(learner(x), y)) if mask is None else (lambda: w * sq(learner(x), y))
        g, loss = brainstate.transform.grad(loss_fn, params, return_value=True)()
        return jax.tree.map(jnp.add, acc, g), loss

    weights = jnp.ones(len(xs)) if mask is None else jnp.asarray(mask, jnp.float32)
    return brainstate.transform.scan(body, zeros_like_params(params), (xs, ys, weights))


def hand_windows(learner: Any, xs: Any, ys: Any, k: int) -> tuple[Any, Any]:
    """One ``MultiStepData`` call and one grad per window of ``k`` steps, summed; ``(grads, losses)``."""
    params = learner.param_states

    def body(acc: Any, inputs: Any) -> tuple[Any, Any]:
        x, y = inputs

        def loss_fn() -> tuple[jax.Array, jax.Array]:
            losses = window_sq(learner(braintrace.MultiStepData(x)), y)
            return jnp.sum(losses), losses

        g, losses = brainstate.transform.grad(loss_fn, params, has_aux=True)()
        return jax.tree.map(jnp.add, acc, g), losses

    windows = (xs.reshape((-1, k, *xs.shape[1:])), ys.reshape((-1, k, *ys.shape[1:])))
    grads, losses = brainstate.transform.scan(body, zeros_like_params(params), windows)
    return grads, losses.reshape(-1)


def state_values(learner: Any) -> dict[Any, np.ndarray]:
    """Every state of the learner (hidden states, traces, counters) as NumPy arrays.

    Trace paths hold the id of their relation's output; it is replaced by the relation's index,
    so that identically built learners have the same keys.
    """
    index = {id(rel.y_var): i for i, rel in enumerate(learner.graph.hidden_param_op_relations)}

    def stable(part: Any) -> Any:
        if isinstance(part, tuple) and part and part[0] in index:
            return ("relation", index[part[0]], *part[1:])
        return part

    return {
        (tuple(stable(p) for p in path), jax.tree_util.keystr(keys)): np.asarray(leaf)
        for path, st in learner.states().items()
        for keys, leaf in jax.tree_util.tree_flatten_with_path(st.value)[0]
    }


def assert_same_states(a: dict[Any, np.ndarray], b: dict[Any, np.ndarray], exact: bool = True) -> None:
    assert set(a) == set(b)
    for key in a:
        if exact:
            np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))
        else:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7, err_msg=str(key))


def from_start(learner: Any, fn: Callable[..., Any], args_list: list[tuple[Any, ...]]) -> list[Any]:
    """``fn(*args)`` for each ``args``, under one jit, each from the learner's current states."""
    snapshot = [(st, st.value) for st in learner.states().values()]
    jitted = brainstate.transform.jit(fn)
    results = []
    for args in args_list:
        for st, value in snapshot:
            st.value = value
        results.append(jitted(*args))
    return results


def jitted(fn: Callable[[], Any]) -> Any:
    """``fn()`` under one ``brainstate.transform.jit``: the runs of a test compile together, once."""
    return brainstate.transform.jit(fn)()


def assert_bitwise(a: Grads, b: Grads) -> None:
    assert set(a) == set(b)
    for p in a:
        np.testing.assert_array_equal(a[p], b[p], err_msg=str(p))


def assert_close(a: Grads, b: Grads, rtol: float, atol: float = 0.0) -> None:
    assert set(a) == set(b)
    for p in a:
        np.testing.assert_allclose(a[p], b[p], rtol=rtol, atol=atol, err_msg=str(p))


def scaled(grads: Grads, factor: float) -> Grads:
    return {p: g * factor for p, g in grads.items()}


# --- 1. equivalence -----------------------------------------------------------------------------


@pytest.mark.parametrize("vjp", ["single-step", "multi-step"])
def test_sum_equals_the_hand_written_block(vjp: str) -> None:
    xs, ys = data()
    a, b = make(vjp=vjp), make(vjp=vjp)
    grads, losses = a.etrace_grad(xs, ys, step_fn=plain_fn(a), reduction="sum", return_value=True)
    ref, ref_losses = hand_block(b, xs, ys)  # compiled separately: the same program
    assert_bitwise(_to_numpy(grads), _to_numpy(ref))
    np.testing.assert_array_equal(losses, ref_losses)
    assert int(a.running_index.value) == T


@pytest.mark.parametrize("mask, total", [(None, float(T)), (BINARY, 4.0), (WEIGHTED, 4.75)],
                         ids=["none", "binary", "weighted"])
def test_mean_is_sum_over_the_total_mask_weight(mask: Any, total: float) -> None:
    xs, ys = data()
    a, b, c = make(), make(), make()

    def run() -> Any:
        options: dict[str, Any] = {"mask": mask, "return_value": True, "loss_output": "scalar"}
        return (a.etrace_grad(xs, ys, step_fn=plain_fn(a), **options),
                b.etrace_grad(xs, ys, step_fn=plain_fn(b), reduction="sum", **options),
                hand_block(c, xs, ys, mask=mask)[0])

    (mean, j_mean), (total_sum, j_sum), hand = jitted(run)
    assert_close(_to_numpy(mean), scaled(_to_numpy(total_sum), 1 / total), rtol=1e-6)
    np.testing.assert_allclose(j_mean, j_sum / total, rtol=1e-6)
    assert_close(_to_numpy(total_sum), _to_numpy(hand), rtol=1e-6, atol=1e-7)  # the mask-weighted hand block


def test_one_window_over_everything_equals_the_whole_sequence_oracle() -> None:
    xs, ys = data()
    learner, other = make(vjp="multi-step"), make(vjp="multi-step")
    grads, (whole, _) = jitted(lambda: (
        learner.etrace_grad(xs, ys, step_fn=window_fn(learner), chunk_size=T, reduction="sum"),
        hand_windows(other, xs, ys, T)))
    assert int(learner.running_index.value) == 1
    assert_close(_to_numpy(grads), _to_numpy(whole), rtol=1e-5, atol=1e-7)
    # One window is exact BPTT whatever the rule (upstream finding F-23).
    bptt = bptt_grads(TanhRNN(), xs, loss=lambda t, out: sq(out, ys[t]))
    assert max_rel_err(bptt, _to_numpy(grads)) < 1e-5


# --- 2. modes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("vjp", ["single-step", "multi-step"])
def test_chunk_size_one_is_the_plain_path_bitwise(vjp: str) -> None:
    xs, ys = data()
    a, b = make(vjp=vjp), make(vjp=vjp)
    (g_none, l_none), (g_one, l_one) = jitted(lambda: (
        a.etrace_grad(xs, ys, step_fn=plain_fn(a), return_value=True),
        b.etrace_grad(xs, ys, step_fn=plain_fn(b), chunk_size=1, return_value=True)))
    assert_bitwise(_to_numpy(g_none), _to_numpy(g_one))
    np.testing.assert_array_equal(l_none, l_one)
    assert int(a.running_index.value) == int(b.running_index.value) == T
    np.testing.assert_array_equal(a.model4compile.h.value, b.model4compile.h.value)


def test_plain_path_equals_length_one_windows() -> None:
    xs, ys = data()
    a, b = make(vjp="multi-step"), make(vjp="multi-step")
    # A length-1 window is not reachable through the driver (chunk_size=1 is plain): hand-built.
    params = b.param_states

    def body(acc: Any, inputs: Any) -> tuple[Any, None]:
        x, y = inputs
        g = brainstate.transform.grad(lambda: sq(b(braintrace.MultiStepData(x[None]))[0], y), params)()
        return jax.tree.map(jnp.add, acc, g), None

    grads, (ref, _) = jitted(lambda: (a.etrace_grad(xs, ys, step_fn=plain_fn(a), reduction="sum"),
                                      brainstate.transform.scan(body, zeros_like_params(params), (xs, ys))))
    assert max_rel_err(_to_numpy(ref), _to_numpy(grads)) < 1e-5


def test_single_step_learner_refuses_windows_but_accepts_one() -> None:
    xs, ys = data()
    learner = make()
    with pytest.raises(ValueError, match="etrace_grad: window mode .* needs a multi-step learner"):
        learner.etrace_grad(xs, ys, step_fn=window_fn(learner), chunk_size=K)
    assert int(learner.running_index.value) == 0
    learner.etrace_grad(xs, ys, step_fn=plain_fn(learner), chunk_size=1)
    assert int(learner.running_index.value) == T


def test_evolve_drives_a_single_step_learner_in_windows() -> None:
    xs, _ = data()
    learner = make()
    learner.etrace_evolve(xs, chunk_size=K)
    assert int(learner.running_index.value) == T // K


class Stub(SequenceDriverMixin):
    """A host of the mixin that reports no ``vjp_method`` (``None``)."""

    _seq_vjp_method = None

    def __init__(self) -> None:
        self.w = brainstate.ParamState(jnp.ones(N_IN))
        self.calls_traced = 0

    @property
    def _seq_param_states(self) -> dict[Any, Any]:
        return {("w",): self.w}

    def __call__(self, x: Any) -> Any:
        self.calls_traced += 1
        return (x.data if isinstance(x, braintrace.MultiStepData) else x) * self.w.value


def test_a_host_without_vjp_method_is_refused_window_mode() -> None:
    stub = Stub()
    xs = jnp.ones((T, N_IN))
    with pytest.raises(ValueError, match="multi-step.*None"):
        stub.etrace_grad(xs, step_fn=lambda x: jnp.sum(stub(x)), chunk_size=K)
    grads = stub.etrace_grad(xs, step_fn=lambda x: jnp.sum(stub(x)), reduction="sum")
    np.testing.assert_allclose(grads[("w",)], T * np.ones(N_IN))
    stub.etrace_evolve(xs, chunk_size=K)  # no VJP is taken: any host drives windows


@pytest.mark.parametrize("chunk_size, shape", [(None, (N_IN,)), (1, (N_IN,)), (K, (K, N_IN)), (3, (3, N_IN))])
def test_slices_step_fn_receives(chunk_size: int | None, shape: tuple[int, ...]) -> None:
    xs, ys = data()
    learner = make(vjp="multi-step")
    seen = []
    inner = step_fn_for(learner, chunk_size)

    def step_fn(x: Any, y: Any) -> jax.Array:
        seen.append((type(x), x.shape))
        return inner(x, y)

    learner.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=chunk_size)
    assert [s for _, s in seen] == [shape]  # traced once
    assert not issubclass(seen[0][0], ETraceInputData)


@pytest.mark.parametrize(
    "chunk_size, loss, received",
    [(None, lambda out: jnp.sum(out ** 2, axis=-1), r"\(1,\)"),
     (None, lambda out: out, r"\(1, 4\)"),
     (K, lambda out: jnp.sum(out ** 2), r"\(\)"),
     (K, lambda out: jnp.sum(out ** 2, axis=-1), r"\(2, 1\)")],
    ids=["plain-(1,)", "plain-(1,4)", "window-()", "window-(2,1)"],
)
def test_wrong_loss_rank_is_refused(chunk_size: int | None, loss: Callable[[Any], Any], received: str) -> None:
    xs, _ = data()
    learner = make(vjp="multi-step")

    def step_fn(x: Any) -> Any:
        return loss(learner(braintrace.MultiStepData(x)) if chunk_size else learner(x))

    expected = "scalar" if chunk_size is None else r"expected shape \(k,\) = \(2,\)"
    with pytest.raises(ValueError, match=f"{expected}.*got shape {received}"):
        learner.etrace_grad(xs, step_fn=step_fn, chunk_size=chunk_size)
    assert int(learner.running_index.value) == 0


def test_plain_and_window_estimates_differ() -> None:
    # Window mode changes the learning rule of an approximate rule (a negative control).
    xs, ys = data()
    a, b = make(vjp="multi-step"), make(vjp="multi-step")
    plain, window = jitted(lambda: (a.etrace_grad(xs, ys, step_fn=plain_fn(a), reduction="sum"),
                                    b.etrace_grad(xs, ys, step_fn=window_fn(b), chunk_size=K, reduction="sum")))
    assert max_rel_err(_to_numpy(plain), _to_numpy(window)) > 1e-3


@pytest.mark.parametrize("k", [2, 3])
def test_window_mode_equals_the_hand_written_window_loop(k: int) -> None:
    xs, ys = data()
    a, b = make(vjp="multi-step"), make(vjp="multi-step")
    (grads, losses), (ref, ref_losses) = jitted(lambda: (
        a.etrace_grad(xs, ys, step_fn=window_fn(a), chunk_size=k, reduction="sum", return_value=True),
        hand_windows(b, xs, ys, k)))
    assert_close(_to_numpy(grads), _to_numpy(ref), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert int(a.running_index.value) == T // k


# --- 3. masking ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, K])
def test_a_zero_prefix_mask_equals_evolving_the_prefix(chunk_size: int | None) -> None:
    xs, ys = data()
    a, b, c = make(vjp="multi-step"), make(vjp="multi-step"), make(vjp="multi-step")
    prefix = 2
    mask = [0.0] * prefix + [1.0] * (T - prefix)

    def run() -> Any:
        a.etrace_evolve(xs[:prefix], chunk_size=chunk_size)
        g1 = a.etrace_grad(xs[prefix:], ys[prefix:], step_fn=step_fn_for(a, chunk_size), chunk_size=chunk_size)
        g2 = b.etrace_grad(xs, ys, step_fn=step_fn_for(b, chunk_size), chunk_size=chunk_size, mask=mask)
        g3 = c.etrace_grad(xs[prefix:], ys[prefix:], step_fn=step_fn_for(c, chunk_size), chunk_size=chunk_size)
        return g1, g2, g3

    g1, g2, g3 = jitted(run)
    # Float32, two programs: their sums may round differently.
    assert_close(_to_numpy(g1), _to_numpy(g2), rtol=1e-5, atol=1e-8)
    # Masking is not shortening: the masked steps still drive the model and its traces.
    assert max_rel_err(_to_numpy(g2), _to_numpy(g3)) > 1e-3


def test_an_interior_hole_equals_grad_evolve_grad() -> None:
    xs, ys = data()
    a, b, c = make(), make(), make()
    hole = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    keep = np.array([0, 1, 4, 5])

    def run() -> Any:
        masked = a.etrace_grad(xs, ys, step_fn=plain_fn(a), mask=hole, reduction="sum")
        g1 = b.etrace_grad(xs[:2], ys[:2], step_fn=plain_fn(b), reduction="sum")
        b.etrace_evolve(xs[2:4])
        g2 = b.etrace_grad(xs[4:], ys[4:], step_fn=plain_fn(b), reduction="sum")
        dropped = c.etrace_grad(xs[keep], ys[keep], step_fn=plain_fn(c), reduction="sum")
        return masked, jax.tree.map(jnp.add, g1, g2), dropped

    masked, split, dropped = jitted(run)
    assert_close(_to_numpy(masked), _to_numpy(split), rtol=1e-5, atol=1e-7)
    assert max_rel_err(_to_numpy(masked), _to_numpy(dropped)) > 1e-3


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_all_zero_mask_gives_exact_finite_zeros(reduction: str) -> None:
    xs, ys = data()
    learner = make()
    grads, j = learner.etrace_grad(xs, ys, step_fn=plain_fn(learner), mask=jnp.zeros(T), reduction=reduction,
                                   return_value=True, loss_output="scalar")
    for g in _to_numpy(grads).values():
        assert np.all(np.isfinite(g)) and np.all(g == 0)
    assert float(j) == 0.0
    assert int(learner.running_index.value) == T  # the model still ran


def test_a_weighted_mask_weights_the_per_step_estimates() -> None:
    xs, ys = data()
    learner = make()

    def run(mask: Any) -> Any:
        return learner.etrace_grad(xs, ys, step_fn=plain_fn(learner), mask=mask, reduction="sum")

    one_hot = [(jnp.eye(T)[t],) for t in range(T)]
    results = from_start(learner, run, [*one_hot, (jnp.asarray(WEIGHTED),), (jnp.asarray(BINARY),)])
    per_step = [_to_numpy(g) for g in results[:T]]
    weighted, binary = _to_numpy(results[T]), _to_numpy(results[T + 1])
    combined = {p: sum(w * g[p] for w, g in zip(WEIGHTED, per_step)) for p in weighted}
    for p in weighted:
        np.testing.assert_allclose(weighted[p], combined[p], rtol=1e-6, atol=1e-6)
    assert max_rel_err(weighted, binary) > 1e-3


# --- 4. vmap ------------------------------------------------------------------------------------


def test_compile_vmap_returns_an_etrace_vmap() -> None:
    vmapped = make_vmapped(3)
    assert type(vmapped) is braintrace.ETraceVmap and type(vmapped).__module__ == "braintrace"
    assert isinstance(vmapped, brainstate.nn.Vmap) and isinstance(vmapped, SequenceDriverMixin)
    assert isinstance(vmapped.module, braintrace.ETraceAlgorithm)
    assert callable(vmapped.etrace_grad) and callable(vmapped.etrace_evolve)


def test_vmapped_sum_equals_the_sum_of_per_lane_estimates() -> None:
    batch = 3
    xs, ys = normal(30, (T, batch, N_IN)), normal(31, (T, batch, 2))
    vmapped = make_vmapped(batch)
    assert vmapped._seq_vjp_method == "single-step"

    def run(x: Any, y: Any) -> Any:
        return vmapped.etrace_grad(x, y, step_fn=lambda xt, yt: sq(vmapped(xt), yt), reduction="sum")

    batched, mispaired = from_start(vmapped, run, [(xs, ys), (xs, jnp.roll(ys, 1, axis=1))])

    lane = make(VmapNet)

    def lane_run(x: Any, y: Any) -> Any:
        return lane.etrace_grad(x, y, step_fn=lambda xt, yt: sq(lane(xt), yt), reduction="sum")

    per_lane = [_to_numpy(g) for g in from_start(lane, lane_run, [(xs[:, i], ys[:, i]) for i in range(batch)])]
    total = {p: sum(g[p] for g in per_lane) for p in per_lane[0]}
    got = _to_numpy(batched)
    assert_close(got, total, rtol=2e-6, atol=1e-6)
    for p, g in got.items():
        assert np.all(np.abs(g) > 0), p
    assert max_rel_err(total, _to_numpy(mispaired)) > 1e-3


@pytest.mark.parametrize("batch", [3, K], ids=["B=3", "B=k"])
def test_vmapped_window_mode_is_refused_and_chunk_one_admitted(batch: int) -> None:
    vmapped = make_vmapped(batch)
    xs, ys = normal(30, (T, batch, N_IN)), normal(31, (T, batch, 2))
    step_fn = lambda x, y: sq(vmapped(x), y)  # noqa: E731
    for call in (lambda: vmapped.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=K),
                 lambda: vmapped.etrace_evolve(xs, chunk_size=K)):
        with pytest.raises(ValueError, match="vmap.*chunk_size=None"):
            call()
    vmapped.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=1)
    vmapped.etrace_evolve(xs, chunk_size=1)
    assert int(vmapped.module.running_index.value) == 2 * T


def test_vmap_introspection_is_forwarded_read_only(capsys: pytest.CaptureFixture[str]) -> None:
    vmapped = make_vmapped(2)
    module = vmapped.module
    assert vmapped.graph is module.graph
    assert vmapped.report.hidden_groups == module.report.hidden_groups
    assert vmapped.param_states == module.param_states and vmapped.hidden_states == module.hidden_states
    assert vmapped.vjp_method == module.vjp_method == "single-step"
    assert vmapped.show_graph(return_msg=True) == module.show_graph(return_msg=True)
    capsys.readouterr()
    for name in ("graph", "report", "param_states", "hidden_states", "vjp_method"):
        with pytest.raises(AttributeError):
            setattr(vmapped, name, None)


# --- 5. surface ---------------------------------------------------------------------------------


@pytest.mark.parametrize("return_value", [False, True])
@pytest.mark.parametrize("has_aux", [False, True])
def test_return_arity(return_value: bool, has_aux: bool) -> None:
    xs, ys = data()
    learner = make()

    def step_fn(x: Any, y: Any) -> Any:
        out = learner(x)
        return (sq(out, y), out) if has_aux else sq(out, y)

    result = learner.etrace_grad(xs, ys, step_fn=step_fn, has_aux=has_aux, return_value=return_value)
    parts = result if (return_value or has_aux) else (result,)
    assert len(parts) == 1 + return_value + has_aux
    assert set(parts[0]) == set(learner.param_states)
    if return_value:
        assert parts[1].shape == (T,)
    if has_aux:
        assert parts[-1].shape == (T, 1, N_REC)


@pytest.mark.parametrize("loss_output, shape", [("per_step", (T,)), ("masked", (T,)), ("scalar", ())])
def test_loss_outputs(loss_output: str, shape: tuple[int, ...]) -> None:
    xs, ys = data()
    a, b = make(), make()
    (_, raw), (_, out) = jitted(lambda: (
        a.etrace_grad(xs, ys, step_fn=plain_fn(a), mask=WEIGHTED, return_value=True),
        b.etrace_grad(xs, ys, step_fn=plain_fn(b), mask=WEIGHTED, return_value=True, loss_output=loss_output)))
    assert out.shape == shape
    expected = {"per_step": raw, "masked": np.asarray(WEIGHTED) * raw,
                "scalar": np.sum(np.asarray(WEIGHTED) * raw) / 4.75}[loss_output]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert float(raw[2]) > 0  # a zero-weight step shows its real loss under 'per_step' ...
    if loss_output == "masked":
        assert float(out[2]) == 0.0  # ... and 0 under 'masked'


def test_aux_stacks_over_windows() -> None:
    xs, ys = data()
    learner = make(vjp="multi-step")

    def step_fn(x: Any, y: Any) -> Any:
        out = learner(braintrace.MultiStepData(x))
        return window_sq(out, y), {"out": out, "first": out[0]}

    _, losses, aux = learner.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=K, has_aux=True, return_value=True)
    assert losses.shape == (T,)
    assert aux["out"].shape == (T // K, K, 1, N_REC) and aux["first"].shape == (T // K, 1, N_REC)


def test_weights_subset_returns_only_those_keys() -> None:
    xs, ys = data()
    a, b = make(), make()
    subset = {p: st for p, st in a.param_states.items() if p != ("w_rec",)}
    before = {p: np.asarray(st.value) for p, st in a.param_states.items()}
    grads, full = jitted(lambda: (a.etrace_grad(xs, ys, step_fn=plain_fn(a), weights=subset),
                                  b.etrace_grad(xs, ys, step_fn=plain_fn(b))))
    assert set(grads) == {("w_in",), ("b",)}
    for p, st in a.param_states.items():
        np.testing.assert_array_equal(st.value, before[p])
    assert_bitwise(_to_numpy(grads), {k: v for k, v in _to_numpy(full).items() if k != ("w_rec",)})


def test_default_weights_are_the_models_param_states() -> None:
    model = TanhRNN()
    learner = braintrace.compile(model, braintrace.D_RTRL, jnp.zeros(N_IN))
    xs, ys = data()
    grads = learner.etrace_grad(xs, ys, step_fn=plain_fn(learner))
    params = model.states(brainstate.ParamState)
    assert set(grads) == set(params)
    assert all(learner.param_states[p] is params[p] for p in params)


def test_three_sequences_arrive_in_order_and_untransposed() -> None:
    learner = make()
    xs = normal(40, (T, N_IN))
    gains = jnp.arange(T, dtype=jnp.float32)
    targets = {"y": normal(41, (T, 1, N_REC)), "scale": jnp.linspace(1.0, 2.0, T)}
    seen = []

    def step_fn(x: Any, gain: Any, target: Any) -> jax.Array:
        seen.append((x.shape, gain.shape, target["y"].shape, target["scale"].shape))
        return target["scale"] * sq(learner(x) * gain, target["y"])

    ref_learner = make()

    def ref_body(_: None, t: Any) -> tuple[None, Any]:
        return None, targets["scale"][t] * sq(ref_learner(xs[t]) * gains[t], targets["y"][t])

    (_, losses), (_, ref) = jitted(lambda: (
        learner.etrace_grad(xs, gains, targets, step_fn=step_fn, return_value=True),
        brainstate.transform.scan(ref_body, None, jnp.arange(T))))
    assert seen == [((N_IN,), (), (1, N_REC), ())]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_one_head_of_a_two_head_model() -> None:
    xs, ys = data()
    a, b = make(lambda: ReadoutRNN(two_heads=True)), make(lambda: ReadoutRNN(two_heads=True))
    params = b.param_states

    def body(acc: Any, inputs: Any) -> tuple[Any, None]:
        x, y = inputs
        g = brainstate.transform.grad(lambda: sq(b(x)[0], y), params)()
        return jax.tree.map(jnp.add, acc, g), None

    grads, (ref, _) = jitted(lambda: (a.etrace_grad(xs, ys, step_fn=lambda x, y: sq(a(x)[0], y), reduction="sum"),
                                      brainstate.transform.scan(body, zeros_like_params(params), (xs, ys))))
    assert_close(_to_numpy(grads), _to_numpy(ref), rtol=1e-6)
    assert np.all(np.asarray(grads[("r2",)]) == 0) and np.any(np.asarray(grads[("r",)]) != 0)


def test_a_regulariser_reading_the_hidden_state() -> None:
    xs, ys = data()
    a, b = make(), make()

    def regularised(learner: Any) -> Callable[[Any, Any], jax.Array]:
        def step_fn(x: Any, y: Any) -> jax.Array:
            out = learner(x)
            return sq(out, y) + 0.1 * jnp.sum(learner.model4compile.h.value ** 2)
        return step_fn

    params = b.param_states
    fn = regularised(b)

    def body(acc: Any, inputs: Any) -> tuple[Any, None]:
        g = brainstate.transform.grad(lambda: fn(*inputs), params)()
        return jax.tree.map(jnp.add, acc, g), None

    grads, (ref, _) = jitted(lambda: (a.etrace_grad(xs, ys, step_fn=regularised(a), reduction="sum"),
                                      brainstate.transform.scan(body, zeros_like_params(params), (xs, ys))))
    assert_close(_to_numpy(grads), _to_numpy(ref), rtol=1e-5)  # float32, two programs


# --- 6. lifecycle -------------------------------------------------------------------------------


def test_evolve_then_grad_is_one_trajectory() -> None:
    xs, ys = data()
    a, b = make(), make()

    def run() -> None:
        a.etrace_evolve(xs[:2])
        a.etrace_grad(xs[2:], ys[2:], step_fn=plain_fn(a))
        b.etrace_evolve(xs)

    jitted(run)
    assert_same_states(state_values(a), state_values(b), exact=False)


@pytest.mark.parametrize("chunk_size", [None, K])
def test_repeated_grad_calls_continue(chunk_size: int | None) -> None:
    xs, ys = data()
    a, b = make(vjp="multi-step"), make(vjp="multi-step")
    options: dict[str, Any] = {"chunk_size": chunk_size, "reduction": "sum"}

    def run() -> Any:
        g1 = a.etrace_grad(xs[:2], ys[:2], step_fn=step_fn_for(a, chunk_size), **options)
        g2 = a.etrace_grad(xs[2:], ys[2:], step_fn=step_fn_for(a, chunk_size), **options)
        return g1, g2, b.etrace_grad(xs, ys, step_fn=step_fn_for(b, chunk_size), **options)

    g1, g2, whole = jitted(run)
    assert_close(_to_numpy(jax.tree.map(jnp.add, g1, g2)), _to_numpy(whole), rtol=1e-5, atol=1e-7)
    calls = T if chunk_size is None else T // chunk_size
    assert int(a.running_index.value) == int(b.running_index.value) == calls


def _raise_after_calling(learner: Any, chunk_size: int | None) -> Callable[..., Any]:
    def step_fn(x: Any, *rest: Any) -> Any:
        learner(braintrace.MultiStepData(x) if chunk_size else x)
        raise RuntimeError("step_fn failed")
    return step_fn


@pytest.mark.parametrize("method", ["etrace_grad", "etrace_evolve"])
@pytest.mark.parametrize("chunk_size", [None, K])
def test_a_failing_step_fn_leaves_the_learner_untouched(method: str, chunk_size: int | None) -> None:
    xs, ys = data()
    learner, fresh = make(vjp="multi-step"), make(vjp="multi-step")
    jitted(lambda: (learner.etrace_evolve(xs[:2]), fresh.etrace_evolve(xs[:2])))
    before = state_values(learner)
    with pytest.raises(RuntimeError, match="step_fn failed"):
        getattr(learner, method)(xs, ys, step_fn=_raise_after_calling(learner, chunk_size), chunk_size=chunk_size)
    assert_same_states(before, state_values(learner))
    assert int(learner.running_index.value) == 2
    # Still usable, and it continues from where it was.
    g, ref = jitted(lambda: (learner.etrace_grad(xs[2:], ys[2:], step_fn=plain_fn(learner), reduction="sum"),
                             fresh.etrace_grad(xs[2:], ys[2:], step_fn=plain_fn(fresh), reduction="sum")))
    assert_bitwise(_to_numpy(g), _to_numpy(ref))


# --- 7. interactions: pp_prop --------------------------------------------------------------------


def counted_windows(learner: Any, xs: Any, ys: Any, k: int, steps_before: Callable[[int], int]) -> Any:
    """A hand-written window loop whose pp_prop correction, before window ``c``, counts ``steps_before(c)``."""
    total: Any = None
    for c in range(xs.shape[0] // k):
        learner.trace_steps.value = jnp.asarray(steps_before(c), learner.trace_steps.value.dtype)
        x, y = xs[c * k:(c + 1) * k], ys[c * k:(c + 1) * k]
        g = brainstate.transform.grad(lambda: jnp.sum(window_fn(learner)(x, y)), learner.param_states)()
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    return total


def test_windowed_pp_prop_uses_the_true_step_count(x64: None) -> None:
    # F-30: upstream indexes the correction by calls, lagging it by a factor k in window mode.
    xs, ys = data()
    options = {"vjp": "multi-step", "algorithm": braintrace.pp_prop, "decay_or_rank": 0.9}
    driver, hand, steps, calls = (make(LeakyReadout, **options) for _ in range(4))
    grads, by_hand, by_steps, by_calls = jitted(lambda: (
        driver.etrace_grad(xs, ys, step_fn=window_fn(driver), chunk_size=K, reduction="sum"),
        hand_windows(hand, xs, ys, K)[0],
        counted_windows(steps, xs, ys, K, lambda c: c * K),
        counted_windows(calls, xs, ys, K, lambda c: c)))
    assert int(driver.running_index.value) == T // K and int(driver.trace_steps.value) == T
    assert max_rel_err(_to_numpy(by_hand), _to_numpy(grads)) < EXACT
    assert max_rel_err(_to_numpy(by_steps), _to_numpy(grads)) < EXACT
    assert max_rel_err(_to_numpy(by_calls), _to_numpy(grads)) > 1e-2  # the control: counting calls differs


# --- 8. robustness ------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction, mask", [("sum", None), ("mean", WEIGHTED)])
def test_unit_carrying_weights_keep_their_unit(reduction: str, mask: Any) -> None:
    xs, ys = data()
    a, b = make(MilliVolt), make(MilliVolt)
    grads, (ref, _) = jitted(lambda: (a.etrace_grad(xs, ys, step_fn=plain_fn(a), mask=mask, reduction=reduction),
                                      hand_block(b, xs, ys, mask=mask)))
    g = grads[("w",)]
    assert isinstance(g, u.Quantity) and u.get_unit(g) == u.mV
    assert np.any(np.asarray(g.to_decimal(u.mV)) != 0)
    total = 4.75 if mask is not None else 1.0
    np.testing.assert_allclose(g.to_decimal(u.mV), ref[("w",)].to_decimal(u.mV) / total, rtol=1e-6)


@pytest.fixture(scope="module")
def learners() -> dict[str, Any]:
    """Learners the argument checks refuse before running (shared: a refusal changes no state)."""
    return {"single": make(), "multi": make(vjp="multi-step"), "vmap": make_vmapped(K)}


XS = np.asarray(normal(50, (T, N_IN)))
XS5 = XS[:5]


def _loss_of(learner: Any) -> Callable[..., Any]:
    return lambda x, *rest: jnp.sum(learner(x) ** 2)


#: ``(id, learner, method, sequences, options, error, message pattern)``: one row per refusal.
ERRORS: list[tuple[str, str, str, tuple[Any, ...], dict[str, Any], type[Exception], str]] = [
    ("1-reduction", "single", "grad", (XS,), {"reduction": "avg"}, ValueError, r"reduction.*'mean'.*'sum'.*'avg'"),
    ("2-loss_output", "single", "grad", (XS,), {"loss_output": "all"}, ValueError,
     r"loss_output.*'per_step'.*'masked'.*'scalar'.*'all'"),
    *[(f"3-chunk-{v!r}", "single", m, (XS,), {"chunk_size": v}, TypeError, "chunk_size")
      for v in (1.5, "2", np.int64(2), True) for m in ("grad", "evolve")],
    ("3-chunk-jax", "single", "grad", (XS,), {"chunk_size": jnp.asarray(2)}, TypeError, "chunk_size.*int"),
    *[(f"4-chunk-{v}", "single", m, (XS,), {"chunk_size": v}, ValueError, "chunk_size.*>= 1")
      for v in (0, -1, -3) for m in ("grad", "evolve")],
    *[(f"5-no-sequences-{m}", "single", m, (), {}, ValueError, "sequence") for m in ("grad", "evolve")],
    *[(f"6-wrapped-{i}", "single", m, seqs, {}, TypeError, "wrap inside step_fn")
      for i, seqs in enumerate([(braintrace.SingleStepData(XS),), (XS, {"a": braintrace.MultiStepData(XS)})])
      for m in ("grad", "evolve")],
    *[(f"7-empty-{i}", "single", m, (XS, seq), {}, ValueError, "sequence 1 is an empty pytree")
      for i, seq in enumerate([{}, (), [], {"a": ()}, [{}, ()]]) for m in ("grad", "evolve")],
    *[(f"8-scalar-{m}", "single", m, (XS, {"c": 2.0}), {}, ValueError,
       r"sequences\[1\]\['c'\] is a scalar.*[Cc]lose over constants") for m in ("grad", "evolve")],
    *[(f"9-lengths-{m}", "single", m, (XS, {"y": XS5}), {}, ValueError,
       r"sequences\[0\] has length 6 and sequences\[1\]\['y'\] has length 5") for m in ("grad", "evolve")],
    *[(f"10-zero-length-{m}", "single", m, (XS[:0],), {}, ValueError, "empty") for m in ("grad", "evolve")],
    *[(f"11-vmap-{m}", "vmap", m, (np.zeros((T, K, N_IN)),), {"chunk_size": K}, ValueError, "vmap")
      for m in ("grad", "evolve")],
    ("12-single-step", "single", "grad", (XS,), {"chunk_size": K}, ValueError,
     r"multi-step.*'single-step'.*compile\(\.\.\., vjp_method='multi-step'\).*etrace_evolve"),
    *[(f"13-ragged-{m}", "multi", m, (XS5,), {"chunk_size": K}, ValueError, r"divide.*5.*multiple.*Trim.* 4 steps")
      for m in ("grad", "evolve")],
    *[(f"14-mask-{s}", "single", "grad", (XS,), {"mask": np.ones(s)}, ValueError,
       r"mask.*\(6,\).*got shape " + re.escape(str(s)))
      for s in [(5,), (6, 1), ()]],
]


@pytest.mark.parametrize(
    "learner_key, method, sequences, options, error, pattern",
    [row[1:] for row in ERRORS], ids=[row[0] for row in ERRORS],
)
def test_argument_errors(learners: dict[str, Any], learner_key: str, method: str, sequences: tuple[Any, ...],
                         options: dict[str, Any], error: type[Exception], pattern: str) -> None:
    learner = learners[learner_key]
    before = state_values(learner)
    with pytest.raises(error, match=pattern):
        if method == "grad":
            learner.etrace_grad(*sequences, step_fn=_loss_of(learner), **options)
        else:
            learner.etrace_evolve(*sequences, **options)
    assert_same_states(before, state_values(learner))


def test_step_fn_is_required() -> None:
    learner = make()
    with pytest.raises(TypeError, match="step_fn"):
        learner.etrace_grad(XS)


#: ``(driver, call)``: each call drives ``learner`` with a given ``step_fn``.
DRIVERS: list[tuple[str, Callable[[Any, Any, Any], Any]]] = [
    ("etrace_grad", lambda learner, xs, fn: learner.etrace_grad(xs, step_fn=fn)),
    ("etrace_train", lambda learner, xs, fn: learner.etrace_train(xs, step_fn=fn, optimizer=optax.sgd(0.1))),
    ("etrace_evolve", lambda learner, xs, fn: learner.etrace_evolve(xs, step_fn=fn)),
]


@pytest.mark.parametrize("driver, call", DRIVERS, ids=[d[0] for d in DRIVERS])
def test_a_step_fn_that_is_not_callable_is_refused(driver: str, call: Callable[[Any, Any, Any], Any]) -> None:
    with pytest.raises(TypeError, match=rf"{driver}: step_fn must be a function .*got 0.5 of type float"):
        call(make(), XS, 0.5)


@pytest.mark.parametrize("vmapped", [False, True], ids=["learner", "vmapped"])
@pytest.mark.parametrize("driver, call", DRIVERS, ids=[d[0] for d in DRIVERS])
def test_a_step_fn_that_never_calls_the_learner_is_refused(driver: str, call: Callable[[Any, Any, Any], Any],
                                                           vmapped: bool) -> None:
    learner = make_vmapped(2) if vmapped else make()
    xs = normal(51, (T, 2, N_IN)) if vmapped else XS
    before = state_values(learner)
    with pytest.raises(ValueError, match=rf"{driver}: step_fn did not call this learner.*learner\(x\)"):
        call(learner, xs, lambda x: jnp.sum(x ** 2))
    assert_same_states(before, state_values(learner))
    call(learner, xs, lambda x: jnp.sum(learner(x) ** 2))  # calling it, the same driver runs


@pytest.mark.parametrize("vmapped", [False, True], ids=["learner", "vmapped"])
@pytest.mark.parametrize("driver, call", DRIVERS, ids=[d[0] for d in DRIVERS])
def test_a_step_fn_that_calls_the_learner_twice_is_refused(driver: str, call: Callable[[Any, Any, Any], Any],
                                                           vmapped: bool) -> None:
    learner = make_vmapped(2) if vmapped else make()
    xs = normal(51, (T, 2, N_IN)) if vmapped else XS
    before = state_values(learner)
    with pytest.raises(ValueError, match=rf"{driver}: step_fn called this learner 2 times in one step.*once per step"):
        call(learner, xs, lambda x: jnp.sum(learner(x) ** 2) + jnp.sum(learner(x)))
    assert_same_states(before, state_values(learner))


def test_has_aux_without_a_pair_is_a_type_error() -> None:
    learner = make()
    with pytest.raises(TypeError, match="has_aux=True.*pair"):
        learner.etrace_grad(XS, step_fn=lambda x: jnp.sum(learner(x)), has_aux=True)
    assert int(learner.running_index.value) == 0


#: Two violated rows at once: the earlier row of the contract is reported.
ORDER: list[tuple[str, str, tuple[Any, ...], dict[str, Any], type[Exception], str]] = [
    ("1-before-2", "single", (XS,), {"reduction": "x", "loss_output": "y"}, ValueError, "reduction"),
    ("2-before-3", "single", (XS,), {"loss_output": "y", "chunk_size": 1.5}, ValueError, "loss_output"),
    ("3-before-5", "single", (), {"chunk_size": 1.5}, TypeError, "chunk_size"),
    ("4-before-5", "single", (), {"chunk_size": 0}, ValueError, "chunk_size"),
    ("6-over-all-sequences-first", "single", ({}, braintrace.MultiStepData(XS)), {}, TypeError, "wrap inside"),
    ("8-in-sequence-0-before-9", "single", ({"a": XS, "c": 1.0}, XS5), {}, ValueError, "scalar"),
    ("9-in-sequence-0-before-7", "single", ({"a": XS, "b": XS5}, {}), {}, ValueError, "length"),
    ("10-before-11", "vmap", (XS[:0],), {"chunk_size": K}, ValueError, "empty"),
    ("12-before-13", "single", (XS5,), {"chunk_size": K}, ValueError, "multi-step"),
    ("13-before-14", "multi", (XS5,), {"chunk_size": K, "mask": np.ones(3)}, ValueError, "divide"),
]


@pytest.mark.parametrize("learner_key, sequences, options, error, pattern", [r[1:] for r in ORDER],
                         ids=[r[0] for r in ORDER])
def test_validation_order(learners: dict[str, Any], learner_key: str, sequences: tuple[Any, ...],
                          options: dict[str, Any], error: type[Exception], pattern: str) -> None:
    learner = learners[learner_key]
    with pytest.raises(error, match=pattern):
        learner.etrace_grad(*sequences, step_fn=_loss_of(learner), **options)


def test_vmap_refusal_comes_before_the_vjp_method_check() -> None:
    class VmappedStub(Stub):
        _seq_is_vmapped = True

    with pytest.raises(ValueError, match="vmap"):
        VmappedStub().etrace_grad(XS, step_fn=lambda x: jnp.sum(x), chunk_size=K)


@pytest.mark.parametrize("method", ["grad", "evolve"])
def test_an_uncompiled_learner_fails_through_its_own_guard(method: str) -> None:
    model = TanhRNN()
    brainstate.nn.init_all_states(model)
    learner = braintrace.D_RTRL(model)
    with pytest.raises(ValueError, match="compile"):
        if method == "grad":
            learner.etrace_grad(XS, step_fn=_loss_of(learner))
        else:
            learner.etrace_evolve(XS)
    weights = model.states(brainstate.ParamState)
    if method == "grad":  # with explicit weights the call itself reports it
        with pytest.raises(ValueError, match="compile"):
            learner.etrace_grad(XS, step_fn=_loss_of(learner), weights=weights)


def test_evolve_wraps_windows_itself_only_without_a_step_fn() -> None:
    learner = make(vjp="multi-step")
    out = learner.etrace_evolve(XS, chunk_size=K, return_outputs=True)
    assert out.shape == (T // K, K, 1, N_REC)
    seen = []

    def step_fn(x: Any) -> Any:
        seen.append(x)
        return learner(braintrace.MultiStepData(x))

    out = learner.etrace_evolve(XS, step_fn=step_fn, chunk_size=K, return_outputs=True)
    assert out.shape == (T // K, K, 1, N_REC)
    assert len(seen) == 1 and not isinstance(seen[0], ETraceInputData) and seen[0].shape == (K, N_IN)
    assert int(learner.running_index.value) == 2 * (T // K)


@pytest.mark.parametrize("chunk_size, shape", [(None, (T, 1, N_REC)), (1, (T, 1, N_REC)), (K, (T // K, K, 1, N_REC))])
def test_evolve_return_outputs(chunk_size: int | None, shape: tuple[int, ...]) -> None:
    learner = make(vjp="multi-step")
    assert learner.etrace_evolve(XS, chunk_size=chunk_size) is None
    out = learner.etrace_evolve(XS, chunk_size=chunk_size, return_outputs=True)
    assert out.shape == shape


def test_both_methods_inside_an_outer_jit() -> None:
    xs, ys = data()
    a, b = make(vjp="multi-step"), make(vjp="multi-step")

    def run() -> Any:
        a.etrace_evolve(xs[:2], chunk_size=K)
        return a.etrace_grad(xs[2:], ys[2:], step_fn=window_fn(a), chunk_size=K, return_value=True)

    g_jit, l_jit = brainstate.transform.jit(run)()
    # Eagerly, the same run written as one masked call (masking the prefix is evolving it).
    g_eager, l_eager = b.etrace_grad(xs, ys, step_fn=window_fn(b), chunk_size=K, return_value=True,
                                     mask=[0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert_close(_to_numpy(g_jit), _to_numpy(g_eager), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(l_jit, l_eager[2:], rtol=1e-6)
    assert int(a.running_index.value) == int(b.running_index.value) == T // K
    np.testing.assert_allclose(a.model4compile.h.value, b.model4compile.h.value, rtol=1e-6)


# --- 9. beyond upstream -------------------------------------------------------------------------


def test_plain_weights_get_exact_gradients_on_a_single_step_learner() -> None:
    # F-33: upstream returns an exact zero for every non-ETP parameter here.
    xs, ys = data()
    a, b = make(ReadoutRNN), make(ReadoutRNN)
    grads, (ref, _) = jitted(lambda: (a.etrace_grad(xs, ys, step_fn=plain_fn(a), reduction="sum"),
                                      hand_block(b, xs, ys)))
    assert np.max(np.abs(np.asarray(grads[("r",)]))) > 1e-2
    assert_close(_to_numpy(grads), _to_numpy(ref), rtol=1e-6)
    # The readout is used only in the step producing the loss: it is exact (the BPTT gradient).
    bptt = bptt_grads(ReadoutRNN(), xs, loss=lambda t, out: sq(out, ys[t]))
    np.testing.assert_allclose(grads[("r",)], bptt[("r",)], rtol=1e-5, atol=1e-6)


def test_trace_shapes_are_fixed_at_compile_time() -> None:
    # The ETP input is unbatched (n_in,) while the hidden state is (1, n_rec): the traces are
    # allocated at their final shape, so the drivers' scan can carry them.
    learner = make()
    shapes = {k: v.shape for k, v in state_values(learner).items()}
    learner.etrace_evolve(XS)
    assert {k: v.shape for k, v in state_values(learner).items()} == shapes


@pytest.mark.parametrize("vjp, chunk_size", [("single-step", None), ("multi-step", None), ("multi-step", 2),
                                             ("multi-step", 3)])
def test_an_exact_trace_gives_bptt(x64: None, vjp: str, chunk_size: int | None) -> None:
    xs, ys = data()
    learner = make(Leaky, vjp=vjp)
    grads = learner.etrace_grad(xs, ys, step_fn=step_fn_for(learner, chunk_size), chunk_size=chunk_size,
                                reduction="sum")
    assert grads[("w",)].dtype == jnp.float64
    bptt = bptt_grads(Leaky(), xs, loss=lambda t, out: sq(out, ys[t]))
    assert max_rel_err(bptt, _to_numpy(grads)) < EXACT


# --- 6. eager calls ---------------------------------------------------------------------------------


def _memory_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts the process's memory mappings (Linux)")
def test_eager_calls_release_their_compiled_loops() -> None:
    """Each eager driver call compiles its loop; the program must go with the call. JAX's eager
    dispatch of the same loop keeps every program (negative control), and a long eager training
    loop then ends in 'LLVM compilation error: Cannot allocate memory' and a crash."""
    learner = make()
    xs, ys = data(4)
    step_fn = plain_fn(learner)
    calls = (lambda: learner.etrace_grad(xs, ys, step_fn=step_fn),
             lambda: learner.etrace_train(xs, ys, step_fn=step_fn, optimizer=optax.sgd(0.1)),
             lambda: learner.etrace_evolve(xs))
    for call in calls:  # the programs every call shares (pre- and post-processing) compiled once
        call()
    before = _memory_mappings()
    for _ in range(4):
        for call in calls:
            call()
    assert _memory_mappings() - before < 20

    def eager_scan() -> None:  # a fresh loop body each call, dispatched eagerly as the drivers once were
        brainstate.transform.scan(lambda c, x: (c + sq(learner(x), 0.0), None), jnp.zeros(()), xs)

    if jax.default_backend() != "cpu":
        return  # an accelerator's programs live in its runtime, not in the process's mappings
    eager_scan()
    before = _memory_mappings()
    for _ in range(12):
        eager_scan()
    assert _memory_mappings() - before >= 20

"""pp_prop / ES-D-RTRL (``IODimVjpAlgorithm``): arguments, traces, and gradients against BPTT.

The reference is the BPTT oracle of :mod:`tests.algorithm.bptt` (plain ``brainstate`` gradients
through the step loop). Exactness regimes pinned here (float64, tolerance 1e-10):

* single-step, one step from a reset: equal to BPTT for every parameter (dense ``mm``/``mv``
  with bias, element-wise with ``weight_fn``, conv with bias, a readout, a direct ``y -> loss``
  path);
* multi-step, one window over the whole sequence: equal to BPTT (ranks 16 and 1, decays .5, .9).

Longer single-step runs are approximate; their alignment with BPTT is measured and pinned.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._op.conv import conv
from tests.algorithm.bptt import (
    Grads,
    bptt_grads,
    cosine,
    max_rel_err,
    normal,
    single_step_grads,
    window_grads,
    x64,
)

__all__ = ["x64"]  # the fixture is used by name

EXACT = 1e-10


class Leaky(brainstate.nn.Module):
    """``h = σ(τ) h + tanh(x W + b)``; output ``h W_out + 0.3 Σ y`` (a direct ``y -> loss`` path)."""

    def __init__(self, n_in: int = 3, n_hid: int = 4, n_out: int = 2) -> None:
        super().__init__()
        self.n_hid = n_hid
        self.w = brainstate.ParamState(normal(0, (n_in, n_hid)))
        self.b = brainstate.ParamState(normal(4, (n_hid,), 0.1))
        self.tau = brainstate.ParamState(normal(5, (n_hid,), 0.5))
        self.w_out = brainstate.ParamState(normal(1, (n_hid, n_out)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hid,) if batch_size is None else (batch_size, self.n_hid)
        self.h = brainstate.HiddenState(normal(6, shape, 0.5))  # a nonzero start

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        y = braintrace.matmul(x, self.w.value, self.b.value)
        self.h.value = leak * self.h.value + jnp.tanh(y)
        return self.h.value @ self.w_out.value + 0.3 * y.sum(-1, keepdims=True)


class LinearLeaky(brainstate.nn.Module):
    """``h = 0.8 h + x W``: the leaky integrator pp_prop's filters are built for."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (3, 4)))
        self.w_out = brainstate.ParamState(normal(1, (4, 2)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.8 * self.h.value + braintrace.matmul(x, self.w.value)
        return self.h.value @ self.w_out.value


def inputs(n_steps: int, batch: int | None, n_in: int = 3) -> jax.Array:
    return normal(2, (n_steps, n_in) if batch is None else (n_steps, batch, n_in))


def compile_pp(model: brainstate.nn.Module, x0: Any, batch_size: int | None, **options: Any) -> Any:
    """``braintrace.compile(model, pp_prop, ...)`` (decay .9 by default), diagnostics silenced."""
    options.setdefault("decay_or_rank", 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, braintrace.pp_prop, x0, batch_size=batch_size, **options)


def run_steps(learner: Any, xs: Any) -> None:
    """Run the learner over the steps of ``xs`` (no gradient), under one jit."""
    brainstate.transform.jit(lambda: [learner(xs[t]) for t in range(xs.shape[0])])()


def param_cosine(ref: Grads, got: Grads, path: Any) -> float:
    return cosine({path: ref[path]}, {path: got[path]})


# --- decay_or_rank and the public names -----------------------------------------------------


@pytest.mark.parametrize(
    "value, decay, rank",
    [(0.9, 0.9, 19), (19, 0.9, 19), (5, 2 / 3, 5), (1, 0.0, 1), (True, 0.0, 1), (np.float64(0.5), 0.5, 3)],
)
def test_decay_or_rank_table(value: Any, decay: float, rank: int) -> None:
    learner = braintrace.pp_prop(LinearLeaky(), value)
    assert isinstance(learner.decay, float)
    assert learner.decay == pytest.approx(decay, abs=1e-15)
    assert learner.num_rank == rank


@pytest.mark.parametrize("value", [np.float32(0.9), jnp.asarray(0.9), np.array([0.9]), "0.9", None])
def test_decay_or_rank_wrong_type(value: Any) -> None:
    with pytest.raises(ValueError, match='Please provide "num_rank" \\(int\\) or "decay"'):
        braintrace.pp_prop(LinearLeaky(), value)


@pytest.mark.parametrize("value, shown", [(0, "0"), (-1, "-1"), (False, "False"), (1.0, "1.0"),
                                           (1.5, "1.5"), (-0.5, "-0.5")])
def test_decay_or_rank_out_of_range(value: Any, shown: str) -> None:
    with pytest.raises(ValueError, match=f"decay_or_rank={shown}") as info:
        braintrace.pp_prop(LinearLeaky(), value)
    assert "0 <= decay < 1" in str(info.value) or "> 0" in str(info.value)


def test_decay_zero_is_accepted() -> None:
    learner = braintrace.pp_prop(LinearLeaky(), 0.0)
    assert learner.decay == 0.0 and learner.num_rank == 1


def test_other_bad_arguments() -> None:
    with pytest.raises(ValueError, match="vjp_method"):
        braintrace.pp_prop(LinearLeaky(), 0.9, vjp_method="two-step")
    with pytest.raises(TypeError, match="decay_or_rank"):
        braintrace.pp_prop(LinearLeaky())  # type: ignore[call-arg]


def test_names_and_module() -> None:
    assert braintrace.ES_D_RTRL is braintrace.pp_prop
    assert issubclass(braintrace.pp_prop, braintrace.IODimVjpAlgorithm)
    assert braintrace.pp_prop.__module__ == "braintrace"
    for name in ("IODimVjpAlgorithm", "pp_prop", "ES_D_RTRL"):
        assert name in braintrace.__all__
    learner = braintrace.pp_prop(LinearLeaky(), 0.9)
    with pytest.raises(AttributeError):
        learner.decay = 0.5  # type: ignore[misc]  # read-only: the config is the coordinate
    assert learner.num_rank == 19


def test_compile_by_name() -> None:
    for name in ("pp_prop", "ES_D_RTRL", " esd_rtrl "):
        learner = braintrace.compile(LinearLeaky(), name, jnp.ones((2, 3)), batch_size=2, decay_or_rank=0.9)
        assert type(learner) is braintrace.pp_prop
    with pytest.raises(TypeError, match="decay_or_rank"):
        braintrace.compile(LinearLeaky(), "pp_prop", jnp.ones((2, 3)), batch_size=2)


# --- trace state ----------------------------------------------------------------------------


def test_trace_shapes_and_keys() -> None:
    learner = compile_pp(Leaky(), jnp.ones((2, 3)), 2)
    (mm,) = [r for r in learner.graph.hidden_param_op_relations if r.x_var is not None]
    assert set(learner.etrace_xs) == {id(mm.x_var)}
    assert learner.etrace_xs[id(mm.x_var)].value.shape == (2, 3)
    assert isinstance(learner.etrace_xs[id(mm.x_var)], braintrace.EligibilityTrace)
    assert len(learner.etrace_dfs) == 2  # the matmul and the element-wise leak, one group
    for (y_id, group_name), st in learner.etrace_dfs.items():
        assert group_name == "hidden_group_0"
        assert st.value.shape == (2, 4, 1)


class Broadcast(brainstate.nn.Module):
    """A matmul output ``(4,)`` broadcast into a hidden state ``(2, 4)``: not the hidden shape."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.ones((3, 4)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((2, 4)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)  # (4,) -> (2, 4)
        return self.h.value


def test_hidden_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"outputs \(4,\) but drives hidden group 0 of shape \(2, 4\)"):
        compile_pp(Broadcast(), jnp.ones(3), None)


def test_trace_update_rule() -> None:
    # h = 0.8 h + x W: D = 0.8, df = 1, so ε_x = α ε_x + x and ε_f = α 0.8 ε_f + (1 - α).
    alpha = 0.5
    learner = compile_pp(LinearLeaky(), jnp.ones((2, 3)), 2, decay_or_rank=alpha)
    xs = inputs(3, 2)
    run_steps(learner, xs)
    eps_x, eps_f = np.zeros((2, 3)), np.zeros((2, 4, 1))
    for t in range(3):
        eps_x = alpha * eps_x + np.asarray(xs[t])
        eps_f = alpha * 0.8 * eps_f + (1 - alpha)
    (tx,), (tf,) = learner.etrace_xs.values(), learner.etrace_dfs.values()
    np.testing.assert_allclose(tx.value, eps_x, rtol=1e-6)
    np.testing.assert_allclose(tf.value, eps_f, rtol=1e-6)
    assert int(learner.trace_steps.value) == 3 and int(learner.running_index.value) == 3


def test_reset_state_resizes_only_batched_traces() -> None:
    unbatched = compile_pp(Leaky(), jnp.ones(3), None)  # etp_mv and an unbatched leak
    run_steps(unbatched, jnp.ones((1, 3)))
    unbatched.reset_state(batch_size=5)
    assert [st.value.shape for st in unbatched.etrace_xs.values()] == [(3,)]
    assert {st.value.shape for st in unbatched.etrace_dfs.values()} == {(4, 1)}
    assert all(not np.any(st.value) for st in unbatched.etrace_dfs.values())
    assert int(unbatched.trace_steps.value) == 0 and int(unbatched.running_index.value) == 0

    batched = compile_pp(Leaky(), jnp.ones((2, 3)), 2)  # etp_mm and a leak broadcast over the batch
    batched.reset_state(batch_size=5)
    assert [st.value.shape for st in batched.etrace_xs.values()] == [(5, 3)]
    assert {st.value.shape for st in batched.etrace_dfs.values()} == {(5, 4, 1)}
    batched.reset_state()
    assert [st.value.shape for st in batched.etrace_xs.values()] == [(5, 3)]


def test_get_etrace_of() -> None:
    model = Leaky()
    learner = compile_pp(model, jnp.ones((2, 3)), 2)
    run_steps(learner, jnp.ones((1, 2, 3)))
    rels = {r.primitive.name: r for r in learner.graph.hidden_param_op_relations}
    # An element-wise weight has no input trace (upstream raised KeyError here).
    xs, dfs = learner.get_etrace_of(model.tau)
    assert xs == {} and list(dfs) == [(id(rels["etp_elemwise"].y_var), "hidden_group_0")]
    # A secondary key (the bias state) is found, by state or by path.
    for query in (model.b, ("b",)):
        xs, dfs = learner.get_etrace_of(query)
        assert list(xs) == [id(rels["etp_mm"].x_var)]
        assert list(dfs) == [(id(rels["etp_mm"].y_var), "hidden_group_0")]
        np.testing.assert_allclose(xs[id(rels["etp_mm"].x_var)], np.ones((2, 3)))
    with pytest.raises(ValueError, match="w_out"):
        learner.get_etrace_of(model.w_out)  # the readout has no relation


# --- exactness against BPTT -----------------------------------------------------------------


@pytest.mark.parametrize("batch", [None, 2])
def test_single_step_one_step_equals_bptt(x64: None, batch: int | None) -> None:
    xs = inputs(1, batch)
    model = Leaky()
    ref = bptt_grads(model, xs, batch_size=batch)
    learner = compile_pp(model, xs[0], batch)
    assert {r.primitive.name for r in learner.graph.hidden_param_op_relations} == {
        "etp_elemwise", "etp_mv" if batch is None else "etp_mm"}
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


@pytest.mark.parametrize("decay_or_rank", [0.9] + [pytest.param(v, marks=pytest.mark.slow) for v in (16, 1, 0.5)])
def test_multi_step_whole_sequence_equals_bptt(x64: None, decay_or_rank: Any) -> None:
    xs = inputs(5, 2)
    model = Leaky()
    ref = bptt_grads(model, xs, batch_size=2)
    learner = compile_pp(model, xs[0], 2, decay_or_rank=decay_or_rank, vjp_method="multi-step")
    assert max_rel_err(ref, window_grads(learner, xs, [5])) < EXACT
    assert int(learner.trace_steps.value) == 5  # time steps, not calls


class TwoState(brainstate.nn.Module):
    """``v`` and ``a`` mix element-wise: one hidden group with ``S = 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (3, 4)))
        self.w_out = brainstate.ParamState(normal(1, (4, 2)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(normal(2, (batch_size or 1, 4)))
        self.a = brainstate.HiddenState(normal(3, (batch_size or 1, 4)))

    def update(self, x: Any) -> Any:
        y = braintrace.matmul(x, self.w.value)
        v, a = self.v.value, self.a.value
        self.v.value = 0.9 * v - 0.2 * a + jnp.tanh(y)
        self.a.value = 0.8 * a + 0.3 * v
        return self.v.value @ self.w_out.value


@pytest.mark.slow
def test_two_states_fast_and_per_state_solves_agree(x64: None) -> None:
    xs = inputs(3, 2)
    model = TwoState()
    one_step = bptt_grads(model, xs[:1], batch_size=2)
    fast = compile_pp(model, xs[0], 2)
    assert [g.num_state for g in fast.graph.hidden_groups] == [2]
    assert max_rel_err(one_step, single_step_grads(fast, xs[:1])) < EXACT  # one step: exact
    # Separate (identical) models: a learner runs on the hidden states it was compiled with.
    per_state = compile_pp(TwoState(), xs[0], 2, fast_solve=False)
    fast = compile_pp(TwoState(), xs[0], 2)
    assert max_rel_err(single_step_grads(fast, xs), single_step_grads(per_state, xs)) < EXACT


def _learner_after(model: brainstate.nn.Module, xs: Any, run: Callable[[Any], Any]) -> Any:
    """A fresh multi-step pp_prop learner (decay .5) after ``run(learner)`` (no gradient)."""
    learner = compile_pp(model, xs[0], 2, decay_or_rank=0.5, vjp_method="multi-step")
    brainstate.transform.jit(lambda: run(learner))()
    return learner


@pytest.mark.slow
def test_bias_correction_counts_time_steps(x64: None) -> None:
    xs = inputs(6, 2)
    model = LinearLeaky()
    # One window of three steps, or three single steps: the same traces and step count. (The
    # learners share the model's hidden state, so each runs to its gradient before the next.)
    windowed = _learner_after(model, xs, lambda lr: lr(braintrace.MultiStepData(xs[:3])))
    assert int(windowed.running_index.value) == 1 and int(windowed.trace_steps.value) == 3
    g_windowed = window_grads(windowed, xs[3:], [3])
    stepped = _learner_after(model, xs, lambda lr: [lr(xs[t]) for t in range(3)])
    assert int(stepped.running_index.value) == 3 and int(stepped.trace_steps.value) == 3
    assert max_rel_err(window_grads(stepped, xs[3:], [3]), g_windowed) < EXACT
    # Counting the one call instead (upstream) changes the correction and the gradient.
    by_calls = _learner_after(model, xs, lambda lr: lr(braintrace.MultiStepData(xs[:3])))
    by_calls.trace_steps.value = jnp.asarray(1, jnp.int32)
    assert max_rel_err(g_windowed, window_grads(by_calls, xs[3:], [3])) > 1e-2


class Emb(brainstate.nn.Module):
    """``h = 0.7 h + tanh(T[idx])``, or the same lookup written as ``one_hot(idx) @ T``."""

    vocab, feat = 5, 3

    def __init__(self, one_hot: bool) -> None:
        super().__init__()
        self.one_hot = one_hot
        self.table = brainstate.ParamState(normal(0, (self.vocab, self.feat)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, self.feat)))

    def update(self, idx: Any) -> Any:
        if self.one_hot:
            y = braintrace.matmul(jax.nn.one_hot(idx, self.vocab, dtype=self.table.value.dtype), self.table.value)
        else:
            y = braintrace.embedding(idx, self.table.value)
        self.h.value = 0.7 * self.h.value + jnp.tanh(y)
        return self.h.value.sum(-1, keepdims=True)


@pytest.mark.slow
def test_embedding_uses_one_hot_input_trace(x64: None) -> None:
    idx = jnp.asarray([[1, 4], [1, 0], [3, 4]])
    learner = compile_pp(Emb(False), idx[0], 2, decay_or_rank=0.5)
    (x_trace,) = learner.etrace_xs.values()
    assert x_trace.value.shape == (2, Emb.vocab) and x_trace.value.dtype == jnp.float64
    got = single_step_grads(learner, idx)
    one_hot = np.asarray(jax.nn.one_hot(idx, Emb.vocab))
    np.testing.assert_allclose(x_trace.value, one_hot[2] + 0.5 * one_hot[1] + 0.25 * one_hot[0], atol=1e-12)
    # pp_prop on the lookup equals pp_prop on the same lookup as a one-hot matmul.
    as_matmul = compile_pp(Emb(True), idx[0], 2, decay_or_rank=0.5)
    assert max_rel_err(single_step_grads(as_matmul, idx), got) < EXACT


class ConvLeaky(brainstate.nn.Module):
    """``h = 0.6 h + tanh(conv(x, K) + b)`` in the default ``NCW/OIW`` layout."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = brainstate.ParamState(normal(0, (3, 2, 3), 0.5))  # (out, in, width)
        self.bias = brainstate.ParamState(normal(1, (3,), 0.1))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, 3, 5)))

    def update(self, x: Any) -> Any:
        y = conv(x, self.kernel.value, self.bias.value, padding="SAME")
        self.h.value = 0.6 * self.h.value + jnp.tanh(y)
        return self.h.value.mean(-1)


@pytest.mark.slow
def test_conv_with_bias(x64: None) -> None:
    xs = normal(2, (3, 2, 2, 5))
    model = ConvLeaky()
    ref_one = bptt_grads(model, xs[:1], batch_size=2)
    ref_all = bptt_grads(model, xs, batch_size=2)
    learner = compile_pp(model, xs[0], 2)
    assert [r.primitive.name for r in learner.graph.hidden_param_op_relations] == ["etp_conv"]
    assert max_rel_err(ref_one, single_step_grads(learner, xs[:1])) < EXACT
    # Further steps use the trace: upstream crashed on the per-position bias gradient here.
    grads = single_step_grads(learner, xs[1:])
    assert grads[("bias",)].shape == (3,) and np.all(np.isfinite(grads[("bias",)]))
    multi = compile_pp(model, xs[0], 2, vjp_method="multi-step")
    assert max_rel_err(ref_all, window_grads(multi, xs, [3])) < EXACT


# --- approximate regimes: measured alignment and a training run ---------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_cls, decay, min_cos_all, min_cos_relation",
    # Measured (float32, T = 8): Leaky at decay .5 — all .980, b .882, tau .991, w .984;
    # LinearLeaky at decay .9 — all .988, w .985.
    [(Leaky, 0.5, 0.97, 0.85), (LinearLeaky, 0.9, 0.98, 0.97)],
)
def test_single_step_aligned_with_bptt(
    model_cls: type[brainstate.nn.Module], decay: float, min_cos_all: float, min_cos_relation: float
) -> None:
    xs = inputs(8, 2)
    model = model_cls()
    ref = bptt_grads(model, xs, batch_size=2)
    learner = compile_pp(model, xs[0], 2, decay_or_rank=decay)
    got = single_step_grads(learner, xs)
    assert cosine(ref, got) > min_cos_all
    relation_paths = {p for r in learner.graph.hidden_param_op_relations for p in r.trainable_paths.values()}
    for path in relation_paths:
        assert param_cosine(ref, got, path) > min_cos_relation, path
    # Paths without a relation (the readout) get the exact gradient at every step.
    for path in set(ref) - relation_paths:
        np.testing.assert_allclose(got[path], ref[path], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_history_term_improves_alignment() -> None:
    # On the leaky integrator the trace history matters: rank 1 (no history) is clearly worse.
    # Measured (float32, T = 8): cosine .988 at decay .9, .896 at rank 1.
    xs = inputs(8, 2)
    model = LinearLeaky()
    ref = bptt_grads(model, xs, batch_size=2)
    with_history = cosine(ref, single_step_grads(compile_pp(model, xs[0], 2, decay_or_rank=0.9), xs))
    without = cosine(ref, single_step_grads(compile_pp(model, xs[0], 2, decay_or_rank=1), xs))
    assert with_history > without + 0.05


@pytest.mark.slow
def test_training_lowers_the_loss() -> None:
    # Task: match a leaky running sum of the inputs through a fixed linear teacher.
    n_steps, batch = 10, 4
    xs = normal(7, (n_steps, batch, 3))
    w_teacher = np.asarray(normal(8, (3, 2)))
    state, targets = np.zeros((batch, 2)), []
    for t in range(n_steps):
        state = 0.8 * state + np.asarray(xs[t]) @ w_teacher
        targets.append(state)
    target_seq = jnp.asarray(np.stack(targets), dtype=xs.dtype)

    class Student(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(normal(9, (3, 2), 0.1))
            self.tau = brainstate.ParamState(jnp.zeros(2))

        def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
            self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, 2)))

        def update(self, x: Any) -> Any:
            leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
            self.h.value = leak * self.h.value + braintrace.matmul(x, self.w.value)
            return self.h.value

    model = Student()
    learner = compile_pp(model, xs[0], batch, decay_or_rank=0.5)
    params = learner.param_states

    @brainstate.transform.jit
    def epoch() -> Any:
        learner.reset()
        total = jnp.zeros(())
        for t in range(n_steps):
            loss = lambda t=t: jnp.sum((learner(xs[t]) - target_seq[t]) ** 2) / batch  # noqa: E731
            grads, value = brainstate.transform.grad(loss, params, return_value=True)()
            for path, g in grads.items():
                params[path].value = params[path].value - 0.01 * g
            total = total + value
        return total

    losses = [float(epoch()) for _ in range(30)]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.3 * losses[0], losses

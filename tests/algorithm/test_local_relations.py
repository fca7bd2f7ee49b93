"""Weights whose one-step gradient is the same-step term of their trace (``local_relation_weights``).

pp_prop and D_RTRL leave such weights out of the one-step VJP and do not subtract the same-step
term for them. These tests pin which relations qualify, and that the gradients are those of the
plain form (one-step VJP minus the same-step term) step after step, in float64.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import pytest

import braintrace
from braintrace._compiler import local_relation_weights
from tests.algorithm.bptt import bptt_grads, max_rel_err, normal, single_step_grads, x64

__all__ = ["x64"]  # the fixture is used by name

EXACT = 1e-10


class _Cell(brainstate.nn.Module):
    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__()
        self.n_hid = n_hid
        self.w = brainstate.ParamState(normal(0, (n_in, n_hid)))
        self.u = brainstate.ParamState(normal(1, (n_hid, n_hid), 0.5))
        self.tau = brainstate.ParamState(normal(2, (n_hid,), 0.5))
        self.w_out = brainstate.ParamState(normal(3, (n_hid, 2)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hid,) if batch_size is None else (batch_size, self.n_hid)
        self.h = brainstate.HiddenState(normal(4, shape, 0.5))


class Leaky(_Cell):
    """``h = σ(τ) h + tanh(x W + h U)``: every relation is local when unbatched."""

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        y = braintrace.matmul(x, self.w.value) + braintrace.matmul(self.h.value, self.u.value)
        self.h.value = leak * self.h.value + jnp.tanh(y)
        return self.h.value @ self.w_out.value


class DirectPath(_Cell):
    """The input relation's output also reaches the loss directly (``+ 0.3 Σ y``)."""

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        y = braintrace.matmul(x, self.w.value)
        self.h.value = leak * self.h.value + jnp.tanh(y + braintrace.matmul(self.h.value, self.u.value))
        return self.h.value @ self.w_out.value + 0.3 * y.sum(-1, keepdims=True)


class SharedWeight(_Cell):
    """``U`` drives the hidden state through a relation and the output through a plain product."""

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        y = braintrace.matmul(x, self.w.value) + braintrace.matmul(self.h.value, self.u.value)
        self.h.value = leak * self.h.value + jnp.tanh(y)
        return (self.h.value @ self.u.value) @ self.w_out.value


class Mixing(_Cell):
    """The gate relation reaches the state through another product (a GRU's reset gate)."""

    def update(self, x: Any) -> Any:
        r = jax.nn.sigmoid(braintrace.matmul(x, self.w.value))
        self.h.value = jnp.tanh(braintrace.matmul(r * self.h.value, self.u.value))
        return self.h.value @ self.w_out.value


class ReadPast(_Cell):
    """The output is a function of the previous state (a spike of the pre-update potential)."""

    def update(self, x: Any) -> Any:
        s = jnp.tanh(self.h.value)
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + braintrace.matmul(x, self.w.value) + braintrace.matmul(s, self.u.value)
        return s @ self.w_out.value


class Reshaped(_Cell):
    """The relation's output is rearranged before it enters the state (``flip``)."""

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + jnp.flip(braintrace.matmul(x, self.w.value), -1)
        return self.h.value @ self.w_out.value + 0.0 * self.u.value.sum() + 0.0 * self.tau.value.sum()


def compile_pp(model: brainstate.nn.Module, batch: int | None, cls: Any = braintrace.pp_prop) -> Any:
    x0 = jnp.ones((3,) if batch is None else (batch, 3))
    options = {} if issubclass(cls, braintrace.D_RTRL) else {"decay_or_rank": 0.8}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, cls, x0, batch_size=batch, **options)


class PlainPP(braintrace.pp_prop):
    """pp_prop without the shortcut: every weight through the one-step VJP, minus the same-step term."""

    _history_holds_same_step = False


class PlainDRTRL(braintrace.D_RTRL):
    """D_RTRL without the shortcut."""

    _history_holds_same_step = False


#: (learner with the shortcut, the same learner without it)
RULES = [pytest.param(braintrace.pp_prop, PlainPP, id="pp_prop"), pytest.param(braintrace.D_RTRL, PlainDRTRL, id="D_RTRL")]


def detached_paths(learner: Any) -> set[tuple[str, ...]]:
    graph = learner.graph
    relations = graph.hidden_param_op_relations
    candidates = frozenset(i for i, rel in enumerate(relations) if learner._same_step_in_history(rel))
    found = local_relation_weights(graph.hidden_perturb, relations, graph.hidden_groups, graph.module_info,
                                   excluded_groups=learner._groups_read_past_update(), candidates=candidates)
    used = learner._local_relation_weights()
    assert used == (found if learner._history_holds_same_step else (frozenset(), {}))
    return set(used.paths)


@pytest.mark.parametrize(
    "model, batch, expected",
    [
        (Leaky, None, {("w",), ("u",), ("tau",)}),
        (Leaky, 2, {("w",), ("u",)}),  # the leak broadcasts over the batch: not element-wise in y
        (DirectPath, 2, {("u",)}),
        (SharedWeight, 2, {("w",)}),
        (Mixing, 2, {("u",)}),
        (ReadPast, 2, set()),  # its group is read past the update
        (Reshaped, 2, set()),
    ],
)
@pytest.mark.parametrize("rule, plain", RULES)
def test_which_weights_are_local(model: Any, batch: int | None, expected: set[Any], rule: Any, plain: Any) -> None:
    # D_RTRL reads the history off the new trace also where the primitive's rules roll it (the
    # hooked element-wise leak has no closed-form kernel), so the same weights are local; but
    # Mixing's group has no history (D ≡ 0), where D_RTRL credits u by the one-step VJP.
    if rule is braintrace.D_RTRL and model is Mixing:
        expected = set()
    assert detached_paths(compile_pp(model(), batch, rule)) == expected


@pytest.mark.parametrize("rule, plain", RULES)
def test_plain_form_detaches_nothing(rule: Any, plain: Any) -> None:
    assert detached_paths(compile_pp(Leaky(), 2, plain)) == set()


@pytest.mark.parametrize("model", [Leaky, DirectPath, SharedWeight, Mixing, ReadPast, Reshaped])
@pytest.mark.parametrize("batch", [None, 2])
@pytest.mark.parametrize("rule, plain", RULES)
def test_gradients_equal_the_plain_form(x64: None, model: Any, batch: int | None, rule: Any, plain: Any) -> None:
    xs = normal(7, (5, 3) if batch is None else (5, batch, 3))
    fast = single_step_grads(compile_pp(model(), batch, rule), xs)
    reference = single_step_grads(compile_pp(model(), batch, plain), xs)
    assert max_rel_err(reference, fast) < EXACT


@pytest.mark.parametrize("cell, has_local", [
    (braintrace.nn.GRUCell, True), (braintrace.nn.MGUCell, True),
    (braintrace.nn.ValinaRNNCell, False),  # relu is a custom_jvp function: not looked into
    (braintrace.nn.LSTMCell, False),  # its gates are slices of one product
])
@pytest.mark.parametrize("rule, plain", RULES)
def test_nn_cells_equal_the_plain_form(cell: Any, has_local: bool, rule: Any, plain: Any) -> None:
    def fresh() -> brainstate.nn.Module:
        brainstate.random.seed(1)  # the same initial weights for both learners
        return cell(3, 4)

    xs = normal(8, (4, 2, 3))
    fast_learner = compile_pp(fresh(), 2, rule)
    assert bool(detached_paths(fast_learner)) == has_local
    fast = single_step_grads(fast_learner, xs)
    reference = single_step_grads(compile_pp(fresh(), 2, plain), xs)
    assert max_rel_err(reference, fast) < 1e-5  # the cells keep float32 weights


@pytest.mark.parametrize("model", [Leaky, DirectPath, SharedWeight])
@pytest.mark.parametrize("rule, plain", RULES)
def test_first_step_equals_bptt(x64: None, model: Any, rule: Any, plain: Any) -> None:
    xs = normal(9, (1, 2, 3))
    ref = bptt_grads(model(), xs, batch_size=2)
    assert max_rel_err(ref, single_step_grads(compile_pp(model(), 2, rule), xs)) < EXACT


class Diagonal(_Cell):
    """``h = σ(τ) h + tanh(x W)``: an element-wise recurrence, where D_RTRL equals BPTT."""

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value))
        return self.h.value @ self.w_out.value + 0.0 * self.u.value.sum()


def test_d_rtrl_with_local_weights_equals_bptt(x64: None) -> None:
    xs = normal(11, (6, 2, 3))
    learner = compile_pp(Diagonal(), 2, braintrace.D_RTRL)
    assert detached_paths(learner) == {("w",)}
    ref = bptt_grads(Diagonal(), xs, batch_size=2)
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


class OwnGradient(braintrace.pp_prop):
    """A rule defined outside the library that replaces the gradient (here: the library's, scaled)."""

    def _solve_weight_gradients(self, *args: Any) -> Any:
        return jax.tree.map(lambda g: 2.0 * g, super()._solve_weight_gradients(*args))


def test_rules_defined_elsewhere_keep_every_one_step_gradient(x64: None) -> None:
    learner = compile_pp(Leaky(), 2, OwnGradient)
    assert detached_paths(compile_pp(Leaky(), 2)) and not learner._local_relation_weights().paths
    xs = normal(10, (3, 2, 3))
    plain = single_step_grads(compile_pp(Leaky(), 2, PlainPP), xs)
    assert max_rel_err({k: 2.0 * v for k, v in plain.items()}, single_step_grads(learner, xs)) < EXACT


class ReadBoth(_Cell):
    """The output reads the state both before and after its update."""

    def update(self, x: Any) -> Any:
        s = jnp.tanh(self.h.value)
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + braintrace.matmul(x, self.w.value) + braintrace.matmul(s, self.u.value)
        return (self.h.value + s) @ self.w_out.value


class ThreeTermEProp(braintrace.EProp):
    """EProp whose trace roll is user code (a pass-through): a replaced learning signal then
    takes its three terms as they are, the history, ``+ ⟨s, ē^t⟩`` and ``− ⟨g, ε^t⟩``, each
    read off its own trace, and every weight keeps its one-step gradient."""

    def _step_relation(self, *args: Any) -> Any:
        return super()._step_relation(*args)


def compile_random_eprop(model: brainstate.nn.Module, batch: int | None, cls: Any, kappa: float) -> Any:
    x0 = jnp.ones((3,) if batch is None else (batch, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, cls, x0, batch_size=batch, feedback="random", random_feedback_key=3,
                                  kappa_filter_decay=kappa)


@pytest.mark.parametrize("model", [Leaky, DirectPath, SharedWeight, Mixing, ReadPast, ReadBoth, Reshaped])
@pytest.mark.parametrize("batch", [None, 2])
@pytest.mark.parametrize("kappa", [0.0, 0.5])
def test_random_feedback_equals_its_three_terms(x64: None, model: Any, batch: int | None, kappa: float) -> None:
    """Random feedback leaves local weights out of the one-step VJP (their gradient is
    ``⟨s, ē^t⟩``), cancels ``⟨g, ε^t⟩`` against a history read off ``ε^t`` and reads a trace whose
    history is the entering one (``ReadPast``, ``ReadBoth``) once: the same gradient as the three
    terms."""
    xs = normal(12, (5, 3) if batch is None else (5, batch, 3))
    three_terms = compile_random_eprop(model(), batch, ThreeTermEProp, kappa)
    assert not three_terms._local_relation_weights().paths
    reference = single_step_grads(three_terms, xs)
    assert max_rel_err(reference, single_step_grads(compile_random_eprop(model(), batch, braintrace.EProp, kappa), xs)) < EXACT

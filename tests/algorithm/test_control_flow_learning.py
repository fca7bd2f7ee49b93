"""Online learning through control flow: D_RTRL against BPTT and the hand-flattened twins.

* Canonicalised models (if-converted conds, unrolled short scans) compute the same function
  as their twins, and single-step D_RTRL on them equals BPTT element-wise.
* Descended scans (longer than ``scan_unroll_limit``): for element-wise substep recurrences,
  D_RTRL equals BPTT single-step, over the whole sequence, and in chunks (where the gradient
  depends on the trace folded over every substep at each chunk boundary).
* A weight-free ``while_loop`` settling the hidden state: single-step D_RTRL equals that of
  the no-while twin (which equals BPTT), although the perturbed step detaches the loop.
* Windows (``vjp_method='multi-step'``) over weight-free while loops (settling the hidden
  state, between the weight product and the hidden state, nested in a ``cond`` or a ``scan``,
  computing from the input alone) differentiate the loop by recomputing its iterations: D_RTRL equals BPTT
  of the loop-free twin for every window split, pp_prop equals pp_prop on the twin. A loop
  that reads a weight is refused at compile under either VJP method.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import (
    bptt_grads,
    cosine,
    max_rel_err,
    normal,
    single_step_grads,
    window_grads,
    x64,
)
from braintrace._algorithm.engine.graph_executor import detached_df_key, df_key
from tests.compiler import control_flow_models as cf

__all__ = ["x64"]  # the fixture is used by name

T = 4
EXACT = 1e-10


def inputs(n_in: int = 3, batch: int | None = None) -> Any:
    """``T`` steps; the first feature takes values that visit every cond/switch branch."""
    shape = (T, n_in) if batch is None else (T, batch, n_in)
    xs = np.array(normal(5, shape))
    xs[..., 0] = np.array([1.0, -1.0, 0.2, -0.8]).reshape(T, *([1] * (len(shape) - 2)))
    return jnp.asarray(xs)


def learner_of(model: brainstate.nn.Module, x0: Any, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the plain readout weight is reported as excluded
        return braintrace.compile(model, braintrace.D_RTRL, x0, **options)


CANONICALISED = {
    "cond": (cf.CondModel, {}),
    "switch3": (cf.SwitchModel, {}),
    "cond_in_scan": (cf.CondInScanModel, {}),
    "scan_len1": (cf.SubstepModel, {"length": 1}),
    "scan_reverse": (cf.SubstepModel, {"length": 3, "reverse": True}),
    "for_loop_reverse": (cf.SubstepModel, {"length": 3, "reverse": True, "api": "for_loop"}),
    "two_carries": (cf.TwoStateModel, {"length": 3}),
    "scan_len16": pytest.param((cf.SubstepModel, {"length": 16}), marks=pytest.mark.slow),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CANONICALISED.values()), ids=list(CANONICALISED))
def test_canonicalised_model_learns_like_bptt_and_its_twin(case: Any, x64: None) -> None:
    cls, kwargs = case
    xs = inputs()
    ref = bptt_grads(cls(**kwargs), xs)
    twin = bptt_grads(cls(flat=True, **kwargs), xs)
    assert max_rel_err(ref, twin) < EXACT
    online = single_step_grads(learner_of(cls(**kwargs), xs[0]), xs)
    assert max_rel_err(ref, online) < EXACT


# --- structured scan descent --------------------------------------------------------------

DESCENDED = {
    "scan": (cf.SubstepModel, {"length": 20}),
    "for_loop": (cf.SubstepModel, {"length": 20, "api": "for_loop"}),
    "two_states": (cf.TwoStateModel, {"length": 20}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DESCENDED.values()), ids=list(DESCENDED))
def test_descended_scan_single_step_equals_bptt(case: Any, x64: None) -> None:
    cls, kwargs = case
    xs = inputs()
    ref = bptt_grads(cls(**kwargs), xs)
    learner = learner_of(cls(**kwargs), xs[0])
    assert learner.graph.explain(kind=braintrace.DiagnosticKind.SCAN_DESCENT_APPLIED)
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


@pytest.mark.slow
@pytest.mark.parametrize("windows", [[T], [1, 3], [1] * T], ids=["whole", "chunks_1_3", "steps"])
@pytest.mark.parametrize("case", list(DESCENDED.values()), ids=list(DESCENDED))
def test_descended_scan_multi_step_equals_bptt(case: Any, windows: list[int], x64: None) -> None:
    cls, kwargs = case
    xs = inputs()
    ref = bptt_grads(cls(**kwargs), xs)
    learner = learner_of(cls(**kwargs), xs[0], vjp_method="multi-step")
    assert max_rel_err(ref, window_grads(learner, xs, windows)) < EXACT


@pytest.mark.slow
def test_descended_scan_batched_single_step_equals_bptt(x64: None) -> None:
    xs = inputs(batch=2)
    ref = bptt_grads(cf.SubstepModel(length=20), xs, batch_size=2)
    learner = learner_of(cf.SubstepModel(length=20), xs[0], batch_size=2)
    assert max_rel_err(ref, single_step_grads(learner, xs)) < EXACT


@pytest.mark.slow
def test_mixing_body_whole_sequence_is_exact_and_chunks_approximate(x64: None) -> None:
    xs = inputs()
    ref = bptt_grads(cf.MixingModel(), xs)
    whole = learner_of(cf.MixingModel(), xs[0], vjp_method="multi-step")
    assert max_rel_err(ref, window_grads(whole, xs, [T])) < EXACT
    # The substep hidden Jacobian keeps the leak but drops the mixing through U: chunk
    # boundaries lose that cross-substep credit (documented approximation; cosine 0.986 here).
    chunked = learner_of(cf.MixingModel(), xs[0], vjp_method="multi-step")
    approx = window_grads(chunked, xs, [1] * T)
    assert all(np.all(np.isfinite(g)) for g in approx.values())
    assert cosine(ref, approx) > 0.95 and max_rel_err(ref, approx) > 1e-3


@pytest.mark.slow
def test_reading_the_state_through_stacked_ys_is_exact(x64: None) -> None:
    # ys[-1] is the carried state's new value through another variable, so the output reads the
    # previous value past the perturbed update: the learner takes ∂L/∂h^{t-1} through every path.
    xs = inputs()
    model = functools.partial(cf.SubstepModel, length=20, read_ys=True)
    learner = learner_of(model(), xs[0])
    assert learner._groups_read_past_update()
    assert max_rel_err(bptt_grads(model(), xs), single_step_grads(learner, xs)) < EXACT


def test_non_param_dim_algorithms_refuse_descended_graphs() -> None:
    model = cf.SubstepModel(length=20)
    learner = braintrace.pp_prop(model, decay_or_rank=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(NotImplementedError, match="scan_descent='off'"):
            learner.compile_graph(jnp.ones(3))


# --- weight-free while_loop ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("coupled", [False, True], ids=["settle", "settle_coupled"])
def test_while_settle_single_step_equals_twin(coupled: bool, x64: None) -> None:
    xs = inputs()
    twin_ref = bptt_grads(cf.SettleModel(flat=True, coupled=coupled), xs)
    twin = single_step_grads(learner_of(cf.SettleModel(flat=True, coupled=coupled), xs[0]), xs)
    assert max_rel_err(twin_ref, twin) < EXACT
    online = single_step_grads(learner_of(cf.SettleModel(coupled=coupled), xs[0]), xs)
    assert max_rel_err(twin, online) < EXACT


@pytest.mark.parametrize("coupled", [False, True], ids=["settle", "settle_coupled"])
def test_while_settle_pp_prop_equals_its_twin(coupled: bool, x64: None) -> None:
    xs = inputs()
    learners = []
    for flat in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learners.append(braintrace.compile(cf.SettleModel(flat=flat, coupled=coupled), "pp_prop", xs[0],
                                               decay_or_rank=0.8))
    twin, online = (single_step_grads(learner, xs) for learner in learners)
    assert max_rel_err(twin, online) < EXACT


def _halvings(xs: Any) -> list[int]:
    """How many times :class:`HalvedDriveModel`'s loop halves the drive at each step."""
    model = cf.HalvedDriveModel()
    counts = []
    for x in xs:
        z = jnp.max(jnp.abs(jnp.tanh(x @ model.w.value)))
        counts.append(next((k for k in range(3) if z / 2 ** k <= model.limit), 3))
    return counts


@pytest.mark.parametrize("algorithm, options", [("d_rtrl", {}), ("pp_prop", {"decay_or_rank": 0.7})])
def test_a_while_between_the_weight_product_and_the_hidden_state_is_learned_through(
    algorithm: str, options: dict[str, Any], x64: None,
) -> None:
    """The loop is detached in the perturbed step and its part of ``df`` taken in forward mode:
    the learner equals itself on the loop-free twin, and D_RTRL equals BPTT."""
    xs = inputs()
    assert len(set(_halvings(xs))) > 1  # the trip count depends on the data
    learners = []
    for flat in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learners.append(braintrace.compile(cf.HalvedDriveModel(flat=flat), algorithm, xs[0], **options))
    twin, online = (single_step_grads(learner, xs) for learner in learners)
    assert max_rel_err(twin, online) < EXACT
    if algorithm == "d_rtrl":
        assert max_rel_err(bptt_grads(cf.HalvedDriveModel(flat=True), xs), online) < EXACT


def test_executor_stacks_descended_jacobians_over_substeps() -> None:
    model = cf.SubstepModel(length=20)
    executor = braintrace.ETraceGraphExecutor(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        executor.compile_graph(jnp.ones(3))
    (xs, dfs), Ds = executor.solve_h2w_h2h_jacobian(jnp.array([0.3, -0.2, 0.5]))[3:5]
    (group,) = executor.graph.hidden_groups
    leak, drive = executor.graph.hidden_param_op_relations
    assert Ds[0].shape == (20, 4, 1, 1)
    # D of h = sigmoid(tau) h + ... at every substep is the leak.
    np.testing.assert_allclose(Ds[0][..., 0, 0], jnp.broadcast_to(jax.nn.sigmoid(model.tau.value), (20, 4)), rtol=1e-6)
    assert xs[id(drive.x_var)].shape == (20, 3)
    np.testing.assert_allclose(xs[id(drive.x_var)][:, 0], 0.3 * jnp.linspace(0.5, 1.5, 20), rtol=1e-6)
    for rel in (leak, drive):
        assert dfs[df_key(rel, group)].shape == (20, 4, 1)


def test_while_tail_reports_the_part_crossing_the_loop() -> None:
    for coupled in (False, True):
        executor = braintrace.ETraceGraphExecutor(cf.SettleModel(coupled=coupled))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            executor.compile_graph(jnp.ones(3))
        (_, dfs), _ = executor.solve_h2w_h2h_jacobian(jnp.array([0.3, -0.2, 0.5]))[3:5]
        (rel,) = executor.graph.hidden_param_op_relations
        (group,) = rel.hidden_groups
        full, through = dfs[df_key(rel, group)], dfs[detached_df_key(rel, group)]
        np.testing.assert_allclose(through[..., 0], full[..., 0], rtol=1e-6)  # h: only through the loop
        if coupled:  # a: only around the loop
            np.testing.assert_allclose(through[..., 1], 0.0, atol=1e-7)
            assert bool(jnp.all(full[..., 1] != 0))


#: The weight-free while models (``flat=True``: the loop-free twin).
WHILE_MODELS = {
    "settle": cf.SettleModel,
    "settle_coupled": functools.partial(cf.SettleModel, coupled=True),
    "halved_drive": cf.HalvedDriveModel,
    "halved_in_branch": cf.HalvedInBranchModel,
    "halved_in_scan": cf.HalvedInScanModel,
    "input_loop": cf.InputLoopModel,
}


@pytest.mark.slow
@pytest.mark.parametrize("windows", [[T], [1, 3], [1] * T], ids=["whole", "chunks_1_3", "steps"])
@pytest.mark.parametrize("model", list(WHILE_MODELS))
def test_d_rtrl_windows_over_a_while_equal_bptt(model: str, windows: list[int], x64: None) -> None:
    xs = inputs()
    make = WHILE_MODELS[model]
    learner = learner_of(make(), xs[0], vjp_method="multi-step")
    assert max_rel_err(bptt_grads(make(flat=True), xs), window_grads(learner, xs, windows)) < EXACT


@pytest.mark.parametrize("model", ["halved_in_branch", "halved_in_scan", "input_loop"])
def test_single_step_through_a_nested_or_input_while_equals_bptt(model: str, x64: None) -> None:
    xs = inputs()
    make = WHILE_MODELS[model]
    assert max_rel_err(bptt_grads(make(flat=True), xs), single_step_grads(learner_of(make(), xs[0]), xs)) < EXACT


@pytest.mark.parametrize("model", ["settle_coupled", "halved_drive"])
def test_pp_prop_windows_over_a_while_equal_its_twin(model: str, x64: None) -> None:
    xs = inputs()
    got = []
    for flat in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learner = braintrace.compile(WHILE_MODELS[model](flat=flat), "pp_prop", xs[0], decay_or_rank=0.7,
                                         vjp_method="multi-step")
        got.append(window_grads(learner, xs, [2, 2]))
    assert max_rel_err(got[1], got[0]) < EXACT
    # pp_prop's factorised trace is approximate across a window boundary: the comparison can fail.
    assert max_rel_err(bptt_grads(WHILE_MODELS[model](flat=True), xs), got[0]) > 1e-4


@pytest.mark.parametrize("vjp_method", ["single-step", "multi-step"])
def test_pp_prop_in_its_exact_regime_equals_bptt_through_a_while(vjp_method: str, x64: None) -> None:
    # A feedforward step (h = halve(tanh(x W)), no recurrence): pp_prop's feedforward coordinate
    # is exact there, through the data-dependent loop as without it.
    xs = inputs()
    assert len(set(_halvings(xs))) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(cf.FeedforwardHalvedModel(), "pp_prop", xs[0], decay_or_rank=0.0,
                                     vjp_method=vjp_method)
    got = single_step_grads(learner, xs) if vjp_method == "single-step" else window_grads(learner, xs, [2, 2])
    assert max_rel_err(bptt_grads(cf.FeedforwardHalvedModel(flat=True), xs), got) < EXACT


@pytest.mark.parametrize("vjp_method", ["single-step", "multi-step"])
def test_the_gradient_audit_takes_bptt_through_a_while(vjp_method: str, x64: None) -> None:
    # The audit's BPTT reference binds the loop reversibly (JAX's reverse mode refuses it): it
    # equals BPTT of the loop-free twin, and D_RTRL is exact against it.
    from braintrace._audit import check_gradients

    xs = inputs()
    learner = learner_of(cf.HalvedDriveModel(), xs[0], vjp_method=vjp_method)
    ys = jnp.zeros((xs.shape[0], 2))
    if vjp_method == "single-step":
        audit = check_gradients(learner, xs, ys, step_fn=lambda x, y: jnp.sum((learner(x) - y) ** 2))
    else:
        audit = check_gradients(learner, xs, ys, chunk_size=2, step_fn=lambda x, y: jnp.sum(
            (learner(braintrace.MultiStepData(x)) - y) ** 2, axis=-1))
    twin = cf.HalvedDriveModel(flat=True)

    def loss() -> Any:
        return sum(jnp.sum(twin(x) ** 2) for x in xs)

    ref = brainstate.transform.grad(loss, twin.states(brainstate.ParamState))()
    assert audit.exact
    assert max_rel_err({p: np.asarray(g) for p, g in ref.items()},
                       {p: np.asarray(g) for p, g in audit.bptt_grads.items()}) < EXACT


@pytest.mark.parametrize("vjp_method", ["single-step", "multi-step"])
def test_a_while_reading_a_weight_is_refused_with_its_line_and_the_fix(vjp_method: str) -> None:
    with pytest.raises(braintrace.NotSupportedError,
                       match=r"weight is used inside a while_loop at .*control_flow_models.py:\d+.*"
                             r"lax.fori_loop with static bounds, or lax.scan"):
        learner_of(cf.WeightInWhile(), jnp.ones(4), vjp_method=vjp_method)

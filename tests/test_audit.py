"""The gradient audit: ``check_gradients`` and ``compare_learners`` (``braintrace._audit``).

The reference in every test is written here: ``brainstate.transform.grad`` of the masked summed
loss through a Python loop over the steps of a fresh copy of the model (same initialisation),
and the cosine / relative error / norm ratio computed by hand with NumPy. D_RTRL is exact on an
element-wise recurrence (:class:`Leaky`) and approximate on a dense one (:class:`Dense`, the
negative control), in float64.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._audit import GradientAudit, LearnerComparison, check_gradients, compare_learners
from braintrace._audit import check as audit_check
from braintrace._audit.report import PLOT_FLOOR, gradient_figures
from tests.algorithm.bptt import normal, x64

__all__ = ["x64"]  # the fixture is used by name

T, N_IN, N_HID, N_OUT = 6, 3, 4, 2
MASK = [1.0, 0.0, 1.0, 0.5, 2.0, 1.0]
EXACT = 1e-10


# --- models -----------------------------------------------------------------------------------


class Leaky(brainstate.nn.Module):
    """``h = tanh(a ⊙ h + x W)``, readout ``h R``: an element-wise recurrence (D_RTRL is exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(1, (N_IN, N_HID), 0.6))
        self.readout = brainstate.ParamState(normal(2, (N_HID, N_OUT)))
        self.decay = jnp.linspace(0.5, 0.9, N_HID)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, N_HID) if batch_size else (N_HID,)))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = jnp.tanh(self.decay * self.h.value + braintrace.matmul(x, self.w.value))
        return self.h.value @ self.readout.value


class Dense(brainstate.nn.Module):
    """A ``ValinaRNNCell`` (its recurrence mixes units: D_RTRL is approximate) and a plain readout."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = braintrace.nn.ValinaRNNCell(N_IN, N_HID)
        self.readout = brainstate.ParamState(normal(5, (N_HID, N_OUT)))

    def update(self, x: jax.Array) -> jax.Array:
        return self.cell(x) @ self.readout.value


def make(model_cls: type) -> brainstate.nn.Module:
    brainstate.random.seed(0)
    return model_cls()


def data(batch: int | None = None) -> tuple[jax.Array, jax.Array]:
    lead = (T, batch) if batch else (T,)
    return normal(11, (*lead, N_IN)), normal(12, (*lead, N_OUT))


def loss(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((out - y) ** 2)


def window_loss(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((out - y) ** 2, axis=-1)


def learner_of(model_cls: type, algorithm: Any = "d_rtrl", batch: int | None = None, **options: Any) -> Any:
    x0 = data(batch)[0][0]
    return braintrace.compile(make(model_cls), algorithm, x0, batch_size=batch, **options)


def step_of(learner: Any) -> Callable[..., jax.Array]:
    return lambda x, y: loss(learner(x), y)


# --- the hand-written reference ---------------------------------------------------------------


def hand_bptt(model_cls: type, xs: Any, ys: Any, mask: Any = None, batch: int | None = None,
              truncated: bool = False) -> dict:
    """``grad`` of ``Σ_t mask_t loss(model(x_t), y_t)`` through a Python loop, on a fresh model."""
    model = make(model_cls)
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)
    hidden = model.states(brainstate.HiddenState)
    weights = np.ones(T) if mask is None else np.asarray(mask)

    def total() -> jax.Array:
        acc = jnp.zeros(())
        for t in range(T):
            if truncated:
                for st in hidden.values():
                    st.value = jax.lax.stop_gradient(st.value)
            acc = acc + weights[t] * loss(model(xs[t]), ys[t])
        return acc

    return dict(brainstate.transform.jit(lambda: brainstate.transform.grad(total, params)())())


def flat(grads: dict) -> dict[str, np.ndarray]:
    """``{'cell.W.weight['bias']': array, ...}``: every leaf of every parameter, in float64."""
    out = {}
    for path, g in grads.items():
        for keys, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
            out[".".join(map(str, path)) + jax.tree_util.keystr(keys)] = np.asarray(leaf, np.float64)
    return out


def by_hand(online: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """Cosine, relative error, norm ratio of two flat vectors (NumPy, nothing shared with the audit)."""
    a, b = online.ravel(), ref.ravel()
    return (float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))),
            float(np.linalg.norm(a - b) / np.linalg.norm(b)),
            float(np.linalg.norm(a) / np.linalg.norm(b)))


def assert_grads_equal(got: dict, ref: dict, rtol: float) -> None:
    got, ref = flat(got), flat(ref)
    assert sorted(got) == sorted(ref)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=rtol, atol=rtol * np.abs(ref[name]).max(), err_msg=name)


def state_values(learner: Any) -> list[tuple[Any, np.ndarray]]:
    return [(path, np.asarray(leaf)) for path, st in learner.states().items() for leaf in jax.tree.leaves(st.value)]


def assert_bitwise_equal(before: list, after: list) -> None:
    assert [p for p, _ in before] == [p for p, _ in after]
    for (path, a), (_, b) in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path


# --- the figures ------------------------------------------------------------------------------


def test_the_figures_equal_a_hand_written_bptt_reference(x64: None) -> None:
    xs, ys = data()
    learner = learner_of(Dense)
    audit = check_gradients(learner, xs, ys, step_fn=step_of(learner), mask=jnp.asarray(MASK))
    ref = hand_bptt(Dense, xs, ys, MASK)
    assert_grads_equal(audit.bptt_grads, ref, rtol=1e-12)
    online = learner.etrace_grad(xs, ys, step_fn=step_of(learner), mask=jnp.asarray(MASK), reduction="sum")
    assert_grads_equal(audit.online_grads, online, rtol=1e-12)
    got, want = flat(online), flat(ref)
    assert [row.name for row in audit.rows] == list(want)
    for row in audit.rows:
        cosine, rel, ratio = by_hand(got[row.name], want[row.name])
        np.testing.assert_allclose([row.cosine, row.relative_error, row.norm_ratio], [cosine, rel, ratio],
                                   rtol=1e-6, atol=1e-12)
        assert row.exact == (rel <= audit.rtol) and row.size == want[row.name].size
    every = by_hand(np.concatenate([got[n].ravel() for n in want]), np.concatenate([want[n].ravel() for n in want]))
    np.testing.assert_allclose([audit.overall.cosine, audit.overall.relative_error, audit.overall.norm_ratio],
                               every, rtol=1e-6, atol=1e-12)
    objective = sum(w * float(loss(o, y)) for w, o, y in zip(MASK, learner.etrace_evolve(xs, return_outputs=True), ys))
    np.testing.assert_allclose(audit.objective, objective, rtol=1e-10)
    # D_RTRL drops the dense recurrence's mixing of units: approximate, but a readout is exact.
    rows = {row.name: row for row in audit.rows}
    assert not audit.exact and audit.verdict == "approximate"
    assert rows["cell.W.weight['weight']"].relative_error > 1e-2 and not rows["cell.W.weight['weight']"].exact
    assert rows["readout"].relative_error < EXACT and rows["readout"].exact
    # Negative control: against truncated BPTT (no history) the figures are clearly different.
    truncated = flat(hand_bptt(Dense, xs, ys, MASK, truncated=True))
    name = "cell.W.weight['weight']"
    assert abs(by_hand(got[name], truncated[name])[1] - rows[name].relative_error) > 1e-3


def test_d_rtrl_on_an_element_wise_recurrence_is_exact(x64: None) -> None:
    xs, ys = data()
    learner = learner_of(Leaky)
    audit = check_gradients(learner, xs, ys, step_fn=step_of(learner), rtol=1e-9)
    assert audit.exact and audit.verdict == "exact"
    assert sorted(row.name for row in audit.rows) == ["readout", "w"]
    assert max(row.relative_error for row in audit.rows) < EXACT
    assert min(row.cosine for row in audit.rows) > 1 - EXACT
    assert_grads_equal(audit.bptt_grads, hand_bptt(Leaky, xs, ys), rtol=1e-12)
    # A subset of the weights, and a step_fn with auxiliary outputs (discarded).
    with_aux = lambda x, y: (step_of(learner)(x, y), x)  # noqa: E731
    subset = {("w",): learner.param_states[("w",)]}
    only_w = check_gradients(learner, xs, ys, step_fn=with_aux, has_aux=True, weights=subset, rtol=1e-9)
    assert [row.name for row in only_w.rows] == ["w"]
    assert only_w.rows[0] == next(row for row in audit.rows if row.name == "w")


def test_figures_of_zero_gradients() -> None:
    assert gradient_figures(np.zeros(2), np.zeros(2)) == (1.0, 0.0, 1.0)
    cosine, rel, ratio = gradient_figures(np.ones(2), np.zeros(2))
    assert np.isnan(cosine) and rel == np.inf and ratio == np.inf
    cosine, rel, ratio = gradient_figures(np.zeros(2), np.ones(2))
    assert np.isnan(cosine) and rel == 1.0 and ratio == 0.0
    audit = GradientAudit.from_gradients("z", {("w",): np.ones(2)}, {("w",): np.zeros(2)}, rtol=1e-4, objective=0.0)
    assert not audit.exact and audit.to_dict()["rows"][0]["relative_error"] is None


# --- modes ------------------------------------------------------------------------------------


def test_window_mode_on_a_multi_step_learner(x64: None) -> None:
    xs, ys = data()
    leaky = learner_of(Leaky, vjp_method="multi-step")
    window_step = lambda x, y: window_loss(leaky(braintrace.MultiStepData(x)), y)  # noqa: E731
    audit = check_gradients(leaky, xs, ys, step_fn=window_step, chunk_size=3, mask=jnp.asarray(MASK), rtol=1e-9)
    assert audit.exact
    assert_grads_equal(audit.bptt_grads, hand_bptt(Leaky, xs, ys, MASK), rtol=1e-12)
    dense = learner_of(Dense, vjp_method="multi-step")
    dense_step = lambda x, y: window_loss(dense(braintrace.MultiStepData(x)), y)  # noqa: E731
    audit = check_gradients(dense, xs, ys, step_fn=dense_step, chunk_size=2, rtol=1e-9)
    assert_grads_equal(audit.bptt_grads, hand_bptt(Dense, xs, ys), rtol=1e-12)
    assert not audit.exact  # negative control: windows of two steps do not cover the history


def test_vmapped_learner(x64: None) -> None:
    xs, ys = data(batch=2)
    learner = braintrace.compile(make(Leaky), "d_rtrl", xs[0], batch_size=2, vmap=True)
    audit = check_gradients(learner, xs, ys, step_fn=step_of(learner), rtol=1e-9)
    assert audit.learner == "ETraceVmap(D_RTRL)" and audit.exact
    assert_grads_equal(audit.bptt_grads, hand_bptt(Leaky, xs, ys, batch=2), rtol=1e-12)
    learner.etrace_evolve(xs[:2])  # mid-stream: the traces carry two steps of history
    before = state_values(learner)
    with pytest.warns(UserWarning, match="made 2 call.s. since its last reset.*reset=True"):
        midstream = check_gradients(learner, xs, ys, step_fn=step_of(learner), rtol=1e-9)
    assert not midstream.exact  # that history is not in the BPTT reference
    fresh = check_gradients(learner, xs, ys, step_fn=step_of(learner), rtol=1e-9, reset=True)
    assert_bitwise_equal(before, state_values(learner))
    assert fresh.exact and fresh.rows == audit.rows


def test_learner_options_are_accepted_and_the_reference_is_the_loss_gradient(x64: None) -> None:
    xs, ys = data()
    learner = learner_of(Dense, braintrace.ThreeFactor)
    mods = normal(21, (T, N_HID))
    step = lambda x, y, m: loss(learner(x, modulator=m), y)  # noqa: E731
    audit = check_gradients(learner, xs, ys, mods, step_fn=step)
    assert_grads_equal(audit.bptt_grads, hand_bptt(Dense, xs, ys), rtol=1e-12)
    assert not audit.exact  # a random modulator is not the loss gradient's signal


# --- states -----------------------------------------------------------------------------------


def test_every_state_is_left_as_it_was_also_when_step_fn_raises(x64: None) -> None:
    xs, ys = data()
    learner, twin = learner_of(Dense), learner_of(Dense)
    for each in (learner, twin):
        each.etrace_evolve(xs[:3])  # non-zero hidden states and traces, running_index 3
    before = state_values(learner)
    assert int(learner.running_index.value) == 3
    traces = learner.states(braintrace.EligibilityTrace).values()
    assert traces and all(np.abs(leaf).max() > 0 for st in traces for leaf in jax.tree.leaves(st.value))
    check_gradients(learner, xs, ys, step_fn=step_of(learner), reset=True)
    assert_bitwise_equal(before, state_values(learner))

    def broken(x: jax.Array, y: jax.Array) -> jax.Array:
        learner(x)
        raise RuntimeError("broken step")

    with pytest.raises(RuntimeError, match="broken step"):
        check_gradients(learner, xs, ys, step_fn=broken, reset=True)
    assert_bitwise_equal(before, state_values(learner))

    online_calls = {"n": 0}

    def counting(x: jax.Array, y: jax.Array) -> jax.Array:
        online_calls["n"] += 1
        return loss(twin(x), y)

    twin.etrace_grad(xs, ys, step_fn=counting)  # how often the online run calls step_fn
    learner.etrace_grad(xs, ys, step_fn=step_of(learner))  # the same run: the two stay alike
    before = state_values(learner)
    calls = {"n": 0}

    def fails_in_the_bptt_run(x: jax.Array, y: jax.Array) -> jax.Array:
        calls["n"] += 1
        if calls["n"] > online_calls["n"]:
            raise RuntimeError("fails in the BPTT run")
        return step_of(learner)(x, y)

    with pytest.raises(RuntimeError, match="fails in the BPTT run"):
        check_gradients(learner, xs, ys, step_fn=fails_in_the_bptt_run, reset=True)
    assert calls["n"] == online_calls["n"] + 1  # the online run had completed
    assert_bitwise_equal(before, state_values(learner))
    # The learner runs as before (its own step restored): the same result as its untouched twin.
    assert_grads_equal(learner.etrace_grad(xs, ys, step_fn=step_of(learner)),
                       twin.etrace_grad(xs, ys, step_fn=step_of(twin)), rtol=0.0)
    with pytest.raises(AssertionError):  # negative control: a plain run does move the states
        assert_bitwise_equal(before, state_values(learner))


# --- several learners -------------------------------------------------------------------------


def test_compare_learners_runs_bptt_once_and_matches_single_audits(x64: None, monkeypatch: pytest.MonkeyPatch) -> None:
    xs, ys = data()
    runs = {"n": 0}
    bptt = audit_check.bptt_gradients

    def counting(*args: Any, **kwargs: Any) -> Any:
        runs["n"] += 1
        return bptt(*args, **kwargs)

    monkeypatch.setattr(audit_check, "bptt_gradients", counting)
    algorithms = ["d_rtrl", ("pp_prop", {"decay_or_rank": 0.9}), braintrace.ETraceConfig(recurrence_scope="coupled")]
    comparison = compare_learners(make(Leaky), algorithms, xs, ys, loss_fn=loss, rtol=1e-9)
    assert runs["n"] == 1
    assert comparison.labels[:2] == ("d_rtrl", "pp_prop(decay_or_rank=0.9)") and len(comparison.labels) == 3
    first = comparison.audits[0].bptt_grads
    assert all(audit.bptt_grads[p] is first[p] for audit in comparison.audits for p in first)
    assert_grads_equal(first, hand_bptt(Leaky, xs, ys), rtol=1e-12)
    assert [audit.exact for audit in comparison.audits] == [True, False, True]  # pp_prop's leak is not the model's
    single = learner_of(Leaky, "pp_prop", decay_or_rank=0.9)
    alone = check_gradients(single, xs, ys, step_fn=step_of(single), rtol=1e-9)
    assert {row.name: row for row in alone.rows}["w"].relative_error > 1e-2
    for got, want in zip(comparison["pp_prop(decay_or_rank=0.9)"].rows, alone.rows, strict=True):
        assert got.name == want.name
        np.testing.assert_allclose([got.cosine, got.relative_error, got.norm_ratio],
                                   [want.cosine, want.relative_error, want.norm_ratio], rtol=1e-9)
    lines = comparison.table().splitlines()
    assert len(lines) == 2 + 3 * (len(alone.rows) + 1)
    assert sum(line.startswith("pp_prop(decay_or_rank=0.9) ") for line in lines) == len(alone.rows) + 1


def test_compare_learners_in_window_mode_and_labelled(x64: None) -> None:
    xs, ys = data()
    rules = {"D-RTRL": braintrace.D_RTRL, "ES-D-RTRL": ("pp_prop", {"decay_or_rank": 0.7})}
    comparison = compare_learners(make(Leaky), rules, xs, ys, loss_fn=window_loss, chunk_size=3,
                                  vjp_method="multi-step", rtol=1e-9)
    assert comparison.labels == ("D-RTRL", "ES-D-RTRL")
    assert comparison["D-RTRL"].exact and not comparison["ES-D-RTRL"].exact
    with pytest.raises(KeyError, match="no learner labelled 'd_rtrl'; the labels are"):
        comparison["d_rtrl"]
    assert_grads_equal(comparison.audits[0].bptt_grads, hand_bptt(Leaky, xs, ys), rtol=1e-12)


# --- the report -------------------------------------------------------------------------------


@pytest.fixture
def audit() -> GradientAudit:
    """An audit of made-up gradients: a dict-valued parameter (two leaves) and an array one."""
    bptt = {("cell", "W", "weight"): {"bias": np.array([1.0, 2.0]), "weight": np.array([[1.0, 0.0], [0.0, 1.0]])},
            ("readout",): np.array([3.0, -1.0])}
    online = {("cell", "W", "weight"): {"bias": np.array([1.0, 2.5]), "weight": np.array([[1.0, 0.0], [0.0, 1.0]])},
              ("readout",): np.array([3.0, -1.0 + 1e-6])}
    return GradientAudit.from_gradients("D_RTRL", online, bptt, rtol=1e-4, objective=1.5)


def test_table_repr_and_dict(audit: GradientAudit) -> None:
    lines = audit.table().splitlines()
    assert lines[0] == "D_RTRL vs BPTT (rtol=0.0001): approximate"
    assert lines[1].split() == ["parameter", "cosine", "rel.", "error", "norm", "ratio", "verdict"]
    assert [line.split()[0] for line in lines[2:]] == [*(row.name for row in audit.rows), "overall"]
    assert len({line.index(line.split()[1]) for line in lines[2:]}) == 1  # aligned columns
    assert repr(audit) == audit.table()
    out = json.loads(json.dumps(audit.to_dict()))
    assert out["learner"] == "D_RTRL" and out["exact"] is False and out["rtol"] == 1e-4
    assert [row["name"] for row in out["rows"]] == [row.name for row in audit.rows]
    assert out["rows"][0]["relative_error"] == audit.rows[0].relative_error
    assert out["rows"][0]["path"] == ["cell", "W", "weight"] and out["rows"][0]["leaf"] == "['bias']"
    assert [row.exact for row in audit.rows] == [False, True, True]
    np.testing.assert_allclose(audit.rows[0].relative_error, 0.5 / np.sqrt(5))


def test_plots(audit: GradientAudit) -> None:
    from matplotlib.figure import Figure

    ax = audit.plot(Figure().add_subplot())
    assert len(ax.patches) == len(audit.rows) and ax.get_yscale() == "log"
    assert list(ax.lines[0].get_ydata()) == [audit.rtol, audit.rtol]
    heights = [patch.get_height() for patch in ax.patches]
    np.testing.assert_allclose(heights, [max(row.relative_error, PLOT_FLOOR) for row in audit.rows])
    assert heights[1] == PLOT_FLOOR  # an exact zero is drawn at the floor of the log axis
    comparison = LearnerComparison((audit, audit), rtol=audit.rtol, objective=audit.objective)
    ax = comparison.plot(Figure().add_subplot())
    assert len(ax.patches) == 2 * len(audit.rows)
    import matplotlib.pyplot as plt

    ax = audit.plot()
    assert ax.figure is not None
    plt.close(ax.figure)


# --- argument errors --------------------------------------------------------------------------


def driver_message(call: Callable[[], Any]) -> str:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return str(info.value)


def test_bad_arguments_of_check_gradients() -> None:
    xs, ys = data()
    learner = learner_of(Dense)
    step = step_of(learner)
    with pytest.raises(TypeError, match="learner must be a compiled braintrace learner.*got Dense"):
        check_gradients(make(Dense), xs, ys, step_fn=step)
    with pytest.raises(TypeError, match="step_fn must be a callable"):
        check_gradients(learner, xs, ys, step_fn=None)  # type: ignore[arg-type]
    for rtol in (0.0, -1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"rtol must be a positive finite number, got {rtol!r}"):
            check_gradients(learner, xs, ys, step_fn=step, rtol=rtol)
    for not_a_float in ("1e-4", True):
        with pytest.raises(TypeError, match="rtol must be a positive float"):
            check_gradients(learner, xs, ys, step_fn=step, rtol=not_a_float)  # type: ignore[arg-type]
    # The driver's own refusals reach the user unchanged.
    ragged = driver_message(lambda: learner.etrace_grad(xs, ys[:5], step_fn=step, reduction="sum"))
    assert "same leading (time) length" in ragged
    with pytest.raises(ValueError) as info:
        check_gradients(learner, xs, ys[:5], step_fn=step)
    assert str(info.value) == ragged
    single_step = driver_message(lambda: learner.etrace_grad(xs, ys, step_fn=step, chunk_size=2, reduction="sum"))
    assert "needs a multi-step learner" in single_step
    with pytest.raises(ValueError) as info:
        check_gradients(learner, xs, ys, step_fn=step, chunk_size=2)
    assert str(info.value) == single_step
    windowed = learner_of(Dense, vjp_method="multi-step")
    window_step = lambda x, y: window_loss(windowed(braintrace.MultiStepData(x)), y)  # noqa: E731
    divides = driver_message(lambda: windowed.etrace_grad(xs, ys, step_fn=window_step, chunk_size=4, reduction="sum"))
    assert "does not divide the sequence length 6" in divides
    with pytest.raises(ValueError) as info:
        check_gradients(windowed, xs, ys, step_fn=window_step, chunk_size=4)
    assert str(info.value) == divides


def test_bad_arguments_of_compare_learners() -> None:
    xs, ys = data()
    model = make(Dense)
    with pytest.raises(ValueError, match=r"unknown algorithm 'd_rtlr'; valid names are \[.*'d_rtrl'"):
        compare_learners(model, ["d_rtrl", "d_rtlr"], xs, ys, loss_fn=loss)
    with pytest.raises(ValueError, match=r"appear more than once.*mapping"):
        compare_learners(model, ["d_rtrl", "d_rtrl"], xs, ys, loss_fn=loss)
    with pytest.raises(TypeError, match=r"a pair \(rule, options_dict\)"):
        compare_learners(model, [("pp_prop", 0.9)], xs, ys, loss_fn=loss)
    with pytest.raises(TypeError, match="dict is not a braintrace.ETraceAlgorithm subclass"):
        compare_learners(model, [dict], xs, ys, loss_fn=loss)
    with pytest.raises(TypeError, match="algorithms must be a list of rules"):
        compare_learners(model, "d_rtrl", xs, ys, loss_fn=loss)
    with pytest.raises(ValueError, match="algorithms is empty"):
        compare_learners(model, [], xs, ys, loss_fn=loss)
    with pytest.raises(TypeError, match="model must be a brainstate.nn.Module"):
        compare_learners(object(), ["d_rtrl"], xs, ys, loss_fn=loss)
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        compare_learners(model, ["d_rtrl"], xs, ys, loss_fn=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rtol must be a positive finite number"):
        compare_learners(model, ["d_rtrl"], xs, ys, loss_fn=loss, rtol=0)
    with pytest.raises(ValueError, match="compare_learners: every leaf must have the same leading"):
        compare_learners(model, ["d_rtrl"], xs, ys[:4], loss_fn=loss)
    with pytest.raises(ValueError, match="compare_learners: no sequences given"):
        compare_learners(model, ["d_rtrl"], loss_fn=loss)

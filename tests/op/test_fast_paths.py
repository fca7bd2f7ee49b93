"""Every closed-form D-RTRL bundle (``FastPathRules``) against the general per-primitive rules.

For each row of ``cases/`` whose primitive has a bundle:

* ``instant(x, df)`` equals the instantaneous term of the general path (``xy_to_dw`` per
  sample and per state);
* ``recurrent(D, ε)[..., a]`` equals ``Σ_c dt_to_t(D[..., a, c], ε[..., c])``;
* ``solve(g, ε)`` equals ``Σ_a dt_to_t(g[..., a], ε[..., a])`` (also folded over the batch);
* ``chunk`` over a window equals the step-by-step roll;
* ``roll_and_solve_steps`` over several steps equals ``roll_and_solve`` step by step;
* ``applicable`` is false whenever a transform hook is active.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

from braintrace._op import _registries as reg
from braintrace._op import dense
from tests.op.cases import ALL_CASES
from tests.op.opcase import OpCase, close, rand

FAST = [c for c in ALL_CASES if reg.get_fast_path_rules(c.prim) is not None and not c.hooked]
HOOKED = [c for c in ALL_CASES if reg.get_fast_path_rules(c.prim) is not None and c.hooked]
fast_cases = pytest.mark.parametrize("case", FAST, ids=[c.id for c in FAST])
states = pytest.mark.parametrize("num_state", [1, 2])


def _batched(case: OpCase) -> bool:
    return case.prim in reg.BATCHED_PRIMITIVES


def _has_bias(case: OpCase) -> bool:
    return bool(case.params.get("has_bias", False))


def _traces(case: OpCase, num_state: int, key: int) -> dict[str, jax.Array]:
    return {k: rand(key + i, (*s, num_state)) for i, (k, s) in enumerate(case.drtrl_shapes.items())}


def _general_recurrent(case: OpCase, diag: jax.Array, old: dict[str, jax.Array], num_state: int) -> dict[str, jax.Array]:
    dt_to_t = reg.ETP_RULES_DT_TO_T[case.prim]
    rows = []
    for a in range(num_state):
        terms = [
            dt_to_t(diag[..., a, c], {k: v[..., c] for k, v in old.items()}, **case.params)
            for c in range(num_state)
        ]
        rows.append(jax.tree.map(lambda *xs: sum(xs), *terms))
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=-1), *rows)


def _general_instant(case: OpCase, x: Any, df: jax.Array) -> dict[str, jax.Array]:
    xy_to_dw = reg.ETP_RULES_XY_TO_DW[case.prim]

    def one_state(d: jax.Array) -> dict[str, jax.Array]:
        if _batched(case):
            return jax.vmap(lambda xb, db: xy_to_dw(xb, db, case.weights, **case.params))(x, d)
        return xy_to_dw(x, d, case.weights, **case.params)  # type: ignore[no-any-return]

    return jax.vmap(one_state, in_axes=-1, out_axes=-1)(df)  # type: ignore[no-any-return]


def _diag(case: OpCase, num_state: int, key: int, lead: tuple[int, ...] = ()) -> jax.Array:
    return 0.5 * rand(key, (*lead, *case.y().shape, num_state, num_state))


@fast_cases
@states
def test_instant_matches_the_general_instantaneous_term(case: OpCase, num_state: int) -> None:
    fp = reg.ETP_FAST_PATH_RULES[case.prim]
    df = rand(30, (*case.y().shape, num_state))
    got = fp.instant(case.x, df, _has_bias(case))
    jax.tree.map(close, got, _general_instant(case, case.x, df))


@fast_cases
@states
def test_recurrent_matches_the_sum_of_dt_to_t(case: OpCase, num_state: int) -> None:
    fp = reg.ETP_FAST_PATH_RULES[case.prim]
    diag, old = _diag(case, num_state, 31), _traces(case, num_state, 40)
    jax.tree.map(close, fp.recurrent(diag, old, num_state), _general_recurrent(case, diag, old, num_state))


@fast_cases
@states
def test_solve_matches_the_sum_of_dt_to_t(case: OpCase, num_state: int) -> None:
    fp = reg.ETP_FAST_PATH_RULES[case.prim]
    g, trace = rand(32, (*case.y().shape, num_state)), _traces(case, num_state, 50)
    dt_to_t = reg.ETP_RULES_DT_TO_T[case.prim]
    per_state = [dt_to_t(g[..., a], {k: v[..., a] for k, v in trace.items()}, **case.params) for a in range(num_state)]
    want = jax.tree.map(lambda *xs: sum(xs), *per_state)
    jax.tree.map(close, fp.solve(g, trace), want)
    if _batched(case):
        folded = fp.solve(g, trace, fold_batch=True)
        jax.tree.map(lambda u, v: close(u, v.sum(axis=0), atol=1e-4), folded, want)


#: How each platform rolls a group of steps' (or a window's) trace and sums their own gradient
#: terms: element-wise and one product (CPU), a bfloat16 product of the float32 parts and one
#: product (TPU), both element-wise (TPU, a trace of ``dense.ELEMENTWISE_TRACE_BYTES`` or more).
STEPS_FORMS = pytest.mark.parametrize("backend", ["cpu", "tpu", "tpu-large-trace"])


def _steps_form(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: backend.removesuffix("-large-trace"))
    if backend.endswith("-large-trace"):
        monkeypatch.setattr(dense, "ELEMENTWISE_TRACE_BYTES", 0)


@fast_cases
@states
@STEPS_FORMS
def test_chunk_equals_the_step_by_step_roll(
    case: OpCase, num_state: int, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window in closed form, as each platform sums its steps."""
    fp = reg.ETP_FAST_PATH_RULES[case.prim]
    if fp.chunk is None:
        pytest.skip("this bundle has no chunk kernel")
    _steps_form(backend, monkeypatch)
    steps = 4
    xs = None if case.x is None else jnp.stack([case.x * (t + 1) for t in range(steps)])
    dfs = rand(33, (steps, *case.y().shape, num_state))
    diags = _diag(case, num_state, 34, (steps,))
    trace = start = _traces(case, num_state, 60)
    for t in range(steps):
        inst = fp.instant(None if xs is None else xs[t], dfs[t], _has_bias(case))
        trace = jax.tree.map(jnp.add, fp.recurrent(diags[t], trace, num_state), inst)
    eye = jnp.broadcast_to(jnp.eye(num_state), diags.shape[1:])
    suffix = [eye] * steps  # P_s = D_{T-1} ... D_{s+1}
    for s in range(steps - 2, -1, -1):
        suffix[s] = suffix[s + 1] @ diags[s + 1]
    full = suffix[0] @ diags[0]
    got = fp.chunk(xs, dfs, jnp.stack(suffix), full, start, num_state)
    jax.tree.map(lambda u, v: close(u, v, atol=1e-4, rtol=1e-4), got, trace)


def _own_terms(fp: Any, own: jax.Array, xs: jax.Array, dfs: jax.Array, has_bias: bool) -> dict[str, jax.Array]:
    """``solve_instant(own_s, x_s, df_s)`` folded over the batch and summed over the steps."""
    per_step = [fp.solve_instant(own[t][..., None], xs[t], dfs[t][..., None], has_bias, fold_batch=True)
                for t in range(own.shape[0])]
    return jax.tree.map(lambda *terms: sum(terms), *per_step)  # type: ignore[no-any-return]


OWN = pytest.mark.parametrize("with_own", [False, True], ids=["history", "with-own-terms"])


@fast_cases
@STEPS_FORMS
@OWN
def test_roll_and_solve_steps_equals_roll_and_solve_step_by_step(
    case: OpCase, backend: str, with_own: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a one-state trace stored without its state axis: the last trace and the summed
    gradients of five steps, each step contracting the trace it entered with (and, given
    ``own``, adding its own term); the steps' own terms in each platform's form
    (:data:`STEPS_FORMS`)."""
    fp = reg.ETP_FAST_PATH_RULES[case.prim]
    if fp.roll_and_solve_steps is None or fp.roll_and_solve is None or not _batched(case):
        pytest.skip("no kernel over several steps (they serve batched primitives)")
    _steps_form(backend, monkeypatch)
    steps, y = 5, case.y().shape
    trace = start = {k: rand(70 + i, s) for i, (k, s) in enumerate(case.drtrl_shapes.items())}
    xs = jnp.stack([case.x * (t + 1) for t in range(steps)])
    diags, dfs, signals = (rand(key, (steps, *y)) for key in (71, 72, 73))
    total = None
    for t in range(steps):
        trace, grads = fp.roll_and_solve(trace, diags[t], xs[t], dfs[t], signals[t], _has_bias(case))
        total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    kwargs = {}
    if with_own:
        kwargs["own"] = rand(74, (steps, *y))
        total = jax.tree.map(jnp.add, total, _own_terms(fp, kwargs["own"], xs, dfs, _has_bias(case)))
    got_trace, got_grads = fp.roll_and_solve_steps(start, diags, xs, dfs, signals, _has_bias(case), **kwargs)
    jax.tree.map(lambda u, v: close(u, v, atol=1e-5, rtol=1e-5), (got_trace, got_grads), (trace, total))


@fast_cases
@STEPS_FORMS
@OWN
def test_roll_filter_and_solve_steps_equals_roll_filter_and_solve_step_by_step(
    case: OpCase, backend: str, with_own: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace and its filter ``ē ← κ ē + ε`` over five steps at once: the last trace and filter
    and the summed gradients of the steps one by one, in each platform's form."""
    fp = reg.ETP_FAST_PATH_RULES[case.prim]
    if fp.roll_filter_and_solve_steps is None or fp.roll_filter_and_solve is None or not _batched(case):
        pytest.skip("no filtered kernel over several steps (they serve batched primitives)")
    _steps_form(backend, monkeypatch)
    steps, y, kappa = 5, case.y().shape, 0.7
    trace = start = {k: rand(80 + i, s) for i, (k, s) in enumerate(case.drtrl_shapes.items())}
    filt = filt_start = {k: rand(90 + i, s) for i, (k, s) in enumerate(case.drtrl_shapes.items())}
    xs = jnp.stack([case.x * (t + 1) for t in range(steps)])
    diags, dfs, signals, filt_signals = (rand(key, (steps, *y)) for key in (81, 82, 83, 84))
    total = None
    for t in range(steps):
        trace, filt, grads = fp.roll_filter_and_solve(trace, filt, diags[t], xs[t], dfs[t], signals[t],
                                                      filt_signals[t], kappa, _has_bias(case))
        total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    kwargs = {}
    if with_own:
        kwargs["own"] = rand(85, (steps, *y))
        total = jax.tree.map(jnp.add, total, _own_terms(fp, kwargs["own"], xs, dfs, _has_bias(case)))
    got = fp.roll_filter_and_solve_steps(start, filt_start, diags, xs, dfs, signals, filt_signals, kappa,
                                         _has_bias(case), **kwargs)
    jax.tree.map(lambda u, v: close(u, v, atol=1e-5, rtol=1e-5), got, (trace, filt, total))


@pytest.mark.parametrize("case", HOOKED, ids=[c.id for c in HOOKED])
def test_fast_path_is_gated_off_under_any_transform_hook(case: OpCase) -> None:
    assert not reg.ETP_FAST_PATH_RULES[case.prim].applicable(case.params)


@fast_cases
def test_fast_path_applies_without_hooks(case: OpCase) -> None:
    assert reg.ETP_FAST_PATH_RULES[case.prim].applicable(case.params)


BATCHED_FAST = [c for c in FAST if c.prim in reg.BATCHED_PRIMITIVES]


@pytest.mark.parametrize("case", BATCHED_FAST, ids=[c.id for c in BATCHED_FAST])
@states
def test_folded_solve_off_cpu_equals_the_row_loop(
    case: OpCase, num_state: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off CPU the batch fold is one vectorised reduction, on CPU a loop over the rows: same sums."""
    fp = reg.ETP_FAST_PATH_RULES[case.prim]
    g, trace = rand(35, (*case.y().shape, num_state)), _traces(case, num_state, 70)
    assert g.shape[0] > 1, "a batch of several rows, so that the fold is not a single row"
    on_cpu = jax.jit(lambda s, t: fp.solve(s, t, fold_batch=True))(g, trace)
    chosen = []

    def off_cpu_branch(*operands: Any, cpu: Any, default: Any) -> Any:
        chosen.append(default)
        return default(*operands)

    monkeypatch.setattr(jax.lax, "platform_dependent", off_cpu_branch)
    off_cpu = jax.jit(lambda s, t: fp.solve(s, t, fold_batch=True))(g, trace)
    assert chosen, "the fold chooses its form by platform"
    jax.tree.map(lambda u, v: close(u, v, atol=1e-5), off_cpu, on_cpu)

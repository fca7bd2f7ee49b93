"""The explicit time axis of the drivers and ``predict``: ``time_axis=0`` (time-major) or ``1`` (batch-major).

A batch-major run equals the time-major run of the transposed sequences (gradients, losses,
final states), with the per-step outputs of ``etrace_evolve`` / ``predict`` back batch-major and
the losses and auxiliaries as in the time-major run. A sequence in the other layout than the
declared one is refused with the fix named, read from the learner's batch size; when the batch
size equals the length, both layouts have the same shape and the declared axis decides.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import braintools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import normal
from tests.algorithm.test_sequence_drivers import N_IN, T, VmapNet, assert_same_states, state_values

B = 4
DRIVERS = ("etrace_grad", "etrace_evolve", "etrace_train")


def build(algorithm: str = "d_rtrl", batch: int = B, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(VmapNet(), algorithm, jnp.zeros((batch, N_IN)), batch_size=batch, **options)


def sq_fn(learner: Any) -> Callable[[Any, Any], jax.Array]:
    return lambda x, y: jnp.sum((learner(x) - y) ** 2)


def drive(learner: Any, call: str, *sequences: Any, **options: Any) -> Any:
    """``learner.<call>(*sequences)`` with what that driver needs beside them."""
    if call == "etrace_grad":
        return learner.etrace_grad(*sequences, step_fn=sq_fn(learner), **options)
    if call == "etrace_train":
        return learner.etrace_train(*sequences, step_fn=sq_fn(learner), optimizer=braintools.optim.SGD(lr=0.01),
                                    **options)
    return learner.etrace_evolve(sequences[0], return_outputs=True, **options)


def batch_major(batch: int = B, length: int = T) -> tuple[jax.Array, jax.Array]:
    return normal(60, (batch, length, N_IN)), normal(61, (batch, length, 2), 0.5)


def swapped(*trees: Any) -> tuple[Any, ...]:
    return tuple(jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), tree) for tree in trees)


@pytest.fixture(scope="module")
def learners() -> dict[str, Any]:
    """Learners that every test here only asks to refuse (their states never change)."""
    return {"d_rtrl": build(), "bptt": build("bptt"), "vmap": build(vmap=True)}


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [*DRIVERS, "predict"])
@pytest.mark.parametrize("time_axis", [2, -1, None, True, 1.0, "batch"])
def test_any_other_time_axis_is_refused_naming_it(learners: dict[str, Any], call: str, time_axis: Any) -> None:
    learner = learners["d_rtrl"]
    xs, ys = swapped(*batch_major())
    with pytest.raises(ValueError, match=f"{call}: time_axis must be 0 .* or 1 .* got {time_axis!r}"):
        if call == "predict":
            learner.predict(xs, time_axis=time_axis)
        else:
            drive(learner, call, xs, ys, time_axis=time_axis)


@pytest.mark.parametrize("key", ["d_rtrl", "bptt", "vmap"])
@pytest.mark.parametrize("call", DRIVERS)
def test_a_batch_major_sequence_given_as_time_major_is_refused(learners: dict[str, Any], key: str, call: str) -> None:
    xs, ys = batch_major()  # (B, T, ...) given with the default time_axis=0
    with pytest.raises(ValueError, match=r"sequences\[0\] has shape \(4, 6, 3\): axis 0 is the batch size 4 .* "
                                         r"reads as batch-major .* Pass time_axis=1, or transpose it"):
        drive(learners[key], call, xs, ys)


@pytest.mark.parametrize("call", DRIVERS)
def test_a_time_major_sequence_given_as_batch_major_is_refused(learners: dict[str, Any], call: str) -> None:
    xs, ys = swapped(*batch_major())
    with pytest.raises(ValueError, match=r"reads as time-major .* but time_axis=1 declares batch-major .* "
                                         r"Pass time_axis=0"):
        drive(learners["bptt"], call, xs, ys, time_axis=1)


def test_batch_major_needs_a_batch() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        unbatched = braintrace.compile(VmapNet(), "d_rtrl", jnp.zeros(N_IN))
    with pytest.raises(ValueError, match="time_axis=1 declares batch-major .* this learner is unbatched"):
        unbatched.etrace_evolve(normal(62, (T, N_IN)), time_axis=1)
    xs, ys = batch_major()
    with pytest.raises(ValueError, match=r"time_axis=1 .* sequences\[1\] has shape \(6,\)"):
        build("bptt").etrace_grad(xs, jnp.ones(T), step_fn=lambda x, m: jnp.sum(x), time_axis=1)


# --- batch-major runs equal time-major ones ---------------------------------------------------


@pytest.mark.parametrize("algorithm", ["d_rtrl", "bptt"])
def test_etrace_grad_batch_major_equals_time_major(algorithm: str) -> None:
    xs, ys = batch_major()
    a, b = build(algorithm), build(algorithm)

    def with_aux(learner: Any) -> Callable[[Any, Any], Any]:
        def step_fn(x: Any, y: Any) -> Any:
            out = learner(x)
            return jnp.sum((out - y) ** 2), out
        return step_fn

    ga, la, aux_a = a.etrace_grad(xs, ys, step_fn=with_aux(a), return_value=True, has_aux=True, time_axis=1)
    gb, lb, aux_b = b.etrace_grad(*swapped(xs, ys), step_fn=with_aux(b), return_value=True, has_aux=True)
    for path in gb:
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6), ga[path], gb[path])
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    assert la.shape == (T,) and aux_a.shape == (T, B, 2)  # the auxiliaries stay stacked over calls
    np.testing.assert_allclose(aux_a, aux_b, rtol=1e-6)
    assert_same_states(state_values(a), state_values(b), exact=False)


@pytest.mark.slow  # several driver programs, a few seconds
def test_etrace_train_and_evolve_batch_major() -> None:
    xs, ys = batch_major()
    a, b = build(), build()
    ra = drive(a, "etrace_train", xs, ys, update_every=2, time_axis=1)
    rb = drive(b, "etrace_train", *swapped(xs, ys), update_every=2)
    np.testing.assert_allclose(ra.losses, rb.losses, rtol=1e-6)
    assert_same_states(state_values(a), state_values(b), exact=False)
    outs = a.etrace_evolve(xs, return_outputs=True, time_axis=1)
    assert outs.shape == (B, T, 2)  # back batch-major
    np.testing.assert_allclose(outs, jnp.swapaxes(b.etrace_evolve(swapped(xs)[0], return_outputs=True), 0, 1),
                               rtol=1e-6)
    windowed = build(vjp_method="multi-step").etrace_evolve(xs, chunk_size=2, return_outputs=True, time_axis=1)
    assert windowed.shape == (B, T // 2, 2, 2)


@pytest.mark.slow  # several driver programs, a few seconds
def test_when_the_batch_size_equals_the_length_the_declared_axis_decides() -> None:
    xs, ys = batch_major(batch=T, length=T)  # (B, T, ...) with B == T: both layouts read the same
    declared, transposed, other = build("bptt", T), build("bptt", T), build("bptt", T)
    g_declared = declared.etrace_grad(xs, ys, step_fn=sq_fn(declared), time_axis=1)
    g_transposed = transposed.etrace_grad(*swapped(xs, ys), step_fn=sq_fn(transposed), time_axis=0)
    for path in g_transposed:
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6), g_declared[path], g_transposed[path])
    # Read with time_axis=0, the same arrays are taken as time-major, as declared: another gradient.
    g_other = other.etrace_grad(xs, ys, step_fn=sq_fn(other))
    path = next(iter(g_other))
    assert not np.allclose(jax.tree.leaves(g_other[path])[0], jax.tree.leaves(g_declared[path])[0])
    np.testing.assert_allclose(declared.predict(xs, time_axis=1),
                               jnp.swapaxes(transposed.predict(swapped(xs)[0]), 0, 1), rtol=1e-6)

"""The BPTT oracle and the online-learning drivers the algorithm tests compare against it.

* :func:`bptt_grads` — the reference: ``brainstate.transform.grad`` of the summed loss through
  a plain Python loop over the model's steps (backpropagation through time, no learner).
* :func:`single_step_grads` / :func:`single_step_run` — a learner run one step per call, one
  ``grad`` per step, the per-step gradients summed (the supported online pattern).
* :func:`window_grads` — a learner run over ``MultiStepData`` windows, one ``grad`` per
  window, summed.
* :func:`max_rel_err`, :func:`cosine` — comparisons over whole gradient dictionaries;
* the ``x64`` fixture — float64 for one test, restored afterwards.

Every driver keys gradients by the parameter's path, which is the same for the model's
``states(ParamState)`` and the learner's ``param_states``. Drivers run the whole loop under one
``brainstate.transform.jit`` by default: one XLA compilation per case instead of one per
primitive (eager dispatch compiles every new operation shape separately). ``jit=False`` runs
eagerly. Inputs and targets come from NumPy generators so that building them compiles nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace

Grads = dict[tuple[Any, ...], Any]
#: ``loss(t, out) -> scalar`` for the output of step ``t`` (``t`` may be a traced integer).
StepLoss = Callable[[Any, Any], jax.Array]


@pytest.fixture
def x64() -> Iterator[None]:
    """Run one test in float64 (exactness is then checked at ``rel. err < 1e-10``).

    Skipped on a TPU, which has no float64 arithmetic; ``tests/device`` checks every exact
    learner there in float32.
    """
    if jax.default_backend() == "tpu":
        pytest.skip("float64 test: a TPU has no float64 arithmetic (tests/device checks exactness in float32)")
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    """A fixed standard-normal array in the default float dtype (NumPy-generated)."""
    value = scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(value, dtype=jnp.result_type(float))


#: Steps that have their own target in :func:`target_loss` (later steps reuse them cyclically).
TARGET_STEPS = 8


def target_loss(t: Any, out: Any) -> jax.Array:
    """A squared error against a fixed random target of the output's shape, one per step.

    ``t`` may be traced (inside a scan): the targets of every step are one constant table.
    """
    leaves = jax.tree.leaves(out)
    total = jnp.zeros((), leaves[0].dtype)
    for i, leaf in enumerate(leaves):
        table = jnp.stack([normal(1000 + 7 * s + i, tuple(leaf.shape)) for s in range(TARGET_STEPS)])
        target = table[t % TARGET_STEPS].astype(leaf.dtype)
        total = total + jnp.sum((leaf - target) ** 2)
    return total


def _run(fn: Callable[[], Any], jit: bool) -> Any:
    return brainstate.transform.jit(fn)() if jit else fn()


def step_input(xs: Any, t: int) -> Any:
    """The input of step ``t`` of a time-major input pytree."""
    return jax.tree.map(lambda a: a[t], xs)


def num_steps(xs: Any) -> int:
    return int(jax.tree.leaves(xs)[0].shape[0])


def _to_numpy(grads: Any) -> Grads:
    """``{path: array}``; a pytree-valued parameter gives one entry per leaf (its key path appended)."""
    return {
        (*tuple(p), *(str(k) for k in keys)): np.asarray(leaf)
        for p, g in dict(grads).items()
        for keys, leaf in jax.tree_util.tree_flatten_with_path(g)[0]
    }


def bptt_grads(
    model: brainstate.nn.Module, xs: Any, loss: StepLoss = target_loss, batch_size: int | None = None,
    jit: bool = True, truncated: bool = False,
) -> Grads:
    """The BPTT gradient of ``Σ_t loss(t, model(x_t))`` w.r.t. every ``ParamState`` of ``model``.

    The model's states are (re)initialised with ``batch_size`` first, so the run starts from
    the same zero state as a freshly compiled learner. ``truncated=True`` stops the gradient
    at every step's incoming hidden states (the sum of one-step gradients, no history).
    """
    brainstate.nn.init_all_states(model, batch_size=batch_size)
    params = model.states(brainstate.ParamState)
    hidden = model.states(brainstate.HiddenState)

    def total() -> jax.Array:
        acc = jnp.zeros(())
        for t in range(num_steps(xs)):
            if truncated:
                for st in hidden.values():
                    st.value = jax.lax.stop_gradient(st.value)
            acc = acc + loss(t, model(step_input(xs, t)))
        return acc

    return _to_numpy(_run(lambda: brainstate.transform.grad(total, params)(), jit))


def _sum_grads(grads: Sequence[Any]) -> Any:
    total = grads[0]
    for g in grads[1:]:
        total = jax.tree.map(jnp.add, total, g)
    return total


def single_step_run(
    learner: Any, xs: Any, loss: StepLoss = target_loss, jit: bool = True, params: Any = None
) -> tuple[Grads, Any]:
    """``(Σ_t grad(loss(t, learner(x_t))), stacked outputs)``: one call and one ``grad`` per step.

    Under ``jit`` the steps run in a ``brainstate.transform.scan`` (the step is traced once);
    eagerly they run in a Python loop. ``params`` defaults to ``learner.param_states`` (give
    ``vmapped.module.param_states`` for a ``brainstate.nn.Vmap`` learner).
    """
    params = learner.param_states if params is None else params

    def step(x_t: Any, t: Any) -> tuple[Any, Any]:
        def step_loss() -> tuple[jax.Array, Any]:
            out = learner(x_t)
            return loss(t, out), out

        return brainstate.transform.grad(step_loss, params, has_aux=True)()

    if not jit:
        per_step = [step(step_input(xs, t), t) for t in range(num_steps(xs))]
        outs = jax.tree.map(lambda *o: jnp.stack(o), *[o for _, o in per_step])
        return _to_numpy(_sum_grads([g for g, _ in per_step])), outs

    def run() -> Any:
        def body(acc: Any, inputs: Any) -> tuple[Any, Any]:
            grads, out = step(*inputs)
            return jax.tree.map(jnp.add, acc, grads), out

        zeros = {p: jax.tree.map(jnp.zeros_like, st.value) for p, st in params.items()}
        return brainstate.transform.scan(body, zeros, (xs, jnp.arange(num_steps(xs))))

    grads, outs = _run(run, True)
    return _to_numpy(grads), outs


def single_step_grads(learner: Any, xs: Any, loss: StepLoss = target_loss, jit: bool = True) -> Grads:
    """The summed gradients of :func:`single_step_run`."""
    return single_step_run(learner, xs, loss, jit)[0]


def per_step_grads(learner: Any, xs: Any, loss: StepLoss = target_loss) -> Grads:
    """Per parameter path, the gradients of every step stacked ``(T, ...)``: one call and one
    ``grad`` of that step's ``loss`` per step, in one jitted scan."""
    params = learner.param_states

    def run() -> Any:
        def body(carry: None, inp: tuple[Any, jax.Array]) -> tuple[None, Any]:
            x, t = inp
            return carry, brainstate.transform.grad(lambda: loss(t, learner(x)), params)()

        return brainstate.transform.scan(body, None, (xs, jnp.arange(num_steps(xs))))[1]

    return _to_numpy(_run(run, True))


def window_grads(
    learner: Any, xs: Any, windows: Sequence[int], loss: StepLoss = target_loss, jit: bool = True
) -> Grads:
    """Sum over windows of the gradient of the window's loss, each window one ``MultiStepData`` call."""
    if sum(windows) != num_steps(xs):
        raise ValueError(f"windows {list(windows)} do not cover the {num_steps(xs)} steps.")
    params = learner.param_states

    def run() -> Any:
        per_window = []
        start = 0
        for length in windows:
            chunk = jax.tree.map(lambda a, s=start, n=length: a[s:s + n], xs)

            def window_loss(chunk: Any = chunk, start: int = start, length: int = length) -> jax.Array:
                outs = learner(braintrace.MultiStepData(chunk))
                acc = jnp.zeros(())
                for k in range(length):
                    acc = acc + loss(start + k, step_input(outs, k))
                return acc

            per_window.append(brainstate.transform.grad(window_loss, params)())
            start += length
        return _sum_grads(per_window)

    return _to_numpy(_run(run, jit))


def max_rel_err(ref: Grads, got: Grads) -> float:
    """``max |ref - got| / max |ref|`` over every parameter (each parameter normalised by itself)."""
    assert set(ref) == set(got), (sorted(ref), sorted(got))
    worst = 0.0
    for p in ref:
        scale = max(float(np.max(np.abs(ref[p]))), 1e-30)
        worst = max(worst, float(np.max(np.abs(ref[p] - got[p]))) / scale)
    return worst


def cosine(ref: Grads, got: Grads) -> float:
    """Cosine between the two gradients flattened over every parameter."""
    a = np.concatenate([np.ravel(ref[p]) for p in sorted(ref, key=str)])
    b = np.concatenate([np.ravel(got[p]) for p in sorted(ref, key=str)])
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def norm_ratio(ref: Grads, got: Grads) -> float:
    """``‖got‖ / ‖ref‖`` over every parameter."""
    a = np.concatenate([np.ravel(ref[p]) for p in ref])
    b = np.concatenate([np.ravel(got[p]) for p in ref])
    return float(np.linalg.norm(b) / np.linalg.norm(a))

"""The model, data and training loop of ``tests/test_checkpoint.py``, and its resume half.

``python -m tests.checkpoint_resume_script FOLDER JOB [JOB ...]`` (run from the repository
root) resumes, in a fresh process, the runs the test interrupted: for each ``JOB`` (an
algorithm name, with ``+adam`` for a run trained by Adam) it builds the learner as the test
does, loads ``FOLDER/JOB.ckpt``, runs the remaining steps and writes every state and the losses
to ``FOLDER/JOB.out`` (a ``braintools.file`` msgpack file). Both processes run the code below,
so an exact resume gives the same bits.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

import braintrace
from braintrace._checkpoint import _learner_entries, _optimizer_entries

N_IN, N_HIDDEN, BATCH = 3, 4, 2
#: Steps before the checkpoint and after it (equal, so one jitted loop serves both halves).
STEPS = 3
LR = 0.1

#: name -> (learning rule, its options, whether the leak is an element-wise weight)
ALGORITHMS: dict[str, tuple[Any, dict[str, Any], bool]] = {
    "d_rtrl": (braintrace.D_RTRL, {}, True),
    "pp_prop": (braintrace.pp_prop, {"decay_or_rank": 0.9}, True),
    "eprop": (braintrace.EProp, {"kappa_filter_decay": 0.5}, True),
    "ottt": (braintrace.OTTT, {"leak": 0.5}, False),
}


class LeakyRNN(brainstate.nn.Module):
    """``h <- sigmoid(leak) * h + tanh(x @ W + b)``; with a plain ``0.5`` decay if not ``learn_leak``."""

    def __init__(self, n_hidden: int = N_HIDDEN, learn_leak: bool = True, gain: bool = False) -> None:
        super().__init__()
        rng = np.random.RandomState(42)
        self.n_hidden = n_hidden
        self.learn_leak = learn_leak
        self.W = brainstate.ParamState({
            "weight": jnp.asarray(rng.randn(N_IN, n_hidden) * 0.5, jnp.float32),
            "bias": jnp.asarray(rng.randn(n_hidden) * 0.1, jnp.float32),
        })
        if learn_leak:
            self.leak = brainstate.ParamState(jnp.asarray(rng.randn(n_hidden), jnp.float32))
        if gain:
            self.gain = brainstate.ParamState(jnp.ones(n_hidden, jnp.float32))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, self.n_hidden), jnp.float32))

    def update(self, x: jax.Array) -> jax.Array:
        drive = jnp.tanh(braintrace.matmul(x, self.W.value["weight"], self.W.value["bias"]))
        if hasattr(self, "gain"):
            drive = drive * braintrace.element_wise(self.gain.value)  # learns online, no warning
        decay = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid) if self.learn_leak else 0.5
        self.h.value = decay * self.h.value + drive
        return self.h.value


def build(algorithm: str, n_hidden: int = N_HIDDEN, gain: bool = False) -> Any:
    """A fresh compiled learner of ``algorithm`` on :class:`LeakyRNN` (batch 2)."""
    rule, options, learn_leak = ALGORITHMS[algorithm]
    model = LeakyRNN(n_hidden, learn_leak=learn_leak, gain=gain)
    return braintrace.compile(model, rule, jnp.zeros((BATCH, N_IN)), batch_size=BATCH, **options)


def adam(learner: Any) -> Any:
    """An Adam with a step schedule (so the scheduler has states too) on the learner's parameters."""
    optimizer = braintools.optim.Adam(lr=braintools.optim.StepLR(0.05, step_size=2, gamma=0.5))
    optimizer.register_trainable_weights(learner.param_states)
    return optimizer


def data() -> tuple[jax.Array, jax.Array]:
    """Inputs ``(2 * STEPS, batch, in)`` and targets ``(2 * STEPS, batch, hidden)``."""
    rng = np.random.RandomState(0)
    xs = rng.randn(2 * STEPS, BATCH, N_IN).astype(np.float32)
    ys = rng.randn(2 * STEPS, BATCH, N_HIDDEN).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(ys)


def trainer(learner: Any, optimizer: Any = None) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A jitted loop of online steps: per step, the learner's gradient of the step loss, then an
    SGD update (or ``optimizer.step``); returns the step losses."""
    params = learner.param_states

    def step(x: jax.Array, y: jax.Array) -> jax.Array:
        grads, loss = brainstate.transform.grad(
            lambda: jnp.mean((learner(x) - y) ** 2), params, return_value=True)()
        if optimizer is None:
            for path, st in params.items():
                st.value = jax.tree.map(lambda v, g: v - LR * g, st.value, grads[path])
        else:
            optimizer.step(grads)
        return loss

    @brainstate.transform.jit
    def run(xs: jax.Array, ys: jax.Array) -> jax.Array:
        return brainstate.transform.for_loop(step, xs, ys)

    return run


def snapshot(learner: Any, optimizer: Any = None) -> dict[str, np.ndarray]:
    """Every leaf of every state of the learner (and optimizer), by its checkpoint name (the
    mantissa of a quantity)."""
    entries = _learner_entries(learner, "snapshot")
    if optimizer is not None:
        entries.update(_optimizer_entries(optimizer, {id(e.state) for e in entries.values()}, "snapshot"))
    return {name: np.asarray(u.get_mantissa(e.leaf)) for name, e in entries.items()}


def job_parts(job: str) -> tuple[str, bool]:
    algorithm, _, trained_by = job.partition("+")
    return algorithm, trained_by == "adam"


def resume(checkpoint: str, job: str) -> dict[str, Any]:
    """Build the learner of ``job``, load ``checkpoint``, run the second half: states and losses."""
    algorithm, with_adam = job_parts(job)
    learner = build(algorithm)
    optimizer = adam(learner) if with_adam else None
    braintrace.load_checkpoint(checkpoint, learner, optimizer=optimizer)
    xs, ys = data()
    losses = trainer(learner, optimizer)(xs[STEPS:], ys[STEPS:])
    return {"states": snapshot(learner, optimizer), "losses": np.asarray(losses)}


def main(argv: list[str]) -> None:
    folder, jobs = argv[0], argv[1:]
    for job in jobs:
        braintools.file.msgpack_save(os.path.join(folder, f"{job}.out"),
                                     resume(os.path.join(folder, f"{job}.ckpt"), job))


if __name__ == "__main__":
    main(sys.argv[1:])

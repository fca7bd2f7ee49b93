"""Online learning next to BPTT on a synthetic evidence-accumulation task (``make demo``).

A leaky recurrent network (trainable per-neuron leak, ETP input and recurrent weights, a plain
readout) watches a noisy stream of +-1 pulses and must report, at every step, the sign of the
evidence seen so far. Three learners train the same network from the same initialisation:

* BPTT: ``jax.grad`` through the whole sequence (memory grows with its length);
* D_RTRL: online, one gradient per step from the eligibility trace (memory independent of length);
* pp_prop: online, the cheaper input/output-factored trace.

The online learners run each batch through ``learner.etrace_train``, the sequence driver that
takes one gradient per step inside a scan and applies the optimizer to their sum.

The script prints progress, the final loss and accuracy of each method and the compiled memory
of one training step, and saves the loss curves to ``online_learning_demo.png``.

Run ``python examples/online_learning_demo.py --iterations 20`` for a quick look.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Mapping

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np

import braintrace


class LeakyRNN(brainstate.nn.Module):
    """``h = σ(τ) h + tanh(x W_in + h W_rec)``, readout ``h W_out``."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, seed: int = 0) -> None:
        super().__init__()
        k = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.n_hidden = n_hidden
        self.tau = brainstate.ParamState(jnp.full((n_hidden,), 1.0, dtype=jnp.float32))
        self.w_in = brainstate.ParamState(jax.random.normal(k[0], (n_in, n_hidden)) / np.sqrt(n_in))
        self.w_rec = brainstate.ParamState(0.5 * jax.random.normal(k[1], (n_hidden, n_hidden)) / np.sqrt(n_hidden))
        self.w_out = brainstate.ParamState(jax.random.normal(k[2], (n_hidden, n_out)) / np.sqrt(n_hidden))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hidden,) if batch_size is None else (batch_size, self.n_hidden)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        # In place, for BPTT's reset_all_states (learner.reset() re-initialises by itself).
        self.h.value = jnp.zeros_like(self.h.value)

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        drive = braintrace.matmul(x, self.w_in.value) + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = leak * self.h.value + jnp.tanh(drive)
        return self.h.value @ self.w_out.value


def make_task(key: jax.Array, batch: int, steps: int) -> tuple[jax.Array, jax.Array]:
    """Noisy pulses ``(steps, batch, 2)`` and the running sign of their sum ``(steps, batch)``.

    Each sequence draws its pulses with a hidden bias (``+1`` with probability 0.7 or 0.3), so
    the sum drifts away from zero; the target at every step is whether the pulses so far sum to
    more than zero, which the inputs determine.
    """
    k1, k2 = jax.random.split(key)
    p_up = jnp.where(jax.random.bernoulli(k2, 0.5, (1, batch)), 0.7, 0.3)
    pulses = jnp.where(jax.random.uniform(k1, (steps, batch)) < p_up, 1.0, -1.0)
    evidence = jnp.cumsum(pulses, axis=0)
    x = jnp.stack([pulses, jnp.ones_like(pulses)], axis=-1)
    return x, (evidence > 0).astype(jnp.int32)


def step_loss(logits: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.take_along_axis(logp, target[..., None], axis=-1).mean()
    return loss, (jnp.argmax(logits, -1) == target).mean()


def adam(lr: float, params: Mapping[Any, brainstate.ParamState]) -> braintools.optim.Adam:
    """Adam registered once on ``params``: its moments carry over from batch to batch."""
    optimizer = braintools.optim.Adam(lr=lr)
    optimizer.register_trainable_weights(dict(params))
    return optimizer


def bptt_trainer(model: LeakyRNN, batch: int, lr: float) -> Callable[[jax.Array, jax.Array], tuple[Any, Any]]:
    """``jax.grad`` of the mean loss of whole sequences, one Adam step per batch."""
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)
    optimizer = adam(lr, params)

    def loss_fn(xs: jax.Array, ys: jax.Array) -> tuple[jax.Array, Any]:
        brainstate.nn.reset_all_states(model)
        outs = brainstate.transform.for_loop(model, xs)
        losses, accs = jax.vmap(step_loss)(outs, ys)
        return losses.mean(), (losses.mean(), accs.mean())

    @brainstate.transform.jit
    def train(xs: jax.Array, ys: jax.Array) -> tuple[Any, Any]:
        grads, (loss, acc) = brainstate.transform.grad(loss_fn, params, has_aux=True, return_value=False)(xs, ys)
        optimizer.update(grads)
        return loss, acc

    return train


def online_trainer(model: LeakyRNN, algorithm: Any, batch: int, lr: float, x0: jax.Array, **options: Any) -> Any:
    """From reset states, one online gradient per step summed over the sequence (``etrace_train``), one Adam step."""
    learner = braintrace.compile(model, algorithm, x0, batch_size=batch, **options)
    optimizer = adam(lr, learner.param_states)

    def step_fn(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return step_loss(learner(x), y)  # (loss, accuracy): the one learner call of this step

    @brainstate.transform.jit
    def train(xs: jax.Array, ys: jax.Array) -> tuple[Any, Any]:
        learner.reset()
        result = learner.etrace_train(xs, ys, step_fn=step_fn, optimizer=optimizer, has_aux=True)
        return result.losses.mean(), result.aux.mean()

    return train


def temp_bytes(train: Any, xs: jax.Array, ys: jax.Array) -> float:
    """XLA's compiled temporary memory of one training step, in MiB (nan when unavailable)."""
    try:
        stats = train.lower(xs, ys).compile().memory_analysis()
        return float(stats.temp_size_in_bytes) / 2**20
    except Exception:  # memory_analysis is backend-dependent
        return float("nan")


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--plot", default="online_learning_demo.png")
    args = parser.parse_args(argv)
    key = jax.random.PRNGKey(0)
    x0, _ = make_task(key, args.batch, args.steps)
    trainers = {
        "BPTT": bptt_trainer(LeakyRNN(2, args.hidden, 2), args.batch, lr=args.lr),
        "D_RTRL": online_trainer(LeakyRNN(2, args.hidden, 2), braintrace.D_RTRL, args.batch, args.lr, x0[0]),
    }
    if "pp_prop" in braintrace.__all__:
        trainers["pp_prop"] = online_trainer(
            LeakyRNN(2, args.hidden, 2), "pp_prop", args.batch, args.lr, x0[0], decay_or_rank=0.9)
    history: dict[str, list[float]] = {name: [] for name in trainers}
    accuracy: dict[str, list[float]] = {name: [] for name in trainers}
    results: dict[str, dict[str, float]] = {}
    for name, train in trainers.items():
        start = time.perf_counter()
        for it in range(args.iterations):
            xs, ys = make_task(jax.random.fold_in(key, it), args.batch, args.steps)
            loss, acc = train(xs, ys)
            history[name].append(float(loss))
            accuracy[name].append(float(acc))
            if it % max(1, args.iterations // 10) == 0 or it == args.iterations - 1:
                print(f"[{name:>7}] iteration {it + 1:4d}/{args.iterations}  loss {float(loss):.4f}  "
                      f"accuracy {float(acc):.3f}", flush=True)
        xs, ys = make_task(jax.random.PRNGKey(10_000), args.batch, args.steps)
        results[name] = {
            "final_loss": float(np.mean(history[name][-10:])),
            "accuracy": float(np.mean(accuracy[name][-10:])),
            "seconds": time.perf_counter() - start,
            "temp_mib": temp_bytes(train, xs, ys),
        }
    print("\nmethod    final loss  accuracy  step memory (MiB)  time (s)   (loss, accuracy: last 10 batches)")
    for name, r in results.items():
        print(f"{name:<8}  {r['final_loss']:10.4f}  {r['accuracy']:8.3f}  {r['temp_mib']:17.3f}  {r['seconds']:8.1f}")
    _plot(history, args.plot)
    return results


def _plot(history: dict[str, list[float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the loss-curve figure.")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, losses in history.items():
        ax.plot(losses, label=name)
    ax.set_xlabel("training iteration (one batch of sequences)")
    ax.set_ylabel("cross-entropy")
    ax.set_title("Evidence accumulation: online learning vs BPTT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved the loss curves to {path}")


if __name__ == "__main__":
    main(sys.argv[1:])

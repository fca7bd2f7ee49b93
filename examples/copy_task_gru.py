"""The copy task with a GRU: online D-RTRL next to backpropagation through time.

A trial presents ``length`` random symbols (one-hot, one per step), waits ``delay`` blank steps,
then raises a *recall* cue for ``length`` steps during which the network must output the
symbols in their original order. Only the recall steps are scored; chance is ``1/symbols``.

The GRU (update gate, reset gate, candidate, all through :func:`braintrace.matmul`) learns
with D-RTRL by default, and with BPTT as the reference. D-RTRL keeps one trace per parameter
and neglects how neurons influence each other's futures (the off-diagonal recurrent Jacobian),
so on a task that is all about memory it is expected to trail BPTT: the figure shows by how much.

Run ``python examples/copy_task_gru.py`` (a couple of minutes on two cores for both learners)
or ``--algorithms d_rtrl --iterations 50`` for a quick look.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace
from _common import (  # the shared helpers beside this script
    History,
    common_parser,
    plot_histories,
    positive_int,
    predict,
    pyplot,
    save_figure,
    step_accuracy,
    train_learners,
)


class GRU(brainstate.nn.Module):
    """``h ← (1 − z) h + z tanh(x W_xc + r ⊙ (h W_hc))`` with gates ``z, r = σ([x, h] W + b)``; readout ``h W_out``.

    The reset gate multiplies the recurrent contribution after the matmul (the cuDNN form), so
    every weight drives the hidden state within one step and all of them learn online.
    """

    def __init__(self, n_in: int, n_hidden: int, n_out: int, seed: int = 0) -> None:
        super().__init__()
        k = jax.random.split(jax.random.PRNGKey(seed), 5)
        n_xh = n_in + n_hidden

        def init(key: jax.Array, shape: tuple[int, int]) -> brainstate.ParamState:
            return brainstate.ParamState(jax.random.normal(key, shape) / np.sqrt(shape[0]))

        self.n_hidden = n_hidden
        # One matmul per gate: the compiler links a weight to a hidden state when the op's
        # output has the state's shape, which a fused (n_xh, 2 * n_hidden) gate matmul has not.
        self.w_z = init(k[0], (n_xh, n_hidden))
        self.b_z = brainstate.ParamState(jnp.zeros((n_hidden,)))
        self.w_r = init(k[1], (n_xh, n_hidden))
        self.b_r = brainstate.ParamState(jnp.zeros((n_hidden,)))
        self.w_xc = init(k[2], (n_in, n_hidden))
        self.w_hc = init(k[3], (n_hidden, n_hidden))
        self.b_c = brainstate.ParamState(jnp.zeros((n_hidden,)))
        self.w_out = init(k[4], (n_hidden, n_out))
        self.b_out = brainstate.ParamState(jnp.zeros((n_out,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hidden,) if batch_size is None else (batch_size, self.n_hidden)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        # In place: a compiled learner holds this very state object.
        self.h.value = jnp.zeros_like(self.h.value)

    def update(self, x: jax.Array) -> jax.Array:
        h = self.h.value
        xh = jnp.concatenate([x, h], axis=-1)
        z = jax.nn.sigmoid(braintrace.matmul(xh, self.w_z.value, self.b_z.value))
        r = jax.nn.sigmoid(braintrace.matmul(xh, self.w_r.value, self.b_r.value))
        cand = jnp.tanh(braintrace.matmul(x, self.w_xc.value, self.b_c.value) + r * braintrace.matmul(h, self.w_hc.value))
        self.h.value = (1.0 - z) * h + z * cand
        return self.h.value @ self.w_out.value + self.b_out.value


def make_trials(
    rng: np.random.Generator, n: int, length: int, delay: int, symbols: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` trials: inputs ``(time, n, symbols + 1)``, labels ``(time, n)``, weights ``(time,)``.

    Input channel ``symbols`` is the recall cue. ``time = 2 * length + delay``; the labels of the
    recall steps are the presented symbols, elsewhere 0 (unscored).
    """
    seq = rng.integers(0, symbols, (n, length))
    total = 2 * length + delay
    xs = np.zeros((total, n, symbols + 1), np.float32)
    xs[np.arange(length)[:, None], np.arange(n)[None, :], seq.T] = 1.0
    recall = np.arange(length + delay, total)
    xs[recall, :, symbols] = 1.0
    labels = np.zeros((total, n), np.int32)
    labels[recall] = seq.T
    weights = np.zeros(total, np.float32)
    weights[recall] = 1.0
    return xs, labels, weights


def main(argv: list[str] | None = None) -> dict[str, History]:
    """Train on the copy task with each learner; returns ``learner -> History``."""
    parser = common_parser(__doc__, iterations=400, batch=32, lr=0.01, algorithms=["d_rtrl", "bptt"],
                           plot="copy_task_gru.png", test_size=256)
    parser.add_argument("--hidden", type=positive_int, default=64, help="GRU units")
    parser.add_argument("--length", type=positive_int, default=5, help="symbols to copy")
    parser.add_argument("--delay", type=positive_int, default=10, help="blank steps before the recall cue")
    parser.add_argument("--symbols", type=positive_int, default=4, help="alphabet size")
    args = parser.parse_args(argv)
    n_in = args.symbols + 1

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(args.seed)
        while True:
            yield make_trials(rng, args.batch, args.length, args.delay, args.symbols)

    test = make_trials(np.random.default_rng(args.seed + 10_000), args.test_size, args.length, args.delay,
                       args.symbols)
    print(f"copy task: {args.length} of {args.symbols} symbols, delay {args.delay}, "
          f"{2 * args.length + args.delay} steps; GRU with {args.hidden} units")
    results = train_learners(
        args.algorithms, lambda: GRU(n_in, args.hidden, args.symbols, seed=args.seed), args.batch, args.lr,
        np.zeros((args.batch, n_in), np.float32), batches, args.iterations, step_accuracy, test, args.pp_decay,
        args.grad_clip or None)
    histories = {name: r[2] for name, r in results.items()}
    if args.plot:
        _plot(histories, results, test, args.length, args.delay, args.symbols, args.plot)
    return histories


def _plot(histories: dict[str, History], results: dict[str, Any], test: tuple[np.ndarray, ...], length: int,
          delay: int, symbols: int, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    plot_histories(axes[0], axes[1], histories, chance=1.0 / symbols)
    xs, labels, weights = test
    recall = weights > 0
    width = 0.8 / len(results)
    for i, (name, (_, trainer, _)) in enumerate(results.items()):
        outs = predict(trainer, xs)
        per_pos = (outs.argmax(-1)[recall] == labels[recall]).mean(axis=1)
        axes[2].bar(np.arange(length) + i * width, per_pos, width=width, color=f"C{i}", label=name)
    axes[2].axhline(1.0 / symbols, ls="--", color="gray", lw=1)
    axes[2].set(xlabel="position in the sequence", ylabel="held-out accuracy", ylim=(0, 1.02),
                title=f"recall accuracy by position (delay {delay})")
    axes[2].set_xticks(np.arange(length) + 0.4 - width / 2, [str(p + 1) for p in range(length)])
    axes[2].legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])

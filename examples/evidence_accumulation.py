"""Evidence accumulation with a delayed response: D-RTRL, pp_prop and a psychometric curve.

Two input channels carry noisy evidence for "left" and "right" during the stimulus period;
their mean difference (the *coherence*) varies from trial to trial and is often much smaller
than the noise. After a short delay a go cue asks for the decision, which is scored only in the
response period. A good network integrates the difference over the whole stimulus and holds
the sum through the delay; its accuracy then rises with the coherence (the psychometric curve),
and the figure draws it next to the ideal observer's, the best any decision rule can do.

The network is a leaky rate RNN (trainable per-unit leak through :func:`braintrace.element_wise`,
input and recurrent weights through :func:`braintrace.matmul`, a plain readout). By default it
learns with D-RTRL (one trace per parameter) and with pp_prop (factored input/output traces,
``O(inputs + hidden)`` memory per weight), each from the same initialisation.

Run ``python examples/evidence_accumulation.py`` (about a minute on two cores) or with
``--iterations 50`` for a quick look.
"""

from __future__ import annotations

import math
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
    train_learners,
    window_accuracy,
)

#: The coherences trials are drawn from (mean evidence difference per step, in noise units).
COHERENCES = np.array([0.0, 0.1, 0.2, 0.4, 0.8])


class LeakyRNN(brainstate.nn.Module):
    """``h ← a h + (1 − a) tanh(x W_in + h W_rec + b)`` with ``a = σ(τ)`` per unit; readout ``h W_out``."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, seed: int = 0) -> None:
        super().__init__()
        k = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.n_hidden = n_hidden
        # A strong float32 (jnp.full of a Python float is weakly typed): the first Adam step would
        # make it strong and the jitted training step would compile a second time.
        self.tau = brainstate.ParamState(jnp.full((n_hidden,), 2.0, dtype=jnp.float32))
        self.w_in = brainstate.ParamState(jax.random.normal(k[0], (n_in, n_hidden)) / np.sqrt(n_in))
        self.w_rec = brainstate.ParamState(0.9 * jax.random.normal(k[1], (n_hidden, n_hidden)) / np.sqrt(n_hidden))
        self.b = brainstate.ParamState(jnp.zeros((n_hidden,)))
        self.w_out = brainstate.ParamState(jax.random.normal(k[2], (n_hidden, n_out)) / np.sqrt(n_hidden))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hidden,) if batch_size is None else (batch_size, self.n_hidden)
        self.h = brainstate.HiddenState(jnp.zeros(shape))

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        # In place: a compiled learner holds this very state object.
        self.h.value = jnp.zeros_like(self.h.value)

    def update(self, x: jax.Array) -> jax.Array:
        a = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        drive = braintrace.matmul(x, self.w_in.value, self.b.value) + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = a * self.h.value + (1.0 - a) * jnp.tanh(drive)
        return self.h.value @ self.w_out.value


def make_trials(
    rng: np.random.Generator, n: int, stimulus: int, delay: int, response: int = 5, noise: float = 1.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``n`` trials: inputs ``(time, n, 3)``, labels ``(time, n)``, weights ``(time,)`` and the coherences ``(n,)``.

    Channels 0 and 1 carry the left/right evidence (Gaussian, ``noise`` standard deviation)
    during the first ``stimulus`` steps, channel 2 the go cue of the response period. The label
    is the side with the larger *true* mean (1 = right); at coherence 0 it is a coin flip.
    """
    total = stimulus + delay + response
    side = rng.integers(0, 2, n)
    coherence = rng.choice(COHERENCES, n)
    signed = np.where(side == 1, 1.0, -1.0) * coherence
    xs = np.zeros((total, n, 3), np.float32)
    xs[:stimulus, :, 0] = -signed / 2 + noise * rng.standard_normal((stimulus, n))
    xs[:stimulus, :, 1] = signed / 2 + noise * rng.standard_normal((stimulus, n))
    xs[stimulus + delay:, :, 2] = 1.0
    labels = np.broadcast_to(side.astype(np.int32), (total, n)).copy()
    weights = np.zeros(total, np.float32)
    weights[stimulus + delay:] = 1.0
    return xs, labels, weights, coherence


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train each learner; returns ``{'histories': learner -> History, 'psychometric': learner -> accuracies}``."""
    parser = common_parser(__doc__, iterations=150, batch=64, lr=0.01, algorithms=["d_rtrl", "pp_prop"],
                           plot="evidence_accumulation.png", test_size=1024)
    parser.add_argument("--hidden", type=positive_int, default=32, help="recurrent units")
    parser.add_argument("--stimulus", type=positive_int, default=20, help="steps of evidence")
    parser.add_argument("--delay", type=positive_int, default=5, help="steps between evidence and go cue")
    args = parser.parse_args(argv)

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(args.seed)
        while True:
            yield make_trials(rng, args.batch, args.stimulus, args.delay)[:3]

    xs, labels, weights, coherence = make_trials(np.random.default_rng(args.seed + 10_000), args.test_size,
                                                 args.stimulus, args.delay)
    test = (xs, labels, weights)
    print(f"evidence accumulation: {args.stimulus} stimulus + {args.delay} delay + 5 response steps, "
          f"{args.hidden} units")
    results = train_learners(
        args.algorithms, lambda: LeakyRNN(3, args.hidden, 2, seed=args.seed), args.batch, args.lr,
        np.zeros((args.batch, 3), np.float32), batches, args.iterations, window_accuracy, test, args.pp_decay,
        args.grad_clip or None)
    histories = {name: r[2] for name, r in results.items()}
    curves = {name: psychometric(predict(r[1], test[0]), test[1], test[2], coherence) for name, r in results.items()}
    curves_shown = {**curves, "ideal observer": ideal_observer(args.stimulus)}
    for name, curve in curves_shown.items():
        print(f"[{name}] accuracy by coherence " + "  ".join(f"{c:.1f}: {a:.2f}" for c, a in zip(COHERENCES, curve)))
    if args.plot:
        _plot(histories, curves, args.stimulus, args.plot)
    return {"histories": histories, "psychometric": curves}


def psychometric(outs: np.ndarray, labels: np.ndarray, weights: np.ndarray, coherence: np.ndarray) -> np.ndarray:
    """Held-out accuracy at each of :data:`COHERENCES` (the response-period decision)."""
    scored = weights > 0
    choice = (outs[scored].mean(0)).argmax(-1)
    hits = choice == labels[-1]
    return np.array([hits[coherence == c].mean() if np.any(coherence == c) else np.nan for c in COHERENCES])


def ideal_observer(stimulus: int, noise: float = 1.0) -> np.ndarray:
    """The best possible accuracy at each coherence: the sign of the summed evidence difference.

    Summed over ``stimulus`` steps, the difference of the two channels has mean ``c · stimulus``
    and standard deviation ``noise · sqrt(2 · stimulus)``, so the accuracy is
    ``Φ(c · sqrt(stimulus / 2) / noise)``.
    """
    z = COHERENCES * np.sqrt(stimulus / 2.0) / noise
    return np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in z])


def _plot(histories: dict[str, History], curves: dict[str, np.ndarray], stimulus: int, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    plot_histories(axes[0], axes[1], histories, chance=0.5)
    for i, (name, curve) in enumerate(curves.items()):
        axes[2].plot(COHERENCES, curve, "o-", color=f"C{i}", label=name)
    axes[2].plot(COHERENCES, ideal_observer(stimulus), "k:", label="ideal observer")
    axes[2].axhline(0.5, ls="--", color="gray", lw=1)
    axes[2].set(xlabel="coherence (mean difference / noise)", ylabel="held-out accuracy", ylim=(0.3, 1.02),
                title="psychometric curve")
    axes[2].legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])

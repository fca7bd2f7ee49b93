"""Delayed match-to-sample with a recurrent LIF network learning online.

Each trial shows a *sample* stimulus (one of two spiking input populations), a silent *delay*,
then a *test* stimulus; during the *response* period (marked by a cue population) the network
must say whether the test matched the sample. Chance is 50 %, and the answer cannot be read
from the test stimulus alone: the network has to carry the sample across the delay in its
membrane potentials and recurrent spikes (an XOR over time).

The network is :class:`_common.LIFNetwork`: :class:`braintrace.nn.LIF` neurons whose membrane
time constants are ``brainstate.ParamState``s, trained with the input, recurrent and readout
weights (all through ETP operators). It learns with D-RTRL by default — one gradient per time
step, memory independent of the trial length — with the gradient's norm clipped at 1
(``--grad-clip``: surrogate gradients of spiking networks can spike). ``--algorithms`` trains
others too (``eprop``, ``pp_prop``, ... or ``bptt`` for the reference), each on a fresh copy of
the network.

Run ``python examples/delayed_match_lif.py`` (about a minute on two cores) or with
``--iterations 30`` for a quick look; the figure shows the loss, the accuracy and the input
and hidden spikes of one held-out trial after training.
"""

from __future__ import annotations

import sys
from typing import Iterator

import brainstate
import jax.numpy as jnp
import numpy as np

from _common import (  # the shared helpers beside this script
    History,
    LIFNetwork,
    common_parser,
    plot_histories,
    positive_int,
    pyplot,
    save_figure,
    train_learners,
    window_accuracy,
)

#: Input channels per population (stimulus A, stimulus B, response cue).
N_PER_POP = 8


class Timing:
    """Period lengths of a trial, in steps: fixation, sample, delay, test, response."""

    def __init__(self, delay: int, stimulus: int = 8, fixation: int = 4, response: int = 8) -> None:
        self.fixation, self.stimulus, self.delay, self.response = fixation, stimulus, delay, response

    @property
    def sample_on(self) -> int:
        return self.fixation

    @property
    def test_on(self) -> int:
        return self.fixation + self.stimulus + self.delay

    @property
    def response_on(self) -> int:
        return self.test_on + self.stimulus

    @property
    def total(self) -> int:
        return self.response_on + self.response


def make_trials(
    rng: np.random.Generator, n: int, timing: Timing, n_per_pop: int = N_PER_POP, rate: float = 0.4,
    noise: float = 0.02,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` trials: spikes ``(time, n, 3 * n_per_pop)``, labels ``(time, n)`` (1 = match), weights ``(time,)``.

    Channels ``[0, n_per_pop)`` code stimulus A, the next block stimulus B and the last block the
    response cue; every channel also fires at the background ``noise`` rate.
    """
    sample = rng.integers(0, 2, n)
    test = rng.integers(0, 2, n)
    rates = np.full((timing.total, n, 3 * n_per_pop), noise, np.float32)
    for stim, on in ((sample, timing.sample_on), (test, timing.test_on)):
        for i, s in enumerate(stim):
            rates[on:on + timing.stimulus, i, s * n_per_pop:(s + 1) * n_per_pop] = rate
    rates[timing.response_on:, :, 2 * n_per_pop:] = rate
    spikes = (rng.random(rates.shape) < rates).astype(np.float32)
    labels = np.broadcast_to((sample == test).astype(np.int32), (timing.total, n)).copy()
    weights = np.zeros(timing.total, np.float32)
    weights[timing.response_on:] = 1.0
    return spikes, labels, weights


def main(argv: list[str] | None = None) -> dict[str, History]:
    """Train on delayed match-to-sample with each learner; returns ``learner -> History``."""
    parser = common_parser(__doc__, iterations=200, batch=32, lr=0.01, algorithms=["d_rtrl"],
                           plot="delayed_match_lif.png", test_size=256, grad_clip=1.0)
    parser.add_argument("--hidden", type=positive_int, default=64, help="recurrent LIF neurons")
    parser.add_argument("--delay", type=positive_int, default=24, help="delay period, in steps")
    args = parser.parse_args(argv)
    timing = Timing(args.delay)
    n_in = 3 * N_PER_POP

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(args.seed)
        while True:
            yield make_trials(rng, args.batch, timing)

    test = make_trials(np.random.default_rng(args.seed + 10_000), args.test_size, timing)
    print(f"delayed match-to-sample: {timing.total} steps per trial (delay {timing.delay}), "
          f"{args.hidden} LIF neurons")
    results = train_learners(
        args.algorithms,
        lambda: LIFNetwork(n_in, args.hidden, 2, tau=12.5, in_scale=3.0, rec_scale=1.0, seed=args.seed),
        args.batch, args.lr, np.zeros((args.batch, n_in), np.float32), batches, args.iterations,
        window_accuracy, test, args.pp_decay, args.grad_clip or None)
    histories = {name: r[2] for name, r in results.items()}
    if args.plot:
        model = next(iter(results.values()))[0]
        _plot(histories, model, test[0][:, :args.batch], timing, args.plot)
    return histories


def _plot(histories: dict[str, History], model: LIFNetwork, xs: np.ndarray, timing: Timing, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    brainstate.nn.reset_all_states(model, batch_size=xs.shape[1])
    hidden = []
    for x in xs:  # eager, one step at a time: the figure needs the hidden spikes, not the output
        model(jnp.asarray(x))
        hidden.append(np.asarray(model.spikes())[0])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    plot_histories(axes[0], axes[1], histories, chance=0.5)
    t_in, c_in = np.nonzero(xs[:, 0])
    t_h, c_h = np.nonzero(np.asarray(hidden))
    axes[2].scatter(t_in, c_in, s=3, color="k")
    axes[2].scatter(t_h, c_h + xs.shape[-1] + 2, s=3, color="C3")
    for edge in (timing.sample_on, timing.test_on, timing.response_on):
        axes[2].axvline(edge, color="gray", lw=0.8)
    axes[2].set(xlabel="time step", ylabel="input channel (black) / LIF neuron (red)",
                title=f"one trial after training ({next(iter(histories))})")
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])

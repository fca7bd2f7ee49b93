"""Spike-train classification, SHD-style: 700 input channels, 20 classes, a recurrent LIF network.

By default the data are an SHD-like synthetic set made offline (:func:`shd_data.synthetic_shd`):
each class is a few bands of spikes sweeping across the 700 channels along a class-specific
path, with per-sample speed, channel shift, jitter and background spikes. Given ``--data`` (and
optionally ``--test-data``), the script reads real Spiking Heidelberg Digits files instead
(``shd_train.h5`` / ``shd_test.h5``, already on disk; needs ``h5py``).

Spikes are binned into ``--steps`` time steps and fed to :class:`_common.LIFNetwork`
(700 → ``--hidden`` recurrent :class:`braintrace.nn.LIF` neurons with trainable time constants →
20 leaky readout units). The loss is the cross-entropy of the readout in the second half of the
sample, one gradient per time step (D-RTRL by default, the gradient's norm clipped at
``--grad-clip``); the prediction is the class with the largest mean readout there.

Run ``python examples/shd_classification.py`` (a couple of minutes on two cores) or with
``--train-size 200 --iterations 30`` for a quick look.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

import numpy as np

from _common import (  # the shared helpers beside this script
    Batch,
    History,
    LIFNetwork,
    common_parser,
    plot_histories,
    positive_float,
    positive_int,
    predict,
    pyplot,
    save_figure,
    train_learners,
    window_accuracy,
)
from shd_data import SpikeEvents, bin_events, load_shd, synthetic_shd


def loss_weights(n_steps: int) -> np.ndarray:
    """Score the second half of the sample: the network has heard most of it by then."""
    w = np.zeros(n_steps, np.float32)
    w[n_steps // 2:] = 1.0
    return w


def as_batch(data: SpikeEvents, index: np.ndarray, n_steps: int, max_time: float) -> Batch:
    """Binned spikes ``(steps, batch, channels)``, labels ``(steps, batch)`` and the loss weights ``(steps,)``."""
    xs = bin_events(data, index, n_steps, max_time)
    labels = np.broadcast_to(data.labels[index].astype(np.int32), (n_steps, len(index))).copy()
    return xs, labels, loss_weights(n_steps)


def load_data(args: Any) -> tuple[SpikeEvents, SpikeEvents, str]:
    """The training and held-out sets: real SHD files when ``--data`` is given, else synthetic."""
    if args.data:
        train = load_shd(args.data, limit=args.train_size)
        if args.test_data:
            test = load_shd(args.test_data, limit=args.test_size)
        else:  # hold out the tail of the training file
            n_test = min(args.test_size, len(train) // 5)
            if n_test < 1:
                raise ValueError(f"--data {args.data!r} holds {len(train)} samples: too few to hold some out; "
                                 f"pass --test-data as well.")
            order = np.random.default_rng(args.seed).permutation(len(train))
            train, test = train.subset(order[n_test:]), train.subset(order[:n_test])
        return train, test, f"SHD files ({args.data})"
    train = synthetic_shd(args.train_size, seed=args.seed)
    test = synthetic_shd(args.test_size, seed=args.seed + 10_000)
    return train, test, "synthetic SHD-like data"


def main(argv: list[str] | None = None) -> dict[str, History]:
    """Train each learner on the spike-classification set; returns ``learner -> History``."""
    parser = common_parser(__doc__, iterations=100, batch=32, lr=0.005, algorithms=["d_rtrl"],
                           plot="shd_classification.png", test_size=400, grad_clip=1.0)
    parser.add_argument("--hidden", type=positive_int, default=64, help="recurrent LIF neurons")
    parser.add_argument("--steps", type=positive_int, default=40, help="time bins per sample")
    parser.add_argument("--max-time", type=positive_float, default=1.0, help="seconds of each sample kept")
    parser.add_argument("--train-size", type=positive_int, default=2000, help="training samples (a limit for --data)")
    parser.add_argument("--data", default="", help="path of a local SHD training file (.h5); default: synthetic")
    parser.add_argument("--test-data", default="", help="path of a local SHD test file (.h5)")
    args = parser.parse_args(argv)
    if args.test_data and not args.data:
        parser.error("--test-data needs --data as well")
    train, test, source = load_data(args)
    n_classes = int(max(train.labels.max(), test.labels.max())) + 1
    print(f"{source}: {len(train)} training and {len(test)} held-out samples, {train.n_channels} channels, "
          f"{n_classes} classes, {args.steps} steps of {1000 * args.max_time / args.steps:.0f} ms")

    def batches() -> Iterator[Batch]:
        rng = np.random.default_rng(args.seed)
        while True:  # epochs of shuffled batches
            order = rng.permutation(len(train))
            for start in range(0, len(order) - args.batch + 1, args.batch):
                yield as_batch(train, order[start:start + args.batch], args.steps, args.max_time)

    if len(train) < args.batch:
        raise ValueError(f"--batch {args.batch} is larger than the {len(train)} training samples; lower it.")
    held_out = as_batch(test, np.arange(len(test)), args.steps, args.max_time)
    results = train_learners(
        args.algorithms,
        lambda: LIFNetwork(train.n_channels, args.hidden, n_classes, tau=8.0, in_scale=4.0, rec_scale=0.5,
                           seed=args.seed),
        args.batch, args.lr, np.zeros((args.batch, train.n_channels), np.float32), batches, args.iterations,
        window_accuracy, held_out, args.pp_decay, args.grad_clip or None)
    histories = {name: r[2] for name, r in results.items()}
    if args.plot:
        _plot(histories, results, held_out, test, n_classes, args.plot)
    return histories


def _plot(histories: dict[str, History], results: dict[str, Any], held_out: Batch,
          test: SpikeEvents, n_classes: int, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    plot_histories(axes[0], axes[1], histories, chance=1.0 / n_classes)
    shown = [int(np.nonzero(test.labels == c)[0][0]) for c in range(2) if np.any(test.labels == c)]
    for i, k in enumerate(shown):
        axes[2].scatter(test.times[k], test.units[k], s=1, color=f"C{i}", label=f"class {test.labels[k]}")
    axes[2].set(xlabel="time (s)", ylabel="input channel", title="two held-out samples")
    axes[2].legend(fontsize=8, markerscale=6)
    xs, labels, weights = held_out
    name, (_, trainer, _) = next(iter(results.items()))
    pred = np.einsum("t,tbc->bc", weights, predict(trainer, xs)).argmax(-1)
    confusion = np.zeros((n_classes, n_classes))
    np.add.at(confusion, (labels[-1], pred), 1.0)
    axes[3].imshow(confusion / np.maximum(confusion.sum(1, keepdims=True), 1), cmap="Blues", vmin=0, vmax=1)
    axes[3].set(xlabel="predicted class", ylabel="true class", title=f"held-out confusion ({name})",
                xticks=range(0, n_classes, 5), yticks=range(0, n_classes, 5))
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])

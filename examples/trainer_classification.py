"""Sequence classification with ``braintools.trainer``: BPTT and online learners in one table.

The same script trains the same network with each learner named by ``--learners`` (``bptt``,
the exact reference, and the online rules ``d_rtrl``, ``pp_prop``, ``eprop`` by default)
through :class:`braintrace.trainer.OnlineModule` inside the unmodified
``braintools.trainer.Trainer``, then prints one table: held-out accuracy, seconds per epoch
(the first, which compiles the training step, apart) and the XLA memory of one training step (its temporaries and arguments), so that what online
learning costs against BPTT can be read off one run.

Two data sets from scikit-learn's 1,797 8×8 digits (they ship inside scikit-learn; nothing is
downloaded):

* ``--data rows``: each image read row by row, 8 steps of 8 pixel intensities, into a
  recurrent tanh network (:class:`braintrace.nn.ValinaRNNCell`) and a linear readout;
* ``--data spikes``: each image as ``--steps`` steps of Poisson spikes over its 64 pixels
  (``braintools.PoissonEncoder``: the dense ``(T, channels)`` spike format of the
  Spiking Heidelberg Digits), into a recurrent LIF network (:class:`_common.LIFNetwork`).

The loss is the cross-entropy of the readout at every step; the prediction is the class of the
largest summed readout (:func:`braintrace.trainer.accuracy`).

Run ``python examples/trainer_classification.py`` (a few minutes on two cores) or with
``--epochs 2 --train-size 256`` for a quick look.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, NamedTuple

import brainstate
import braintools
import jax.numpy as jnp
import numpy as np

import braintrace
from braintrace.trainer import OnlineModule, accuracy
from _common import LIFNetwork, positive_int  # the shared helpers beside this script

LEARNERS = ("bptt", "d_rtrl", "pp_prop", "eprop")
#: Options a learner needs besides the network (passed through to ``braintrace.compile``).
LEARNER_OPTIONS: dict[str, dict[str, Any]] = {"pp_prop": {"decay_or_rank": 0.9}}


class Row(NamedTuple):
    """One learner's line of the table."""

    learner: str
    accuracy: float
    first_epoch_seconds: float  # includes compiling the training step
    seconds_per_epoch: float  # the epochs after the first
    step_memory_bytes: int


class EpochTimes(braintools.trainer.Callback):
    """The wall time of each training epoch."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


class RowNetwork(brainstate.nn.Module):
    """8 pixel rows → ``hidden`` tanh units (recurrent) → 10 logits per step."""

    def __init__(self, hidden: int, seed: int) -> None:
        super().__init__()
        with brainstate.random.seed_context(seed):
            self.rnn = braintrace.nn.ValinaRNNCell(8, hidden)
            self.readout = brainstate.nn.Linear(hidden, 10)  # a readout needs no trace

    def update(self, x: Any) -> Any:
        return self.readout(self.rnn(x))


def digits(data: str, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs (N, T, channels), labels (N,))`` in a fixed random order."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError("the digits ship inside scikit-learn: pip install scikit-learn "
                          "(or pip install braintrace[demo])") from err
    loaded = load_digits()
    images = loaded.images.astype(np.float32) / 16.0
    order = np.random.default_rng(seed).permutation(len(images))
    images, labels = images[order], loaded.target[order].astype(np.int32)
    if data == "rows":
        return images, labels
    with brainstate.random.seed_context(seed), brainstate.environ.context(dt=1.0):  # 1 ms steps
        encoder = braintools.PoissonEncoder(normalize=True, max_rate=500.0)  # a white pixel: 500 Hz
        spikes = encoder(images.reshape(len(images), 64), n_time=steps)  # (T, N, 64), 0 or 1
    return np.asarray(jnp.swapaxes(spikes, 0, 1), np.float32), labels


def network(data: str, hidden: int, seed: int) -> brainstate.nn.Module:
    return RowNetwork(hidden, seed) if data == "rows" else LIFNetwork(64, hidden, 10, seed=seed)


def cross_entropy(logits: Any, labels: Any) -> Any:
    return jnp.mean(braintools.metric.softmax_cross_entropy_with_integer_labels(logits, labels))


def train(learner: str, args: argparse.Namespace, xs: np.ndarray, labels: np.ndarray) -> Row:
    """Fit one learner on the first ``--train-size`` sequences; score the next ``--test-size``."""
    n_train = args.train_size
    train_set = (xs[:n_train], labels[:n_train])
    test_set = (xs[n_train:n_train + args.test_size], labels[n_train:n_train + args.test_size])
    module = OnlineModule(network(args.data, args.hidden, args.seed), learner, loss=cross_entropy,
                          optimizer=braintools.optim.Adam(lr=args.lr), metrics={"acc": accuracy},
                          **LEARNER_OPTIONS.get(learner, {}))
    loader = braintools.trainer.DataLoader(train_set, batch_size=args.batch, shuffle=True, drop_last=True,
                                           seed=args.seed)
    memory = module.training_memory(next(iter(loader)))
    epochs = EpochTimes()
    trainer = braintools.trainer.Trainer(max_epochs=args.epochs, logger=False, enable_progress_bar=False,
                                         enable_checkpointing=False, default_root_dir=args.root, callbacks=[epochs])
    trainer.fit(module, loader)
    later = epochs.seconds[1:] or epochs.seconds
    test_loader = braintools.trainer.DataLoader(test_set, batch_size=len(test_set[0]))  # any batch size
    scores = trainer.test(module, test_loader, verbose=False)
    return Row(learner, float(scores["test_acc"]), epochs.seconds[0], float(np.mean(later)), memory)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = ["| learner | test accuracy | first epoch (s, compiles) | s / later epoch | step memory (KiB) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.learner} | {r.accuracy:.3f} | {r.first_epoch_seconds:.2f} | {r.seconds_per_epoch:.3f} "
              f"| {r.step_memory_bytes / 1024:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    """Train each learner; print and return the table's rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=["rows", "spikes"], default="rows")
    parser.add_argument("--learners", nargs="+", default=list(LEARNERS), metavar="NAME",
                        help=f"names of braintrace.compile (default: {' '.join(LEARNERS)})")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--batch", type=positive_int, default=32)
    parser.add_argument("--hidden", type=positive_int, default=64)
    parser.add_argument("--steps", type=positive_int, default=16, help="time steps per image (--data spikes)")
    parser.add_argument("--train-size", type=positive_int, default=1400)
    parser.add_argument("--test-size", type=positive_int, default=397)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=".", help="the Trainer's default_root_dir")
    args = parser.parse_args(argv)
    xs, labels = digits(args.data, args.steps, args.seed)
    if args.train_size + args.test_size > len(xs) or args.train_size < args.batch:
        parser.error(f"--train-size {args.train_size} + --test-size {args.test_size} must fit in the {len(xs)} "
                     f"digits, and the training set must hold at least one batch of {args.batch}")
    rows = [train(learner, args, xs, labels) for learner in args.learners]
    print(f"digits as {args.data}: {args.train_size} training / {args.test_size} test sequences of "
          f"{xs.shape[1]} steps, {args.epochs} epochs")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

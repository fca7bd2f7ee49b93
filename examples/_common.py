"""Shared pieces of the example scripts: progress, training loops, spike encoding, a LIF network, plots.

Every example trains a recurrent model on batches of sequences ``xs`` of shape
``(time, batch, inputs)`` with integer targets ``labels`` of shape ``(time, batch)`` and a
per-step loss weight ``weights`` of shape ``(time,)`` (zero where a step is not scored). The
trainers here turn that into one jitted training step:

* :func:`online_trainer` compiles the model with a braintrace learning rule; each batch is
  ``learner.reset()`` and one call of the sequence driver ``learner.etrace_train`` (one online
  gradient per step, weighted, summed, divided by the total weight, one Adam step);
* :func:`bptt_trainer` is the reference: one gradient of the whole sequence's weighted loss.

Nothing here downloads anything; the data of every example is generated or read from a local file.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import optax

import braintrace

__all__ = [
    "Progress",
    "Trainer",
    "History",
    "Batch",
    "LIFNetwork",
    "cross_entropy",
    "online_trainer",
    "bptt_trainer",
    "make_trainer",
    "predict",
    "fit",
    "window_accuracy",
    "step_accuracy",
    "rate_spikes",
    "positive_int",
    "positive_float",
    "non_negative_float",
    "common_parser",
    "train_learners",
    "algorithm_names",
    "learner_options",
    "LEARNERS",
    "pyplot",
    "plot_histories",
    "save_figure",
    "smooth",
]

#: ``step_loss(logits (batch, classes), labels (batch,)) -> loss ()``: the unweighted loss of one step.
StepLoss = Callable[[jax.Array, jax.Array], jax.Array]
#: One batch of sequences: inputs ``(time, batch, inputs)``, labels ``(time, batch)``, weights ``(time,)``.
Batch = tuple[np.ndarray, np.ndarray, np.ndarray]


# --- argument parsing -------------------------------------------------------------------------

def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1, with an error that shows the value."""
    value = int(text)
    if value < 1:
        raise ValueError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An ``argparse`` type: a float > 0, with an error that shows the value."""
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a number > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """An ``argparse`` type: a float >= 0, with an error that shows the value."""
    value = float(text)
    if not value >= 0:
        raise ValueError(f"expected a number >= 0, got {value}")
    return value


def common_parser(
    doc: str,
    *,
    iterations: int,
    batch: int,
    lr: float,
    algorithms: list[str],
    plot: str,
    test_size: int,
    grad_clip: float = 0.0,
) -> argparse.ArgumentParser:
    """The arguments every example takes; each script adds its own size arguments.

    ``grad_clip`` is the default of ``--grad-clip``: the gradient's global norm is clipped at it
    before each Adam step (0: no clipping).
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--iterations", type=positive_int, default=iterations, help="training batches")
    parser.add_argument("--batch", type=positive_int, default=batch, help="sequences per batch")
    parser.add_argument("--lr", type=positive_float, default=lr, help="Adam learning rate")
    parser.add_argument("--grad-clip", type=non_negative_float, default=grad_clip,
                        help="clip the gradient's global norm at this value before each Adam step (0: no clipping)")
    parser.add_argument("--algorithms", nargs="+", default=algorithms, choices=algorithm_names(), metavar="NAME",
                        help=f"learners to train, each on a fresh copy of the model: {', '.join(algorithm_names())}")
    parser.add_argument("--pp-decay", type=positive_float, default=0.9, help="pp_prop's trace decay, in (0, 1)")
    parser.add_argument("--test-size", type=positive_int, default=test_size, help="held-out sequences scored at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=plot, help="figure path ('' for none)")
    return parser


# --- progress ---------------------------------------------------------------------------------

class Progress:
    """A progress bar over ``total`` iterations: ``tqdm`` when it is installed, else a printed line.

    The fallback prints about ten lines per run (and the last iteration), each with the
    iteration count, the elapsed time and the latest metrics.

    Examples
    --------
    >>> with Progress(3, "demo", use_tqdm=False) as bar:
    ...     for i in range(3):
    ...         bar.update(loss=1.0 / (i + 1))  # doctest: +ELLIPSIS
    demo:   1/3 ... loss 1.0000
    demo:   2/3 ... loss 0.5000
    demo:   3/3 ... loss 0.3333
    """

    def __init__(self, total: int, desc: str, use_tqdm: bool | None = None) -> None:
        self.total, self.desc, self.count = total, desc, 0
        self._start = time.perf_counter()
        self._every = max(1, total // 10)
        self._bar: Any = None
        if use_tqdm is not False:
            try:
                from tqdm import tqdm
            except ImportError:
                if use_tqdm:
                    raise
            else:
                self._bar = tqdm(total=total, desc=desc, leave=True)

    def update(self, **metrics: float) -> None:
        """Advance by one iteration and show ``metrics`` (name -> value)."""
        self.count += 1
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in metrics.items()}, refresh=False)
            self._bar.update(1)
            return
        if self.count % self._every == 0 or self.count == self.total:
            shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            width = len(str(self.total))
            elapsed = time.perf_counter() - self._start
            print(f"{self.desc}: {self.count:{width}d}/{self.total} [{elapsed:6.1f}s]  {shown}", flush=True)

    def close(self) -> None:
        """Close the bar (a no-op for the printed fallback)."""
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- models -----------------------------------------------------------------------------------

class LIFNetwork(brainstate.nn.Module):
    """A recurrent layer of :class:`braintrace.nn.LIF` neurons with a leaky (non-spiking) readout.

    The input and the recurrent spikes drive the neurons through :func:`braintrace.matmul`,
    ``I = x W_in + b + s W_rec`` with ``s`` the spikes of the potential entering the step
    (``lif.get_spike()``). The neurons integrate it by one exponential-Euler step of
    ``τ dV/dt = −V + R I`` and spike when ``V`` crosses 1 mV (a sigmoid surrogate gradient); a spike
    resets ``V`` to 0 at the next step (``spk_reset='hard'``). The per-neuron membrane time
    constant ``τ`` is a ``brainstate.ParamState``, so it learns online with the weights; the
    readout is a :class:`braintrace.nn.LeakyRateReadout`, ``r ← e^{−dt/τ_out} r + s' W_out`` with
    ``s'`` the new spikes. The step is ``dt = 1 ms``: the network sets it for its own updates.

    The membrane resistance is ``R = 1 / (1 − e^{−dt/τ})`` ohm at the initial ``τ``, so that one
    step of a unit current adds 1 mV to the potential: at initialisation the update is the
    discrete ``V ← e^{−dt/τ} V (1 − s) + I``.

    Parameters
    ----------
    n_in, n_rec, n_out : int
        Input channels, recurrent neurons, readout units.
    tau : float
        Initial membrane time constant, in ms (steps).
    readout_tau : float
        Fixed time constant of the readout, in ms.
    in_scale, rec_scale : float
        Standard deviation of the input / recurrent weights, times ``1/sqrt(fan-in)``.
    seed : int
        Seed of the weight initialisation.

    Examples
    --------
    >>> net = LIFNetwork(3, 5, 2, tau=10.0)
    >>> brainstate.nn.init_all_states(net, batch_size=4)  # doctest: +ELLIPSIS
    LIFNetwork(...)
    >>> net(jnp.ones((4, 3))).shape, net.spikes().shape
    ((4, 2), (4, 5))
    >>> net.lif.trainable_constants
    ('tau',)
    """

    #: The simulation step of every update.
    dt = 1.0 * u.ms

    def __init__(
        self,
        n_in: int,
        n_rec: int,
        n_out: int,
        tau: float = 8.0,
        readout_tau: float = 4.5,
        in_scale: float = 1.0,
        rec_scale: float = 0.5,
        seed: int = 0,
    ) -> None:
        super().__init__()
        k = jax.random.split(jax.random.PRNGKey(seed), 3)
        # Strong float32 parameters and initial states (a Python float is weakly typed): the first
        # training step would make them strong and the jitted step would compile a second time.
        zero = jnp.zeros((), jnp.float32)
        tau_m = brainstate.ParamState(jnp.full((n_rec,), tau, dtype=jnp.float32) * u.ms)
        resistance = 1.0 / -np.expm1(-u.get_magnitude(self.dt / u.ms) / tau) * u.ohm
        self.lif = braintrace.nn.LIF(n_rec, R=resistance, tau=tau_m, V_th=1.0 * u.mV, spk_reset="hard",
                                     spk_fun=braintools.surrogate.Sigmoid(),
                                     V_initializer=braintools.init.Constant(zero * u.mV))
        self.w_in = brainstate.ParamState(in_scale * jax.random.normal(k[0], (n_in, n_rec)) / np.sqrt(n_in))
        self.w_rec = brainstate.ParamState(rec_scale * jax.random.normal(k[1], (n_rec, n_rec)) / np.sqrt(n_rec))
        self.bias = brainstate.ParamState(jnp.zeros((n_rec,)))
        with brainstate.environ.context(dt=self.dt):
            self.readout = braintrace.nn.LeakyRateReadout(
                n_rec, n_out, tau=readout_tau * u.ms,
                w_init=jax.random.normal(k[2], (n_rec, n_out)) / np.sqrt(n_rec), r_init=braintools.init.Constant(zero))

    def spikes(self) -> jax.Array:
        """The spikes of the current membrane potential (surrogate gradient)."""
        return self.lif.get_spike()

    def update(self, x: jax.Array) -> jax.Array:
        current = braintrace.matmul(x, self.w_in.value, self.bias.value) + braintrace.matmul(self.spikes(), self.w_rec.value)
        with brainstate.environ.context(dt=self.dt):
            return self.readout(self.lif(current * u.mA))


# --- losses and metrics -----------------------------------------------------------------------

def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The batch-mean cross-entropy of one step: ``logits (batch, classes)``, ``labels (batch,)``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def window_accuracy(outs: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> float:
    """Fraction of sequences whose weighted-mean logits over the scored steps pick the label.

    ``outs (time, batch, classes)``, ``labels (time, batch)`` (constant over the scored steps),
    ``weights (time,)``.
    """
    w = np.asarray(weights, dtype=float)
    mean_logits = np.einsum("t,tbc->bc", w, np.asarray(outs)) / w.sum()
    last_scored = int(np.nonzero(w)[0][-1])
    return float((mean_logits.argmax(-1) == np.asarray(labels)[last_scored]).mean())


def step_accuracy(outs: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> float:
    """Fraction of scored steps (``weights > 0``) whose argmax is the label, over the batch."""
    scored = np.asarray(weights) > 0
    hits = np.asarray(outs).argmax(-1)[scored] == np.asarray(labels)[scored]
    return float(hits.mean())


# --- trainers ---------------------------------------------------------------------------------

class Trainer(NamedTuple):
    """A jitted training step and forward pass over batches of a fixed size.

    ``train(xs, labels, weights) -> (loss, outs)`` updates the parameters in place;
    ``forward(xs) -> outs`` runs the model from reset states without learning.
    """

    name: str
    batch_size: int
    train: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    forward: Callable[[jax.Array], jax.Array]


def _adam(lr: float, params: Mapping[Any, brainstate.ParamState], grad_clip: float | None) -> braintools.optim.Adam:
    """Adam registered once on ``params``: its moments live in states and carry over from batch to batch.

    With ``grad_clip``, each gradient's global norm is clipped at it first.
    """
    optimizer = braintools.optim.Adam(lr=lr, grad_clip_norm=grad_clip)
    optimizer.register_trainable_weights(dict(params))
    return optimizer


def _weighted_mean(losses: jax.Array, weights: jax.Array) -> jax.Array:
    """``Σ_t w_t loss_t / max(Σ_t w_t, 1)``: the objective whose gradient the trainers follow."""
    return jnp.sum(weights * losses) / jnp.maximum(jnp.sum(weights), 1.0)


def online_trainer(
    model: brainstate.nn.Module,
    algorithm: Any,
    batch_size: int,
    lr: float,
    x0: jax.Array,
    step_loss: StepLoss = cross_entropy,
    grad_clip: float | None = None,
    **options: Any,
) -> Trainer:
    """Compile ``model`` with ``algorithm`` and build its online training step.

    Each batch starts from reset states (``learner.reset()``: in place, into the state objects
    the learner was compiled with) and is one call of ``learner.etrace_train``: one learner call
    and one online gradient of ``step_loss`` per step, weighted by ``weights``, summed, divided
    by the total weight (the driver's ``'mean'`` reduction) and applied by Adam once per batch,
    its global norm clipped at ``grad_clip`` if given. ``x0`` is one step's input ``(batch, inputs)``; ``options`` go to :func:`braintrace.compile`
    (e.g. ``decay_or_rank`` for ``pp_prop``).
    """
    learner = braintrace.compile(model, algorithm, x0, batch_size=batch_size, **options)
    optimizer = _adam(lr, learner.param_states, grad_clip)

    def step_fn(x: jax.Array, label: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = learner(x)  # the one learner call of this step
        return step_loss(out, label), out

    @brainstate.transform.jit
    def train(xs: jax.Array, labels: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        learner.reset()
        result = learner.etrace_train(xs, labels, step_fn=step_fn, optimizer=optimizer, mask=weights, has_aux=True)
        return _weighted_mean(result.losses, weights), result.aux

    @brainstate.transform.jit
    def forward(xs: jax.Array) -> jax.Array:
        learner.reset()
        return learner.etrace_evolve(xs, return_outputs=True)

    name = algorithm if isinstance(algorithm, str) else algorithm.__name__
    return Trainer(name, batch_size, train, forward)


def bptt_trainer(
    model: brainstate.nn.Module,
    batch_size: int,
    lr: float,
    step_loss: StepLoss = cross_entropy,
    grad_clip: float | None = None,
) -> Trainer:
    """The reference: backpropagation through time of the weighted loss of whole sequences.

    One Adam step per batch, the gradient's global norm clipped at ``grad_clip`` if given.

    Each sequence starts from ``brainstate.nn.reset_all_states(model, batch_size=batch_size)``: every
    module's ``reset_state`` re-initialises its hidden states at the batch size.
    """
    brainstate.nn.init_all_states(model, batch_size=batch_size)
    params = model.states(brainstate.ParamState)
    optimizer = _adam(lr, params, grad_clip)

    def forward(xs: jax.Array) -> jax.Array:
        brainstate.nn.reset_all_states(model, batch_size=batch_size)
        return brainstate.transform.for_loop(model, xs)

    def loss_fn(xs: jax.Array, labels: jax.Array, weights: jax.Array) -> tuple[jax.Array, Any]:
        outs = forward(xs)
        loss = _weighted_mean(jax.vmap(step_loss)(outs, labels), weights)
        return loss, (loss, outs)

    @brainstate.transform.jit
    def train(xs: jax.Array, labels: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        grads, (loss, outs) = brainstate.transform.grad(loss_fn, params, has_aux=True, return_value=False)(
            xs, labels, weights)
        optimizer.update(grads)
        return loss, outs

    return Trainer("bptt", batch_size, train, brainstate.transform.jit(forward))


def make_trainer(
    algorithm: str,
    model: brainstate.nn.Module,
    batch_size: int,
    lr: float,
    x0: jax.Array,
    step_loss: StepLoss = cross_entropy,
    grad_clip: float | None = None,
    **options: Any,
) -> Trainer:
    """``'bptt'`` or any name :func:`braintrace.compile` accepts (``'d_rtrl'``, ``'pp_prop'``, ``'eprop'`` ...)."""
    if algorithm.lower() == "bptt":
        return bptt_trainer(model, batch_size, lr, step_loss, grad_clip)
    return online_trainer(model, algorithm, batch_size, lr, x0, step_loss, grad_clip, **options)


#: Learners that need no model-specific option (OTTT, OTPE and OSTTP need the model's leak or
#: feedback matrices, so the generic scripts leave them out).
LEARNERS = ("d_rtrl", "pp_prop", "eprop", "bptt")


def algorithm_names() -> list[str]:
    """The learner names the examples accept: ``'bptt'`` and the braintrace rules in :data:`LEARNERS`."""
    return list(LEARNERS)


def learner_options(name: str, pp_decay: float) -> dict[str, Any]:
    """The constructor options a learner needs: ``pp_prop``'s trace decay, nothing for the others."""
    return {"decay_or_rank": pp_decay} if name.lower() == "pp_prop" else {}


# --- loops ------------------------------------------------------------------------------------

class History(NamedTuple):
    """Per-iteration training loss and accuracy, and the held-out accuracy at the end."""

    loss: list[float]
    accuracy: list[float]
    test_accuracy: float
    seconds: float


def predict(trainer: Trainer, xs: np.ndarray) -> np.ndarray:
    """Run ``trainer.forward`` over ``xs (time, n, inputs)`` in batches; returns ``(time, n, outputs)``.

    The last batch is padded with zeros to the trainer's batch size (the jitted step has a
    fixed shape) and the padding is dropped from the result.
    """
    b, n = trainer.batch_size, xs.shape[1]
    outs = []
    for start in range(0, n, b):
        chunk = xs[:, start:start + b]
        pad = b - chunk.shape[1]
        if pad:
            chunk = np.concatenate([chunk, np.zeros((chunk.shape[0], pad, *chunk.shape[2:]), chunk.dtype)], axis=1)
        outs.append(np.asarray(trainer.forward(jnp.asarray(chunk)))[:, :b - pad])
    return np.concatenate(outs, axis=1)


def fit(
    trainer: Trainer,
    batches: Iterable[Batch],
    iterations: int,
    accuracy: Callable[[np.ndarray, np.ndarray, np.ndarray], float],
    test: Batch | None = None,
    desc: str | None = None,
) -> History:
    """Train for ``iterations`` batches from ``batches`` with a progress bar; score ``test`` at the end."""
    losses: list[float] = []
    accs: list[float] = []
    start = time.perf_counter()
    it: Iterator[Batch] = iter(batches)
    with Progress(iterations, desc or trainer.name) as bar:
        for _ in range(iterations):
            xs, labels, weights = next(it)
            loss, outs = trainer.train(jnp.asarray(xs), jnp.asarray(labels), jnp.asarray(weights))
            losses.append(float(loss))
            accs.append(accuracy(np.asarray(outs), labels, weights))
            bar.update(loss=losses[-1], acc=accs[-1])
    test_acc = float("nan")
    if test is not None:
        xs, labels, weights = test
        test_acc = accuracy(predict(trainer, xs), labels, weights)
    return History(losses, accs, test_acc, time.perf_counter() - start)


def train_learners(
    algorithms: list[str],
    build_model: Callable[[], brainstate.nn.Module],
    batch_size: int,
    lr: float,
    x0: np.ndarray,
    make_batches: Callable[[], Iterable[Batch]],
    iterations: int,
    accuracy: Callable[[np.ndarray, np.ndarray, np.ndarray], float],
    test: Batch | None = None,
    pp_decay: float = 0.9,
    grad_clip: float | None = None,
) -> dict[str, tuple[brainstate.nn.Module, Trainer, History]]:
    """Train a fresh model (same initialisation) with each learner on the same batches.

    ``pp_decay`` is ``pp_prop``'s trace decay; ``grad_clip`` (if given) clips each gradient's
    global norm before the Adam step. Returns ``name -> (model, trainer, history)``
    in the order given.
    """
    results = {}
    for name in algorithms:
        model = build_model()
        trainer = make_trainer(name, model, batch_size, lr, jnp.asarray(x0), grad_clip=grad_clip,
                               **learner_options(name, pp_decay))
        history = fit(trainer, make_batches(), iterations, accuracy, test)
        print(f"[{name}] held-out accuracy {history.test_accuracy:.3f}, {history.seconds:.1f} s")
        results[name] = (model, trainer, history)
    return results


# --- spike encoding ---------------------------------------------------------------------------

def rate_spikes(rng: np.random.Generator, rates: np.ndarray, n_steps: int) -> np.ndarray:
    """Bernoulli spike trains: ``rates (..., channels)`` in [0, 1] per step -> ``(n_steps, ..., channels)``.

    Examples
    --------
    >>> s = rate_spikes(np.random.default_rng(0), np.array([[0.0, 1.0]]), 4)
    >>> s.shape, float(s[:, 0, 0].sum()), float(s[:, 0, 1].sum())
    ((4, 1, 2), 0.0, 4.0)
    """
    rates = np.clip(np.asarray(rates, dtype=np.float32), 0.0, 1.0)
    return (rng.random((n_steps, *rates.shape)) < rates).astype(np.float32)


# --- plotting ---------------------------------------------------------------------------------

def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` (with a note) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'braintrace[demo]'): skipping the figure.")
        return None
    return plt


def plot_histories(ax_loss: Any, ax_acc: Any, histories: dict[str, History], chance: float) -> None:
    """Smoothed training loss and accuracy of each learner, chance level dashed."""
    for i, (name, h) in enumerate(histories.items()):
        ax_loss.plot(h.loss, color=f"C{i}", alpha=0.25)
        ax_loss.plot(smooth(h.loss), color=f"C{i}", label=name)
        ax_acc.plot(smooth(h.accuracy), color=f"C{i}", label=f"{name} (held-out {h.test_accuracy:.2f})")
    ax_acc.axhline(chance, ls="--", color="gray", lw=1, label="chance")
    ax_loss.set(xlabel="training batch", ylabel="cross-entropy", title="training loss")
    ax_acc.set(xlabel="training batch", ylabel="accuracy", title="training accuracy", ylim=(0, 1.02))
    ax_loss.legend(fontsize=8)
    ax_acc.legend(fontsize=8)


def save_figure(fig: Any, path: str) -> None:
    """Save ``fig`` to ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"saved the figure to {path}")


def smooth(values: list[float], width: int = 10) -> np.ndarray:
    """A running mean over ``width`` iterations (shorter at the start) for loss curves."""
    v = np.asarray(values, dtype=float)
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(idx - width, 0)
    return (c[idx] - c[lo]) / (idx - lo)

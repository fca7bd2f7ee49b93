"""The ``braintools.trainer.Trainer`` recipe of ``docs/tutorials/training_online.ipynb`` (section 5).

The trainer's training step is fixed: it differentiates the loss ``training_step`` returns with
respect to every ``ParamState`` and hands that gradient to its optimizer. The recipe makes the
gradient the learner's online one: ``training_step`` runs ``etrace_grad`` over the time-major batch
(on ``stop_gradient`` copies of the parameters, so the trainer never differentiates through the
learner) and returns the surrogate ``L + <sg(g), θ> - sg(<g, θ>)``, whose value is the loss ``L``
and whose gradient is the online estimate ``g``.

Checked: the loss falls over epochs; the first update the trainer applies equals ``etrace_grad``
followed by the same optimizer step by hand, and differs from the BPTT update (the network is
recurrent, where D_RTRL is an approximation, so a trainer that differentiated the learner's
forward pass would be caught); with a zero learning rate the loss does not move.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace

I, H, T, B, N = 2, 6, 12, 4, 16  # inputs, hidden units, steps, batch, sequences
LR = 0.05

Params = dict[tuple[Any, ...], np.ndarray]


class LeakyRNN(brainstate.nn.Module):
    """``h = 0.8 h + tanh([x, h] W + b)``, read out by a plain ``h R`` (recurrent: D_RTRL approximates)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        w = np.concatenate([rng.normal(0, 1 / np.sqrt(I), (I, H)), rng.normal(0, 0.5 / np.sqrt(H), (H, H))])
        self.w = brainstate.ParamState(jnp.asarray(w, jnp.float32))
        self.b = brainstate.ParamState(jnp.zeros(H, jnp.float32))
        self.r = brainstate.ParamState(jnp.asarray(rng.normal(0, 1 / np.sqrt(H), (H, 1)), jnp.float32))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((H,) if batch_size is None else (batch_size, H)))

    def update(self, x: Any) -> Any:
        u = jnp.concatenate([x, self.h.value], axis=-1)
        self.h.value = 0.8 * self.h.value + jnp.tanh(braintrace.matmul(u, self.w.value, self.b.value))
        return self.h.value @ self.r.value


def mse(out: Any, y: Any) -> Any:
    return jnp.mean((out - y) ** 2)


class OnlineModule(braintools.trainer.LightningModule):
    """The recipe: ``training_step`` returns a loss whose gradient is the learner's online gradient."""

    def __init__(self, learner: Any, make_optimizer: Callable[[], Any]) -> None:
        super().__init__()
        self.learner = learner
        self.make_optimizer = make_optimizer

    def step_fn(self, x: Any, y: Any) -> Any:
        return mse(self.learner(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        xs, ys = batch  # (T, B, I), (T, B, 1)
        params = self.learner.param_states
        live = {p: st.value for p, st in params.items()}
        self.learner.reset()
        for p, st in params.items():
            st.value = jax.lax.stop_gradient(live[p])
        grads, loss = self.learner.etrace_grad(xs, ys, step_fn=self.step_fn, return_value=True,
                                               loss_output="scalar")
        for p, st in params.items():
            st.value = live[p]
        slope = jax.lax.stop_gradient(grads)
        linear = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(slope), jax.tree.leaves(live)))
        return {"loss": jax.lax.stop_gradient(loss) + linear - jax.lax.stop_gradient(linear)}

    def configure_optimizers(self) -> Any:
        return self.make_optimizer()


class Record(braintools.trainer.Callback):
    """Per-epoch mean losses, and the parameters after the first optimizer step."""

    def __init__(self) -> None:
        self.epoch_losses: list[float] = []
        self.after_first_step: Params | None = None

    def on_after_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if self.after_first_step is None:
            self.after_first_step = values(module.learner)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.epoch_losses.append(float(trainer.callback_metrics["train_loss"]))


def values(learner: Any) -> Params:
    return {p: np.asarray(st.value) for p, st in learner.param_states.items()}


def build() -> Any:
    return braintrace.compile(LeakyRNN(seed=1), braintrace.D_RTRL, jnp.zeros((B, I)), batch_size=B)


def data() -> tuple[np.ndarray, np.ndarray]:
    """``(N, T, I)`` inputs and the ``(N, T, 1)`` outputs of a teacher network (another seed), in NumPy."""
    xs = np.random.default_rng(0).normal(size=(N, T, I)).astype(np.float32)
    teacher = LeakyRNN(seed=7)
    w, b, r = (np.asarray(st.value) for st in (teacher.w, teacher.b, teacher.r))
    h, ys = np.zeros((N, H), np.float32), []
    for t in range(T):
        h = 0.8 * h + np.tanh(np.concatenate([xs[:, t], h], axis=-1) @ w + b)
        ys.append(h @ r)
    return xs, np.stack(ys, axis=1).astype(np.float32)


def time_major(samples: list[tuple[np.ndarray, ...]]) -> tuple[jax.Array, ...]:
    return tuple(jnp.stack(arrays, axis=1) for arrays in zip(*samples))


def loader() -> Any:
    return braintools.trainer.DataLoader(data(), batch_size=B, collate_fn=time_major, drop_last=True)


def fit(lr: float, epochs: int, tmp_path: Path) -> tuple[Record, Params]:
    learner = build()
    before = values(learner)
    record = Record()
    trainer = braintools.trainer.Trainer(
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path), callbacks=[record],
    )
    trainer.fit(OnlineModule(learner, lambda: braintools.optim.SGD(lr=lr)), loader())
    return record, before


def flat(params: Params) -> np.ndarray:
    return np.concatenate([np.ravel(params[p]) for p in sorted(params)])


@pytest.mark.slow
def test_trainer_applies_the_online_gradient_and_the_loss_falls(tmp_path: Path) -> None:
    record, before = fit(LR, epochs=3, tmp_path=tmp_path)
    losses = record.epoch_losses
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], losses

    xs, ys = next(iter(loader()))
    by_hand = build()
    sgd = braintools.optim.SGD(lr=LR)
    sgd.register_trainable_weights(by_hand.param_states)
    by_hand.reset()
    grads = by_hand.etrace_grad(xs, ys, step_fn=lambda x, y: mse(by_hand(x), y))
    sgd.step(grads)

    assert record.after_first_step is not None
    trainer_update = flat(record.after_first_step) - flat(before)
    hand_update = flat(values(by_hand)) - flat(before)
    assert np.linalg.norm(hand_update) > 1e-4
    np.testing.assert_allclose(trainer_update, hand_update, rtol=1e-5, atol=1e-7)

    # The BPTT update of the same batch: D_RTRL is an approximation for this recurrent network, so a
    # trainer that backpropagated through the learner's forward pass would have applied this one.
    model = LeakyRNN(seed=1)
    brainstate.nn.init_all_states(model, batch_size=B)
    bptt = brainstate.transform.grad(
        lambda: jnp.mean(jax.vmap(mse)(brainstate.transform.for_loop(model, xs), ys)),
        model.states(brainstate.ParamState),
    )()
    bptt_update = -LR * flat({p: np.asarray(g) for p, g in bptt.items()})
    cosine = hand_update @ bptt_update / np.linalg.norm(hand_update) / np.linalg.norm(bptt_update)
    assert cosine < 0.99, cosine


@pytest.mark.slow
def test_zero_learning_rate_does_not_improve(tmp_path: Path) -> None:
    record, before = fit(0.0, epochs=2, tmp_path=tmp_path)
    assert record.after_first_step is not None
    np.testing.assert_array_equal(flat(record.after_first_step), flat(before))
    first, last = record.epoch_losses
    assert last == pytest.approx(first, rel=1e-6)

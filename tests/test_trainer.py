"""``braintrace.trainer.OnlineModule`` inside the unmodified ``braintools.trainer.Trainer``.

Pinned: the update the Trainer applies is the learner's ``etrace_grad`` followed by the same
optimizer step, bit for bit; ``'bptt'`` applies the exact BPTT gradient; evaluation runs at any
batch size from fresh states; streams carry the states; a non-finite batch is skipped and
reported with the weights, optimizer state and learner states as before it; early stopping and
checkpoints work; mistakes are refused at the call with the fix named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace.trainer import OnlineModule, accuracy

I, H, C, T, B, N = 3, 6, 2, 5, 4, 12  # inputs, hidden units, classes, steps, batch, sequences
LR = 0.05


class LeakyRNN(brainstate.nn.Module):
    """``h = 0.8 h + tanh([x, h] W + b)``, read out by ``h R`` (recurrent: D_RTRL approximates)."""

    def __init__(self, seed: int = 1) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        w = np.concatenate([rng.normal(0, 1 / np.sqrt(I), (I, H)), rng.normal(0, 0.5 / np.sqrt(H), (H, H))])
        self.w = brainstate.ParamState(jnp.asarray(w, jnp.float32))
        self.b = brainstate.ParamState(jnp.zeros(H, jnp.float32))
        self.r = brainstate.ParamState(jnp.asarray(rng.normal(0, 1 / np.sqrt(H), (H, C)), jnp.float32))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((H,) if batch_size is None else (batch_size, H)))

    def update(self, x: Any) -> Any:
        u = jnp.concatenate([x, self.h.value], axis=-1)
        self.h.value = 0.8 * self.h.value + jnp.tanh(braintrace.matmul(u, self.w.value, self.b.value))
        return self.h.value @ self.r.value


def cross_entropy(out: Any, label: Any) -> Any:
    return jnp.mean(braintools.metric.softmax_cross_entropy_with_integer_labels(out, label))


def data(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, C, size=n)
    xs = rng.normal(size=(n, T, I)).astype(np.float32) + labels[:, None, None].astype(np.float32)
    return xs, labels


def loader(xs: Any = None, labels: Any = None, batch_size: int = B, **options: Any) -> Any:
    if xs is None:
        xs, labels = data()
    return braintools.trainer.DataLoader((xs, labels), batch_size=batch_size, drop_last=True, **options)


def trainer(tmp_path: Path, epochs: int = 1, **options: Any) -> Any:
    options = {"logger": False, "enable_progress_bar": False, "enable_checkpointing": False, **options}
    return braintools.trainer.Trainer(max_epochs=epochs, default_root_dir=str(tmp_path), **options)


def module(learner: Any = "d_rtrl", optimizer: Any = None, **options: Any) -> OnlineModule:
    optimizer = braintools.optim.SGD(lr=LR) if optimizer is None else optimizer
    return OnlineModule(LeakyRNN(), learner, loss=cross_entropy, optimizer=optimizer, **options)


def weights(m: OnlineModule) -> dict[Any, np.ndarray]:
    return {p: np.asarray(st.value) for p, st in m.learner.param_states.items()}


class AfterEachStep(braintools.trainer.Callback):
    """The weights at the end of each training batch (after the module's own hooks ran)."""

    def __init__(self) -> None:
        self.weights: list[dict[Any, np.ndarray]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.weights.append(weights(module))


@pytest.mark.parametrize("learner", ["d_rtrl", "bptt"])
def test_the_update_is_the_learners_gradient_and_optimizer_step_bit_for_bit(learner: str, tmp_path: Path) -> None:
    record = AfterEachStep()
    trained = module(learner, braintools.optim.Adam(lr=LR))
    trainer(tmp_path, callbacks=[record]).fit(trained, loader())

    by_hand = module(learner, braintools.optim.Adam(lr=LR))
    adam = by_hand.optimizer
    for batch_idx, (xs, label_tuple) in enumerate(loader()):
        labels = jnp.asarray(label_tuple)  # braintools' collate leaves NumPy scalars as a tuple
        learner_ = by_hand.build((xs, labels))
        if batch_idx == 0:
            adam.register_trainable_weights(learner_.param_states)
        learner_.reset()
        grads = learner_.etrace_grad(xs, step_fn=lambda x: cross_entropy(learner_(x), labels), time_axis=1)
        brainstate.transform.jit(adam.step)(grads)  # jitted, as the Trainer steps it
        for p, w in weights(by_hand).items():
            np.testing.assert_array_equal(record.weights[batch_idx][p], w)
    assert len(record.weights) == N // B


def test_bptt_applies_the_exact_gradient_and_d_rtrl_does_not(tmp_path: Path) -> None:
    xs, labels = data(B)
    grads = {name: module(name).online_gradients((xs, labels))[0] for name in ("bptt", "d_rtrl")}

    model = LeakyRNN()
    brainstate.nn.init_all_states(model, batch_size=B)

    def objective() -> Any:
        outs = brainstate.transform.for_loop(model, jnp.swapaxes(jnp.asarray(xs), 0, 1))
        return jnp.mean(jax.vmap(lambda o: cross_entropy(o, labels))(outs))

    reference = brainstate.transform.grad(objective, model.states(brainstate.ParamState))()
    flat_ref = np.concatenate([np.ravel(reference[p]) for p in sorted(reference)])
    for name, g in grads.items():
        flat = np.concatenate([np.ravel(g[p]) for p in sorted(g)])
        if name == "bptt":
            np.testing.assert_allclose(flat, flat_ref, rtol=1e-5, atol=1e-7)
        else:  # recurrent: D_RTRL approximates
            assert not np.allclose(flat, flat_ref, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("learner", ["bptt", "d_rtrl", "pp_prop", "eprop"])
def test_every_learner_name_trains_in_the_same_script(learner: str, tmp_path: Path) -> None:
    options = {"decay_or_rank": 0.9} if learner == "pp_prop" else {}
    trained = module(learner, braintools.optim.Adam(lr=0.05), metrics={"acc": accuracy}, **options)
    fit = trainer(tmp_path, epochs=4)
    fit.fit(trained, loader(), loader(*data(9), batch_size=9))
    first = trained.validation_step(next(iter(loader())), 0)["loss"]
    assert np.isfinite(first)
    assert fit.callback_metrics["val_acc"] >= 0.6, fit.callback_metrics


def test_evaluation_runs_at_any_batch_size_from_fresh_states(tmp_path: Path) -> None:
    trained = module()
    trainer(tmp_path).fit(trained, loader())
    xs, labels = data(7)
    hidden_before = {p: np.asarray(st.value) for p, st in trained.learner.hidden_states.items()}

    result = trained.validation_step((xs, labels), 0)
    outputs = trained.predict_step((xs, labels), 0)

    model = trained.model
    by_hand = LeakyRNN()
    for p, st in model.states(brainstate.ParamState).items():
        by_hand.states(brainstate.ParamState)[p].value = st.value
    brainstate.nn.init_all_states(by_hand, batch_size=7)
    expected = np.stack([np.asarray(by_hand(jnp.asarray(xs[:, t]))) for t in range(T)], axis=1)
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-6)
    loss = np.mean([float(cross_entropy(jnp.asarray(expected[:, t]), labels)) for t in range(T)])
    np.testing.assert_allclose(result["loss"], loss, rtol=1e-5)
    for p, value in hidden_before.items():  # evaluation leaves the training states alone
        np.testing.assert_array_equal(trained.learner.hidden_states[p].value, value)

    metrics = trainer(tmp_path).validate(trained, loader(xs, labels, batch_size=7), verbose=False)
    np.testing.assert_allclose(metrics["val_loss"], loss, rtol=1e-5)
    predictions = trainer(tmp_path).predict(trained, loader(xs, labels, batch_size=7))
    np.testing.assert_allclose(predictions[0], expected, rtol=1e-5, atol=1e-6)


def test_carried_states_run_on_from_batch_to_batch(tmp_path: Path) -> None:
    xs, labels = data(2 * B)
    carried = module(states="carry", optimizer=braintools.optim.SGD(lr=0.0))
    trainer(tmp_path).fit(carried, loader(xs, labels))

    reset = module(optimizer=braintools.optim.SGD(lr=0.0))
    learner = reset.build((xs[:B], labels[:B]))
    learner.reset()
    for start in (0, B):
        learner.etrace_evolve(jnp.asarray(xs[start:start + B]), time_axis=1)
    for p, st in carried.learner.hidden_states.items():
        np.testing.assert_allclose(st.value, learner.hidden_states[p].value, rtol=1e-6, atol=1e-7)


def test_a_nan_target_skips_the_update_and_names_the_target(tmp_path: Path) -> None:
    xs, labels = data()
    targets = labels.astype(np.float32)
    targets[B + 1] = np.nan  # the second batch

    def loss(out: Any, y: Any) -> Any:
        return cross_entropy(out, jnp.nan_to_num(y).astype(jnp.int32)) + 0.0 * jnp.sum(y)

    record = AfterEachStep()
    m = OnlineModule(LeakyRNN(), "d_rtrl", loss=loss, optimizer=braintools.optim.Adam(lr=LR))
    with pytest.warns(braintrace.NonFiniteWarning, match=r"batch 1: the target went non-finite"):
        trainer(tmp_path, callbacks=[record]).fit(m, loader(xs, targets))
    assert m.skipped_batches == [(0, 1, "target")]
    for p, w in record.weights[0].items():  # the update of batch 1 was not applied
        np.testing.assert_array_equal(record.weights[1][p], w)
    assert not np.array_equal(record.weights[2][next(iter(record.weights[2]))],
                              record.weights[1][next(iter(record.weights[1]))])
    # Adam's state was put back too: the run equals one that never saw batch 1.
    keep = np.r_[0:B, 2 * B:N]
    clean = OnlineModule(LeakyRNN(), "d_rtrl", loss=loss, optimizer=braintools.optim.Adam(lr=LR))
    trainer(tmp_path).fit(clean, loader(xs[keep], targets[keep]))
    for p, w in weights(clean).items():
        np.testing.assert_array_equal(record.weights[-1][p], w)


def test_early_stopping_and_checkpoints(tmp_path: Path) -> None:
    stop = braintools.trainer.EarlyStopping(monitor="val_loss", patience=0, min_delta=1e9)
    checkpoints = braintools.trainer.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss")
    fit = trainer(tmp_path, epochs=5, callbacks=[stop, checkpoints])
    fit.fit(module(), loader(), loader(*data(6), batch_size=6))
    assert fit.current_epoch == 1  # stopped after the patience ran out
    assert any((tmp_path / "ckpt").iterdir())


def test_time_major_batches(tmp_path: Path) -> None:
    def time_major(samples: list[tuple[np.ndarray, ...]]) -> tuple[jax.Array, ...]:
        xs, labels = zip(*samples)
        return jnp.stack(xs, axis=1), jnp.asarray(labels)

    batch = next(iter(loader()))
    swapped = (jnp.swapaxes(jnp.asarray(batch[0]), 0, 1), batch[1])
    g1 = module(time_axis=1).online_gradients(batch)[0]
    g0 = module(time_axis=0).online_gradients(swapped)[0]
    for p in g1:
        np.testing.assert_array_equal(g0[p], g1[p])
    xs, labels = data()
    time_major_loader = braintools.trainer.DataLoader((xs, labels), batch_size=B, drop_last=True,
                                                      collate_fn=time_major)
    trainer(tmp_path).fit(module(time_axis=0), time_major_loader)


def test_mistakes_are_refused_with_the_fix_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="targets must be one of"):
        module(targets="label")
    with pytest.raises(ValueError, match="time_axis must be 0"):
        module(time_axis=2)
    with pytest.raises(ValueError, match="states must be one of"):
        module(states="keep")
    with pytest.raises(TypeError, match="optimizer must be a braintools.optim optimizer"):
        module(optimizer="adam")
    with pytest.raises(RuntimeError, match=r"module.build\(batch\)"):
        module().learner
    with pytest.raises(ValueError, match="mask must be None"):
        module(mask="first")
    net = LeakyRNN()
    compiled = braintrace.compile(net, "d_rtrl", jnp.zeros((B, I)), batch_size=B)
    assert OnlineModule(net, compiled, loss=cross_entropy, optimizer=braintools.optim.SGD(lr=LR)).learner is compiled
    assert module(braintrace.D_RTRL).build(data(B)) is not None  # a class is compiled, not taken as a learner
    with pytest.raises(ValueError, match="compiled for another model"):
        OnlineModule(LeakyRNN(), compiled, loss=cross_entropy, optimizer=braintools.optim.SGD(lr=LR))
    per_sample = OnlineModule(LeakyRNN(), "d_rtrl", loss=braintools.metric.softmax_cross_entropy_with_integer_labels,
                              optimizer=braintools.optim.SGD(lr=LR))
    with pytest.raises(ValueError, match=r"one number per step .* got shape \(4,\)"):
        per_sample.online_gradients(data(B))
    xs, labels = data(N + 1)
    partial = braintools.trainer.DataLoader((xs, labels), batch_size=B)
    with pytest.raises(ValueError, match="drop_last=True"):
        trainer(tmp_path).fit(module(), partial)


def test_one_compiled_training_step_for_every_batch(tmp_path: Path) -> None:
    class Counting(OnlineModule):
        traces = 0

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            Counting.traces += 1  # Python runs only while the Trainer traces the step
            return super().training_step(batch, batch_idx)

    m = Counting(LeakyRNN(), "d_rtrl", loss=cross_entropy, optimizer=braintools.optim.Adam(lr=LR))
    trainer(tmp_path, epochs=2).fit(m, loader())
    assert Counting.traces == 1


def _state_values(m: OnlineModule) -> dict[Any, Any]:
    """Every state value of the module's learner (weights, hidden states, traces, counters)."""
    return {path: jax.tree.map(np.asarray, st.value) for path, st in brainstate.graph.states(m.learner).items()}


def _assert_same(a: dict[Any, Any], b: dict[Any, Any]) -> None:
    assert a.keys() == b.keys()
    for path in a:
        jax.tree.map(np.testing.assert_array_equal, a[path], b[path])


def test_a_module_fits_again_and_its_weights_keep_their_names(tmp_path: Path) -> None:
    # The Trainer keys the optimizer by the weights' paths in the module; compiling the learner
    # must not rename them (a second fit then found no gradient for any weight).
    m = module(optimizer=braintools.optim.Adam(lr=LR))
    names = list(m.states(brainstate.ParamState))
    trainer(tmp_path).fit(m, loader())
    assert list(m.states(brainstate.ParamState)) == names == [("model", "b"), ("model", "r"), ("model", "w")]
    first = weights(m)
    trainer(tmp_path).fit(m, loader())
    assert all(not np.array_equal(first[p], w) for p, w in weights(m).items())


class FailBeforeUpdate(braintools.trainer.Callback):
    """Raises in the Trainer's ``on_before_optimizer_step`` of training batch ``at`` (after the
    batch's gradient step has run the learner)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.calls += 1
        if self.calls == self.at + 1:
            raise RuntimeError("injected failure in a callback")


def test_a_batch_stopped_between_its_gradient_and_its_update_is_rolled_back_at_the_next_start(tmp_path: Path) -> None:
    # Carried states: batch 1 runs its forward pass, then a callback raises before the update.
    # The next fit starts from the states after batch 0 (the weights and the learner's states),
    # exactly as a run that only ever saw batch 0 before.
    m = module(states="carry", optimizer=braintools.optim.Adam(lr=LR))
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer(tmp_path, callbacks=[FailBeforeUpdate(at=1)]).fit(m, loader())
    with pytest.warns(UserWarning, match="training batch 1 did not finish"):
        trainer(tmp_path).fit(m, loader())

    clean = module(states="carry", optimizer=braintools.optim.Adam(lr=LR))
    xs, labels = data()
    trainer(tmp_path).fit(clean, loader(xs[:B], labels[:B]))
    trainer(tmp_path).fit(clean, loader())
    # Trace keys hold the id of their relation: compare the states in order.
    for a, b in zip(_state_values(m).values(), _state_values(clean).values(), strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("stage", ["loss", "optimizer update"])
def test_a_failed_training_step_leaves_the_learner_as_it_was_and_the_module_usable(stage: str, tmp_path: Path) -> None:
    failing = {"on": True}

    def loss(out: Any, label: Any) -> Any:
        if failing["on"] and stage == "loss":
            raise RuntimeError("injected failure in the loss")
        return cross_entropy(out, label)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        if failing["on"] and stage == "optimizer update":
            raise RuntimeError("injected failure in the optimizer")
        return jax.tree.map(lambda g: -LR * g, updates), state

    import optax

    sgd = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    m = OnlineModule(LeakyRNN(), "d_rtrl", loss=loss, optimizer=sgd)
    m.build(next(iter(loader())))
    m.learner.reset()
    before, weights_before = _state_values(m), weights(m)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer(tmp_path).fit(m, loader())
    if stage == "loss":
        _assert_same(_state_values(m), before)
    else:
        # The Trainer ran the batch's gradient step before its optimizer step failed: the hidden
        # states and traces are those of that batch until the module starts again; the weights
        # never changed.
        _assert_same(weights(m), weights_before)

    failing["on"] = False
    with pytest.warns(UserWarning, match="training batch 0 did not finish"):
        trainer(tmp_path).fit(m, loader())
    clean = OnlineModule(LeakyRNN(), "d_rtrl", loss=loss, optimizer=optax.GradientTransformation(
        lambda params: optax.EmptyState(), update))
    trainer(tmp_path).fit(clean, loader())
    for p, w in weights(clean).items():
        np.testing.assert_array_equal(weights(m)[p], w)

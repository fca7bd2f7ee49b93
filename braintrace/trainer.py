"""Online learning as a ``braintools.trainer`` module: ``Trainer(...).fit(OnlineModule(...), loader)``.

:class:`OnlineModule` is a ``braintools.trainer.LightningModule`` that trains a network with any
learner of :func:`braintrace.compile` (``'d_rtrl'``, ``'pp_prop'``, ``'eprop'``, ... or
``'bptt'``, the exact reference) inside the unmodified ``braintools.trainer.Trainer``: its
progress bar, loggers, callbacks, checkpoints, gradient clipping, accumulation and early
stopping all apply. Each training batch is one jitted program: reset the network (or carry its
states, for streams), run the learner's sequence driver ``etrace_grad`` over the batch, and hand
the learner's gradient to the Trainer's optimizer.

The Trainer differentiates the loss ``training_step`` returns with respect to every parameter;
its training step has no hook for a gradient computed another way, and overriding its private
step builder would tie this module to one braintools release. The module therefore returns the
learner's loss plus a term whose value is exactly ``0`` and whose derivative in each parameter
is, by a ``jax.custom_jvp`` rule, the learner's gradient for it: the Trainer's ``grad`` yields
that gradient unchanged (the learner runs on ``stop_gradient`` copies of the parameters, so the
Trainer never differentiates through it) and the logged loss is the learner's loss.

Evaluation (``validate``, ``test``, ``predict``) runs the trained network forward with
``learner.predict`` at whatever batch size the loader yields, from fresh states, without
traces: no padding and no new ``compile``. Training batches share the batch size the learner
is compiled for (a loader whose last batch is smaller needs ``drop_last=True``; refused at
``fit`` otherwise).

A batch whose input, target, weights, loss, gradient or learner states are not finite is not
applied: the weights, the optimizer's state and the learner's states are put back as they were
before it, and a :class:`~braintrace.NonFiniteWarning` names what went non-finite first, the
epoch and the batch (``check_finite=True``, the default; the check runs inside the jitted step).

Examples
--------
>>> import braintools, brainstate, jax.numpy as jnp, numpy as np, braintrace
>>> from braintrace.trainer import OnlineModule, accuracy
>>> class Net(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.rnn = braintrace.nn.ValinaRNNCell(4, 8)
...         self.out = braintrace.nn.Linear(8, 3)
...     def update(self, x):
...         return self.out(self.rnn(x))
>>> rng = np.random.default_rng(0)
>>> xs = rng.normal(size=(16, 5, 4)).astype(np.float32)  # 16 sequences of 5 steps
>>> labels = rng.integers(0, 3, size=16)
>>> def cross_entropy(logits, labels):  # the loss of one step, averaged over the batch
...     return jnp.mean(braintools.metric.softmax_cross_entropy_with_integer_labels(logits, labels))
>>> module = OnlineModule(Net(), 'd_rtrl', loss=cross_entropy, optimizer=braintools.optim.Adam(lr=1e-2),
...                       metrics={'acc': accuracy})
>>> trainer = braintools.trainer.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
...                                      enable_checkpointing=False)
>>> loader = braintools.trainer.DataLoader((xs, labels), batch_size=8, drop_last=True)
>>> trainer.fit(module, loader)
>>> outputs = module.learner.predict(xs[:3], time_axis=1)  # any batch size
>>> outputs.shape
(3, 5, 3)
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeGuard, Union

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from braintrace._algorithm import ETraceAlgorithm, ETraceConfig
from braintrace._algorithm.drive.finite import WHAT, Status, advance, all_finite
from braintrace._algorithm.drive.layout import checked_time_axis
from braintrace._compile import Learner, compile as compile_learner
from braintrace._algorithm.engine.rule_contract import GroupRule
from braintrace._algorithm.rules.trace_rule import TraceRule
from braintrace._errors import NonFiniteWarning, non_finite_advice
from braintrace._typing import Path, PyTree

if TYPE_CHECKING:
    import optax

__all__ = ["OnlineModule", "accuracy"]

#: ``loss(output, target) -> scalar``: the loss of one step, averaged over the batch.
LossFn = Callable[[PyTree, PyTree], jax.Array]
#: ``metric(outputs, targets) -> scalar``: ``outputs`` time-major ``(T, B, ...)``.
MetricFn = Callable[[PyTree, PyTree], jax.Array]
#: What :class:`OnlineModule` trains with: a learner to compile (as :func:`braintrace.compile`
#: takes it) or a compiled one.
LearnerSpec = Union[str, type[ETraceAlgorithm], ETraceConfig, TraceRule, GroupRule, Learner]
#: A batch of a ``DataLoader``: ``(inputs, targets)``, batch-major or time-major (``time_axis``).
Batch = Union[tuple[PyTree, PyTree], list[PyTree]]
#: A state and the value it held when saved.
Saved = tuple[brainstate.State, PyTree]

_TARGETS = ("sequence", "step")
_STATES = ("reset", "carry")


def accuracy(outputs: jax.Array, labels: jax.Array) -> jax.Array:
    """The fraction of sequences whose summed output over time peaks at the label.

    Parameters
    ----------
    outputs : array
        Time-major per-step outputs ``(T, B, C)`` (logits, spike counts, ...).
    labels : array
        Integer labels ``(B,)``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> outputs = jnp.asarray([[[1., 0.], [0., 1.]], [[1., 0.], [1., 0.]]])  # T=2, B=2, C=2
    >>> float(accuracy(outputs, jnp.asarray([0, 1])))
    0.5
    """
    return jnp.mean(jnp.argmax(jnp.sum(outputs, axis=0), axis=-1) == labels)


@jax.custom_jvp
def _zero_with_slope(value: jax.Array, slope: jax.Array) -> jax.Array:
    """Exactly ``0``; its derivative in ``value`` is ``slope`` (``slope`` itself is a constant)."""
    return jnp.zeros((), value.dtype)


@_zero_with_slope.defjvp
def _zero_with_slope_jvp(
    primals: tuple[jax.Array, jax.Array], tangents: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    value, slope = primals
    value_dot, _ = tangents
    return jnp.zeros((), value.dtype), jnp.sum(jax.lax.stop_gradient(slope).astype(value.dtype) * value_dot)


class OnlineModule(braintools.trainer.LightningModule):
    """A ``braintools.trainer`` module that trains ``model`` with an online learner (or BPTT).

    Parameters
    ----------
    model : brainstate.nn.Module
        The network: one call is one time step, ``model(x_t) -> output_t``.
    learner : str or type or learner, default ``'d_rtrl'``
        A learner name or class of :func:`braintrace.compile` (``'bptt'`` for the exact
        reference), compiled on the first batch; or a learner already compiled for ``model``.
    loss : callable
        ``loss(output_t, target_t) -> scalar``, the loss of one step (mean over the batch).
    optimizer : braintools.optim optimizer or optax.GradientTransformation
        The optimizer the Trainer steps (``configure_optimizers`` returns it).
    targets : {'sequence', 'step'}
        ``'sequence'``: one target per sequence, ``(B, ...)``, scored at every step of it;
        ``'step'``: one target per step, laid out like the inputs.
    mask : None, 'last' or array
        Per-step loss weights ``(T,)``: every step (``None``), only the last one, or given.
    metrics : dict, optional
        ``name -> metric(outputs, targets)`` logged in training and evaluation, with
        ``outputs`` time-major ``(T, B, ...)`` (for example :func:`accuracy`).
    states : {'reset', 'carry'}
        ``'reset'``: every training batch starts from fresh states (sequence batches);
        ``'carry'``: the states run on from batch to batch (one long stream cut in batches).
        Evaluation always starts from fresh states.
    time_axis : {1, 0}
        The inputs' (and per-step targets') time axis: ``1`` for the ``(B, T, ...)`` batches a
        ``DataLoader`` stacks from ``(T, ...)`` samples, ``0`` for time-major batches.
    reduction : {'mean', 'sum'}
        The training objective over steps: divided by the total mask weight, or not.
    check_finite : bool
        Skip (and report) a training batch with a non-finite input, target, weight, loss,
        gradient or learner state; default ``True``.
    **compile_options
        Passed to :func:`braintrace.compile` (``vjp_method``, ``vmap``, learner options, ...).

    Attributes
    ----------
    skipped_batches : list of (epoch, batch_idx, what)
        The training batches whose update was skipped by the non-finite check.

    Examples
    --------
    >>> import braintools, jax.numpy as jnp, braintrace
    >>> from braintrace.trainer import OnlineModule
    >>> module = OnlineModule(braintrace.nn.ValinaRNNCell(3, 4), 'bptt', targets='step',
    ...                       loss=lambda out, y: jnp.mean((out - y) ** 2), optimizer=braintools.optim.SGD(lr=0.1))
    >>> batch = (jnp.ones((2, 5, 3)), jnp.zeros((2, 5, 4)))  # 2 sequences of 5 steps, batch-major
    >>> grads, loss = module.online_gradients(batch)  # what a training step applies
    >>> module.learner.batch_size, grads[('W', 'weight')]['weight'].shape
    (2, (7, 4))
    """

    #: brainstate's graph walks the module through ``model`` only, so the Trainer names the weights
    #: ``('model', ...)`` in every fit: the learner (which holds the model too) and the snapshots of
    #: states would otherwise come first (their names sort before ``'model'``).
    graph_invisible_attrs = ("_learner", "_unfinished", "_restore_after_batch", "_restore_after_update")

    def __init__(
        self,
        model: brainstate.nn.Module,
        learner: LearnerSpec = "d_rtrl",
        *,
        loss: LossFn,
        optimizer: braintools.optim.Optimizer | optax.GradientTransformation,
        targets: str = "sequence",
        mask: str | ArrayLike | None = None,
        metrics: Mapping[str, MetricFn] | None = None,
        states: str = "reset",
        time_axis: int = 1,
        reduction: str = "mean",
        check_finite: bool = True,
        **compile_options: Any,
    ) -> None:
        super().__init__()
        _check_choice("targets", targets, _TARGETS)
        _check_choice("states", states, _STATES)
        time_axis = checked_time_axis("OnlineModule", time_axis)
        _check_choice("reduction", reduction, ("mean", "sum"))
        if not callable(loss):
            raise TypeError(f"OnlineModule: loss must be a function loss(output_t, target_t) -> scalar, got {loss!r}.")
        if not isinstance(check_finite, bool):
            raise TypeError(f"OnlineModule: check_finite must be True or False, got {check_finite!r}.")
        self.model = model
        self.loss = loss
        self.optimizer = _optimizer(optimizer)
        self.targets = targets
        self.mask = mask
        self.metrics = dict(metrics or {})
        self.states_mode = states
        self.time_axis = time_axis
        self.reduction = reduction
        self.check_finite = check_finite
        self.skipped_batches: list[tuple[int, int, str]] = []
        self._learner_spec = learner
        self._compile_options = compile_options
        self._learner: Learner | None = learner if _is_compiled_learner(learner) else None
        if self._learner is not None and _compiled_model(self._learner) is not model:
            raise ValueError(
                "OnlineModule: the learner given was compiled for another model than the one given; pass "
                "the model it was compiled for, or a learner name to compile for this model."
            )
        if not (mask is None or (isinstance(mask, str) and mask == "last") or np.ndim(mask) == 1):
            raise ValueError(
                f"OnlineModule: mask must be None (every step), 'last' (the last step only) or a (T,) array "
                f"of per-step loss weights, got {mask!r}."
            )
        self._nonfinite = brainstate.ShortTermState(jnp.zeros((), jnp.int32))
        self._batch_idx = 0
        self._restore_after_batch: list[Saved] = []
        self._restore_after_update: list[Saved] = []
        self._pending: list[tuple[int, int, str]] = []
        #: The training batch that started and has not ended, with the learner's states before it.
        self._unfinished: tuple[int, list[Saved]] | None = None

    # ------------------------------------------------------------------ the learner

    @property
    def learner(self) -> Learner:
        """The compiled learner (compiled on the first batch, or by :meth:`build`)."""
        if self._learner is None:
            raise RuntimeError(
                "OnlineModule: the learner is compiled on the first training batch; call "
                "module.build(batch) with an example batch to compile it before."
            )
        return self._learner

    def build(self, batch: Batch) -> Learner:
        """Compile the learner for batches like ``batch`` (``(inputs, targets)``); returns it.

        The learner is compiled at the batch size of ``batch``, from its first time step.
        A module built from an already compiled learner returns it unchanged.
        """
        if self._learner is None:
            xs = self._inputs(batch)
            first = jax.tree.map(lambda leaf: jnp.take(jnp.asarray(leaf), 0, axis=self.time_axis), xs)
            batch_size = _batch_size(xs, self.time_axis)
            self._learner = compile_learner(
                self.model, self._learner_spec, first, batch_size=batch_size, **self._compile_options
            )
        return self._learner

    # ------------------------------------------------------------------ training

    def configure_optimizers(self) -> braintools.optim.Optimizer:
        return self.optimizer

    def training_step(self, batch: Batch, batch_idx: int) -> dict[str, jax.Array]:
        """The learner's loss on ``batch``; its derivative is the learner's gradient."""
        xs, ys = self._split(batch)
        params = self.learner.param_states
        live = {path: st.value for path, st in params.items()}
        for path, st in params.items():
            st.value = jax.lax.stop_gradient(live[path])
        try:
            grads, loss, outputs = self._learner_gradients(xs, ys)
        finally:
            for path, st in params.items():
                st.value = live[path]
        if self.check_finite:
            self._nonfinite.value = self._first_nonfinite(xs, ys, live, loss, grads)
        for name, metric in self.metrics.items():
            self.log(name, metric(outputs, self._time_major_targets(ys)), prog_bar=True)
        carried = sum(
            (_zero_with_slope(value, slope)
             for path in grads
             for value, slope in zip(jax.tree.leaves(live[path]), jax.tree.leaves(grads[path]))),
            jnp.zeros((), jnp.result_type(loss)),
        )
        return {"loss": jax.lax.stop_gradient(loss) + carried}

    def online_gradients(self, batch: Batch) -> tuple[dict[Path, PyTree], jax.Array]:
        """``(grads, loss)`` of ``batch`` as :meth:`training_step` takes them, outside the Trainer.

        Runs the same reset (``states='reset'``) and ``etrace_grad`` call, and leaves the
        learner's states as that call does.
        """
        self.build(batch)
        grads, loss, _ = self._learner_gradients(*self._split(batch))
        return grads, loss

    def _learner_gradients(self, xs: PyTree, ys: PyTree) -> tuple[dict[Path, PyTree], jax.Array, PyTree]:
        """``(grads, loss, per-step outputs)``: the reset (``states='reset'``) and ``etrace_grad`` of a batch."""
        learner = self.learner
        if self.states_mode == "reset":
            learner.reset()
        return learner.etrace_grad(
            *self._sequences(xs, ys), step_fn=self._step_fn(ys), mask=self._mask(xs),
            reduction=self.reduction, loss_output="scalar", return_value=True, has_aux=True,
            time_axis=self.time_axis,
        )

    def training_memory(self, batch: Batch) -> int:
        """Bytes XLA allocates for one training step on batches like ``batch`` (nothing runs).

        The compiled program of :meth:`online_gradients`: its temporaries plus its arguments
        (weights, states, traces and the batch), as ``memory_analysis`` of the compiled step
        reports them on the default device. The learner's states are not changed.
        """
        self.build(batch)
        stats = brainstate.transform.jit(self.online_gradients).lower(batch).compile().memory_analysis()
        return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes)

    # ------------------------------------------------------------------ evaluation

    def validation_step(self, batch: Batch, batch_idx: int) -> dict[str, jax.Array]:
        """The training objective and the metrics of ``batch``, at its batch size, from fresh states."""
        xs, ys = self._split(batch)
        outputs = self._time_major(self.learner.predict(xs, time_axis=self.time_axis))
        targets = self._time_major_targets(ys)
        losses = jax.vmap(self.loss, in_axes=(0, 0 if self.targets == "step" else None))(outputs, targets)
        mask = self._mask(xs)
        weights = jnp.ones_like(losses) if mask is None else mask
        objective = jnp.sum(weights * losses)
        if self.reduction == "mean":
            objective = objective / jnp.maximum(jnp.sum(weights), 1.0)
        result = {"loss": objective}
        result.update({name: metric(outputs, targets) for name, metric in self.metrics.items()})
        return result

    def test_step(self, batch: Batch, batch_idx: int) -> dict[str, jax.Array]:
        """As :meth:`validation_step`."""
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Batch | PyTree, batch_idx: int) -> PyTree:
        """The per-step outputs of ``batch``'s inputs (laid out like them), from fresh states."""
        xs = self._inputs(batch)
        return self.learner.predict(xs, time_axis=self.time_axis)

    # ------------------------------------------------------------------ hooks: batch sizes, non-finite batches

    def on_fit_start(self) -> None:
        self._roll_back_unfinished_batch()
        loader = getattr(self.trainer, "train_dataloader", None)
        size, drop_last = getattr(loader, "batch_size", None), getattr(loader, "drop_last", True)
        dataset = getattr(loader, "dataset", None)
        if isinstance(size, int) and not drop_last and dataset is not None and len(dataset) % size:
            raise ValueError(
                f"OnlineModule: the training loader's last batch holds {len(dataset) % size} sequences, "
                f"not {size}: a learner trains at the one batch size it is compiled for. Pass "
                f"drop_last=True to the training DataLoader (validation, test and predict run at "
                f"any batch size)."
            )

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        learner = self.build(batch)
        size = _batch_size(self._inputs(batch), self.time_axis)
        if learner.batch_size is not None and size != learner.batch_size:
            raise ValueError(
                f"OnlineModule: training batch {batch_idx} holds {size} sequences, but the learner "
                f"trains at batch size {learner.batch_size}. Give every training batch that size "
                f"(DataLoader(..., drop_last=True)); evaluation runs at any batch size."
            )
        self._batch_idx = batch_idx
        _strongly_typed([*brainstate.graph.states(self).values(), *brainstate.graph.states(learner).values()])
        self._unfinished = (batch_idx, _snapshot(list(brainstate.graph.states(learner).values())))
        if self.check_finite:
            self._restore_after_batch = _snapshot(_non_param_states(learner))

    def on_train_batch_end(self, outputs: dict[str, jax.Array], batch: Batch, batch_idx: int) -> None:
        self._unfinished = None

    def _roll_back_unfinished_batch(self) -> None:
        """Put back the learner's states a batch that never ended had changed (an exception stopped it).

        The Trainer offers no hook for an exception: a failure between the gradient step and the
        optimizer step (in a callback, in the optimizer's update) leaves the learner's hidden
        states and traces at that batch's forward pass, the weights and the optimizer's state as
        they were. The next fit of this module starts from the learner's states before the failed
        batch instead (the Trainer sets the optimizer up afresh for every fit).
        """
        if self._unfinished is None:
            return
        batch_idx, saved = self._unfinished
        self._unfinished = None
        _restore(saved)
        warnings.warn(
            f"OnlineModule: training batch {batch_idx} did not finish (an exception stopped it); the "
            f"learner's weights and states are put back as they were before it.",
            UserWarning, stacklevel=3,
        )

    def on_after_backward(self) -> None:
        if not self.check_finite:
            return
        code = int(self._nonfinite.value)
        if code:
            _restore(self._restore_after_batch)
            self._pending.append((self.current_epoch, self._batch_idx, WHAT[code - 1]))
            self._nonfinite.value = jnp.zeros((), jnp.int32)

    def on_before_optimizer_step(self, optimizer: braintools.optim.Optimizer) -> None:
        if self.check_finite and self._pending:
            states = [*self.learner.param_states.values(), *brainstate.graph.states(optimizer).values()]
            self._restore_after_update = _snapshot(states)

    def on_after_optimizer_step(self, optimizer: braintools.optim.Optimizer) -> None:
        if not self._pending:
            return
        _restore(self._restore_after_update)
        for epoch, batch_idx, what in self._pending:
            warnings.warn(
                f"OnlineModule: epoch {epoch}, training batch {batch_idx}: the {what} went non-finite "
                f"(NaN or infinity) first; the update was skipped, the weights, the optimizer's state "
                f"and the learner's states are as before it. {non_finite_advice(what)}",
                NonFiniteWarning, stacklevel=2,
            )
        self.skipped_batches.extend(self._pending)
        self._pending = []

    # ------------------------------------------------------------------ helpers

    def _step_fn(self, ys: PyTree) -> Callable[..., tuple[jax.Array, PyTree]]:
        learner, user_loss = self.learner, self.loss

        def loss(out: PyTree, y: PyTree) -> jax.Array:
            value = user_loss(out, y)
            if np.shape(value) != ():
                raise ValueError(
                    f"OnlineModule: loss(output, target) must return one number per step (the mean over "
                    f"the batch), got shape {np.shape(value)}; reduce it, e.g. "
                    f"loss=lambda out, y: jnp.mean(per_sample_loss(out, y))."
                )
            return value
        if self.targets == "step":
            def per_step(x: PyTree, y: PyTree) -> tuple[jax.Array, PyTree]:
                out = learner(x)
                return loss(out, y), out
            return per_step

        def per_sequence(x: PyTree) -> tuple[jax.Array, PyTree]:
            out = learner(x)
            return loss(out, ys), out
        return per_sequence

    def _sequences(self, xs: PyTree, ys: PyTree) -> tuple[PyTree, ...]:
        return (xs, ys) if self.targets == "step" else (xs,)

    def _mask(self, xs: PyTree) -> jax.Array | None:
        if self.mask is None:
            return None
        length = jax.tree.leaves(xs)[0].shape[self.time_axis]
        if isinstance(self.mask, str):
            return jnp.zeros(length).at[-1].set(1.0)
        return jnp.asarray(self.mask)

    def _first_nonfinite(
        self, xs: PyTree, ys: PyTree, weights: dict[Path, PyTree], loss: jax.Array, grads: dict[Path, PyTree],
    ) -> jax.Array:
        checks = {
            "input": all_finite(xs), "target": all_finite(ys), "weight": all_finite(weights),
            "loss": all_finite(loss), "gradient": all_finite(grads),
            "trace": all_finite([st.value for st in _non_param_states(self.learner)]),
        }
        return advance(Status.fresh(), 0, checks).code

    def _split(self, batch: object) -> tuple[PyTree, PyTree]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"OnlineModule: a training or evaluation batch must be a pair (inputs, targets), got "
                f"{type(batch).__name__}; build the DataLoader from (inputs, targets) arrays."
            )
        return _stacked(batch[0]), _stacked(batch[1])

    def _inputs(self, batch: Batch | PyTree) -> PyTree:
        return _stacked(batch[0] if isinstance(batch, (tuple, list)) else batch)

    def _time_major(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda leaf: jnp.moveaxis(leaf, self.time_axis, 0), tree)

    def _time_major_targets(self, ys: PyTree) -> PyTree:
        return self._time_major(ys) if self.targets == "step" else ys


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"OnlineModule: {name} must be one of {tuple(allowed)}, got {value!r}.")


def _optimizer(optimizer: object) -> braintools.optim.Optimizer:
    import optax

    if isinstance(optimizer, optax.GradientTransformation):
        return braintools.optim.OptaxOptimizer(tx=optimizer)
    if not isinstance(optimizer, braintools.optim.Optimizer):
        raise TypeError(
            f"OnlineModule: optimizer must be a braintools.optim optimizer (braintools.optim.Adam(lr=1e-3), "
            f"...) or an optax.GradientTransformation, got {type(optimizer).__name__}."
        )
    return optimizer


def _batch_size(xs: PyTree, time_axis: int) -> int:
    leaf = jax.tree.leaves(xs)[0]
    if np.ndim(leaf) < 2:
        raise ValueError(
            f"OnlineModule: inputs need a batch and a time axis, got shape {np.shape(leaf)}; a "
            f"DataLoader over (N, T, ...) inputs yields (B, T, ...) batches (time_axis=1)."
        )
    return int(np.shape(leaf)[1 - time_axis])


def _is_compiled_learner(learner: LearnerSpec) -> TypeGuard[Learner]:
    """Whether ``learner`` is a learner (what :func:`braintrace.compile` returns), not a spec to compile."""
    return not isinstance(learner, type) and hasattr(learner, "etrace_grad") and hasattr(learner, "predict")


def _compiled_model(learner: Learner) -> brainstate.nn.Module | None:
    """The model a compiled learner (or the learner a vmap wraps) runs."""
    inner = getattr(learner, "module", learner)
    return getattr(inner, "model4compile", None)


def _stacked(part: PyTree) -> PyTree:
    """``part``, with a tuple or list of scalars stacked into one array.

    ``braintools.trainer``'s default collate function leaves NumPy scalars (integer labels
    from a NumPy array) as a tuple of per-sample scalars.
    """
    if isinstance(part, (tuple, list)) and part and all(np.ndim(x) == 0 for x in part):
        return jnp.stack([jnp.asarray(x) for x in part])
    return part


def _strongly_typed(states: Iterable[brainstate.State]) -> None:
    """Give weakly typed values (Python scalars, weak-typed arrays) of ``states`` a fixed dtype.

    The first update makes them strongly typed (an optimizer's step counter starts as a Python
    int; some initialisers make weak-typed biases), so the jitted training step would compile a
    second time on the second batch.
    """
    for st in states:
        if any(_weak(leaf) for leaf in jax.tree.leaves(st.value)):
            st.value = jax.tree.map(lambda leaf: jnp.array(leaf, dtype=jnp.result_type(leaf)) if _weak(leaf) else leaf,
                                    st.value)


def _weak(leaf: object) -> bool:
    return isinstance(leaf, (bool, int, float, complex)) or bool(getattr(leaf, "weak_type", False))


def _non_param_states(learner: Learner) -> list[brainstate.State]:
    return [st for st in brainstate.graph.states(learner).values() if not isinstance(st, brainstate.ParamState)]


def _snapshot(states: Sequence[brainstate.State]) -> list[Saved]:
    return [(st, st.value) for st in states]


def _restore(saved: list[Saved]) -> None:
    for st, value in saved:
        st.value = value

"""The scan of ``etrace_grad`` and ``etrace_train``: :class:`GradRun`, the sum of a learner's per-call estimates.

For each call ``c`` (a step, or a window of ``k`` steps) the learner's online estimate ``ĝ_c`` of
the gradient of ``J_c = Σ_{t in call c} mask_t · loss_t`` is taken with
``brainstate.transform.grad`` inside ``brainstate.transform.scan``, and the scan carries
``Σ_c ĝ_c``. Under ``check_finite`` the carry also holds the non-finite status, and every update
from the first non-finite step on is discarded (:mod:`braintrace._algorithm.drive.finite`). A learner
that rolls traces in the backward pass gets a sink for them here, and one that rolls them over
a group of calls at once gets its calls in groups: a scan over the groups, each a scan over its
calls followed by the group's roll (:mod:`braintrace._algorithm.carriers.backward_roll`).
"""

from __future__ import annotations

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.drive.host import Grads, RollSink, SequenceHost, StepFn
from braintrace._algorithm.drive.finite import Status, StateGuard, advance, all_finite
from braintrace._typing import Path, PyTree

__all__ = ["GradRun", "windows", "zeros_like"]


class GradRun:
    """The :class:`~braintrace._algorithm.drive.host.SequenceRun` of an online learner: ``(Σ_c ĝ_c, losses, aux)``.

    Parameters
    ----------
    call : str
        The driver's name, for error messages.
    step_fn : callable
        ``step_fn(*slices) -> loss`` (``(loss, aux)`` with ``has_aux``), calling the learner once.
    weights : dict
        ``path -> ParamState`` to differentiate.
    window : int or None
        The window length ``k`` (``None``: one step per call).
    has_aux : bool
        ``step_fn`` returns ``(loss, aux)``.
    host : SequenceHost
        The learner driven.
    guarded : list of State, optional
        Under ``check_finite``, the states frozen after a non-finite step (``None``: unchecked).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> run = GradRun('example', lambda x: jnp.sum(learner(x)), dict(learner.param_states), None, False, learner)
    >>> grads, losses, aux, status = run((jnp.ones((5, 3)),), jnp.ones(5), jnp.arange(5))
    >>> grads[('W', 'weight')]['weight'].shape, losses.shape, aux, status
    ((7, 4), (5,), None, None)
    """

    def __init__(
        self, call: str, step_fn: StepFn, weights: dict[Path, brainstate.ParamState], window: int | None,
        has_aux: bool, host: SequenceHost, guarded: list[brainstate.State] | None = None,
    ) -> None:
        self.call = call
        self.step_fn = step_fn
        self.weights = weights
        self.window = window
        self.has_aux = has_aux
        self.host = host
        self.guarded = guarded  # check_finite: the states frozen after a non-finite step

    def __call__(
        self, sequences: tuple[PyTree, ...], mask: jax.Array, steps: jax.Array, status: Status | None = None
    ) -> tuple[Grads, jax.Array, PyTree, Status | None]:
        """The summed estimate, losses and aux; and the status, checked from ``status`` on."""
        xs = windows(sequences, self.window)
        mask_rows = mask if self.window is None else mask.reshape((-1, self.window))
        zeros = {path: zeros_like(st.value) for path, st in self.weights.items()}
        if self.guarded is None:
            group = 1 if self.window is not None else self.host._seq_calls_per_roll(int(np.shape(mask)[0]))
            if group > 1:
                grads, losses, aux = self._grouped(xs, mask_rows, zeros, group)
                return grads, losses, aux, None
            grads, (losses, aux) = brainstate.transform.scan(self._body, zeros, (xs, mask_rows))
            return grads, losses, aux, None
        starts = steps if self.window is None else steps[:: self.window]
        carry = (zeros, Status.fresh() if status is None else status)
        (grads, status), (losses, aux) = brainstate.transform.scan(self._checked_body, carry, (xs, mask_rows, starts))
        return grads, losses, aux, status

    def _grad(
        self, slices: tuple[PyTree, ...], w: jax.Array, grouped: bool = False,
    ) -> tuple[Grads, tuple[jax.Array, PyTree], RollSink | None]:
        """One call's estimate and ``(loss, aux)``; and, ``grouped``, what its backward pass
        returned of the traces the learner rolls over the group (``None``: no sink)."""

        def objective(*sink: RollSink) -> tuple[jax.Array, tuple[jax.Array, PyTree]]:
            with self.host._seq_rolling_into(sink[0] if sink else None):
                loss, aux = self._loss(self.step_fn(*slices))
            return u.math.sum(w * loss), (loss, aux)

        sink = None if self.window is not None else self.host._seq_roll_sink(grouped)
        rolled = None
        if sink is None:
            grads, loss_aux = brainstate.transform.grad(objective, self.weights, has_aux=True)()
        else:
            (grads, (rolled,)), loss_aux = brainstate.transform.grad(
                objective, self.weights, argnums=(0,), has_aux=True)(sink)
            if not grouped:
                self.host._seq_write_rolled(rolled)
        self.host._seq_after_gradient(grads)
        return grads, loss_aux, rolled

    def _body(self, acc: Grads, inputs: tuple[tuple[PyTree, ...], jax.Array]) -> tuple[Grads, tuple[jax.Array, PyTree]]:
        g, loss_aux, _ = self._grad(*inputs)
        return _added(acc, g), loss_aux

    def _grouped(
        self, xs: tuple[PyTree, ...], mask: jax.Array, zeros: Grads, size: int,
    ) -> tuple[Grads, jax.Array, PyTree]:
        """The calls in groups of ``size``: each call returns its traces' factors instead of
        rolling them, and the learner rolls them once per group
        (:mod:`braintrace._algorithm.carriers.backward_roll`)."""

        def call(acc: Grads, inputs: tuple[tuple[PyTree, ...], jax.Array]) -> tuple[Grads, tuple[PyTree, ...]]:
            g, loss_aux, factors = self._grad(*inputs, grouped=True)
            return _added(acc, g), (loss_aux, factors)

        def group(acc: Grads, inputs: tuple[tuple[PyTree, ...], jax.Array]) -> tuple[Grads, tuple[jax.Array, PyTree]]:
            acc, (loss_aux, factors) = brainstate.transform.scan(call, acc, inputs)
            history = self.host._seq_roll_calls(factors)
            return _added(acc, {path: history[path] for path in acc}), loss_aux

        groups = jax.tree.map(lambda a: jnp.reshape(a, (-1, size, *np.shape(a)[1:])), (xs, mask))
        grads, (losses, aux) = brainstate.transform.scan(group, zeros, groups)
        return grads, jnp.reshape(losses, (-1,)), jax.tree.map(lambda a: jnp.reshape(a, (-1, *np.shape(a)[2:])), aux)

    def _checked_body(
        self, carry: tuple[Grads, Status], inputs: tuple[tuple[PyTree, ...], jax.Array, jax.Array]
    ) -> tuple[tuple[Grads, Status], tuple[jax.Array, PyTree]]:
        """:meth:`_body`, with every update discarded from the first non-finite step on."""
        (acc, status), (slices, w, step) = carry, inputs
        guard = StateGuard(self.guarded or ())
        entering = [st.value for st in self.weights.values()]
        g, (loss, aux), _ = self._grad(slices, w)
        checks = {**self._step_checks(slices, w, entering, loss, guard), "gradient": all_finite(g)}
        status = advance(status, step, checks)
        guard.keep_if(status.fine)
        acc = jax.tree.map(lambda a, b: jnp.where(status.fine, a + b, a), acc, g)
        return (acc, status), (loss, aux)

    @staticmethod
    def _step_checks(
        slices: tuple[PyTree, ...], w: jax.Array, entering: list[PyTree], loss: jax.Array, guard: StateGuard
    ) -> dict[str, jax.Array]:
        """What ``check_finite`` checks at a step, its gradient aside (``what -> all finite``)."""
        # The first sequence is the input; the others (targets, modulators) are named targets.
        return {"input": all_finite(slices[:1]), "target": all_finite(slices[1:]), "mask": all_finite(w),
                "weight": all_finite(entering), "loss": all_finite(loss), "trace": all_finite(guard.written())}

    def _loss(self, result: PyTree) -> tuple[jax.Array, PyTree]:
        """``(loss, aux)`` of one ``step_fn`` result, with the loss's shape checked."""
        if self.has_aux:
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TypeError(
                    f"{self.call}: has_aux=True, so step_fn must return a pair (loss, aux), got "
                    f"{_describe(result)}. Return (loss, aux), or pass has_aux=False."
                )
            loss, aux = result
        else:
            loss, aux = result, None
        shape = tuple(np.shape(loss))
        if self.window is None and shape != ():
            raise ValueError(
                f"{self.call}: with chunk_size None or 1, step_fn must return a scalar loss, got shape "
                f"{shape}. Reduce it inside step_fn (e.g. jnp.mean), or weight steps with mask."
            )
        if self.window is not None and shape != (self.window,):
            raise ValueError(
                f"{self.call}: in window mode step_fn must return one loss per step of the window: "
                f"expected shape (k,) = ({self.window},), got shape {shape}. Reduce every axis but "
                f"the window's time axis (e.g. jnp.mean(..., axis=-1)); spread a window-level "
                f"objective v as jnp.broadcast_to(v / k, (k,))."
            )
        return loss, aux


def _added(acc: Grads, g: Grads) -> Grads:
    return jax.tree.map(lambda a, b: a + b, acc, g)


def windows(sequences: tuple[PyTree, ...], window: int | None) -> tuple[PyTree, ...]:
    """The sequences, every leaf reshaped ``(T, ...) -> (T // k, k, ...)`` in window mode.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> windows((jnp.ones((6, 3)),), 2)[0].shape
    (3, 2, 3)
    """
    if window is None:
        return sequences
    return jax.tree.map(lambda a: jnp.reshape(a, (-1, window, *np.shape(a)[1:])), sequences)


def zeros_like(value: PyTree) -> PyTree:
    """Zeros shaped, typed and (for a ``brainunit`` quantity) unit-carrying like ``value``.

    Examples
    --------
    >>> import brainunit as u, jax.numpy as jnp
    >>> zeros_like({'w': jnp.ones(2) * u.mV})
    {'w': Quantity([0. 0.], "mV")}
    """
    return jax.tree.map(u.math.zeros_like, value, is_leaf=lambda x: isinstance(x, u.Quantity))


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of length {len(value)}"
    shape = getattr(value, "shape", None)
    return type(value).__name__ if shape is None else f"{type(value).__name__} of shape {tuple(shape)}"

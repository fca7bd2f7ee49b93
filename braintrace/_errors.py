"""Exception types raised by braintrace.

The operand errors inherit from two builtin exceptions each, so that code catching what JAX
itself would raise for the same mistake (a ``TypeError`` from ``dot_general`` for mismatched
contraction sizes, an ``AttributeError`` for a list operand) keeps working, while the message
names the argument, shows the value and says what to do.
"""

from __future__ import annotations

__all__ = [
    "OperandShapeError",
    "OperandTypeError",
    "ModelTypeError",
    "NotSupportedError",
    "CompilationError",
    "NonFiniteError",
    "EagerCallWarning",
    "ConcurrentCallError",
    "internal_error",
]


class OperandShapeError(ValueError, TypeError):
    """An operand of an ETP operator has a shape that does not fit the others."""


class OperandTypeError(TypeError, AttributeError):
    """An operand of an ETP operator is not an array (or a ``brainunit.Quantity``)."""


class NotSupportedError(Exception):
    """The model uses a feature the eligibility-trace compiler does not support.

    Raised, for example, when a ``ParamState`` is written inside the model step, or when the
    hidden states of one recurrently coupled group have different shapes.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> class WritesWeight(brainstate.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = brainstate.ParamState(jnp.ones(2))
    ...         self.h = brainstate.HiddenState(jnp.zeros(2))
    ...     def update(self, x):
    ...         self.w.value = 0.9 * self.w.value  # weights may not change inside a step
    ...         self.h.value = braintrace.element_wise(self.w.value) * x
    ...         return self.h.value
    >>> braintrace.compile_etrace_graph(WritesWeight(), jnp.ones(2))
    Traceback (most recent call last):
        ...
    braintrace.NotSupportedError: ...
    """


class CompilationError(Exception):
    """A model cannot be turned into an online learner (e.g. no weight reaches a hidden state).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> plain = brainstate.nn.Linear(3, 2)  # no ETP operator, no hidden state
    >>> braintrace.compile(plain, braintrace.D_RTRL, jnp.ones(3))
    Traceback (most recent call last):
        ...
    braintrace.CompilationError: No trainable weights are routed through ETP ops to a hidden state, ...
    """


class ConcurrentCallError(RuntimeError):
    """A compiled function calling a learner was called by two threads at once; the later write-back was refused.

    ``brainstate.transform.jit`` of a step that calls a learner reads the learner's states, runs
    the compiled program and writes them back. When another thread changed those states in
    between, writing back would erase its update: the call raises this instead and writes
    nothing. Hold ``learner.lock`` around the call (or give each thread its own learner).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> step = brainstate.transform.jit(lambda x: learner(x))
    >>> _ = step(jnp.ones(3))
    >>> def another_call(_):  # another thread's step lands while this call runs
    ...     handle.remove()
    ...     learner.running_index.value = learner.running_index.value + 1
    >>> handle = learner.running_index.register_hook('read', another_call)
    >>> step(jnp.ones(3))
    Traceback (most recent call last):
        ...
    braintrace.ConcurrentCallError: A compiled function that calls a learner was called from thread ...
    >>> int(learner.running_index.value)  # the other step stands, this one wrote nothing
    2
    """


class NonFiniteError(FloatingPointError, ValueError):
    """A sequence driver met a non-finite value; it stopped there (``check_finite=True``).

    Raised after the loop of :meth:`~braintrace.SequenceDriverMixin.etrace_grad`,
    ``etrace_evolve`` or ``etrace_train`` when a step produced a NaN or an infinity. The
    learner's states are left as they were after the last finite step.

    Attributes
    ----------
    call : str
        The driver that stopped (``'etrace_train'``, ...).
    step : int
        The index of the first step (along the sequences' time axis) whose value was not
        finite; in window mode, the first step of that window.
    what : str
        Which value, the first in this order: ``'input'`` (a floating leaf of the step's slice
        of the first sequence), ``'target'`` (of the other sequences' slices; ``etrace_evolve``
        names every sequence ``'input'``), ``'mask'`` (the step's mask entry), ``'weight'`` (a
        differentiated weight entering the step), ``'loss'``, ``'gradient'`` (of the step's
        loss, for a weight), ``'trace'`` (a hidden state, eligibility trace or other state the
        learner wrote in that step) or ``'update'`` (an optimizer update of ``etrace_train``,
        reported at the last step before it).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> xs = jnp.ones((5, 3)).at[2, 0].set(jnp.nan)
    >>> try:
    ...     learner.etrace_evolve(xs, check_finite=True)
    ... except braintrace.NonFiniteError as err:
    ...     print(err.step, err.what, int(learner.running_index.value))
    2 input 2
    """

    def __init__(self, call: str, step: int, what: str) -> None:
        self.call, self.step, self.what = call, step, what
        if what == "update":
            told = (f"{call}: the optimizer update after step {step} made a weight or an optimizer "
                    f"state non-finite (NaN or infinity); it was not applied, the run stopped there "
                    f"and the learner's states are left as they were after step {step}")
        else:
            kept = f"after step {step - 1}, the last finite one" if step else "before the run"
            told = (f"{call}: the {what} at step {step} is not finite (NaN or infinity); the run "
                    f"stopped there and the learner's states are left as they were {kept}")
        super().__init__(told + _NON_FINITE_ADVICE[what])


_NON_FINITE_ADVICE = {
    "input": ". Clean the data (e.g. jnp.nan_to_num) or mask it out before driving the learner.",
    "target": ". Clean the targets (e.g. jnp.nan_to_num), or give that step a mask entry of 0 and a finite target.",
    "mask": ". The mask weighs each step's loss: give finite values (0 leaves a step out).",
    "weight": (". A weight held a NaN or infinity before the step ran (set so, or left by an earlier "
               "update): restore the weights (load_checkpoint) and lower the learning rate or clip updates."),
    "loss": ". Check the loss for log(0), division by zero or overflow at that step.",
    "gradient": ". Lower the learning rate, clip gradients, or check the loss's derivative there.",
    "trace": (". Either the dynamics diverged (lower the learning rate or make the recurrence "
              "contractive) or the step made a NaN from finite inputs (an Embedding index outside "
              "[0, num_embeddings) reads a NaN row; log or sqrt of a negative value)."),
    "update": ". Lower the learning rate or clip the updates.",
}


def non_finite_advice(what: str) -> str:
    """What to do about a non-finite ``what`` (one of :data:`braintrace._algorithm.drive.finite.WHAT`)."""
    return _NON_FINITE_ADVICE[what][2:]


class NonFiniteWarning(RuntimeWarning):
    """A training batch met a non-finite value and its update was skipped.

    Issued by :class:`braintrace.trainer.OnlineModule` (``check_finite=True``) after the
    optimizer step of a window holding such a batch: the weights, the optimizer's state and the
    learner's states were put back as they were before it. The message names what went
    non-finite first (input, target, weight, loss, gradient or trace), the epoch and the batch.

    Examples
    --------
    >>> import warnings, braintrace
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error", braintrace.NonFiniteWarning)  # stop training at the first skip
    ...     issubclass(braintrace.NonFiniteWarning, RuntimeWarning)
    True
    """


class EagerCallWarning(UserWarning):
    """A learner is called step by step outside ``jit``, paying its step's tracing at every call.

    Issued once per learner, at its third eager call (``learner(x)`` in a Python loop, not under
    ``brainstate.transform.jit`` or a sequence driver), with the measured host time per call.
    An eager call traces the learner's step and dispatches it operation by operation every time;
    compiled once under ``brainstate.transform.jit``, the same step runs many times faster.

    Examples
    --------
    >>> import warnings, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter('always')
    ...     for _ in range(4):
    ...         _ = learner(jnp.ones(3))
    >>> [w.category.__name__ for w in caught]
    ['EagerCallWarning']
    """


def internal_error(what: str) -> RuntimeError:
    """The error for a broken internal invariant: a bug in braintrace, never a user mistake."""
    return RuntimeError(
        f"braintrace internal error: {what}. This is a bug in braintrace; please report it with "
        f"the code that triggered it."
    )


for _cls in (NotSupportedError, CompilationError, NonFiniteError, NonFiniteWarning, EagerCallWarning, ConcurrentCallError):
    _cls.__module__ = "braintrace"


class ModelTypeError(TypeError, AssertionError):
    """The object given as a model is not a ``brainstate.nn.Module``."""

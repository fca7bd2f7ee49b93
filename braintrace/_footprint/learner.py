"""``learner_memory``: how much memory one training step of a compiled learner needs, before a run.

The learner's traces, parameters and states are counted (:mod:`braintrace._footprint.inventory`)
and one online training step is compiled by XLA, not run (:mod:`braintrace._footprint.step_memory`).
This sits below the learners (``ETraceAlgorithm.memory`` calls it): it reads a learner through
:class:`~braintrace._typing.LearnerLike` and imports none of them.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> from braintrace._footprint import learner_memory
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones(3))
>>> learner_memory(learner, jnp.ones(3)).steps  # one time step, whatever the sequence length
1
"""

from __future__ import annotations

from braintrace._footprint.estimate import MemoryEstimate
from braintrace._footprint.inventory import algorithm_of, state_bytes
from braintrace._footprint.step_memory import OnlineLearner, online_step_memory
from braintrace._typing import PyTree

__all__ = ["learner_memory"]


def learner_memory(learner: OnlineLearner, *example_inputs: PyTree) -> MemoryEstimate:
    """How much memory one training step of an already compiled learner needs (no step runs).

    The same figures as a row of :func:`~braintrace.estimate_memory`, for the learner as it is:
    its traces, parameters and states, and XLA's memory of one online training step (the gradient
    of the sum of its output with respect to ``learner.param_states``) for ``example_inputs``.
    The learner's states are not changed.

    Parameters
    ----------
    learner : ETraceAlgorithm or ETraceVmap
        A learner built by :func:`braintrace.compile`.
    *example_inputs
        Inputs of one step, as the learner is called with (arrays or ``jax.ShapeDtypeStruct``).

    Returns
    -------
    MemoryEstimate

    Raises
    ------
    TypeError
        If ``learner`` is not a compiled learner.
    ValueError
        If it is not compiled, or no example input is given.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> from braintrace._footprint import learner_memory
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
    >>> row = learner_memory(learner, jnp.ones((2, 3)))
    >>> row.method, row.batch_size, row.trace_bytes  # traces: 2 samples · (7·4 + 4) · 1 state · 4 B
    ('D_RTRL', 2, 256)
    >>> row.total_bytes >= row.persistent_bytes  # the step reads every state it keeps
    True
    """
    algorithm = algorithm_of(learner)
    if not algorithm.is_compiled:
        raise ValueError(
            f"learner_memory: {type(algorithm).__name__} is not compiled; build it with "
            f"braintrace.compile(model, algorithm, example_input)."
        )
    if not example_inputs:
        raise ValueError(
            f"learner_memory: give an example input of one step, as {type(algorithm).__name__} is called "
            f"with, e.g. learner.memory(x0)."
        )
    parts = state_bytes(learner)
    step = online_step_memory(learner, example_inputs)
    return MemoryEstimate(method=type(algorithm).__name__, batch_size=algorithm.batch_size, steps=1,
                          trace_bytes=parts.traces, param_bytes=parts.params, state_bytes=parts.states, step=step)

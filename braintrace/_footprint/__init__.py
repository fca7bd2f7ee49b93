"""The memory of one training method: what a learner (or a model under BPTT) keeps and what its step needs.

Below the learners: it reads a learner through :class:`~braintrace._typing.LearnerLike` and builds
none, so ``ETraceAlgorithm.memory`` can call :func:`learner_memory` and the planner
(:mod:`braintrace._memory`, which compiles learners) sits above both. It counts a learner's
traces, parameters and states (:mod:`~braintrace._footprint.inventory`), reads XLA's memory of one
compiled training step (:mod:`~braintrace._footprint.step_memory`) and reports them as a
:class:`MemoryEstimate` (:mod:`~braintrace._footprint.estimate`).

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> from braintrace._footprint import learner_memory
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
>>> learner_memory(learner, jnp.ones((2, 3))).trace_bytes
256
"""

from braintrace._footprint.estimate import MemoryEstimate
from braintrace._footprint.learner import learner_memory

__all__ = ["learner_memory", "MemoryEstimate"]

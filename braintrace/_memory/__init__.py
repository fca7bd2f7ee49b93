"""Memory planning: how much memory a training step needs, per learner and for BPTT, before a run.

:func:`estimate_memory` builds each method at the user's sizes and reads XLA's memory analysis
of one compiled training step (no step runs); :func:`learner_memory` does the same for a
learner already compiled. The figures come back as :class:`MemoryEstimate` rows in a
:class:`MemoryPlan` (a text table, a dict, a bar chart). The planner compiles learners, so it
sits above them; the measurement of one learner, which ``learner.memory()`` uses, sits below
them in :mod:`braintrace._footprint` and is re-exported here.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> from braintrace._memory import estimate_memory
>>> plan = estimate_memory(braintrace.nn.ValinaRNNCell(3, 4), ['bptt', 'd_rtrl'], jnp.ones((2, 3)),
...                        batch_size=2, seq_len=20)
>>> [(row.method, row.steps) for row in plan]
[('BPTT', 20), ('d_rtrl', 1)]
"""

from braintrace._footprint import MemoryEstimate, learner_memory
from braintrace._memory.plan import MemoryPlan
from braintrace._memory.planner import estimate_memory

__all__ = ["estimate_memory", "learner_memory", "MemoryPlan", "MemoryEstimate"]

"""Gradient audits: what a learner's online gradient is, measured against BPTT of the same loss.

* :func:`check_gradients` — one learner, on your model and data: per parameter, the cosine, the
  relative error and the norm ratio of its online gradient against backpropagation through
  time of the same objective, and whether it is exact (:class:`GradientAudit`).
* :func:`compare_learners` — several rules compiled on one model, against one BPTT reference
  (:class:`LearnerComparison`).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._audit import check_gradients
>>> brainstate.random.seed(0)
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones(3))
>>> audit = check_gradients(learner, brainstate.random.normal(size=(6, 3)), step_fn=lambda x: jnp.sum(learner(x) ** 2))
>>> audit.verdict, round(audit.overall.cosine, 2) > 0.5
('approximate', True)
"""

from braintrace._audit.check import check_gradients
from braintrace._audit.compare import LearnerComparison, compare_learners
from braintrace._audit.report import GradientAudit, GradientRow

__all__ = ["check_gradients", "compare_learners", "GradientAudit", "GradientRow", "LearnerComparison"]

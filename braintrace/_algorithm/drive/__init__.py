"""The sequence drivers, as functions of a learner: what drives a learner over whole sequences.

* :mod:`~braintrace._algorithm.drive.host` — :class:`SequenceHost`, what a driver reads from the
  learner (the ``_seq_*`` members), and the drivers' types;
* :mod:`~braintrace._algorithm.drive.checks` — every argument checked before tracing;
* :mod:`~braintrace._algorithm.drive.grad_run` — the scan that sums a learner's per-call estimates;
* :mod:`~braintrace._algorithm.drive.drivers` — :func:`etrace_grad` and :func:`etrace_evolve`;
* :mod:`~braintrace._algorithm.drive.train` — :func:`etrace_train`, an optimizer applied while
  the stream runs.

:class:`~braintrace.SequenceDriverMixin` (:mod:`braintrace._algorithm.sequence`) makes the
drivers every learner's methods. The modules here import the learner-independent helpers of
:mod:`braintrace._algorithm` (non-finite checks, layouts, input markers, the call lock, the
training optimizer), never a learner.
"""

from braintrace._algorithm.drive.drivers import etrace_evolve, etrace_grad
from braintrace._algorithm.drive.host import SequenceHost
from braintrace._algorithm.drive.train import TrainResult, etrace_train

__all__ = ["SequenceHost", "TrainResult", "etrace_evolve", "etrace_grad", "etrace_train"]

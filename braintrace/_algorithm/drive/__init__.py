"""The sequence drivers, as functions of a learner: what drives a learner over whole sequences.

* :mod:`~braintrace._algorithm.drive.host` — :class:`SequenceHost`, what a driver reads from the
  learner (the ``_seq_*`` members), and the drivers' types;
* :mod:`~braintrace._algorithm.drive.checks` — every argument checked before tracing;
* :mod:`~braintrace._algorithm.drive.grad_run` — the scan that sums a learner's per-call estimates;
* :mod:`~braintrace._algorithm.drive.drivers` — :func:`etrace_grad` and :func:`etrace_evolve`;
* :mod:`~braintrace._algorithm.drive.train` — :func:`etrace_train`, an optimizer applied while
  the stream runs.

* :mod:`~braintrace._algorithm.drive.sequence` — :class:`~braintrace.SequenceDriverMixin`, which
  makes the drivers every learner's methods;
* :mod:`~braintrace._algorithm.drive.predict` — ``learner.predict``, the model forward over
  sequences from fresh states;
* :mod:`~braintrace._algorithm.drive.finite`, :mod:`~braintrace._algorithm.drive.layout` and
  :mod:`~braintrace._algorithm.drive.train_optimizer` — the non-finite checks, batch-major
  layouts and the optimizer a training run applies.

The modules here import the learner-independent parts of :mod:`braintrace._algorithm.engine`
(input markers, the call lock, batch sizes), never a learner.
"""

from braintrace._algorithm.drive.drivers import etrace_evolve, etrace_grad
from braintrace._algorithm.drive.host import SequenceHost
from braintrace._algorithm.drive.train import TrainResult, etrace_train

__all__ = ["SequenceHost", "TrainResult", "etrace_evolve", "etrace_grad", "etrace_train"]

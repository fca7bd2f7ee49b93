"""The fuzzer's oracle: what a learner must do with a generated model, measured against plain-jax BPTT.

For one :class:`~tests.fuzz.grammar.FuzzCase`, in float64:

* **refused**: compiling or running raises a braintrace library error (``CompilationError``,
  ``NotSupportedError``, an operand / model type error) or a ``ValueError`` / ``TypeError`` /
  ``NotImplementedError`` raised by braintrace's own code, with a message. Anything else — a
  ``KeyError``, ``IndexError``, ``AttributeError``, ``AssertionError``, a JAX shape error from
  inside the library — is an internal error, a problem.
* **ran**: the learner's objective equals the reference's (the compiled model computes the same
  function as the plain one); every gradient is finite wherever BPTT's is; every weight whose
  relations are all labelled ``exact``, and the readout (which reaches no hidden state), matches
  BPTT element-wise at ``|g - g_BPTT| <= ATOL + RTOL·|g_BPTT|``; every weight driving a hidden state
  has a label, or the compiler warned about it by name.

The online gradient is the learner's own driver, ``etrace_grad(..., reduction='sum')``, one call
per step (``chunk_size=2`` windows for the multi-step learner) from a fresh start. The reference
is :func:`tests.fuzz.models.bptt_reference`. :func:`run_case` marks the phase it is in for the
hang report of :func:`tests.fuzz.watchdog.deadline`.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings
from typing import Any, Iterator

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
from contextlib import contextmanager

import braintrace
from braintrace._errors import ModelTypeError, OperandShapeError, OperandTypeError
from tests.fuzz.grammar import LEARNERS, FuzzCase
from tests.fuzz.models import FuzzModel, bptt_reference, sequences
from tests.fuzz.watchdog import phase

__all__ = ["Outcome", "run_case", "judge", "float64", "RTOL", "ATOL", "refusal_problem"]

#: Element-wise tolerance of an exact gradient against BPTT (float64).
RTOL, ATOL = 1e-6, 1e-9
#: The objective of the compiled model against the plain one (float64).
LOSS_RTOL = 1e-9

#: Raised on purpose by braintrace (``UnitMismatchError``: a bias in the wrong unit, documented by
#: every operator that takes one).
LIBRARY_ERRORS = (braintrace.CompilationError, braintrace.NotSupportedError, OperandShapeError,
                  OperandTypeError, ModelTypeError, u.UnitMismatchError)
DOCUMENTED = (ValueError, TypeError, NotImplementedError)
_PACKAGE = os.path.dirname(braintrace.__file__)


@dataclasses.dataclass
class Outcome:
    """``status`` is ``'refused'``, ``'exact'`` (every label exact) or ``'approximate'``; ``problems`` must be empty.

    ``compared`` names the weights driving hidden states that were labelled exact and so compared
    with BPTT element-wise (the readout, always compared, is not counted).
    """

    status: str
    problems: list[str]
    labels: list[str]
    detail: str = ""
    compared: list[str] = dataclasses.field(default_factory=list)


@contextmanager
def float64() -> Iterator[None]:
    """float64 arrays and brainstate defaults for the block, and JAX's whole tracebacks.

    JAX filters its own frames out of a traceback by default, which would make an error raised
    inside JAX look raised by braintrace's code; the oracle tells the two apart by the last frame.
    """
    previous = bool(jax.config.jax_enable_x64), jax.config.jax_traceback_filtering
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_traceback_filtering", "off")
    try:
        with brainstate.environ.context(precision=64):
            yield
    finally:
        jax.config.update("jax_enable_x64", previous[0])
        jax.config.update("jax_traceback_filtering", previous[1])


def refusal_problem(exc: BaseException) -> str | None:
    """``None`` for an acceptable refusal, else what is wrong with it."""
    message = str(exc).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    raised_in = frames[-1].filename if frames else ""
    where = f"{raised_in}:{frames[-1].lineno}" if frames else "?"
    if isinstance(exc, LIBRARY_ERRORS):
        return None if message else f"{type(exc).__name__} without a message at {where}"
    if type(exc) in DOCUMENTED and raised_in.startswith(_PACKAGE) and message:
        return None
    return f"internal error {type(exc).__name__} at {where}: {message[:400]}"


def _learner_run(case: FuzzCase, xs: Any, ys: Any, caught: list[warnings.WarningMessage]) -> tuple[Any, Any, Any]:
    algorithm, options, chunk = LEARNERS[case.learner]
    brainstate.random.seed(0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        phase("building and compiling the learner (FuzzModel, braintrace.compile)")
        learner = braintrace.compile(FuzzModel(case.model), algorithm, xs[0], batch_size=case.model.batch, **options)
        if chunk == 1:
            def step_fn(x: Any, y: Any) -> Any:
                return jnp.sum((learner(x) - y) ** 2)
        else:
            def step_fn(x: Any, y: Any) -> Any:
                out = learner(braintrace.MultiStepData(x))
                return jnp.sum((out - y) ** 2, axis=tuple(range(1, y.ndim)))
        phase("running the learner (etrace_grad: tracing, XLA compilation, execution)")
        grads, loss = learner.etrace_grad(xs, ys, step_fn=step_fn, reduction="sum", return_value=True,
                                          loss_output="scalar", chunk_size=None if chunk == 1 else chunk)
    caught.extend(record)
    return learner, grads, loss


def _close(got: np.ndarray, ref: np.ndarray) -> tuple[bool, float]:
    err = np.abs(got - ref)
    return bool(np.all(err <= ATOL + RTOL * np.abs(ref))), float(np.max(err, initial=0.0))


def run_case(case: FuzzCase) -> Outcome:
    """Run ``case`` through its learner and BPTT and list everything the oracle objects to."""
    with float64():
        phase("building the data")
        xs, ys = sequences(case.model)
        phase("the BPTT reference (building the model, tracing, compiling, running)")
        ref, ref_loss = bptt_reference(case.model, xs, ys)
        caught: list[warnings.WarningMessage] = []
        try:
            learner, grads, loss = _learner_run(case, xs, ys, caught)
        except Exception as exc:  # noqa: BLE001 - every exception is classified
            problem = refusal_problem(exc)
            detail = "".join(traceback.format_exception(exc)) if problem else f"{type(exc).__name__}: {exc}"
            return Outcome("refused", [problem] if problem else [], [], detail)
        said = " ".join(str(w.message) for w in caught)
        phase("judging the outcome")
        return judge(learner.report.exactness, grads, float(loss), ref, ref_loss, said)


def judge(labels: Any, grads: Any, loss: float, ref: dict[str, np.ndarray], ref_loss: float, said: str) -> Outcome:
    """The outcome of a run: ``labels`` the learner's, ``said`` the text of the compiler's warnings."""
    problems: list[str] = []
    if not np.isclose(loss, ref_loss, rtol=LOSS_RTOL, atol=0.0) and np.isfinite(ref_loss):
        problems.append(f"objective {loss!r} differs from the plain model's {ref_loss!r}")
    got = {path[0]: np.asarray(g) for path, g in dict(grads).items()}
    if set(got) != set(ref):
        problems.append(f"gradient keys {sorted(got)} differ from the weights {sorted(ref)}")
        return Outcome("ran", problems, [])
    texts = [f"{'.'.join(map(str, lab.weight_path))}: {lab.describe()}" for lab in labels]
    for name in ref:
        bad = np.isfinite(ref[name]) & ~np.isfinite(got[name])
        if bad.any():
            problems.append(f"{name}: non-finite gradient where BPTT is finite")
    # A weight several relations train (an unrolled inner loop) is exact only when all of them are.
    labelled = {p[0] for lab in labels for p in lab.weight_paths}
    exact = labelled - {p[0] for lab in labels if not lab.exact for p in lab.weight_paths}
    if "readout" in ref:
        exact.add("readout")  # reaches no hidden state: exact within each call
    for name in sorted(exact):
        ok, err = _close(got[name], ref[name])
        if not ok:
            problems.append(f"{name} is exact but differs from BPTT by {err:.3e} (max |g_BPTT| "
                            f"{np.max(np.abs(ref[name])):.3e})")
    for name in sorted(set(ref) - labelled - {"readout"}):
        if name not in said:
            problems.append(f"{name} drives a hidden state but has no exactness label and no warning")
    status = "exact" if labels and all(lab.exact for lab in labels) else "approximate"
    return Outcome(status, problems, texts, compared=sorted(exact - {"readout"}))

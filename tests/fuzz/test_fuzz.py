"""The property-based fuzzer: random models from :mod:`tests.fuzz.grammar`, judged by :mod:`tests.fuzz.oracle`.

Two profiles of one property (every generated case passes the oracle):

* **bounded** (``make test``): ``FUZZ_EXAMPLES`` cases (default 8), ``derandomize=True`` so the
  same cases run every time, no example database; it must compare at least one weight labelled
  exact with BPTT element-wise (two of three cases lean toward models a learner is exact for:
  :func:`~tests.fuzz.grammar.mixed_cases`);
* **long** (``make fuzz``, ``FUZZ_SECONDS`` of wall time): fresh random cases, batch after batch,
  until the time is spent; hypothesis shrinks the first failure and prints it as a
  ``FuzzCase(...)``, which goes into ``test_regressions.py`` as an explicit model.

In both, each case runs under a wall-clock deadline (:func:`tests.fuzz.watchdog.deadline`:
``FUZZ_CASE_SECONDS``, default 180 s, several times the slowest legitimate case on a loaded
machine). A case that overruns it hangs: the watchdog writes ``FUZZ CASE HANG``, the phase the
case was in, its ``FuzzCase(...)`` (for ``test_regressions.py``) and the Python stack of every
thread to the terminal, past pytest's capture, and ends the process with status 124 (hypothesis
cannot shrink a hang; the case is reported as drawn). A hung XLA program cannot be interrupted
from Python, hence a process exit rather than a test failure; under pytest-xdist the worker
crashes and xdist names the test.

The negative controls show the oracle rejecting what it must: a wrong gradient under an exact
label, an internal error, a NaN BPTT does not have, a driving weight without a label.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections import Counter

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings

import braintrace
from braintrace._compiler.exactness_label import ExactnessLabel
from tests.fuzz import watchdog
from tests.fuzz.grammar import FuzzCase, GroupSpec, ModelSpec, OpSpec, mixed_cases
from tests.fuzz.oracle import Outcome, judge, refusal_problem, run_case

_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=False)


def _check(case: FuzzCase, config: pytest.Config) -> Outcome:
    with watchdog.deadline(repr(case), before_report=watchdog.release_capture(config)):
        outcome = run_case(case)
    # Every case compiles new programs that no later case reuses; JAX keeps them (and their memory
    # mappings) until its caches are cleared, and a long run would exhaust the process's mappings.
    jax.clear_caches()
    gc.collect()
    assert not outcome.problems, f"{case!r}\n{outcome.problems}\n{outcome.labels}\n{outcome.detail}"
    return outcome


def test_generated_models_pass_the_oracle(pytestconfig: pytest.Config) -> None:
    outcomes: list[Outcome] = []

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "8")), derandomize=True, **_SETTINGS)
    @given(mixed_cases())
    def run(case: FuzzCase) -> None:
        outcomes.append(_check(case, pytestconfig))

    run()
    compared = sum(bool(outcome.compared) for outcome in outcomes)
    print(f"{len(outcomes)} cases, {compared} compared element-wise under an exact label")
    assert compared >= 1, f"no case reached the exact comparison: {[o.status for o in outcomes]}"


@pytest.mark.skipif("FUZZ_SECONDS" not in os.environ, reason="the long profile: make fuzz FUZZ_SECONDS=...")
def test_fuzz_for_the_given_time(pytestconfig: pytest.Config) -> None:
    deadline = time.monotonic() + float(os.environ["FUZZ_SECONDS"])
    outcomes: list[Outcome] = []

    def one(case: FuzzCase) -> None:
        outcomes.append(_check(case, pytestconfig))

    batches = 0
    while time.monotonic() < deadline:
        seed(random.randrange(2**32))(settings(max_examples=10, **_SETTINGS)(given(mixed_cases())(one)))()
        batches += 1
    statuses = Counter(outcome.status for outcome in outcomes)
    compared = sum(bool(outcome.compared) for outcome in outcomes)
    print(f"fuzzed {batches} batches of 10 cases: {dict(statuses)}, {compared} compared under an exact label")


# --- negative controls of the oracle --------------------------------------------------------------

REF = {"g0_drive_w": np.array([1.0, 2.0]), "readout": np.array([0.5])}


def _label(exact: bool) -> ExactnessLabel:
    return ExactnessLabel(("g0_drive_w",), (("g0_drive_w",),), (("h0",),), exact, () if exact else ("flipped",))


def _grads(w: list[float], readout: float = 0.5) -> dict[tuple[str], np.ndarray]:
    return {("g0_drive_w",): np.array(w), ("readout",): np.array([readout])}


def test_the_oracle_rejects_a_wrong_gradient_under_an_exact_label() -> None:
    close = [1.0 + 1e-12, 2.0]
    off = [1.0 + 1e-5, 2.0]
    assert judge([_label(True)], _grads(close), 3.0, REF, 3.0, "").problems == []
    assert judge([_label(False)], _grads(off), 3.0, REF, 3.0, "").problems == []
    (problem,) = judge([_label(True)], _grads(off), 3.0, REF, 3.0, "").problems
    assert problem.startswith("g0_drive_w is exact but differs from BPTT by 1.000e-05")
    (problem,) = judge([_label(False)], _grads(close, readout=0.6), 3.0, REF, 3.0, "").problems
    assert problem.startswith("readout is exact")


def test_the_oracle_rejects_a_nan_a_wrong_objective_and_a_silent_weight() -> None:
    (problem,) = judge([_label(False)], _grads([np.nan, 2.0]), 3.0, REF, 3.0, "").problems
    assert problem == "g0_drive_w: non-finite gradient where BPTT is finite"
    (problem,) = judge([_label(True)], _grads([1.0, 2.0]), 3.1, REF, 3.0, "").problems
    assert problem.startswith("objective 3.1 differs")
    (problem,) = judge([], _grads([1.0, 2.0]), 3.0, REF, 3.0, "").problems
    assert problem == "g0_drive_w drives a hidden state but has no exactness label and no warning"
    assert judge([], _grads([1.0, 2.0]), 3.0, REF, 3.0, "g0_drive_w is not traced").problems == []


def _raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001
        return caught


def test_the_oracle_tells_a_refusal_from_an_internal_error() -> None:
    assert refusal_problem(_raised(braintrace.CompilationError("no weight reaches a hidden state"))) is None
    assert refusal_problem(_raised(KeyError("h0"))).startswith("internal error KeyError")
    # a ValueError raised here (outside braintrace's package) is not one of braintrace's documented errors
    assert refusal_problem(_raised(ValueError("shape mismatch"))).startswith("internal error ValueError")
    assert refusal_problem(_raised(braintrace.NotSupportedError(""))).startswith("NotSupportedError without")


def test_a_known_exact_model_is_exact_and_a_mixing_one_is_not() -> None:
    """End to end, the two sides of the label: a leaky element-wise group (exact for D_RTRL, and measured
    so) and a dense recurrence (approximate, and off BPTT, which an exact label would have failed)."""
    leaky = GroupSpec(width=4, drive=OpSpec("matmul", 3, 4, seed=1), recurrence="param")
    exact = run_case(FuzzCase(ModelSpec((leaky,)), "d_rtrl"))
    assert (exact.status, exact.problems) == ("exact", [])
    mixing = GroupSpec(width=4, drive=OpSpec("matmul", 3, 4, seed=1), recurrence="mix",
                       mix=OpSpec("matmul", 4, 4, seed=2))
    approx = run_case(FuzzCase(ModelSpec((mixing,)), "d_rtrl"))
    assert (approx.status, approx.problems) == ("approximate", [])

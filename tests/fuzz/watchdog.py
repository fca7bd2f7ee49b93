"""A wall-clock deadline for one fuzz case: a case that hangs is reported, then the process ends.

``with deadline(repr(case)):`` runs its block under a watchdog thread. If the block is still
running after :func:`case_seconds` (``FUZZ_CASE_SECONDS``, default :data:`DEFAULT_CASE_SECONDS`),
the watchdog writes to file descriptor 2

* a line with :data:`HANG_MARK`, the deadline and the phase the case was in (the oracle marks
  its phases with :func:`phase`: the data, the BPTT reference, compiling the learner, running it,
  judging),
* the case's ``FuzzCase(...)`` repr, to paste into ``tests/fuzz/test_regressions.py``,
* the Python stack of every thread (:func:`faulthandler.dump_traceback`),

and ends the process with status :data:`HANG_STATUS` (``os._exit``). A computation hung inside
XLA holds no Python frame that an exception could interrupt (``signal.alarm`` and
``KeyboardInterrupt`` act only between bytecodes, and only in the main thread); a thread that waits
on an event runs whenever the hung code releases the GIL, which a running or compiling XLA
program and a Python loop both do. Ending the process is the only sure way out, and the report
is written first. (A C call that holds the GIL forever would starve this thread too; JAX releases
it while it compiles and runs.)

Under pytest's output capture, file descriptor 2 is a temporary file that ``os._exit`` would
discard: pass ``before_report=release_capture(pytestconfig)``, which hands fd 2 back to the
terminal (in a pytest-xdist worker that is the controller's stderr, so the report reaches the CI
log, and xdist reports the worker as crashed in the test that hung).

This module imports neither JAX nor pytest, so a subprocess that tests it starts in a blink.
"""

from __future__ import annotations

import faulthandler
import math
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["DEFAULT_CASE_SECONDS", "HANG_MARK", "HANG_STATUS", "case_seconds", "deadline", "phase",
           "release_capture"]

#: Measured on a 2-core machine: the slowest case of the bounded profile takes 7.4 s at a load of
#: about 1 and 9.9 s at a load of 8; the slowest of 30 random cases of the long profile took 28 s
#: at a load of 6. 180 s is six times that worst case (eighteen times the bounded profile's).
DEFAULT_CASE_SECONDS = 180.0
#: The word that opens a hang report.
HANG_MARK = "FUZZ CASE HANG"
#: The exit status of a process whose case hung (coreutils ``timeout``'s).
HANG_STATUS = 124

_active: _Watch | None = None


def case_seconds() -> float:
    """The deadline of one case in seconds: ``FUZZ_CASE_SECONDS`` when set, else the default."""
    text = os.environ.get("FUZZ_CASE_SECONDS", "")
    if not text:
        return DEFAULT_CASE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"FUZZ_CASE_SECONDS={text!r} is not a positive, finite number of seconds; "
                         f"unset it for the default of {DEFAULT_CASE_SECONDS:g} s")
    return seconds


def phase(name: str) -> None:
    """Mark the phase the running case is in (shown in a hang report); nothing without a deadline."""
    watch = _active
    if watch is not None:
        watch.phase, watch.phase_started = name, time.monotonic()


def release_capture(config: Any) -> Callable[[], None]:
    """For ``before_report``: suspend pytest's output capture, given pytest's ``config``."""
    capman = config.pluginmanager.getplugin("capturemanager")

    def release() -> None:
        if capman is not None:
            capman.suspend_global_capture(in_=True)

    return release


@contextmanager
def deadline(case: str, seconds: float | None = None,
             before_report: Callable[[], None] | None = None) -> Iterator[None]:
    """Run the block under a watchdog that reports ``case`` and ends the process after ``seconds``.

    Parameters
    ----------
    case : the case's repr, printed as it is.
    seconds : the deadline; :func:`case_seconds` when ``None``.
    before_report : called by the watchdog before it writes (:func:`release_capture`).

    The watchdog thread is joined when the block ends, so none outlives it.
    """
    global _active
    if _active is not None:
        raise RuntimeError(f"deadline({case!r}) inside the deadline of {_active.case!r}: one case at a time")
    watch = _Watch(case, case_seconds() if seconds is None else seconds, before_report)
    _active = watch
    watch.thread.start()
    try:
        yield
    finally:
        with watch.lock:
            watch.done.set()
        watch.thread.join()
        _active = None


class _Watch:
    """One case's watchdog thread and the phase the case is in."""

    def __init__(self, case: str, seconds: float, before_report: Callable[[], None] | None) -> None:
        self.case, self.seconds, self.before_report = case, seconds, before_report
        self.started = self.phase_started = time.monotonic()
        self.phase = "starting"
        self.done = threading.Event()
        # Held while reporting, so a case that ends at the deadline is either reported or not.
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._wait, name="fuzz-case-watchdog", daemon=True)

    def _wait(self) -> None:
        if self.done.wait(self.seconds):
            return
        with self.lock:
            if self.done.is_set():
                return
            self._report_and_exit()

    def _report_and_exit(self) -> None:
        try:
            if self.before_report is not None:
                self.before_report()
        finally:
            now = time.monotonic()
            _write(2, (
                f"\n{'=' * 24} {HANG_MARK} {'=' * 24}\n"
                f"A fuzz case ran past its deadline of {self.seconds:g} s (FUZZ_CASE_SECONDS) and is "
                f"still running after {now - self.started:.1f} s,\n"
                f"in phase: {self.phase} (for {now - self.phase_started:.1f} s).\n"
                f"The case, for tests/fuzz/test_regressions.py:\n\n{self.case}\n\n"
                f"The Python stack of every thread (a hang inside XLA shows as the frame that called it):\n"
            ))
            faulthandler.dump_traceback(file=2, all_threads=True)
            _write(2, f"{'=' * 24} {HANG_MARK}: exiting with status {HANG_STATUS} {'=' * 24}\n")
            os._exit(HANG_STATUS)


def _write(fd: int, text: str) -> None:
    data = text.encode("utf-8", "backslashreplace")
    while data:
        data = data[os.write(fd, data):]

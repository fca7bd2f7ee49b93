"""The fuzzer's hang detection (:mod:`tests.fuzz.watchdog`): it fires on a case that hangs, and only then.

The negative controls run a deliberate hang in a subprocess that imports only the watchdog (no
JAX), under a deadline of half a second: a wait on a lock, as a thread waits on a hung XLA
program, and a Python loop that never waits (the watchdog thread must still get the GIL). Each
must exit with :data:`~tests.fuzz.watchdog.HANG_STATUS` within :data:`REPORTED_WITHIN` and write
the case, the phase and every thread's stack to stderr, also past pytest's output capture.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.fuzz import watchdog
from tests.fuzz.grammar import FuzzCase, GroupSpec, ModelSpec, OpSpec

ROOT = Path(__file__).resolve().parents[2]
CASE = FuzzCase(ModelSpec((GroupSpec(width=3, drive=OpSpec("grouped", 3, 3, size=1), control="while"),), batch=2),
                "d_rtrl_window")
#: A hang must be reported and the process ended within this (the deadline is half a second).
REPORTED_WITHIN = 30.0

HANGS = {
    "blocked": "threading.Event().wait()",
    "python-loop": "while True: pass",
}


def _run(args: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``python *args`` with ``tests`` importable and the case's repr in ``HANG_CASE``; it must end in time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HANG_CASE": repr(CASE), **env}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=REPORTED_WITHIN)


def _assert_reported(stderr: str, phase: str) -> None:
    assert watchdog.HANG_MARK in stderr, stderr
    assert f"\n{CASE!r}\n" in stderr, stderr
    assert f"in phase: {phase}" in stderr, stderr
    assert "Thread 0x" in stderr and "Current thread 0x" in stderr, stderr  # every thread's stack


@pytest.mark.parametrize("hang", HANGS, ids=list(HANGS))
def test_the_watchdog_reports_a_hang_and_ends_the_process(hang: str) -> None:
    code = textwrap.dedent(f"""
        import os, sys, threading
        from tests.fuzz.watchdog import deadline, phase
        assert "jax" not in sys.modules, "the watchdog imports jax"
        with deadline(os.environ["HANG_CASE"]):
            phase("running the learner")
            {HANGS[hang]}
    """)
    done = _run(["-c", code], {"FUZZ_CASE_SECONDS": "0.5"})
    assert done.returncode == watchdog.HANG_STATUS, done.stderr
    _assert_reported(done.stderr, "running the learner")


@pytest.mark.slow  # a pytest start-up (a second) besides the half-second deadline
def test_the_report_escapes_pytest_output_capture(tmp_path: Path) -> None:
    """Without ``release_capture`` the report would go to pytest's capture file, which the exit discards."""
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import os, threading
        from tests.fuzz.watchdog import deadline, phase, release_capture

        def test_hang(pytestconfig):
            with deadline(os.environ["HANG_CASE"], seconds=0.5, before_report=release_capture(pytestconfig)):
                phase("the BPTT reference")
                threading.Event().wait()
    """))
    # pytest alone, without the plugins installed beside it (hypothesis, xdist): a faster start
    done = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_hang.py"],
                {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, cwd=tmp_path)
    assert done.returncode == watchdog.HANG_STATUS, done.stdout + done.stderr
    _assert_reported(done.stderr, "the BPTT reference")


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fuzz-case-watchdog"]


def test_a_quick_case_finishes_and_leaves_no_watchdog_thread() -> None:
    with watchdog.deadline(repr(CASE), seconds=30.0):
        watchdog.phase("running the learner")
        assert len(_watchdog_threads()) == 1
    assert _watchdog_threads() == []
    with pytest.raises(KeyError, match="h0"), watchdog.deadline(repr(CASE), seconds=30.0):
        raise KeyError("h0")  # a case's error passes through, and the watchdog still ends
    assert _watchdog_threads() == []
    with watchdog.deadline(repr(CASE), seconds=30.0), pytest.raises(RuntimeError, match="one case at a time"):
        with watchdog.deadline(repr(CASE), seconds=30.0):
            pass
    assert _watchdog_threads() == []


def test_the_deadline_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FUZZ_CASE_SECONDS", raising=False)
    assert watchdog.case_seconds() == watchdog.DEFAULT_CASE_SECONDS
    monkeypatch.setenv("FUZZ_CASE_SECONDS", "2.5")
    assert watchdog.case_seconds() == 2.5
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("FUZZ_CASE_SECONDS", bad)
        with pytest.raises(ValueError, match="FUZZ_CASE_SECONDS=.* is not a positive, finite number"):
            watchdog.case_seconds()

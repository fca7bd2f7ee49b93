"""A training process killed with ``SIGKILL`` while it writes a checkpoint.

The child (:mod:`tests.checkpoint_kill_script`) trains and checkpoints after every round; in
the save after round ``KILL_ROUND`` it stops at an announced point of the write (no sleeps:
it prints ``BLOCKED`` and waits) and the test kills it. Then: the checkpoint on disk is the
previous one, whole and loadable; resuming from it reproduces the uninterrupted run bit for
bit; the killed write's temporary file is there, and the next save removes it. The negative
control of the resume comparison is the same comparison against a run resumed one round off.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import braintrace
from braintrace._atomic_file import stale_temporaries, write_atomically
from tests.checkpoint_kill_script import CHECKPOINT, fresh, run_rounds

KILL_ROUND = 3
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.name != "posix", reason="SIGKILL and fsync of a folder are POSIX")


def kill_while_saving(folder: Path, point: str) -> str:
    """Run the child until it blocks at ``point`` in the save after ``KILL_ROUND``; SIGKILL it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint_kill_script", str(folder), str(KILL_ROUND), point],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    watchdog = threading.Timer(300, proc.kill)  # a child that never blocks must not hang the suite
    watchdog.start()
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("BLOCKED"):
            proc.kill()
            raise AssertionError(f"the child did not reach the save: {line!r}\n{proc.communicate()[1][-3000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    finally:
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL
    return line


def same(a: dict, b: dict) -> bool:
    return (a["states"].keys() == b["states"].keys()
            and all(np.array_equal(a["states"][k], b["states"][k]) for k in a["states"])
            and np.array_equal(a["losses"][-len(b["losses"]):], b["losses"]))


# Both points leave the target untouched; the default suite runs the later one.
@pytest.mark.parametrize("point", [pytest.param("payload", marks=pytest.mark.exhaustive), "rename"])
def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path: Path, point: str) -> None:
    kill_while_saving(tmp_path, point)
    path = tmp_path / CHECKPOINT
    left = stale_temporaries(str(path))
    assert left, f"the kill left no temporary file: {sorted(os.listdir(tmp_path))}"  # it was mid-write

    learner, optimizer = fresh()
    extra = braintrace.load_checkpoint(path, learner, optimizer=optimizer, extra={"rounds": 0})
    assert extra == {"rounds": KILL_ROUND - 1}  # the checkpoint before the killed save
    resumed = run_rounds(learner, optimizer, KILL_ROUND - 1)
    uninterrupted = run_rounds(*fresh(), 0)
    assert same(uninterrupted, resumed)
    # negative control: the same checkpoint resumed one round late (a round of data skipped)
    skipped, skipped_optimizer = fresh()
    braintrace.load_checkpoint(path, skipped, optimizer=skipped_optimizer)
    assert not same(uninterrupted, run_rounds(skipped, skipped_optimizer, KILL_ROUND))

    braintrace.save_checkpoint(path, learner, optimizer=optimizer)  # the next save cleans up
    assert sorted(os.listdir(tmp_path)) == [CHECKPOINT]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = str(tmp_path / "f.bin")
    write_atomically(target, lambda tmp: Path(tmp).write_bytes(b"old"))

    def fails(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, fails)
    assert Path(target).read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]


def test_temporaries_of_running_processes_are_kept(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    mine = tmp_path / f"f.bin.tmp-{os.getpid()}-abc"  # this process runs: not stale
    other = tmp_path / "f.bin.tmp-notapid"  # not of our naming: left alone
    for p in (mine, other):
        p.write_bytes(b"x")
    assert stale_temporaries(str(target)) == []
    write_atomically(str(target), lambda tmp: Path(tmp).write_bytes(b"new"))
    assert sorted(os.listdir(tmp_path)) == sorted(["f.bin", mine.name, other.name])

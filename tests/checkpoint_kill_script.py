"""The training process ``tests/test_checkpoint_kill.py`` kills with ``SIGKILL`` mid-checkpoint.

``python -m tests.checkpoint_kill_script FOLDER KILL_ROUND POINT`` (run from the repository
root) trains :class:`~tests.checkpoint_resume_script.LeakyRNN` with D_RTRL and Adam for
``ROUNDS`` rounds of ``STEPS`` online steps and saves ``FOLDER/run.ckpt`` after every round.
During the save after round ``KILL_ROUND`` it stops at ``POINT``, prints ``BLOCKED <file>``
and waits on its standard input for a kill:

* ``payload``: the serialised checkpoint is written to its temporary file, before the file
  is flushed and renamed to the checkpoint's name;
* ``rename``: the temporary file is whole and flushed, just before the rename.

The test and this script share :func:`run_rounds`, so both processes compute the same bits.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

import braintrace
from tests.checkpoint_resume_script import BATCH, N_HIDDEN, N_IN, STEPS, adam, build, snapshot, trainer

ROUNDS = 4
CHECKPOINT = "run.ckpt"


def stream() -> tuple[Any, Any]:
    """Inputs ``(ROUNDS * STEPS, batch, in)`` and targets ``(ROUNDS * STEPS, batch, hidden)``."""
    rng = np.random.RandomState(7)
    xs = rng.randn(ROUNDS * STEPS, BATCH, N_IN).astype(np.float32)
    ys = rng.randn(ROUNDS * STEPS, BATCH, N_HIDDEN).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(ys)


def fresh() -> tuple[Any, Any]:
    """A new learner and its Adam, built the same way in every process."""
    learner = build("d_rtrl")
    return learner, adam(learner)


def run_rounds(learner: Any, optimizer: Any, first: int, folder: str | None = None,
               before_save: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Rounds ``first .. ROUNDS - 1``, saving after each one if ``folder``: states and losses.

    ``before_save(r)`` runs before the save after round ``r`` (counted from 1).
    """
    xs, ys = stream()
    run = trainer(learner, optimizer)
    losses = []
    for r in range(first, ROUNDS):
        span = slice(r * STEPS, (r + 1) * STEPS)
        losses.append(np.asarray(run(xs[span], ys[span])))
        if folder is not None:
            if before_save is not None:
                before_save(r + 1)
            braintrace.save_checkpoint(os.path.join(folder, CHECKPOINT), learner, optimizer=optimizer,
                                       extra={"rounds": r + 1})
    return {"states": snapshot(learner, optimizer), "losses": np.concatenate(losses)}


def _block_at(point: str, target: str) -> None:
    """Make the save to ``target`` stop at ``point``, announce it and wait to be killed."""
    real_replace, real_fsync = os.replace, os.fsync

    def announce(path: str) -> None:
        print(f"BLOCKED {path}", flush=True)
        sys.stdin.read()  # until the test kills this process
        raise SystemExit("the test did not kill this process")

    def replace(src: Any, dst: Any) -> None:
        if point == "rename" and os.fspath(dst) == target:
            announce(os.fspath(src))
        real_replace(src, dst)

    def fsync(fd: int) -> None:
        if point == "payload":
            announce("the temporary file, written but not flushed")
        real_fsync(fd)

    os.replace, os.fsync = replace, fsync  # type: ignore[assignment]


def main(argv: list[str]) -> None:
    folder, kill_round, point = argv[0], int(argv[1]), argv[2]
    target = os.path.join(folder, CHECKPOINT)

    def before_save(r: int) -> None:
        if r == kill_round:
            _block_at(point, target)

    run_rounds(*fresh(), 0, folder, before_save)


if __name__ == "__main__":
    main(sys.argv[1:])

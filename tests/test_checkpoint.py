"""``save_checkpoint`` / ``load_checkpoint``: an interrupted run resumes bit for bit.

Each run trains :class:`~tests.checkpoint_resume_script.LeakyRNN` online for ``STEPS`` steps,
saves, and trains ``STEPS`` more; a fresh learner that loads the checkpoint and trains the same
steps (in this process, or in a new one) must end with the same bits in every state (parameters,
hidden states, traces, counters, optimizer states) and the same losses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.checkpoint_resume_script import (
    ALGORITHMS,
    STEPS,
    adam,
    build,
    data,
    job_parts,
    resume,
    snapshot,
    trainer,
)

REPO = Path(__file__).resolve().parents[1]


class Reference(NamedTuple):
    """An uninterrupted run: its checkpoint after ``STEPS`` steps, its end states and losses."""

    checkpoint: str
    states: dict[str, np.ndarray]
    losses: np.ndarray


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("checkpoints")
    runs: dict[str, Reference] = {}

    def run(job: str) -> Reference:
        if job not in runs:
            algorithm, with_adam = job_parts(job)
            learner = build(algorithm)
            optimizer = adam(learner) if with_adam else None
            train = trainer(learner, optimizer)
            xs, ys = data()
            first = train(xs[:STEPS], ys[:STEPS])
            path = braintrace.save_checkpoint(folder / f"{job}.ckpt", learner, optimizer=optimizer)
            second = train(xs[STEPS:], ys[STEPS:])
            assert np.all(np.isfinite(first)) and np.all(np.isfinite(second))
            runs[job] = Reference(path, snapshot(learner, optimizer), np.asarray(second))
        return runs[job]

    return run


def assert_same_run(resumed: dict[str, Any], ref: Reference) -> None:
    states = resumed["states"]
    assert sorted(states) == sorted(ref.states)
    for name, value in ref.states.items():
        np.testing.assert_array_equal(states[name], value, err_msg=name)
    np.testing.assert_array_equal(resumed["losses"], ref.losses)


# --- (a) the round trip, per learning rule -----------------------------------------------------


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_resume_is_bit_identical(reference: Any, algorithm: str) -> None:
    ref = reference(algorithm)
    names = set(ref.states)
    # what the run must carry: the model's states and the rule's traces and counters
    assert {"model/W['weight']", "model/W['bias']", "model/h", "learner/running_index"} <= names
    assert any(n.startswith("learner/") and "relation0" in n for n in names), "traces, by relation"
    assert not any(re.search(r"\d{9}", n) for n in names), "no id() in a name"
    assert_same_run(resume(ref.checkpoint, algorithm), ref)


def test_load_keeps_the_state_objects(reference: Any) -> None:
    learner = build("d_rtrl")
    before = {id(st) for st in brainstate.graph.states(learner).values()}
    train = trainer(learner)  # built before the load: it must see the loaded values
    braintrace.load_checkpoint(reference("d_rtrl").checkpoint, learner)
    assert {id(st) for st in brainstate.graph.states(learner).values()} == before
    xs, ys = data()
    np.testing.assert_array_equal(train(xs[STEPS:], ys[STEPS:]), reference("d_rtrl").losses)


def test_names_are_stable() -> None:
    ckpt_names = set(snapshot(build("pp_prop")))
    assert ckpt_names == {
        "model/W['bias']", "model/W['weight']", "model/leak", "model/h",
        "learner/etrace_xs/relation0.x", "learner/etrace_dfs/(relation0.y, hidden_group_0)",
        "learner/etrace_dfs/(relation1.y, hidden_group_0)", "learner/running_index", "learner/trace_steps",
    }


# --- (b) across a real process ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() == "tpu", reason="this process holds the chip: a second one cannot open it")
def test_resume_in_another_process(reference: Any) -> None:
    jobs = [*ALGORITHMS, "d_rtrl+adam"]
    folder = os.path.dirname(reference(jobs[0]).checkpoint)
    for job in jobs:
        reference(job)
    # On a GPU this process took most of the memory at start-up: the second one allocates as it goes.
    result = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_resume_script", folder, *jobs],
        cwd=REPO, env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"), capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for job in jobs:
        resumed = braintools.file.msgpack_load(os.path.join(folder, f"{job}.out"))
        assert_same_run(resumed, reference(job))


# --- (c) the optimizer's states --------------------------------------------------------------


def test_adam_resumes_bit_identical(reference: Any) -> None:
    ref = reference("d_rtrl+adam")
    names = set(ref.states)
    assert {"optimizer/step_count", "optimizer/opt_state[0].count", "optimizer/_lr_scheduler/last_epoch"} <= names
    assert any(n.startswith("optimizer/opt_state[0].mu") for n in names)
    # ParamStates the optimizer updates are stored once, as the model's
    assert not any(n.startswith("optimizer/param_groups") for n in names)
    assert int(ref.states["optimizer/step_count"]) == 2 * STEPS
    assert_same_run(resume(ref.checkpoint, "d_rtrl+adam"), ref)


# --- (d) refusals ----------------------------------------------------------------------------


def _refusal(path: str, learner: Any, **kwargs: Any) -> str:
    before = {name: np.array(v) for name, v in snapshot(learner, kwargs.get("optimizer")).items()}
    with pytest.raises(ValueError, match="does not fit this learner; nothing was restored") as info:
        braintrace.load_checkpoint(path, learner, **kwargs)
    after = snapshot(learner, kwargs.get("optimizer"))
    for name, value in before.items():  # all or nothing
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    return str(info.value)


def test_refuses_another_hidden_size(reference: Any) -> None:
    message = _refusal(reference("d_rtrl").checkpoint, build("d_rtrl", n_hidden=5))
    assert "model/W['weight']: expected (3, 5) float32, found (3, 4) float32" in message
    assert "model/h: expected (2, 5) float32, found (2, 4) float32" in message
    assert "learner/etrace_bwg/(relation0.y, 0)['weight']: expected (2, 3, 5, 1) float32, found (2, 3, 4, 1)" in message
    assert "Build the learner exactly as the saved one" in message


def test_refuses_another_learner_class(reference: Any) -> None:
    message = _refusal(reference("d_rtrl").checkpoint, build("pp_prop"))
    assert "learner class: expected pp_prop, found D_RTRL" in message
    assert "learner/etrace_xs/relation0.x: expected (2, 3) float32, missing from the checkpoint" in message
    assert "learner/etrace_bwg/(relation0.y, 0)['weight']: not in this learner, found (2, 3, 4, 1) float32" in message


def test_refuses_a_model_with_an_extra_parameter(reference: Any) -> None:
    message = _refusal(reference("d_rtrl").checkpoint, build("d_rtrl", gain=True))
    assert "model/gain: expected (4,) float32, missing from the checkpoint" in message
    assert "learner class" not in message


def test_refuses_a_missing_or_unexpected_optimizer(reference: Any) -> None:
    learner = build("d_rtrl")
    message = _refusal(reference("d_rtrl").checkpoint, learner, optimizer=adam(learner))
    assert "optimizer: an optimizer (Adam) was given, but the checkpoint holds no optimizer state" in message
    message = _refusal(reference("d_rtrl+adam").checkpoint, build("d_rtrl"))
    assert "holds the states of an optimizer (Adam), but none was given" in message
    learner = build("d_rtrl")
    sgd = braintools.optim.SGD(lr=0.1)
    sgd.register_trainable_weights(learner.param_states)
    message = _refusal(reference("d_rtrl+adam").checkpoint, learner, optimizer=sgd)
    assert "optimizer class: expected SGD, found Adam" in message
    assert "optimizer/opt_state[0].mu[('W',)]['weight']: not in this optimizer" in message


def test_refuses_bad_paths_and_files(tmp_path: Path) -> None:
    learner = build("d_rtrl")
    with pytest.raises(FileNotFoundError, match="there is no checkpoint file at"):
        braintrace.load_checkpoint(tmp_path / "missing.ckpt", learner)
    other = braintools.file.msgpack_save(tmp_path / "other.msgpack", {"a": np.ones(2)})
    with pytest.raises(ValueError, match="is not a braintrace checkpoint"):
        braintrace.load_checkpoint(other, learner)
    with pytest.raises(TypeError, match="must be a compiled braintrace learner"):
        braintrace.save_checkpoint(tmp_path / "x.ckpt", learner.model4compile)
    with pytest.raises(TypeError, match="must be a braintools.optim optimizer"):
        braintrace.save_checkpoint(tmp_path / "x.ckpt", learner, optimizer=object())
    for call in (braintrace.save_checkpoint, braintrace.load_checkpoint):
        with pytest.raises(IsADirectoryError, match=r"is a folder, but a checkpoint is one file.*'run.ckpt'"):
            call(tmp_path, learner)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.msgpack"]  # nothing written by the refusals


def _saved_and_trained(tmp_path: Path) -> tuple[Any, str, bytes, dict[str, np.ndarray]]:
    """A learner trained a little, its checkpoint (path, bytes), and its states after more training."""
    learner = build("d_rtrl")
    xs = data()[0]
    learner(xs[0])
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", learner)
    learner(xs[1])
    return learner, path, Path(path).read_bytes(), snapshot(learner)


def test_a_flipped_bit_in_the_weights_is_refused_and_nothing_is_restored(tmp_path: Path) -> None:
    learner, path, content, after = _saved_and_trained(tmp_path)
    saved = braintools.file.msgpack_load(path, parallel=False)["entries"]
    weight = np.asarray(saved[next(n for n in saved if n.startswith("model/W"))])
    at = content.index(weight.tobytes()) + weight.nbytes // 2
    corrupted = bytearray(content)
    corrupted[at] ^= 0x04
    Path(path).write_bytes(bytes(corrupted))
    with pytest.raises(ValueError, match=r"run.ckpt' is corrupted: its entries do not match the checksum.*nothing was restored"):
        braintrace.load_checkpoint(path, learner)
    assert all(np.array_equal(v, after[k]) for k, v in snapshot(learner).items())


@pytest.mark.parametrize("cut", [0.5, 0.97])
def test_a_truncated_checkpoint_is_refused_and_nothing_is_restored(tmp_path: Path, cut: float) -> None:
    learner, path, content, after = _saved_and_trained(tmp_path)
    Path(path).write_bytes(content[: int(cut * len(content))])
    with pytest.raises(ValueError, match=r"run.ckpt' (cannot be read as a checkpoint: it is truncated|is corrupted)"):
        braintrace.load_checkpoint(path, learner)
    assert all(np.array_equal(v, after[k]) for k, v in snapshot(learner).items())


def test_a_foreign_file_is_refused(tmp_path: Path) -> None:
    learner = build("d_rtrl")
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint at all")
    with pytest.raises(ValueError, match=r"notes.ckpt' cannot be read as a checkpoint"):
        braintrace.load_checkpoint(text, learner)


def test_a_version_1_checkpoint_without_a_checksum_still_loads(tmp_path: Path) -> None:
    learner, path, _, _ = _saved_and_trained(tmp_path)
    raw = braintools.file.msgpack_load(path, parallel=False)
    header = {k: v for k, v in raw["header"].items() if k != "checksum"}
    old = braintools.file.msgpack_save(tmp_path / "old.ckpt", {**raw, "header": {**header, "version": 1}})
    braintrace.load_checkpoint(old, learner)
    for name, value in snapshot(learner).items():
        np.testing.assert_array_equal(value, np.asarray(u.get_mantissa(raw["entries"][name])))


def test_a_path_under_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    learner = build("d_rtrl")
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(NotADirectoryError, match=r"lies under .*taken', which is a file, not a folder"):
        braintrace.save_checkpoint(tmp_path / "taken" / "sub" / "run.ckpt", learner)


def test_refuses_states_keyed_by_an_unknown_id(tmp_path: Path) -> None:
    learner = build("d_rtrl")
    key = id(object())
    learner.cache = {key: brainstate.ShortTermState(jnp.zeros(2))}
    with pytest.raises(braintrace.NotSupportedError, match=f"is keyed by {key}, the id"):
        braintrace.save_checkpoint(tmp_path / "x.ckpt", learner)


# --- (e) units -------------------------------------------------------------------------------


class LeakyMembrane(brainstate.nn.Module):
    """``V <- 0.5 V + x @ W`` with ``W`` and ``V`` in ``unit``."""

    def __init__(self, unit: Any) -> None:
        super().__init__()
        self.unit = unit
        self.W = brainstate.ParamState(jnp.asarray(np.random.RandomState(1).randn(3, 4), jnp.float32) * unit)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.V = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4)) * self.unit)

    def update(self, x: jax.Array) -> Any:
        self.V.value = 0.5 * self.V.value + braintrace.matmul(x, self.W.value)
        return self.V.value


def test_units_round_trip(tmp_path: Path) -> None:
    def build_membrane(unit: Any = u.mV) -> Any:
        return braintrace.compile(LeakyMembrane(unit), braintrace.D_RTRL, jnp.ones((2, 3)), batch_size=2)

    learner = build_membrane()
    learner(jnp.ones((2, 3)))
    path = braintrace.save_checkpoint(tmp_path / "units.ckpt", learner)
    resumed = build_membrane()
    braintrace.load_checkpoint(path, resumed)
    for state, saved in [(resumed.model4compile.W, learner.model4compile.W),
                         (resumed.model4compile.V, learner.model4compile.V)]:
        assert isinstance(state.value, u.Quantity) and state.value.unit == u.mV and str(state.value.unit) == "mV"
        np.testing.assert_array_equal(state.value.mantissa, saved.value.mantissa)
    message = _refusal(path, build_membrane(u.volt))
    assert "model/W: expected (3, 4) float32 [V], found (3, 4) float32 [mV]" in message
    assert "model/V: expected (2, 4) float32 [V], found (2, 4) float32 [mV]" in message


# --- (f) extra -------------------------------------------------------------------------------


def test_extra_round_trips(tmp_path: Path) -> None:
    learner = build("d_rtrl")
    extra = {
        "epoch": 7,
        "lr": 0.125,
        "name": "run-1",
        "history": (np.arange(3.0), jnp.asarray([1.5, 2.5], jnp.float32)),
        "key": jax.random.key_data(jax.random.PRNGKey(3)),
        "dt": 0.1 * u.ms,
    }
    path = braintrace.save_checkpoint(tmp_path / "extra.ckpt", learner, extra=extra)
    template = {"epoch": 0, "lr": 0.0, "name": "", "history": (np.zeros(3), jnp.zeros(2, jnp.float32)),
                "key": jnp.zeros(2, jnp.uint32), "dt": 0.0 * u.ms}
    restored = braintrace.load_checkpoint(path, build("d_rtrl"), extra=template)
    assert restored["epoch"] == 7 and restored["lr"] == 0.125 and restored["name"] == "run-1"
    assert isinstance(restored["history"], tuple)
    np.testing.assert_array_equal(restored["history"][0], np.arange(3.0))
    assert isinstance(restored["history"][1], jax.Array)
    np.testing.assert_array_equal(restored["history"][1], extra["history"][1])
    np.testing.assert_array_equal(restored["key"], extra["key"])
    assert restored["dt"].unit == u.ms and float(restored["dt"].mantissa) == pytest.approx(0.1)
    raw = braintrace.load_checkpoint(path, build("d_rtrl"))
    assert raw["epoch"] == 7 and set(raw["history"]) == {"0", "1"}
    assert braintrace.load_checkpoint(braintrace.save_checkpoint(tmp_path / "none.ckpt", learner), learner) is None
    message = _refusal(tmp_path / "none.ckpt", build("d_rtrl"), extra=template)
    assert "extra: a template was given, but the checkpoint holds no extra" in message
    message = _refusal(path, build("d_rtrl"), extra={**template, "history": (np.zeros(4), jnp.zeros(2))})
    assert "extra: the saved extra does not fit the template: Array shape mismatch: expected (4,), got (3,)" in message
    message = _refusal(path, build("d_rtrl"), extra={**template, "steps": 0})
    assert "extra: the saved extra does not fit the template" in message and "'steps'" in message
    # keys the template leaves out are not returned
    assert braintrace.load_checkpoint(path, build("d_rtrl"), extra={"epoch": 0}) == {"epoch": 7}


@pytest.mark.slow
def test_checkpoint_of_a_vmapped_learner(tmp_path: Path) -> None:
    def build_vmapped() -> Any:
        return braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((2, 3)),
                                  batch_size=2, vmap=True, seed=0)

    learner = build_vmapped()
    x = jnp.asarray(np.random.RandomState(0).randn(2, 3), jnp.float32)
    learner(x)
    path = braintrace.save_checkpoint(tmp_path / "vmap.ckpt", learner)
    resumed = build_vmapped()
    braintrace.load_checkpoint(path, resumed)
    np.testing.assert_array_equal(resumed(x), learner(x))
    message = _refusal(path, build("d_rtrl"))
    assert "learner class: expected D_RTRL, found ETraceVmap(D_RTRL)" in message

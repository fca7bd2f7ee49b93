"""The ``examples/`` scripts: data generators, the SHD loader, the shared training loop, tiny end-to-end runs.

Each script's ``main(argv)`` runs at a tiny size (a few batches of a few sequences) and must
save its figure; nothing may reach the network. The SHD loader reads a small file written
here in the layout of the real data set.
"""

from __future__ import annotations

import doctest
import importlib
import sys
from pathlib import Path
from typing import Any

import brainstate
import brainunit as u
import h5py
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import _common  # noqa: E402
import copy_task_gru  # noqa: E402
import delayed_match_lif  # noqa: E402
import digits_spiking  # noqa: E402
import evidence_accumulation  # noqa: E402
import shd_classification  # noqa: E402
import shd_data  # noqa: E402
import trainer_classification  # noqa: E402

TINY = ["--iterations", "2", "--batch", "4", "--test-size", "8"]


# --- task generators --------------------------------------------------------------------------

def test_delayed_match_trials_label_match_and_score_only_the_response() -> None:
    timing = delayed_match_lif.Timing(delay=5)
    xs, labels, weights = delayed_match_lif.make_trials(np.random.default_rng(0), 64, timing, rate=1.0, noise=0.0)
    n = delayed_match_lif.N_PER_POP
    assert xs.shape == (timing.total, 64, 3 * n) and labels.shape == (timing.total, 64)
    sample = xs[timing.sample_on, :, n:2 * n].max(-1)  # 1 where the sample was B
    test = xs[timing.test_on, :, n:2 * n].max(-1)
    np.testing.assert_array_equal(labels[-1], (sample == test).astype(int))
    assert 0 < labels[-1].mean() < 1
    np.testing.assert_array_equal(np.nonzero(weights)[0], np.arange(timing.response_on, timing.total))
    assert xs[timing.response_on:, :, 2 * n:].min() == 1.0 and xs[:timing.response_on, :, 2 * n:].max() == 0.0


def test_copy_trials_recall_the_presented_symbols_in_order() -> None:
    xs, labels, weights = copy_task_gru.make_trials(np.random.default_rng(1), 5, length=3, delay=2, symbols=4)
    assert xs.shape == (8, 5, 5)
    shown = xs[:3, :, :4].argmax(-1)
    np.testing.assert_array_equal(labels[5:], shown)
    np.testing.assert_array_equal(weights, [0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(xs[:, :, 4].max(1), weights)


def test_evidence_trials_carry_the_signed_coherence() -> None:
    xs, labels, weights, coherence = evidence_accumulation.make_trials(
        np.random.default_rng(2), 4000, stimulus=10, delay=3, noise=0.0)
    diff = (xs[:10, :, 1] - xs[:10, :, 0]).mean(0)
    np.testing.assert_allclose(np.abs(diff), coherence, atol=1e-6)
    strong = coherence > 0
    np.testing.assert_array_equal(labels[-1][strong], (diff[strong] > 0).astype(int))
    assert weights.sum() == 5 and xs[13:, :, 2].min() == 1.0


def test_ideal_observer_is_chance_at_zero_coherence_and_rises() -> None:
    curve = evidence_accumulation.ideal_observer(stimulus=20)
    assert curve[0] == pytest.approx(0.5) and np.all(np.diff(curve) > 0) and curve[-1] < 1.0


def test_psychometric_groups_hits_by_coherence() -> None:
    labels = np.array([[0, 1, 1, 0]])
    outs = np.array([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])  # hits: yes, yes, no, yes
    coherence = evidence_accumulation.COHERENCES[[0, 0, 1, 1]]
    curve = evidence_accumulation.psychometric(outs, labels, np.ones(1), coherence)
    np.testing.assert_array_equal(curve[:2], [1.0, 0.5])
    assert np.isnan(curve[2:]).all()


# --- SHD: the synthetic set and the loader of real files ---------------------------------------

def test_synthetic_shd_has_the_shd_shape_and_class_specific_patterns() -> None:
    data = shd_data.synthetic_shd(80, seed=0)
    assert data.n_channels == 700 and sorted(set(data.labels.tolist())) == list(range(20))
    xs = shd_data.bin_events(data, np.arange(80), n_steps=20, max_time=1.0)
    # Two samples of one class share more active (time, channel) cells than samples of two classes.
    profile = xs.reshape(20, 80, 70, 10).sum(-1)  # pool channels by ten
    same = np.mean([np.sum(profile[:, i] * profile[:, i + 20]) for i in range(20)])
    other = np.mean([np.sum(profile[:, i] * profile[:, (i + 1) % 20]) for i in range(20)])
    assert same > 2 * other


def _write_shd_file(path: Path, times: list[np.ndarray], units: list[np.ndarray], labels: list[int]) -> None:
    """A file laid out like shd_train.h5: ragged float16 times, ragged uint16 units, uint8 labels, extras."""
    with h5py.File(path, "w") as f:
        t = f.create_dataset("spikes/times", (len(times),), dtype=h5py.vlen_dtype(np.float16))
        u = f.create_dataset("spikes/units", (len(units),), dtype=h5py.vlen_dtype(np.uint16))
        for i, (ti, ui) in enumerate(zip(times, units)):
            t[i], u[i] = ti.astype(np.float16), ui.astype(np.uint16)
        f.create_dataset("labels", data=np.asarray(labels, np.uint8))
        f.create_dataset("extra/speaker", data=np.zeros(len(labels), np.uint8))


def test_load_shd_reads_ragged_spikes_and_labels(tmp_path: Path) -> None:
    times = [np.array([0.0, 0.25, 0.5]), np.array([0.125]), np.array([], np.float64)]
    units = [np.array([3, 699, 3]), np.array([10]), np.array([], np.int64)]
    _write_shd_file(tmp_path / "shd.h5", times, units, [4, 19, 0])
    data = shd_data.load_shd(tmp_path / "shd.h5")
    assert data.labels.tolist() == [4, 19, 0] and data.n_channels == 700
    for got, want in zip(data.times, times):
        np.testing.assert_allclose(got, want)
    for got, want in zip(data.units, units):
        np.testing.assert_array_equal(got, want)
    xs = shd_data.bin_events(data, np.array([0, 1, 2]), n_steps=4, max_time=1.0)
    assert xs.shape == (4, 3, 700) and xs.sum() == 4
    assert xs[0, 0, 3] == xs[1, 0, 699] == xs[2, 0, 3] == xs[0, 1, 10] == 1.0
    assert len(shd_data.load_shd(tmp_path / "shd.h5", limit=2)) == 2


def test_save_shd_round_trips_the_synthetic_set(tmp_path: Path) -> None:
    data = shd_data.synthetic_shd(6, seed=3)
    shd_data.save_shd(tmp_path / "s.h5", data)
    back = shd_data.load_shd(tmp_path / "s.h5")
    np.testing.assert_array_equal(back.labels, data.labels)
    for i in range(6):
        np.testing.assert_array_equal(back.units[i], data.units[i])
        np.testing.assert_allclose(back.times[i], data.times[i], atol=1e-3)


def test_load_shd_errors_name_the_path_and_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.h5.*Nothing is downloaded"):
        shd_data.load_shd(tmp_path / "nowhere.h5")
    with h5py.File(tmp_path / "bad.h5", "w") as f:
        f.create_dataset("labels", data=np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match=r"bad.h5.*\['spikes/times', 'spikes/units'\]"):
        shd_data.load_shd(tmp_path / "bad.h5")


# --- digits -------------------------------------------------------------------------------------

def test_font_digits_are_balanced_8x8_images() -> None:
    images, labels = digits_spiking.font_digits(30, seed=1)
    assert images.shape == (30, 8, 8) and np.bincount(labels).tolist() == [3] * 10
    assert images.max() == pytest.approx(1.0) and images.min() >= 0.0
    # Different fonts and distortions: no two samples of one digit are identical.
    assert not np.allclose(images[0], images[10])


def test_sklearn_digits_when_installed() -> None:
    pytest.importorskip("sklearn")
    images, labels = digits_spiking.sklearn_digits()
    assert images.shape == (1797, 8, 8) and images.max() == 1.0 and set(labels.tolist()) == set(range(10))


def test_rate_coding_follows_the_pixel_intensity() -> None:
    images = np.zeros((1, 8, 8), np.float32)
    images[0, 0, :4] = 1.0
    xs, ys, weights = digits_spiking.encode(np.random.default_rng(0), images, np.array([7]), 400, max_rate=0.5)
    assert xs.shape == (400, 1, 64) and (ys == 7).all() and weights.sum() == 200
    np.testing.assert_allclose(xs[:, 0, :4].mean(), 0.5, atol=0.05)
    assert xs[:, 0, 4:].sum() == 0


# --- the shared training loop ---------------------------------------------------------------------

def test_progress_falls_back_to_printed_lines(capsys: pytest.CaptureFixture[str]) -> None:
    with _common.Progress(20, "task", use_tqdm=False) as bar:
        for i in range(20):
            bar.update(loss=float(i))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("task: 20/20") and lines[-1].endswith("loss 19.0000")


def test_window_and_step_accuracy() -> None:
    outs = np.zeros((3, 2, 2))
    outs[1, 0, 1] = outs[2, 0, 1] = 1.0  # sample 0 votes 1 on the scored steps, sample 1 votes 0
    labels = np.array([[0, 0], [1, 1], [1, 1]])
    weights = np.array([0.0, 1.0, 1.0])
    assert _common.window_accuracy(outs, labels, weights) == 0.5
    assert _common.step_accuracy(outs, labels, weights) == 0.5


class _NoReset(_common.LIFNetwork):
    """A model whose reset_state does nothing: learner.reset() must still start each batch afresh."""

    reset_state = brainstate.nn.Module.reset_state


@pytest.mark.parametrize("network", [_common.LIFNetwork, _NoReset])
def test_online_training_resets_the_states_the_learner_uses(network: type) -> None:
    """After training, the training pass and the plain forward pass see the same reset states,
    and the reported loss is the weighted mean Σ_t w_t CE_t / Σ_t w_t of the outputs returned."""
    model = network(6, 8, 2, tau=12.5, in_scale=3.0, seed=0)
    trainer = _common.make_trainer("d_rtrl", model, 4, 0.05, jnp.zeros((4, 6)))
    rng = np.random.default_rng(0)
    xs = (rng.random((6, 4, 6)) < 0.5).astype(np.float32)
    labels = jnp.asarray(rng.integers(0, 2, (6, 4)), jnp.int32)
    weights = jnp.asarray([0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    for _ in range(3):  # the parameters move and the states end each batch non-zero
        trainer.train(jnp.asarray(xs), labels, weights)
    before = {k: np.asarray(u.get_mantissa(v.value)) for k, v in model.states(brainstate.ParamState).items()}
    expected = np.asarray(trainer.forward(jnp.asarray(xs)))
    loss, outs = trainer.train(jnp.asarray(xs), labels, weights)
    np.testing.assert_allclose(np.asarray(outs), expected, atol=1e-5)
    per_step = np.array([float(_common.cross_entropy(o, y)) for o, y in zip(outs, labels)])
    np.testing.assert_allclose(float(loss), (per_step * np.asarray(weights)).sum() / 4, rtol=1e-5)
    after = {k: np.asarray(u.get_mantissa(v.value)) for k, v in model.states(brainstate.ParamState).items()}
    assert any(not np.allclose(before[k], after[k]) for k in before)


def test_predict_pads_the_last_batch() -> None:
    def forward(xs: Any) -> Any:
        return jnp.cumsum(xs, axis=0)

    trainer = _common.Trainer("fake", 4, lambda *a: (jnp.zeros(()), jnp.zeros(())), forward)
    xs = np.arange(3 * 6 * 2, dtype=np.float32).reshape(3, 6, 2)
    np.testing.assert_allclose(_common.predict(trainer, xs), np.cumsum(xs, axis=0))


@pytest.mark.parametrize("module", [_common, shd_data, digits_spiking])
def test_docstring_examples(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# --- tiny end-to-end runs -------------------------------------------------------------------------

def _run(module: Any, tmp_path: Path, *args: str) -> Any:
    plot = tmp_path / "figure.png"
    result = module.main([*TINY, "--plot", str(plot), *args])
    assert plot.stat().st_size > 1000
    return result


def _check_histories(histories: dict[str, Any], names: list[str], iterations: int = 2) -> None:
    assert list(histories) == names
    for h in histories.values():
        assert len(h.loss) == iterations and np.isfinite(h.loss).all() and 0.0 <= h.test_accuracy <= 1.0


def test_delayed_match_lif_runs(tmp_path: Path) -> None:
    histories = _run(delayed_match_lif, tmp_path, "--hidden", "8", "--delay", "2")
    _check_histories(histories, ["d_rtrl"])


@pytest.mark.slow  # three learners compiled and jitted: over 10 s
def test_delayed_match_lif_runs_with_the_other_learners(tmp_path: Path) -> None:
    histories = _run(delayed_match_lif, tmp_path, "--hidden", "8", "--delay", "2",
                     "--algorithms", "eprop", "pp_prop", "bptt")
    _check_histories(histories, ["eprop", "pp_prop", "bptt"])


@pytest.mark.slow  # two learners compiled and jitted: over 10 s
def test_copy_task_gru_runs_with_both_learners(tmp_path: Path) -> None:
    histories = _run(copy_task_gru, tmp_path, "--hidden", "6", "--length", "2", "--delay", "1")
    _check_histories(histories, ["d_rtrl", "bptt"])


@pytest.mark.slow  # two learners compiled and jitted: over 10 s
def test_evidence_accumulation_runs_with_both_online_learners(tmp_path: Path) -> None:
    result = _run(evidence_accumulation, tmp_path, "--hidden", "6", "--stimulus", "3", "--delay", "1")
    _check_histories(result["histories"], ["d_rtrl", "pp_prop"])
    assert set(result["psychometric"]) == {"d_rtrl", "pp_prop"}


def test_shd_classification_runs_on_synthetic_data(tmp_path: Path) -> None:
    histories = _run(shd_classification, tmp_path, "--hidden", "8", "--steps", "4", "--train-size", "20")
    _check_histories(histories, ["d_rtrl"])


def test_shd_classification_runs_on_an_shd_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shd_data.save_shd(tmp_path / "train.h5", shd_data.synthetic_shd(30, seed=5))
    histories = _run(shd_classification, tmp_path, "--hidden", "8", "--steps", "4", "--data", str(tmp_path / "train.h5"))
    _check_histories(histories, ["d_rtrl"])
    assert "SHD files" in capsys.readouterr().out


@pytest.mark.slow  # compile, jit and every font rendered: about 10 s
def test_digits_spiking_runs_on_font_digits(tmp_path: Path) -> None:
    histories = _run(digits_spiking, tmp_path, "--source", "fonts", "--font-samples", "40", "--hidden", "8",
                     "--steps", "4")
    _check_histories(histories, ["d_rtrl"])


def test_trainer_classification_prints_one_row_per_learner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    learner = "pp_prop"  # the rows and the other learners run in docs/tutorials/trainer.ipynb
    rows = trainer_classification.main(["--data", "spikes", "--learners", learner, "--epochs", "2", "--batch", "8",
                                        "--hidden", "8", "--steps", "4", "--train-size", "16", "--test-size", "5",
                                        "--root", str(tmp_path)])
    [row] = rows
    assert row.learner == learner and 0.0 <= row.accuracy <= 1.0 and row.step_memory_bytes > 0
    assert f"| {learner} |" in capsys.readouterr().out


def test_bad_arguments_are_rejected_with_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        delayed_match_lif.main(["--batch", "0"])
    assert "--batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        digits_spiking.main(["--max-rate", "2"])
    err = capsys.readouterr().err
    assert "--max-rate" in err and "2.0" in err
    with pytest.raises(SystemExit):
        copy_task_gru.main(["--algorithms", "no_such_rule"])
    assert "no_such_rule" in capsys.readouterr().err


def test_scripts_import_nothing_that_downloads() -> None:
    for name in ("delayed_match_lif", "copy_task_gru", "evidence_accumulation", "shd_classification",
                 "digits_spiking", "shd_data", "_common"):
        source = (EXAMPLES / f"{name}.py").read_text()
        for word in ("urllib", "requests", "http://", "https://", "fetch_openml", "pooch", "download("):
            assert word not in source, f"{name}.py mentions {word!r}"
        importlib.import_module(name)

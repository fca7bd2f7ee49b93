"""Sharded learners (``braintrace.compile(..., sharding=braintrace.Sharding(...))``) equal one device.

The sharded runs need several devices, so they run in subprocesses (this process keeps its one
CPU device): ``tests/algorithm/sharding_script.py`` with 8 simulated CPU devices runs every
case on one device and sharded (data parallel over 8, model parallel over 8, both over 2 × 4)
and reports the largest relative difference, ``max |sharded − one device| / max |one device|``
per array, of the gradients, the per-step losses and the final states (model states and
traces). The tolerance, ``TOL = 1e-5`` in float32, sits well above the reordered sums of a
split reduction (about 1e-7 here) and well below what a 0.1 % change of the weights does to the
gradients (the negative control, about 1e-3). Two processes with two devices each
(``jax.distributed`` on 127.0.0.1, gloo collectives) must give what one process with four
devices gives.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.sharding_script import cases

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5
TIMEOUT = 900


def _env(devices: int) -> dict[str, str]:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def _run_script(folder: Path, grid: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "tests.algorithm.sharding_script", str(folder), grid],
                            cwd=REPO, env=_env(8), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics: dict[str, Any] = json.loads((folder / "metrics.json").read_text())
    return metrics


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("sharding")
    return folder, _run_script(folder, "default")


def _check_case(name: str, row: dict[str, Any]) -> None:
    for what in ("grads", "loss", "states"):
        if row[what] is not None:
            assert row[what] < TOL, (name, what, row[what])
    assert row["misplaced"] == [], (name, row["misplaced"])


def test_every_case_equals_one_device(sharded: tuple[Path, dict[str, Any]]) -> None:
    _, metrics = sharded
    assert metrics["devices"] == 8
    assert sorted(metrics["cases"]) == sorted(case.name for case in cases("default"))
    for name, row in metrics["cases"].items():
        _check_case(name, row)


def test_the_tolerance_would_catch_a_small_change(sharded: tuple[Path, dict[str, Any]]) -> None:
    _, metrics = sharded
    assert metrics["negative_control"] > 100 * TOL


def test_states_are_split_along_the_named_axes(sharded: tuple[Path, dict[str, Any]]) -> None:
    _, metrics = sharded
    both = metrics["cases"]["rnn_d_rtrl/both/grad"]["specs"]
    assert both["('h',)"] == "P('data', 'model')"
    assert both["('W', 'weight')"] == "{'bias': P('model',), 'weight': P(None, 'model')}"
    trace = next(v for k, v in both.items() if "etrace_bwg" in k)
    assert trace == "{'bias': P('data', 'model', None), 'weight': P('data', None, 'model', None)}"
    data = metrics["cases"]["rnn_d_rtrl/data/grad"]["specs"]
    assert data["('W', 'weight')"] == "{'bias': P(None,), 'weight': P(None, None)}"  # replicated
    for name, row in metrics["cases"].items():
        if name.startswith("rnn_d_rtrl"):  # every D_RTRL trace has a batch and a unit axis
            assert row["trace_bytes_per_device"] * 8 == row["trace_bytes"], name
        else:  # pp_prop's input traces have no unit axis: split along the batch only
            assert row["trace_bytes"] // 8 < row["trace_bytes_per_device"] <= row["trace_bytes"] // 2, name


def test_per_device_trace_memory_falls_as_one_over_devices(sharded: tuple[Path, dict[str, Any]]) -> None:
    _, metrics = sharded
    for layout in ("data", "model"):
        assert metrics["memory"][layout] == [1.0, 0.5, 0.25, 0.125], layout


def test_the_split_step_holds_a_slice_of_the_trace(sharded: tuple[Path, dict[str, Any]]) -> None:
    # Per device: an eighth of the trace plus the step's other buffers (0.5 of the trace measured),
    # below a whole copy (the CPU row loop on a split batch: over 1, see the exhaustive test).
    assert sharded[1]["step_memory"] < 0.75


def test_sizes_the_mesh_does_not_divide_are_refused(sharded: tuple[Path, dict[str, Any]]) -> None:
    errors = sharded[1]["errors"]
    assert "batch_size=6 is not a multiple of the 4 devices of mesh axis 'model'" in errors["batch"]
    assert "('h',) has 6 units" in errors["hidden"] and "4 devices of mesh axis 'model'" in errors["hidden"]
    assert "no batch_size was given" in errors["unbatched"]


def test_a_reset_puts_the_states_back_on_the_mesh(sharded: tuple[Path, dict[str, Any]]) -> None:
    reset = sharded[1]["reset"]
    for vmap in (False, True):
        assert reset[f"reset/vmap={vmap}"] == []
        assert reset[f"overwritten/vmap={vmap}"] == ["('h',)"]  # the check itself sees a misplaced state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_processes_equal_one_process(sharded: tuple[Path, dict[str, Any]]) -> None:
    folder, _ = sharded
    port = str(_free_port())
    workers = [subprocess.Popen([sys.executable, "-m", "tests.algorithm.sharding_worker", str(folder), str(i), port],
                                cwd=REPO, env=_env(2), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outputs = [w.communicate(timeout=TIMEOUT) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for w, (_, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-4000:]
    multi, single = np.load(folder / "multihost.npz"), np.load(folder / "reference.npz")
    assert int(multi["process_count"]) == 2 and int(multi["local_devices"]) == 2
    keys = set(single.files)
    assert keys == set(multi.files) - {"process_count", "local_devices"}
    assert any(k.startswith("grad") for k in keys) and any(k.startswith("state") for k in keys)
    for key in keys:
        scale = max(float(np.max(np.abs(single[key]))), 1e-30)
        assert float(np.max(np.abs(multi[key] - single[key]))) / scale < TOL, key


@pytest.mark.exhaustive
def test_the_rest_of_the_grid_equals_one_device(tmp_path: Path) -> None:
    # The default grid's cases run above; together the two runs cover every case once.
    metrics = _run_script(tmp_path, "rest")
    rest = [case.name for case in cases("rest")]
    assert sorted(metrics["cases"]) == sorted(rest)
    assert sorted([*rest, *(case.name for case in cases("default"))]) == sorted(c.name for c in cases("exhaustive"))
    for name, row in metrics["cases"].items():
        _check_case(name, row)
    assert metrics["step_memory"] < 0.75 < metrics["step_memory_row_loop"]


# --- in this process (one device): the record and the compile option --------------------------


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def test_unknown_axis_lists_the_mesh_axes() -> None:
    with pytest.raises(ValueError, match=r"hidden='units' is not an axis of the mesh; its axes are \('data', 'model'\)"):
        braintrace.Sharding(_mesh(), hidden="units")


def test_bad_records_are_refused() -> None:
    with pytest.raises(ValueError, match="named for both"):
        braintrace.Sharding(_mesh(), batch="data", hidden=("model", "data"))
    with pytest.raises(ValueError, match="give batch="):
        braintrace.Sharding(_mesh())
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        braintrace.Sharding(jax.devices(), batch="data")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a braintrace.Sharding"):
        braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), "d_rtrl", jnp.ones((2, 3)), batch_size=2,
                           sharding="data")


def test_axes_taken_together() -> None:
    sharding = braintrace.Sharding(_mesh(), batch=["data", "model"])
    assert sharding.batch == ("data", "model") and sharding.batch_devices == 1
    learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), "d_rtrl", jnp.ones((2, 3)), batch_size=2,
                                 sharding=sharding)
    assert learner.sharding_plan.specs()[("h",)] == jax.sharding.PartitionSpec(("data", "model"), None)

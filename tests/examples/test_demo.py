"""``make demo``'s script runs end to end at a tiny size and reports every method."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import online_learning_demo  # noqa: E402


def test_demo_runs_and_reports_each_method(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    results = online_learning_demo.main(
        ["--iterations", "2", "--steps", "5", "--batch", "4", "--hidden", "8", "--plot", str(plot)])
    assert set(results) == {"BPTT", "D_RTRL", "pp_prop"}
    for r in results.values():
        assert r["final_loss"] > 0 and 0 <= r["accuracy"] <= 1
    assert plot.exists()


def test_every_method_learns_the_task(tmp_path: Path) -> None:
    """80 iterations at the default size: chance is a loss of ln 2 ≈ 0.69 and accuracy ≈ 0.5."""
    results = online_learning_demo.main(["--iterations", "80", "--plot", str(tmp_path / "demo.png")])
    for name, r in results.items():
        assert r["final_loss"] < 0.2 and r["accuracy"] > 0.9, (name, r)

"""``scripts/on_device.sh``: installs from ``.device-wheels/`` what the machine lacks, and only that.

An accelerator machine brings its own JAX, numpy and more (a GPU image: optax, matplotlib, ...);
a wheel of a distribution the machine has must not be installed over it, and one it lacks must be,
in the build for the machine's Python. The script runs here with this interpreter as ``python3``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "on_device.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the script is a bash script")


def _wheel(folder: pathlib.Path, name: str, version: str, module_source: str) -> None:
    """A minimal pure-Python wheel of distribution ``name`` holding the module ``name``."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module_source,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist_info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist_info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_only_the_distributions_the_machine_lacks_are_installed(tmp_path: pathlib.Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, checkout / "scripts")
    wheels = checkout / ".device-wheels"
    wheels.mkdir()
    _wheel(wheels, "on_device_probe_missing", "1.0", "ORIGIN = 'wheel'\n")
    _wheel(wheels, "pytest", "0.0.1", "raise ImportError('the wheel shadowed the installed pytest')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    site = tmp_path / "site"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "BRAINTRACE_DEVICE_SITE": str(site)}
    env.pop("PYTHONPATH", None)

    probe = "import on_device_probe_missing, pytest; print(on_device_probe_missing.__file__, pytest.__version__)"
    result = subprocess.run(["bash", str(checkout / "scripts" / "on_device.sh"), sys.executable, "-c", probe],
                            env=env, capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    probe_file, pytest_version = result.stdout.split()
    assert pathlib.Path(probe_file).parent == site
    assert pytest_version != "0.0.1" and not (site / "pytest.py").exists()


def test_without_wheels_it_names_the_make_target(tmp_path: pathlib.Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    result = subprocess.run(["bash", str(tmp_path / "scripts" / "on_device.sh"), "true"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "make device-wheels" in result.stderr

"""Pytest set-up shared by the whole suite.

The helper modules under ``tests/`` (reference gradients, model builders, case tables) check
their results with ``assert``. Registering them for pytest's assertion rewriting keeps those
checks under ``python -O`` too, which strips every other ``assert``; ``make test-optimized``
runs the suite that way (``tests/test_optimized_mode.py``).
"""

import importlib.util
import os
import pkgutil
import shutil
import tempfile

import pytest

import tests

pytest.register_assert_rewrite(*(f"tests.{m.name}" for m in pkgutil.iter_modules(tests.__path__)))


#: JAX's persistent compilation cache, read from these variables wherever JAX is imported.
_SHARED_CACHE = {"JAX_COMPILATION_CACHE_DIR": None, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                 # A size bound has JAX lock the folder (with filelock) around every read and write
                 # of an entry; unbounded, one process can read an entry another is still writing
                 # ("Error reading persistent compilation cache entry", an error under -W error).
                 "JAX_COMPILATION_CACHE_MAX_SIZE": str(16 << 30)}


def _share_compiled_programs(config: pytest.Config) -> None:
    """One XLA compilation cache for the run: its xdist workers, and the notebooks and scripts it starts.

    Many tests compile the same small programs (one model under several learners, parametrised
    cases, the notebooks' models), and a program found in the cache skips XLA's compilation,
    about half of a test's time on the CPU. The cache is a temporary folder removed when the run
    ends (set by the controller before it starts the workers, which inherit it); a cache folder
    already set in the environment is used as it is. Processes share it only under JAX's lock on
    the folder, which needs ``filelock`` (the test extra); without it every process compiles
    its own programs.
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or hasattr(config, "workerinput"):
        return
    if importlib.util.find_spec("filelock") is None:  # JAX locks the shared folder with it
        return
    folder = tempfile.mkdtemp(prefix="braintrace-tests-xla-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    for name, value in _SHARED_CACHE.items():
        os.environ.setdefault(name, folder if value is None else value)


def pytest_configure(config: pytest.Config) -> None:
    """A compilation cache shared by the run; on an accelerator, float32 matrix products at full
    precision for the whole run.

    An accelerator's default multiplies float32 in bfloat16 passes (about three digits on a TPU),
    and the suite's float32 comparisons are of rules, not of the hardware's rounding. On CPU the
    default already is full precision.
    """
    _share_compiled_programs(config)
    import jax

    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")

"""Pytest set-up shared by the whole suite.

The helper modules under ``tests/`` (reference gradients, model builders, case tables) check
their results with ``assert``. Registering them for pytest's assertion rewriting keeps those
checks under ``python -O`` too, which strips every other ``assert``; ``make test-optimized``
runs the suite that way (``tests/test_optimized_mode.py``).
"""

import os
import pkgutil
import shutil
import tempfile

import pytest

import tests

pytest.register_assert_rewrite(*(f"tests.{m.name}" for m in pkgutil.iter_modules(tests.__path__)))


#: JAX's persistent compilation cache settings, read from these variables wherever JAX is imported.
_CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
#: The run's cache folder, made by the process that starts the run (xdist workers inherit it).
_RUN_CACHE = "BRAINTRACE_TESTS_XLA_CACHE"


def _cache_compiled_programs(config: pytest.Config) -> None:
    """An XLA compilation cache per test process, kept for the run: the notebooks and scripts it starts share it.

    Many tests compile the same small programs (one model under several learners, parametrised
    cases, the notebooks' models), and a program found in the cache skips XLA's compilation,
    about half of a test's time on the CPU. The folders live in a temporary folder removed when
    the run ends. Each xdist worker has its own: JAX writes an entry in place, so a process could
    read an entry another is still writing ("Error reading persistent compilation cache entry",
    an error under ``-W error``); the kernels and scripts a worker starts run while it waits, one
    at a time. A cache folder the user set in the environment is used as it is.
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") and _RUN_CACHE not in os.environ:
        return
    if not hasattr(config, "workerinput"):  # the process that starts the run
        run_folder = tempfile.mkdtemp(prefix="braintrace-tests-xla-")
        config.add_cleanup(lambda: shutil.rmtree(run_folder, ignore_errors=True))
        os.environ[_RUN_CACHE] = run_folder
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ[_RUN_CACHE], worker)
    for name, value in _CACHE_SETTINGS.items():
        os.environ.setdefault(name, value)


def pytest_configure(config: pytest.Config) -> None:
    """A compilation cache per test process; on an accelerator, float32 matrix products at full
    precision for the whole run.

    An accelerator's default multiplies float32 in bfloat16 passes (about three digits on a TPU),
    and the suite's float32 comparisons are of rules, not of the hardware's rounding. On CPU the
    default already is full precision.
    """
    _cache_compiled_programs(config)
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR"))

    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")

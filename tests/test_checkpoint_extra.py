"""``save_checkpoint(extra=...)``: random states and big ints travel with the run, or are refused.

PRNG keys (typed and raw, brainstate's global key and ``RandomState``), NumPy generators and
Python ints beyond int64 come back with their type and value, both into a template and in a raw
load, and a restored generator or key draws what the saved one would have drawn. A value no
checkpoint stores is refused with a ``TypeError`` naming its key path, and nothing is written.
Files of format version 2 (before these values could be stored) still load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace


class Draw(NamedTuple):
    """A named tuple holding a key and a big counter."""

    key: Any
    count: int


def build() -> Any:
    return braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((2, 3)),
                              batch_size=2, seed=0)


def random_extra() -> dict[str, Any]:
    rng = np.random.default_rng(11)
    rng.random(5)  # a generator part-way through its stream
    return {
        "typed_key": jax.random.key(7),
        "rbg_keys": jax.random.split(jax.random.key(1, impl="rbg"), 3),
        "raw_key": jax.random.PRNGKey(5),
        "numpy": {"pcg": rng, "mt": np.random.Generator(np.random.MT19937(3))},
        "ints": [2**70, -(2**90), 2**63 - 1, -(2**63), 3],
    }


def template() -> dict[str, Any]:
    return {
        "typed_key": jax.random.key(0),
        "rbg_keys": jax.random.split(jax.random.key(0, impl="rbg"), 3),
        "raw_key": jax.random.PRNGKey(0),
        "numpy": {"pcg": np.random.default_rng(0), "mt": np.random.default_rng(0)},
        "ints": [0, 0, 0, 0, 0],
    }


def key_bits(key: Any) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


def assert_restored(restored: dict[str, Any], saved: dict[str, Any]) -> None:
    for name in ("typed_key", "rbg_keys"):
        assert jax.dtypes.issubdtype(restored[name].dtype, jax.dtypes.prng_key), name
        assert jax.random.key_impl(restored[name]) == jax.random.key_impl(saved[name])
        np.testing.assert_array_equal(key_bits(restored[name]), key_bits(saved[name]))
        draw = jax.vmap(lambda key: jax.random.uniform(key, (3,)))
        np.testing.assert_array_equal(draw(restored[name].reshape(-1)), draw(saved[name].reshape(-1)))
    assert restored["raw_key"].dtype == jnp.uint32
    np.testing.assert_array_equal(restored["raw_key"], saved["raw_key"])
    for name in ("pcg", "mt"):
        generator = restored["numpy"][name]
        assert isinstance(generator, np.random.Generator)
        assert type(generator.bit_generator) is type(saved["numpy"][name].bit_generator)
        np.testing.assert_array_equal(generator.random(4), saved["numpy"][name].random(4))  # the same stream on
    assert restored["ints"] == saved["ints"] and all(type(i) is int for i in restored["ints"])


def test_random_states_and_big_ints_round_trip_into_a_template(tmp_path: Path) -> None:
    extra = {**random_extra(), "draw": Draw(jax.random.key(9), 2**65)}
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", build(), extra=extra)
    restored = braintrace.load_checkpoint(path, build(), extra={**template(), "draw": Draw(jax.random.key(0), 0)})
    assert isinstance(restored["raw_key"], jax.Array)  # like the template's leaf
    assert_restored(restored, random_extra())
    assert isinstance(restored["draw"], Draw) and restored["draw"].count == 2**65
    np.testing.assert_array_equal(key_bits(restored["draw"].key), key_bits(jax.random.key(9)))


def test_random_states_and_big_ints_round_trip_in_a_raw_load(tmp_path: Path) -> None:
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", build(), extra=random_extra())
    raw = braintrace.load_checkpoint(path, build())
    assert isinstance(raw["raw_key"], np.ndarray)  # a raw load gives NumPy arrays
    raw["ints"] = [raw["ints"][str(i)] for i in range(len(raw["ints"]))]  # lists come back as {'0': ...}
    assert_restored(raw, random_extra())


def test_brainstate_random_state_and_global_key_round_trip(tmp_path: Path) -> None:
    saved_state = brainstate.random.RandomState(21)
    saved_state.random(3)
    global_key = brainstate.random.get_key()
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", build(),
                                      extra={"state": saved_state, "global": global_key})
    target = brainstate.random.RandomState(0)
    restored = braintrace.load_checkpoint(path, build(), extra={"state": target, "global": jax.random.key(0)})
    assert restored["state"] is target  # a State is restored in place
    np.testing.assert_array_equal(key_bits(target.value), key_bits(saved_state.value))
    np.testing.assert_array_equal(target.random(4), saved_state.random(4))
    brainstate.random.set_key(restored["global"])  # the documented way back
    np.testing.assert_array_equal(key_bits(brainstate.random.get_key()), key_bits(global_key))


@pytest.mark.parametrize(
    "extra, where",
    [
        ({"run": {"log": open}}, r"extra\['run'\]\['log'\] is a builtins.builtin_function_or_method"),
        ({"seen": {1, 2}}, r"extra\['seen'\] is a builtins.set"),
        ({"rows": [1, object()]}, r"extra\['rows'\]\[1\] is a builtins.object"),
        ({"table": np.array([{}, 1], dtype=object)}, r"extra\['table'\] is a NumPy array of Python objects"),
        ({"sub": {"__braintrace_extra__": 1}}, r"extra\['sub'\] is a dict with the key '__braintrace_extra__'"),
    ],
    ids=["function", "set", "object-in-list", "object-array", "reserved-key"],
)
def test_a_value_no_checkpoint_stores_is_refused_by_its_key_path_and_nothing_is_written(
    tmp_path: Path, extra: dict[str, Any], where: str,
) -> None:
    learner = build()
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", learner, extra={"epoch": 1})
    before = Path(path).read_bytes()
    learner(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=where + r".*Nothing was written"):
        braintrace.save_checkpoint(path, learner, extra={"epoch": 2, **extra})
    assert Path(path).read_bytes() == before and os.listdir(tmp_path) == ["run.ckpt"]
    with pytest.raises(TypeError, match=where):
        braintrace.save_checkpoint(tmp_path / "new.ckpt", learner, extra=extra)
    assert os.listdir(tmp_path) == ["run.ckpt"]


def test_a_template_of_another_kind_is_refused_and_nothing_is_restored(tmp_path: Path) -> None:
    saved = build()
    saved(jnp.ones((2, 3)))
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", saved, extra={"key": jax.random.key(1), "n": 2**70})
    learner, state = build(), brainstate.random.RandomState(0)
    before = key_bits(state.value)
    weights = {p: np.asarray(st.value["weight"]) for p, st in learner.param_states.items()}
    cases = [
        ({"key": jnp.zeros(2, jnp.uint32), "n": 0}, "extra['key']: the template holds an array or number, the "
                                                   "checkpoint a typed PRNG key"),
        ({"key": state, "n": ""}, "extra['n']: the template holds another value, the checkpoint a Python int"),
        ({"key": np.random.default_rng(0), "n": 0}, "the template holds an np.random.Generator, the checkpoint a "
                                                    "typed PRNG key"),
        ({"key": jax.random.split(jax.random.key(0), 2), "n": 0}, "PRNG key shape mismatch: expected (2,), got ()"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match="does not fit this learner; nothing was restored") as info:
            braintrace.load_checkpoint(path, learner, extra=extra)
        assert message in str(info.value)
    np.testing.assert_array_equal(key_bits(state.value), before)  # the template's State kept its value
    for p, st in learner.param_states.items():
        np.testing.assert_array_equal(np.asarray(st.value["weight"]), weights[p])


def test_a_template_state_is_written_only_when_everything_fits(tmp_path: Path) -> None:
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", build(), extra={"state": brainstate.random.RandomState(4)})
    other = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 5), braintrace.D_RTRL, jnp.ones((2, 3)), batch_size=2)
    state = brainstate.random.RandomState(0)
    before = key_bits(state.value)
    with pytest.raises(ValueError, match="does not fit this learner"):
        braintrace.load_checkpoint(path, other, extra={"state": state})
    np.testing.assert_array_equal(key_bits(state.value), before)


def test_version_2_files_still_load_and_newer_ones_are_refused(tmp_path: Path) -> None:
    learner = build()
    learner(jnp.ones((2, 3)))
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", learner, extra={"epoch": 3, "key": jax.random.PRNGKey(2)})
    raw = braintools.file.msgpack_load(path, parallel=False)
    assert raw["header"]["version"] == 3
    # Version 2 wrote the same layout; its extra held no tagged values.
    old = braintools.file.msgpack_save(tmp_path / "v2.ckpt", {**raw, "header": {**raw["header"], "version": 2}})
    resumed = build()
    restored = braintrace.load_checkpoint(old, resumed, extra={"epoch": 0, "key": jnp.zeros(2, jnp.uint32)})
    assert restored["epoch"] == 3
    np.testing.assert_array_equal(restored["key"], jax.random.PRNGKey(2))
    np.testing.assert_array_equal(resumed(jnp.ones((2, 3))), learner(jnp.ones((2, 3))))
    newer = braintools.file.msgpack_save(tmp_path / "v4.ckpt", {**raw, "header": {**raw["header"], "version": 4}})
    with pytest.raises(ValueError, match=r"has checkpoint format version 4; this braintrace reads versions \[1, 2, 3\]"):
        braintrace.load_checkpoint(newer, build())

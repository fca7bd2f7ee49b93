"""Random projection's rule record (``braintrace.uoro_rule``) on the group contract's learner.

Run alone by ``braintrace.compile(model, braintrace.uoro_rule(), x0, key=k)``, the record gives
the random-projection engine's single-step gradients draw for draw (the same seed), step by
step, in float64: on one group that mixes its units, a group of two states per unit, two
groups (one key split between them every step), a GRU (a gate that reaches ``h`` only through
another weight), batched and unbatched. Negative controls: another ``eps`` or another key, and
a weight tied between two relations of a group, which the engine credits with one factor (the
record keeps one per relation operand, as its module says). Then the learner's contract: its
refusals, its carriers, reset, checkpoints and the key.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.rules.projection_rule import UOROCarrier
from tests.algorithm.bptt import max_rel_err, normal, per_step_grads, x64  # noqa: F401  (a fixture)
from tests.algorithm.test_uoro import Adaptive, Islands, TanhRNN, TiedRNN

T = 4
EXACT = 1e-10


def _gru() -> brainstate.nn.Module:
    brainstate.random.seed(5)
    return braintrace.nn.GRUCell(3, 4)


def _compile(model: brainstate.nn.Module, algorithm: Any, batch_size: int | None = None, **options: Any) -> Any:
    x0 = normal(31, (3,) if batch_size is None else (batch_size, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, x0, batch_size=batch_size, **options)


def _engine(model: brainstate.nn.Module, seed: int, batch_size: int | None = None) -> Any:
    return _compile(model, braintrace.RandomProjectionVjpAlgorithm, batch_size, vjp_method="single-step",
                    projection_key=seed)


def _record(model: brainstate.nn.Module, seed: int, batch_size: int | None = None, eps: float = 1e-12) -> Any:
    return _compile(model, braintrace.uoro_rule(eps), batch_size, key=seed)


def _xs(batch_size: int | None = None) -> jax.Array:
    return normal(32, (T, 3) if batch_size is None else (T, batch_size, 3))


@pytest.mark.parametrize(
    ("model", "batch_size"),
    [(TanhRNN, None), (Adaptive, None), (Islands, None), (_gru, None), (_gru, 2)],
    ids=["mixing", "two-states", "two-groups", "gru", "gru-batched"],
)
def test_the_record_equals_the_engine_step_by_step(x64: None, model: Callable[[], Any], batch_size: int | None) -> None:
    xs = _xs(batch_size)
    want = per_step_grads(_engine(model(), 7, batch_size), xs)
    got = per_step_grads(_record(model(), 7, batch_size), xs)
    assert set(got) == set(want)
    assert all(np.any(want[p][1:] != 0) for p in want)  # the factors reach every weight
    assert max_rel_err(want, got) < EXACT


@pytest.mark.parametrize("changed", ["eps", "key"])
def test_another_eps_or_key_gives_other_gradients(x64: None, changed: str) -> None:
    xs = _xs()
    want = per_step_grads(_engine(TanhRNN(), 7), xs)
    other = _record(TanhRNN(), 7, eps=1e-2) if changed == "eps" else _record(TanhRNN(), 8)
    assert max_rel_err(want, per_step_grads(other, xs)) > 1e-3


def test_a_weight_tied_between_relations_has_one_factor_in_the_engine_and_two_in_the_record(x64: None) -> None:
    xs = _xs()
    record = _record(TiedRNN(), 7)
    (carrier,) = record.get_etrace_of(("w_in",)).values()
    assert len(carrier.theta_tilde) == 3  # w_in twice, w_rec once
    assert max_rel_err(per_step_grads(_engine(TiedRNN(), 7), xs), per_step_grads(record, xs)) > 1e-3


def test_the_learner_holds_the_records_carriers_and_resets_them_with_the_key() -> None:
    learner = _record(_gru(), 3, batch_size=2)
    (carrier,) = learner.get_etrace_of(("Wh", "weight")).values()
    assert isinstance(carrier, UOROCarrier) and carrier.s_tilde.shape == (2, 4, 1)
    assert [sorted(theta) for theta in carrier.theta_tilde] == [["bias", "weight"]] * 3  # three gates
    key = np.asarray(learner.rule_key.value)
    learner(normal(33, (2, 3)))
    assert not np.array_equal(np.asarray(learner.rule_key.value), key)
    learner.reset_state(batch_size=5)
    (carrier,) = learner.get_etrace_of(("Wh", "weight")).values()
    assert carrier.s_tilde.shape == (5, 4, 1) and not np.any(np.asarray(carrier.s_tilde))
    assert carrier.theta_tilde[0]["weight"].shape == (7, 4)
    np.testing.assert_array_equal(np.asarray(learner.rule_key.value), key)


def test_a_run_after_reset_repeats_bit_for_bit() -> None:
    learner = _record(TanhRNN(), 3)
    first = per_step_grads(learner, _xs())
    learner.reset()  # the model's states and the learner's carriers and key
    again = per_step_grads(learner, _xs())
    for p in first:
        np.testing.assert_array_equal(first[p], again[p])


def _one_step(**fields: Any) -> braintrace.GroupRule:
    rule = braintrace.GroupRule(init=lambda info: jnp.zeros(()), roll=lambda c, step: c,
                                solve=lambda c, g, step: tuple({} for _ in step.xs))
    return rule._replace(**fields)


@pytest.mark.parametrize(
    ("rule", "options", "error", "match"),
    [
        (_one_step(roll=None), {}, TypeError, "roll must be callable"),
        (_one_step(), {"vjp_method": "multi-step"}, ValueError, "single-step calls"),
        (_one_step(), {"key": 1.5}, TypeError, "key must be an integer seed or a PRNG key"),
        (_one_step(init=lambda info: 0.0), {}, TypeError, "pytree of JAX arrays"),
    ],
)
def test_a_mistake_in_the_rule_or_its_options_is_refused_at_compile(
    rule: Any, options: Any, error: type[Exception], match: str,
) -> None:
    with pytest.raises(error, match=match):
        _compile(TanhRNN(), rule, **options)


def test_a_solve_that_misses_a_relation_is_refused_naming_them() -> None:
    learner = _compile(TanhRNN(), _one_step(solve=lambda c, g, step: ({},)))
    with pytest.raises(ValueError, match=r"one dict per relation of hidden group 0 \(2"):
        brainstate.transform.grad(lambda: learner(normal(33, (3,))).sum(), learner.param_states)()


def test_a_solve_for_an_unknown_operand_is_refused() -> None:
    learner = _compile(TanhRNN(), _one_step(solve=lambda c, g, step: tuple({"kernel": 0.0} for _ in step.xs)))
    with pytest.raises(ValueError, match="not trainable operands"):
        brainstate.transform.grad(lambda: learner(normal(33, (3,))).sum(), learner.param_states)()


def test_bad_eps_is_refused_by_the_record() -> None:
    with pytest.raises(ValueError, match="eps must be a positive"):
        braintrace.uoro_rule(0.0)


def test_get_etrace_of_an_unknown_weight_names_the_fix() -> None:
    with pytest.raises(ValueError, match="no carrier of the given weight"):
        _record(TanhRNN(), 0).get_etrace_of(("nope",))


def test_a_checkpoint_restores_the_carriers_and_the_key(tmp_path: Any) -> None:
    learner = _record(_gru(), 3, batch_size=2)
    learner(normal(33, (2, 3)))
    path = str(tmp_path / "group_rule")
    braintrace.save_checkpoint(path, learner)
    saved = [np.asarray(v) for v in jax.tree.leaves((learner.carriers.read(), learner.rule_key.value))]
    learner(normal(34, (2, 3)))
    moved = [np.asarray(v) for v in jax.tree.leaves((learner.carriers.read(), learner.rule_key.value))]
    assert not all(np.array_equal(a, b) for a, b in zip(saved, moved))
    braintrace.load_checkpoint(path, learner)
    restored = [np.asarray(v) for v in jax.tree.leaves((learner.carriers.read(), learner.rule_key.value))]
    assert all(np.array_equal(a, b) for a, b in zip(saved, restored))

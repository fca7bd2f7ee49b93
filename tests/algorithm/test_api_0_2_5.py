"""The learner-level API changes of upstream 0.2.5+ (spec ``rules-0.2.5.md`` §7 items 5–7)."""

from __future__ import annotations

import brainstate
import jax
import jax.numpy as jnp
import pytest

import braintrace
from braintrace._compile import ALGORITHM_NAMES


def cell() -> brainstate.nn.Module:
    return braintrace.nn.ValinaRNNCell(3, 4)


@pytest.mark.parametrize("name, cls", [("uoro", "UORO"), ("three_factor", "ThreeFactor"), ("dni", "DNI"),
                                       ("snap", "SnAp")])
def test_the_post_0_2_4_compile_names(name: str, cls: str) -> None:
    assert ALGORITHM_NAMES[name] is getattr(braintrace, cls)
    learner = braintrace.compile(cell(), name.upper(), jnp.ones(3))  # names are case-insensitive
    assert type(learner).__name__ == cls


def test_an_unknown_name_is_raised_without_chaining() -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'three-factor'") as err:
        braintrace.compile(cell(), "three-factor", jnp.ones(3))
    assert err.value.__cause__ is None and err.value.__context__ is None


def test_keyword_options_are_forwarded_by_call_and_update_never_to_the_model() -> None:
    learner = braintrace.compile(cell(), "three_factor", jnp.ones(3))  # the cell's update takes x only
    assert learner(jnp.ones(3), modulator=1.0).shape == (4,)
    assert learner.update(jnp.ones(3), modulator=jnp.ones(4)).shape == (4,)


@pytest.mark.parametrize("name", ["d_rtrl", "pp_prop", "eprop", "snap", "uoro"])
def test_a_learner_without_options_refuses_a_keyword_by_name(name: str) -> None:
    kwargs = {"decay_or_rank": 0.9} if name == "pp_prop" else {}
    learner = braintrace.compile(cell(), name, jnp.ones(3), **kwargs)
    with pytest.raises(TypeError, match=r"keyword option\(s\) gain= .*passed positionally"):
        learner(jnp.ones(3), gain=2.0)
    assert int(learner.running_index.value) == 0


def test_every_vjp_learner_exposes_its_config() -> None:
    for name in ("d_rtrl", "eprop", "ostl_recurrent", "snap", "uoro", "three_factor", "dni"):
        learner = braintrace.compile(cell(), name, jnp.ones(3))
        assert isinstance(learner.config, braintrace.ETraceConfig), name


class Readout(brainstate.nn.Module):
    """Hidden width 5, readout width 2."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = braintrace.nn.ValinaRNNCell(3, 5)
        self.out = brainstate.ParamState(jnp.ones((5, 2)) / 5)

    def update(self, x: jax.Array) -> jax.Array:
        return self.cell(x) @ self.out.value


@pytest.mark.parametrize("config", [
    braintrace.ETraceConfig(learning_signal="random_feedback"),
    braintrace.ETraceConfig(trace_factorization="io_factorized", decay=0.9, learning_signal="random_feedback"),
], ids=["per_param", "io_factorized"])
def test_random_feedback_is_hidden_to_hidden_when_the_readout_is_narrower(config: braintrace.ETraceConfig) -> None:
    learner = braintrace.compile(Readout(), config, jnp.ones(3), random_feedback_key=0)
    assert [fb.B.shape for fb in learner._feedback_matrices.values()] == [(5, 5)]  # F-28: never readout-sized
    grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    assert grads[("cell", "W", "weight")]["weight"].shape == (8, 5)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))

"""A registered rule is the contract for its primitive.

A user primitive whose registered ``xy_to_dw`` returns ``factor`` times the derivative of its
forward pass must make the learners' gradient of its weight ``factor`` times the gradient with
the exact rule, in single-step and multi-step mode, for D_RTRL and pp_prop, the same-step term
included (JAX's own derivative of the forward pass would give the unscaled same-step term). The
same holds for a rule a user registers on one of the library's primitives: the library's
closed-form kernels, which compute the library's rules, then step aside.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._op import _registries as reg
from braintrace._op import etp_mm_p
from tests.algorithm.bptt import Grads, bptt_grads, max_rel_err, normal, single_step_grads, window_grads, x64

__all__ = ["x64"]  # the fixture is used by name

T, B, I, O = 5, 2, 3, 4


def _impl(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _dt_to_t(hidden_dim: jax.Array, trace: dict[str, jax.Array], **params: Any) -> dict[str, jax.Array]:
    return {"weight": trace["weight"] * hidden_dim[..., None, :]}


def _init_drtrl(x_var: Any, y_var: Any, weight_vars: dict[str, Any], num_state: int) -> dict[str, jax.Array]:
    shape = (x_var.aval.shape[0], *weight_vars["weight"].aval.shape, num_state)
    return {"weight": jnp.zeros(shape, y_var.aval.dtype)}


def _init_pp(x_var: Any, y_var: Any, weight_vars: dict[str, Any], num_state: int) -> jax.Array:
    return jnp.zeros((*y_var.aval.shape, num_state), y_var.aval.dtype)


def scaled_xy_to_dw(factor: float) -> Any:
    def xy_to_dw(x: jax.Array, hidden_dim: jax.Array, weights: dict[str, jax.Array], **params: Any) -> dict[str, jax.Array]:
        _, vjp = jax.vjp(lambda w: x @ w, weights["weight"])
        return {"weight": factor * vjp(hidden_dim)[0]}

    return xy_to_dw


def user_primitive(name: str, factor: float) -> Any:
    p = braintrace.register_primitive(name, _impl, batched=True)
    p.register_etp_rules(dt_to_t=_dt_to_t, xy_to_dw=scaled_xy_to_dw(factor), init_drtrl=_init_drtrl, init_pp=_init_pp)
    return p


EXACT_RULE = user_primitive("test_exact_rule_mm", 1.0)
DOUBLED_RULE = user_primitive("test_doubled_rule_mm", 2.0)


class Model(brainstate.nn.Module):
    """``h = 0.5 h + tanh(y)``, ``y = op(x, W)``; output ``h R + 0.3 Σ y`` (a direct ``y`` path)."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op
        self.w = brainstate.ParamState(normal(0, (I, O), 0.5))
        self.r = brainstate.ParamState(normal(1, (O, 2), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, O)))

    def update(self, x: Any) -> Any:
        y = self.op(x, self.w.value)
        self.h.value = 0.5 * self.h.value + jnp.tanh(y)
        return self.h.value @ self.r.value + 0.3 * jnp.sum(y, axis=-1, keepdims=True)


def _bind(primitive: Any) -> Any:
    return lambda x, w: primitive.bind(x, w)


LEARNERS = {
    "d_rtrl": (braintrace.D_RTRL, {}),
    "pp_prop": (braintrace.pp_prop, {"decay_or_rank": 0.8}),
}


def _grads(op: Any, learner: str, vjp_method: str) -> Grads:
    cls, options = LEARNERS[learner]
    xs = normal(2, (T, B, I))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        online = braintrace.compile(Model(op), cls, xs[0], batch_size=B, vjp_method=vjp_method, **options)
    if vjp_method == "single-step":
        return single_step_grads(online, xs)
    return window_grads(online, xs, [2, 3])


@pytest.mark.parametrize("vjp_method", ["single-step", "multi-step"])
@pytest.mark.parametrize("learner", sorted(LEARNERS))
def test_a_doubled_xy_to_dw_doubles_the_weight_gradient(learner: str, vjp_method: str) -> None:
    exact = _grads(_bind(EXACT_RULE), learner, vjp_method)
    doubled = _grads(_bind(DOUBLED_RULE), learner, vjp_method)
    assert np.all(exact[("w",)] != 0)
    np.testing.assert_allclose(doubled[("w",)], 2 * exact[("w",)], rtol=1e-6)
    # The readout does not go through the primitive: its gradient is unchanged.
    np.testing.assert_allclose(doubled[("r",)], exact[("r",)], rtol=1e-6)


def test_the_exact_user_rule_equals_bptt_on_the_first_step(x64: None) -> None:
    """Differentiating by the registered rule is exact when the rule is (one step from reset)."""
    xs = normal(2, (1, B, I))
    ref = bptt_grads(Model(_bind(EXACT_RULE)), xs, batch_size=B)
    for learner in sorted(LEARNERS):
        cls, options = LEARNERS[learner]
        online = braintrace.compile(Model(_bind(EXACT_RULE)), cls, xs[0], batch_size=B, **options)
        assert max_rel_err(ref, single_step_grads(online, xs)) < 1e-10


@pytest.mark.parametrize("vjp_method", ["single-step", "multi-step"])
@pytest.mark.parametrize("learner", sorted(LEARNERS))
def test_a_rule_registered_on_a_library_primitive_replaces_its_fast_paths(learner: str, vjp_method: str) -> None:
    op = lambda x, w: braintrace.matmul(x, w)  # noqa: E731
    exact = _grads(op, learner, vjp_method)
    assert reg.has_library_rules(etp_mm_p) and reg.get_fast_path_rules(etp_mm_p) is not None
    library = reg.ETP_RULES_XY_TO_DW[etp_mm_p]
    etp_mm_p.register_xy_to_dw(lambda x, hd, w, **p: {k: 2 * v for k, v in library(x, hd, w, **p).items()})
    try:
        assert not reg.has_library_rules(etp_mm_p)
        assert reg.get_fast_path_rules(etp_mm_p) is None and reg.get_instant_drtrl_rule(etp_mm_p) is None
        doubled = _grads(op, learner, vjp_method)
    finally:
        etp_mm_p.register_xy_to_dw(library)
    assert reg.has_library_rules(etp_mm_p) and reg.get_fast_path_rules(etp_mm_p) is not None
    np.testing.assert_allclose(doubled[("w",)], 2 * exact[("w",)], rtol=1e-5)


def test_rules_installed_one_at_a_time_are_checked_when_compiling() -> None:
    """Upstream's per-rule methods and table writes install a rule without a check; compiling a
    model that uses a primitive still without a required rule names the primitive and the rule."""
    p = braintrace.register_primitive("test_piecemeal_half_mm", _impl, batched=True)
    p.register_dt_to_t(_dt_to_t)
    reg.ETP_RULES_XY_TO_DW[p] = scaled_xy_to_dw(1.0)
    p.register_init_pp(_init_pp)
    for cls, options in LEARNERS.values():
        with pytest.raises(braintrace.CompilationError,
                           match=r"'test_piecemeal_half_mm' \(met at the operation on weight \('w',\).*\) has no "
                                 r"init_drtrl rule.*register_etp_rules\(init_drtrl=\.\.\.\)"):
            braintrace.compile(Model(_bind(p)), cls, normal(2, (B, I)), batch_size=B, **options)


@pytest.mark.parametrize("learner", sorted(LEARNERS))
def test_a_complete_piecemeal_registration_trains_like_one_call(learner: str) -> None:
    p = braintrace.register_primitive("test_piecemeal_mm", _impl, batched=True)
    p.register_dt_to_t(_dt_to_t)
    p.register_xy_to_dw(scaled_xy_to_dw(1.0))
    reg.ETP_RULES_INIT_DRTRL[p] = _init_drtrl
    reg.ETP_RULES_INIT_PP[p] = _init_pp
    got, want = _grads(_bind(p), learner, "single-step"), _grads(_bind(EXACT_RULE), learner, "single-step")
    assert set(got) == set(want) and np.all(got[("w",)] != 0)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-6)


def test_a_user_fast_path_is_kept() -> None:
    """A fast path the user registers is part of their contract, not a library shortcut."""
    p = user_primitive("test_own_fast_path_mm", 1.0)
    kernels = reg.ETP_FAST_PATH_RULES[etp_mm_p]
    own = reg.FastPathRules(
        instant=lambda x, df, has_bias: kernels.instant(x, df, has_bias),
        recurrent=kernels.recurrent, solve=kernels.solve, applicable=kernels.applicable,
    )
    p.register_etp_rules(fast_path=own)
    assert reg.get_fast_path_rules(p) is own


class _UserRolledEProp(braintrace.EProp):
    """EProp whose trace roll is user code: random feedback then takes its three terms as they are."""

    def _step_relation(self, *args: Any) -> Any:
        return super()._step_relation(*args)


def test_random_feedback_takes_the_same_step_term_from_a_user_fast_path(x64: None) -> None:
    """A user fast path without ``solve_instant`` builds the same-step term ``x ⊗ df`` that random
    feedback subtracts: with an ``instant`` of twice ``x ⊗ df`` (the user's contract), the
    gradient equals the three terms read off the traces that this ``instant`` rolled."""
    p = user_primitive("test_doubled_instant_mm", 1.0)
    kernels = reg.ETP_FAST_PATH_RULES[etp_mm_p]
    doubled = reg.FastPathRules(
        instant=lambda x, df, has_bias: {k: 2 * v for k, v in kernels.instant(x, df, has_bias).items()},
        recurrent=kernels.recurrent, solve=kernels.solve, applicable=kernels.applicable,
    )
    p.register_etp_rules(fast_path=doubled)
    xs = normal(3, (4, B, I))
    grads = {}
    for cls in (braintrace.EProp, _UserRolledEProp):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learner = braintrace.compile(Model(_bind(p)), cls, xs[0], batch_size=B, feedback="random",
                                         random_feedback_key=0)
        grads[cls] = single_step_grads(learner, xs)
    assert max_rel_err(grads[_UserRolledEProp], grads[braintrace.EProp]) < 1e-10


def test_a_rule_with_the_wrong_gradient_shape_is_named() -> None:
    p = braintrace.register_primitive("test_bad_rule_mm", _impl, batched=True)
    p.register_etp_rules(
        dt_to_t=_dt_to_t, init_drtrl=_init_drtrl, init_pp=_init_pp,
        xy_to_dw=lambda x, hd, weights, **params: {"weight": jnp.ones((B, I, O))},  # per sample
    )
    xs = normal(2, (1, B, I))
    online = braintrace.compile(Model(_bind(p)), braintrace.D_RTRL, xs[0], batch_size=B)
    with pytest.raises(ValueError, match=r"test_bad_rule_mm returned a 'weight' gradient of shape \(2, 3, 4\)"):
        single_step_grads(online, xs)


class InScan(brainstate.nn.Module):
    """The user primitive inside a 3-step inner scan, descended when not unrolled."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(0, (I, O), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, O)))

    def update(self, x: Any) -> Any:
        def body(h: Any, _: Any) -> tuple[Any, None]:
            return 0.5 * h + jnp.tanh(EXACT_RULE.bind(x, self.w.value)), None

        self.h.value = jax.lax.scan(body, self.h.value, None, length=3)[0]
        return self.h.value


def test_user_rules_inside_a_descended_scan_are_refused_with_the_fix() -> None:
    policy = braintrace.ControlFlowPolicy(scan_unroll_limit=1)
    with pytest.raises(braintrace.NotSupportedError, match="scan_unroll_limit"):
        braintrace.compile(InScan(), braintrace.D_RTRL, normal(2, (B, I)), batch_size=B, control_flow=policy)

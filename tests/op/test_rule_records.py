"""One frozen rule record per ETP primitive, the single source of truth of the registries.

``register_etp_rules`` refuses to leave a primitive without a rule every learner needs; rules
installed one at a time are checked by ``required_rules`` (what compilation calls). Upstream's
per-fact tables are live views onto the records: reads and writes go through them, and a
refused write changes nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest
from jax.extend.core import Primitive

import braintrace
from braintrace._op import _registries as reg
from braintrace._op import etp_elemwise_p, etp_mm_p, etp_mv_p
from braintrace._op._rule_record import add_primitive, etp_primitives


def _impl(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _rule(*args: Any, **kwargs: Any) -> Any:
    return {}


def _record(primitive: Any) -> reg.EtpRules:
    record = reg.get_etp_rules(primitive)
    assert record is not None, primitive
    return record


def _snapshot() -> dict[Any, reg.EtpRules | None]:
    return {p: reg.get_etp_rules(p) for p in etp_primitives()}


def _fresh(name: str = "t_record") -> Any:
    return braintrace.register_primitive(name, _impl, batched=True)


def test_register_primitive_writes_one_record_with_the_family_facts() -> None:
    fn = lambda params: {"weight": 1}  # noqa: E731
    p = braintrace.register_primitive("t_facts", _impl, gradient_enabled=True, trainable_invars_fn=fn,
                                      x_invar_index=None, y_outvar_index=0)
    assert reg.get_etp_rules(p) == reg.EtpRules(gradient_enabled=True, x_invar_index=None, trainable_invars_fn=fn)
    assert _record(p).missing_rules() == reg.REQUIRED_RULES
    assert reg.get_etp_rules(jax.lax.add_p) is None and reg.get_etp_rules("etp_mm") is None


def test_register_etp_rules_refuses_a_primitive_left_without_a_required_rule() -> None:
    p = _fresh("t_half")
    before = reg.get_etp_rules(p)
    with pytest.raises(ValueError, match=r"register_etp_rules: ETP primitive 't_half' has no dt_to_t or "
                                         r"init_drtrl rule.*register_etp_rules\(dt_to_t=\.\.\., init_drtrl=\.\.\."):
        p.register_etp_rules(xy_to_dw=_rule, init_pp=_rule)
    assert reg.get_etp_rules(p) is before  # nothing installed, not even the rules that were given


def test_register_etp_rules_accepts_rules_installed_before_it() -> None:
    p = _fresh()
    p.register_dt_to_t(_rule)
    p.register_init_drtrl(_rule)
    p.register_etp_rules(xy_to_dw=_rule, snap_anchor=reg.snap_anchored)
    record = _record(p)
    assert (record.dt_to_t, record.xy_to_dw, record.init_drtrl, record.snap_anchor) == (
        _rule, _rule, _rule, reg.snap_anchored)
    assert record.missing_rules() == () and record.init_pp is None


def test_required_rules_names_what_piecemeal_registration_left_out() -> None:
    p = _fresh("t_piecemeal")
    p.register_dt_to_t(_rule)
    reg.ETP_RULES_XY_TO_DW[p] = _rule
    with pytest.raises(braintrace.CompilationError,
                       match=r"'t_piecemeal' \(met at weight \('w',\)\) has no init_drtrl rule; every learner "
                             r"needs dt_to_t, xy_to_dw and init_drtrl.*register_etp_rules\(init_drtrl=\.\.\.\)"):
        reg.required_rules(p, used_at="weight ('w',)")
    p.register_init_drtrl(_rule)
    assert reg.required_rules(p) == reg.RequiredRules(_rule, _rule, _rule)
    with pytest.raises(braintrace.CompilationError, match="has no dt_to_t or xy_to_dw or init_drtrl"):
        reg.required_rules(jax.lax.add_p)


def test_a_table_write_replaces_the_record_and_a_read_sees_it() -> None:
    p = _fresh()
    old = _record(p)
    reg.ETP_RULES_INIT_PP[p] = _rule
    new = _record(p)
    assert new is not old and old.init_pp is None and new.init_pp is _rule
    assert p in reg.ETP_RULES_INIT_PP and reg.ETP_RULES_INIT_PP[p] is _rule
    assert dict(reg.ETP_RULES_INIT_PP)[p] is _rule and p in list(reg.ETP_RULES_INIT_PP)
    del reg.ETP_RULES_INIT_PP[p]
    assert p not in reg.ETP_RULES_INIT_PP and reg.ETP_RULES_INIT_PP.get(p) is None
    with pytest.raises(KeyError):
        del reg.ETP_RULES_INIT_PP[p]
    reg.ETP_X_INVAR_INDICES[p] = None
    assert reg.get_x_invar_index(p) is None and reg.ETP_X_INVAR_INDICES[p] is None


@pytest.mark.parametrize(
    "write, error, match",
    [
        (lambda p: reg.ETP_RULES_DT_TO_T.__setitem__(p, 3), TypeError,  # type: ignore[assignment]
         r"dt_to_t rule must be callable, got int"),
        (lambda p: reg.ETP_FAST_PATH_RULES.__setitem__(p, (1, 2)), TypeError,  # type: ignore[assignment]
         "FastPathRules"),
        (lambda p: reg.ETP_Y_OUTVAR_INDICES.__setitem__(p, -1), TypeError, "y_outvar_index must be a non-negative int"),
        (lambda p: reg.ETP_X_INVAR_INDICES.__delitem__(p), TypeError, "x_invar_index is a fact of every ETP primitive"),
        (lambda p: reg.BATCHED_COUNTERPARTS.__setitem__(p, jax.lax.add_p), ValueError, "not an ETP primitive"),
        (lambda p: reg.ETP_RULES_DT_TO_T.__setitem__(jax.lax.add_p, _rule), ValueError,
         "add is not an ETP primitive; create it with braintrace.register_primitive"),
        (lambda p: reg.BATCHED_PRIMITIVES.add(jax.lax.add_p), ValueError, "not an ETP primitive"),
        (lambda p: reg.ETP_PRIMITIVES.add("etp_mm"), TypeError,  # type: ignore[arg-type]
         "expected a JAX Primitive"),
        (lambda p: p.register_init_pp(None), TypeError, "register_init_pp: the init_pp rule must be callable"),
    ],
)
def test_a_refused_write_names_the_problem_and_changes_nothing(write: Any, error: type, match: str) -> None:
    p = _fresh()
    before = _snapshot()
    with pytest.raises(error, match=match):
        write(p)
    after = _snapshot()
    assert list(after) == list(before) and all(after[k] is v for k, v in before.items())


def test_the_primitive_sets_are_views_onto_the_records() -> None:
    p = _fresh()
    assert p in reg.ETP_PRIMITIVES and p in reg.BATCHED_PRIMITIVES and p not in reg.GRADIENT_ENABLED_PRIMITIVES
    assert reg.GRADIENT_ENABLED_PRIMITIVES >= {etp_elemwise_p} and etp_mm_p not in reg.GRADIENT_ENABLED_PRIMITIVES
    reg.BATCHED_PRIMITIVES.discard(p)
    assert not _record(p).batched and not reg.is_batched_primitive(p)
    reg.GRADIENT_ENABLED_PRIMITIVES.add(p)
    assert _record(p).gradient_enabled and reg.is_etp_enable_gradient_primitive(p)
    assert list(reg.ETP_PRIMITIVES) == etp_primitives() and len(reg.ETP_PRIMITIVES) == len(etp_primitives())
    hand_made = Primitive("t_hand_made")
    reg.ETP_PRIMITIVES.add(hand_made)
    try:
        assert reg.get_etp_rules(hand_made) == reg.EtpRules() and reg.is_etp_primitive(hand_made)
    finally:
        reg.ETP_PRIMITIVES.discard(hand_made)
    assert not reg.is_etp_primitive(hand_made) and hand_made not in reg.ETP_X_INVAR_INDICES


def test_the_batched_counterpart_is_a_fact_of_the_record() -> None:
    assert _record(etp_mv_p).batched_counterpart is etp_mm_p
    assert reg.BATCHED_COUNTERPARTS[etp_mv_p] is etp_mm_p and etp_mm_p not in reg.BATCHED_COUNTERPARTS


def test_a_rule_written_into_a_library_table_is_a_users_rule() -> None:
    library = _record(etp_mm_p)
    assert reg.has_library_rules(etp_mm_p) and reg.get_fast_path_rules(etp_mm_p) is library.fast_path
    reg.ETP_RULES_SOLVE_DRTRL[etp_mm_p] = _rule
    try:
        assert not reg.has_library_rules(etp_mm_p)
        assert reg.get_fast_path_rules(etp_mm_p) is None and reg.get_instant_drtrl_rule(etp_mm_p) is None
        assert reg.get_solve_drtrl_rule(etp_mm_p) is _rule
    finally:
        add_primitive(etp_mm_p, library)
    assert reg.has_library_rules(etp_mm_p) and reg.get_etp_rules(etp_mm_p) == library
    # A SnAp rule decides no gradient: replacing it keeps the library's kernels in force.
    reg.ETP_RULES_SNAP_ANCHOR[etp_mm_p] = lambda params: False
    try:
        assert reg.has_library_rules(etp_mm_p) and not reg.is_snap_anchored(etp_mm_p, {})
    finally:
        add_primitive(etp_mm_p, library)

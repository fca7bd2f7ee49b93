"""The ``_op`` package re-exports the 0.2.5 registries and their accessors (the same objects)."""

from __future__ import annotations

import jax
import pytest

import braintrace._op as op
from braintrace._op import _registries

REEXPORTED = [
    "BATCHED_COUNTERPARTS",
    "register_batched_counterpart",
    "get_batched_counterpart",
    "ETP_RULES_INSTANT_DRTRL",
    "ETP_RULES_SOLVE_DRTRL",
    "get_instant_drtrl_rule",
    "get_solve_drtrl_rule",
    "ETP_RULES_SNAP_ANCHOR",
    "ETP_RULES_SNAP_ADJACENCY",
    "is_snap_anchored",
    "get_snap_adjacency_rule",
]


@pytest.mark.parametrize("name", REEXPORTED)
def test_the_package_reexports_the_registry_object(name: str) -> None:
    assert name in op.__all__
    assert getattr(op, name) is getattr(_registries, name)


def test_batched_counterparts_are_what_get_batched_counterpart_reads() -> None:
    assert op.BATCHED_COUNTERPARTS[op.etp_mv_p] is op.etp_mm_p
    assert op.get_batched_counterpart(op.etp_mv_p) is op.etp_mm_p
    assert op.get_batched_counterpart(op.etp_mm_p) is None


def test_register_batched_counterpart_rejects_swapped_primitives() -> None:
    with pytest.raises(ValueError, match="unbatched_p=.*batched=True"):
        op.register_batched_counterpart(op.etp_mm_p, op.etp_mv_p)
    assert op.BATCHED_COUNTERPARTS[op.etp_mv_p] is op.etp_mm_p


def test_instant_and_solve_rules_are_read_from_their_tables() -> None:
    for table, getter in ((op.ETP_RULES_INSTANT_DRTRL, op.get_instant_drtrl_rule),
                          (op.ETP_RULES_SOLVE_DRTRL, op.get_solve_drtrl_rule)):
        assert op.etp_mm_p in table, "the library registers closed-form D-RTRL kernels"
        for primitive, rule in table.items():
            if _registries.has_library_rules(primitive):  # no user rule registered beside them
                assert getter(primitive) is rule
        assert getter(jax.lax.add_p) is None


def test_the_package_all_has_no_duplicates_and_resolves() -> None:
    assert len(op.__all__) == len(set(op.__all__))
    for name in op.__all__:
        assert hasattr(op, name), name

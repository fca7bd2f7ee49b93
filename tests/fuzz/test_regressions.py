"""Every failure the fuzzer found, as an explicit model, each judged by the oracle as in the fuzzer.

* A batched group whose drive has an axis of one behind the batch (``grouped_matmul`` over
  ``(B, 1, K)``, ``conv`` over ``(B, 1, W)``, reshaped into ``(B, N)``): D_RTRL's instantaneous
  rule received ``df`` in the hidden layout instead of ``y``'s (an ``IndexError`` in the grouped
  rule, a custom-VJP shape mismatch, a reshape error in the conv rule). Fixed in
  ``HiddenParamOpRelation.adds_unit_axes``: unit axes behind the batch are re-laid like leading ones.
* A ``while_loop`` settling a hidden state under ``vjp_method='multi-step'``: the window's VJP
  reached JAX's "Reverse-mode differentiation does not work for lax.while_loop". The executor now
  binds every loop of a step as a ``custom_vjp`` that recomputes its iterations in reverse mode.
* A sparse mixing recurrence under a saturated SnAp: the ``snap_adjacency`` rule of
  ``sparse_matmul`` densified the structure with ``jnp`` and read it on the host, which raised a
  ``TracerArrayConversionError`` when the rule ran while ``one_step`` was traced. The rule now reads
  the stored pattern from the concrete indices (or declines to describe a traced one).
* A grouped mixing recurrence (``y (2, 1)`` reshaped into ``h1 (2,)``) read by a stacked group
  ``h2 (4,)`` under a saturated SnAp: the compiler related ``y`` to ``h2`` because ``(2, 1)``
  broadcasts *with* ``(4,)``, and the rules received ``h2``'s layout (an ``IndexError``). A relation
  now keeps a hidden state only when ``y`` broadcasts *to* its shape or is it with axes of one.
"""

from __future__ import annotations

import warnings

import brainevent
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.fuzz.grammar import FuzzCase, GroupSpec, ModelSpec, OpSpec
from tests.fuzz.models import FuzzModel
from tests.fuzz.oracle import float64, run_case

UNIT_AXIS_BEHIND_BATCH = [
    pytest.param(FuzzCase(ModelSpec((GroupSpec(width=3, drive=OpSpec("grouped", 3, 3, size=1)),), batch=2), "d_rtrl"),
                 id="grouped-d_rtrl"),
    pytest.param(FuzzCase(ModelSpec((GroupSpec(width=3, drive=OpSpec("conv", 3, 3, size=1)),), batch=2),
                          "d_rtrl_window"), id="conv-window"),
]


@pytest.mark.parametrize("case", UNIT_AXIS_BEHIND_BATCH)
def test_a_unit_axis_behind_the_batch_runs(case: FuzzCase) -> None:
    outcome = run_case(case)
    assert (outcome.status, outcome.problems) == ("approximate", []), outcome.detail


def test_a_while_loop_under_multi_step_windows_runs() -> None:
    # The labels stay approximate: the position analysis does not read through the loop.
    spec = ModelSpec((GroupSpec(width=3, drive=OpSpec("matmul", 3, 3), control="while"),))
    outcome = run_case(FuzzCase(spec, "d_rtrl_window"))
    assert (outcome.status, outcome.problems) == ("approximate", []), outcome.detail


SPARSE_MIX_UNDER_SNAP = FuzzCase(ModelSpec((GroupSpec(
    width=3, drive=OpSpec("grouped", 3, 3, hook="roll", bias=True, size=1, seed=308), recurrence="mix",
    mix=OpSpec("sparse", 3, 3, hook="affine", bias=True, seed=0), control="for_loop", steps=2),),
    readout="etp", batch=2, seed=548), "snap_saturated")


def test_a_sparse_mixing_recurrence_under_a_saturated_snap_is_compared_with_bptt() -> None:
    outcome = run_case(SPARSE_MIX_UNDER_SNAP)
    assert outcome.problems == [], outcome.detail
    assert "g0_mix_w" in outcome.compared, outcome.labels


def test_the_sparse_adjacency_rule_reads_the_pattern_while_traced() -> None:
    from braintrace._op.sparse import _sp_snap_adjacency

    mask = np.array([[1, 0, 1], [0, 1, 0], [1, 1, 0]], bool)
    csr = brainevent.CSR.fromdense(jnp.asarray(mask, jnp.float32))
    read: list[object] = []

    def traced(x: jax.Array) -> jax.Array:
        read.append(_sp_snap_adjacency((2, 3), (2, 3), sparse_mat=csr))
        return x

    jax.jit(traced)(jnp.ones(()))
    (rule,) = read
    assert rule is not None and rule[0] is None
    np.testing.assert_array_equal(rule[1], mask.T)


#: Found by the long profile: compiling SnAp raised an ``IndexError`` in the grouped operator's
#: fast recurrent rule, which was handed the mixing recurrence's ``y`` as if it laid over the
#: stacked group's hidden state ``h2``; a relation now keeps a hidden state only where ``y`` lays
#: over its positions.
GROUPED_MIX_UNDER_SNAP = FuzzCase(model=ModelSpec(groups=(
    GroupSpec(width=3, drive=OpSpec(family='matmul', n_in=3, n_out=3, hook='none', bias=True, size=1, seed=999),
              source=-1, recurrence='none', mix=None, adapt='', reset=True, control='none', steps=2, read='new',
              unit=False),
    GroupSpec(width=2, drive=OpSpec(family='matmul', n_in=3, n_out=2, hook='none', bias=False, size=1, seed=120),
              source=-1, recurrence='mix',
              mix=OpSpec(family='grouped', n_in=2, n_out=2, hook='none', bias=True, size=2, seed=838), adapt='',
              reset=True, control='cond', steps=2, read='new', unit=False),
    GroupSpec(width=4, drive=OpSpec(family='einsum', n_in=2, n_out=4, hook='roll', bias=False, size=1, seed=222),
              source=1, recurrence='roll', mix=None, adapt='', reset=False, control='for_loop', steps=1,
              read='new', unit=True)), readout='identity', batch=None, seed=720), learner='snap_saturated')


def test_a_grouped_mixing_recurrence_read_by_a_stacked_group_under_snap_runs() -> None:
    outcome = run_case(GROUPED_MIX_UNDER_SNAP)
    assert (outcome.status, outcome.problems) == ("approximate", []), outcome.detail
    mix_label = next(label for label in outcome.labels if label.startswith("g1_mix_w"))
    assert "('h2',) outside its hidden groups" in mix_label, outcome.labels


def test_an_output_that_only_broadcasts_with_a_hidden_state_is_not_related_to_it() -> None:
    """``y (2, 1)`` reaches ``h (4,)`` through a reshape and an einsum: not the state's positions."""
    with float64(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FuzzModel(GROUPED_MIX_UNDER_SNAP.model)
        brainstate.nn.init_all_states(model)
        graph = braintrace.compile_etrace_graph(model, jnp.ones(3), include_recurrent_mixing=True,
                                                sparse_n=10, include_weight_to_weight=True)
    (mix,) = [r for r in graph.hidden_param_op_relations if r.primitive.name == "etp_gmv"]
    assert mix.connected_hidden_paths == [("h1",)]
    assert any("(2, 1), which neither broadcasts to hidden state ('h2',)" in str(w.message) for w in caught)

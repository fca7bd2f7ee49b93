"""SnAp-n on other models: every anchored family, two states per position, models without mixing,
the conservative fallback, two mixing equations, refused primitives, and ``vmap``.

Shared pieces (the ring, its variants, the BPTT oracle and the online driver) are in
:mod:`tests.algorithm.snap_ring`; everything runs in float64.
"""

from __future__ import annotations

import functools
from typing import Any

import brainevent
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import DiagnosticKind
from braintrace._op._registries import get_fast_path_rules
from braintrace._op.lora import etp_lora_mv_p
from tests.algorithm.bptt import max_rel_err, normal
from tests.algorithm.snap_ring import (
    B,
    EXACT,
    Grads,
    I,
    N,
    Leaky,
    Ring,
    TwoStateRing,
    assert_same,
    bptt,
    float64,
    inputs,
    online,
    snap,
)

__all__ = ["float64"]  # the module-scoped fixture is used by name


# --- every anchored family ------------------------------------------------------------------


def mixing_matrix(width: int) -> jax.Array:
    """A constant all-to-all mixing on the last axis (not a parameter)."""
    return jnp.asarray(0.4 * np.random.default_rng(5).standard_normal((width, width)), jnp.result_type(float))


@functools.cache
def family_csr() -> Any:
    """A ``(3, 4)`` structure with seven stored values."""
    mask = np.array([[1, 0, 1, 0], [0, 1, 1, 1], [1, 0, 0, 1]], dtype=bool)
    return brainevent.CSR.fromdense(jnp.asarray(mask, dtype=jnp.result_type(float)))


class Families(brainstate.nn.Module):
    """One hidden group driven by several ETP families at once, each through an element-wise tail.

    * ``'vector'``, ``h (4,)``: ``matmul``, ``lora_matmul``, ``sparse_matmul`` (``etp_sp_mv``)
      and ``element_wise`` on ``x (3,)``, with a dense ETP recurrence ``matmul(h, W_rec)``;
    * ``'batched'``, ``h (2, 4)``: ``grouped_matmul``, ``sparse_matmul`` (``etp_sp_mm``) and a
      shared-free ``einsum`` on ``x (2, 3)``, with the batched recurrence ``matmul(h, W_rec)``;
    * ``'conv'``, ``h (1, 5, 4)``: a 1-D ``conv`` of ``x (1, 5, 2)``, with a constant channel mix.

    Every recurrence is all-to-all on the last axis only, so SnAp saturates at ``n = 2``, ``K = 4``.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        shapes = {
            "vector": {"w": (3, 4), "lb": (3, 2), "la": (2, 4), "ws": (7,), "we": (4,), "w_rec": (4, 4)},
            "batched": {"wg": (2, 3, 4), "ws": (7,), "wx": (3, 4), "w_rec": (4, 4)},
            "conv": {"k": (3, 2, 4)},
        }[kind]
        for i, (name, shape) in enumerate(shapes.items()):
            setattr(self, name, brainstate.ParamState(normal(20 + i, shape, 0.4)))
        self.mix = mixing_matrix(4)
        self.spread = jnp.asarray(np.random.default_rng(6).standard_normal((3, 4)), jnp.result_type(float))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros({"vector": (4,), "batched": (2, 4), "conv": (1, 5, 4)}[self.kind]))

    def drive(self, x: jax.Array, h: jax.Array) -> jax.Array:
        if self.kind == "vector":
            return (braintrace.matmul(x, self.w.value)
                    + braintrace.lora_matmul(x, self.lb.value, self.la.value, alpha=0.5)
                    + braintrace.sparse_matmul(x, self.ws.value, sparse_mat=family_csr())
                    + (x @ self.spread) * braintrace.element_wise(self.we.value)
                    + braintrace.matmul(h, self.w_rec.value))
        if self.kind == "batched":
            return (braintrace.grouped_matmul(x, self.wg.value)
                    + braintrace.sparse_matmul(x, self.ws.value, sparse_mat=family_csr())
                    + braintrace.einsum("bk,kn->bn", x, self.wx.value)
                    + braintrace.matmul(h, self.w_rec.value))
        return braintrace.conv(x, self.k.value, padding="SAME", dimension_numbers=("NWC", "WIO", "NWC")) + h @ self.mix

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = jnp.tanh(self.drive(x, self.h.value))
        return self.h.value


FAMILY_CASES = {
    "vector": ((3,), {"etp_mv", "etp_lora_mv", "etp_sp_mv", "etp_elemwise"}),
    "batched": ((2, 3), {"etp_gmv", "etp_sp_mm", "etp_einsum", "etp_mm"}),
    "conv": ((1, 5, 2), {"etp_conv"}),
}


def family_inputs(kind: str) -> tuple[jax.Array, jax.Array]:
    """Six steps of inputs and targets for one :class:`Families` case."""
    x_shape, _ = FAMILY_CASES[kind]
    hidden = {"vector": (4,), "batched": (2, 4), "conv": (1, 5, 4)}[kind]
    return normal(12, (6, *x_shape)), normal(13, (6, *hidden))


@functools.cache
def family_reference(kind: str) -> Grads:
    """BPTT of one :class:`Families` case."""
    return bptt(Families(kind), *family_inputs(kind))


@pytest.mark.parametrize("kind", list(FAMILY_CASES))
def test_every_anchored_family_widens_and_saturates_to_bptt(kind: str) -> None:
    family_csr()  # built eagerly, outside any trace
    xs, ys = family_inputs(kind)
    learner = snap(Families(kind), 2, xs[0])
    group, = learner.graph.hidden_groups
    assert group.snap.is_saturated and group.snap.num_neighbour == 4 and not group.snap.conservative
    names = {r.primitive.name for r in learner.graph.hidden_param_op_relations}
    assert FAMILY_CASES[kind][1] <= names
    for trace in learner.named_etraces().values():
        assert all(leaf.shape[-1] == 4 for leaf in jax.tree.leaves(trace))
    assert max_rel_err(family_reference(kind), online(learner, xs, ys)) < EXACT


def test_lora_has_no_fast_path() -> None:
    # The vector case therefore runs the generic (rule-based) widened trace path as well.
    assert get_fast_path_rules(etp_lora_mv_p) is None


def test_the_coupled_scope_misses_what_order_two_saturates() -> None:
    # The negative control of the family test: the dense recurrence saturates at n = 2, and the
    # same fixture sees SnAp-1 (OSTLRecurrent) miss.
    xs, ys = family_inputs("vector")
    ostl = braintrace.compile(Families("vector"), braintrace.OSTLRecurrent, xs[0])
    assert max_rel_err(family_reference("vector"), online(ostl, xs, ys)) > 1e-3


# --- models SnAp refuses, and models where it equals the other scopes ------------------------


class Embedded(brainstate.nn.Module):
    """``h ← tanh(table[token] + matmul(h, W))``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = brainstate.ParamState(jnp.ones((5, N)))
        self.w = brainstate.ParamState(0.3 * jnp.eye(N))
        self.h = brainstate.HiddenState(jnp.zeros(N))

    def update(self, token: jax.Array) -> jax.Array:
        drive = braintrace.embedding(token, self.table.value) + braintrace.matmul(self.h.value, self.w.value)
        self.h.value = jnp.tanh(drive)
        return self.h.value


class SharedEinsum(brainstate.nn.Module):
    """``h ← tanh(einsum('btk,kn->btn', x, W) + h @ R)``: one weight entry reused along ``t``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(jnp.ones((I, N)))
        self.h = brainstate.HiddenState(jnp.zeros((2, 2, N)))
        self.mix = mixing_matrix(N)

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = jnp.tanh(braintrace.einsum("btk,kn->btn", x, self.w.value) + self.h.value @ self.mix)
        return self.h.value


@pytest.mark.parametrize(
    "model, x, primitive",
    [(Embedded, jnp.asarray(2), "etp_emb_v"), (SharedEinsum, jnp.ones((2, 2, I)), "etp_einsum")],
    ids=["embedding", "shared-axis-einsum"],
)
def test_unanchored_primitives_are_refused_at_every_order(model: Any, x: jax.Array, primitive: str) -> None:
    for n in (1, 2, 4):
        with pytest.raises(NotImplementedError, match=rf"`{primitive}`.*not anchored.*D_RTRL"):
            snap(model(), n, x)
    for algorithm in (braintrace.D_RTRL, braintrace.OSTLRecurrent):
        learner = braintrace.compile(model(), algorithm, x)
        assert any(r.primitive.name == primitive for r in learner.graph.hidden_param_op_relations)


def test_without_mixing_snap_is_ostl_recurrent_and_d_rtrl() -> None:
    xs, ys = inputs()
    for n in (1, 2, 3):
        learner = snap(Leaky(), n, xs[0], vjp_method="multi-step")
        assert learner.graph.hidden_groups[0].trace_state_width == 1
        if n > 1:
            record, = [r for r in learner.graph.diagnostics if r.kind is DiagnosticKind.SNAP_PATTERN_DEGENERATE]
            assert record.level.name == "INFO"
    got = online(learner, xs, ys, chunk=3)
    for algorithm in (braintrace.OSTLRecurrent, braintrace.D_RTRL):
        other = braintrace.compile(Leaky(), algorithm, xs[0], vjp_method="multi-step")
        assert_same(online(other, xs, ys, chunk=3), got)
    assert max_rel_err(bptt(Leaky(), xs, ys), got) < EXACT  # a diagonal model: exact


def test_an_unregistered_mixing_primitive_is_conservative_and_correct() -> None:
    xs, ys = inputs()
    with pytest.warns(UserWarning, match="taken all-to-all.*cumsum"):
        learner = snap(Ring(cumsum=True), 2, xs[0])
    pattern = learner.graph.hidden_groups[0].snap
    assert pattern.conservative and pattern.num_neighbour == N
    assert DiagnosticKind.SNAP_PATTERN_CONSERVATIVE in [r.kind for r in learner.graph.diagnostics]
    assert max_rel_err(bptt(Ring(cumsum=True), xs, ys), online(learner, xs, ys)) < EXACT


def test_two_mixing_equations_compose_precisely() -> None:
    # Both recurrences are read, their adjacencies OR-ed: h_q reads h_(q-1), h_q, h_(q+1), so the
    # order saturates at 4 (three hops cover the ring) instead of widening all-to-all at once.
    xs, ys = inputs()
    ks = [snap(Ring(both_ways=True), n, xs[0]).graph.hidden_groups[0].snap.num_neighbour for n in (2, 3)]
    assert ks == [3, 5]
    learner = snap(Ring(both_ways=True), 4, xs[0])
    pattern = learner.graph.hidden_groups[0].snap
    assert pattern.is_saturated and not pattern.conservative and pattern.num_neighbour == N
    assert max_rel_err(bptt(Ring(both_ways=True), xs, ys), online(learner, xs, ys)) < EXACT


# --- two states per position ----------------------------------------------------------------


def test_two_states_per_position_widen_to_k_times_s() -> None:
    # h reads v's new value, so single steps also use the widened history Jacobian.
    xs, ys = inputs()
    group, = snap(TwoStateRing(), 3, xs[0]).graph.hidden_groups
    assert group.num_state == 2 and group.snap.num_neighbour == 3 and group.trace_state_width == 6
    learner = snap(TwoStateRing(), N, xs[0])
    assert learner.graph.hidden_groups[0].trace_state_width == 2 * N
    ref = bptt(TwoStateRing(), xs, ys)
    assert max_rel_err(ref, online(learner, xs, ys)) < EXACT
    assert max_rel_err(ref, online(snap(TwoStateRing(), 1, xs[0]), xs, ys)) > 1e-3


# --- batches, vmap, and the drivers ---------------------------------------------------------


def test_a_batched_ring_keeps_the_batch_axis_apart() -> None:
    batched = snap(Ring(), N, inputs(batch=B)[0][0], batch_size=B)
    pattern = batched.graph.hidden_groups[0].snap
    assert pattern.varshape == (B, N) and pattern.num_neighbour == N  # not B·N
    assert {r.primitive.name for r in batched.graph.hidden_param_op_relations} == {"etp_mm", "etp_sp_mm"}


def test_etrace_vmap_lanes_sum_to_the_batched_bptt_gradient() -> None:
    xs, ys = inputs(batch=B)
    ref = bptt(Ring(), xs, ys, batch=B)
    vmapped = braintrace.compile(Ring(), "snap", xs[0], batch_size=B, vmap=True, n=N)
    assert isinstance(vmapped, braintrace.ETraceVmap)
    assert max_rel_err(ref, online(vmapped, xs, ys)) < EXACT



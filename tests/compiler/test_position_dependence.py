"""The position walk reads an operation without a rule of its own through its JVP rule.

A library primitive (``braintools.surrogate``'s ``heaviside_surrogate_gradient``, the spike of
every ``braintrace.nn`` neuron) is element-wise, and so is its JVP rule; a primitive whose rule
moves values is read as moving them; one whose rule cannot be traced or read stays unreadable.
"""

from __future__ import annotations

from typing import Any

import brainstate
import braintools
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import braintrace
from braintrace import _compatible_imports as compat
from braintrace._compatible_imports import Primitive, ShapedArray, ad
from braintrace._compiler.position_dependence import group_adjacency, read_tail

V = 4


def _primitive(name: str, impl: Any, jvp: Any = None) -> Primitive:
    """A one-result primitive of ``impl`` (shape-preserving), with ``jvp`` as its JVP rule if given."""
    prim = Primitive(name)
    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x: ShapedArray(x.shape, x.dtype))
    if jvp is not None:
        ad.primitive_jvps[prim] = jvp
    return prim


def _tail(fn: Any) -> Any:
    return jax.make_jaxpr(fn)(jnp.zeros(V)).jaxpr


def _pattern(reach: Any) -> list[list[int]]:
    (axis,) = reach
    return axis.astype(int).tolist()


def test_the_surrogate_spike_is_element_wise() -> None:
    tail = _tail(lambda y: braintools.surrogate.Sigmoid()(y - 1.0))
    assert "heaviside_surrogate_gradient" in str(tail)
    reach, reason = read_tail(tail, (V,))
    assert reason is None and _pattern(reach) == np.eye(V, dtype=int).tolist()


def _rolled_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return jnp.roll(x, 1), jnp.roll(t, 1)


ROLLED = _primitive("test_rolled", lambda x: jnp.roll(x, 1), _rolled_jvp)


def test_a_rule_that_moves_values_is_read_as_moving() -> None:
    reach, reason = read_tail(_tail(lambda y: ROLLED.bind(y)), (V,))
    assert reason is None
    assert _pattern(reach) == np.roll(np.eye(V, dtype=int), 1, axis=0).tolist()  # h[q] reads y[q - 1]


NO_RULE = _primitive("test_without_jvp", lambda x: x)


def test_a_primitive_without_a_jvp_rule_is_unreadable() -> None:
    assert read_tail(_tail(lambda y: NO_RULE.bind(y)), (V,)) == (None, "`test_without_jvp` has no position rule")


def _through_no_rule(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return NO_RULE.bind(x), NO_RULE.bind(t)


NESTED = _primitive("test_nested", lambda x: x, _through_no_rule)


def test_a_rule_is_read_one_level_deep() -> None:
    """Its operations need rules of their own: a rule binding its own primitive (``cumsum``) or
    another rule-less one does not recurse."""
    assert read_tail(_tail(lambda y: NESTED.bind(y)), (V,)) == (None, "`test_nested` has no position rule")
    assert read_tail(_tail(jnp.cumsum), (V,)) == (None, "`cumsum` has no position rule")


def test_a_lif_layer_s_recurrence_is_unit_by_unit() -> None:
    class Layer(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = brainstate.ParamState(jnp.ones((3, V)))
            self.lif = braintrace.nn.LIF(V, spk_fun=braintools.surrogate.Sigmoid())

        def update(self, x: jax.Array) -> jax.Array:
            return self.lif(braintrace.matmul(x, self.w.value) * u.mA)

    with brainstate.environ.context(dt=1.0 * u.ms):
        graph = braintrace.compile_etrace_graph(brainstate.nn.init_all_states(Layer()), jnp.ones(3))
    (adjacency,), reason = group_adjacency(graph.hidden_groups[0])
    assert reason is None and adjacency.astype(int).tolist() == np.eye(V, dtype=int).tolist()


def test_a_tail_reads_y_as_its_last_input_whether_its_constants_are_separate_or_leading_inputs() -> None:
    """The compiler builds a ``y -> h`` tail with the other values it reads as constants; JAX 0.12
    keeps constants without values as plain leading inputs. Either way ``y`` is the last input."""
    closed = jax.make_jaxpr(lambda c, y: c + jnp.roll(y, 1))(jnp.zeros(V), jnp.zeros(V))
    c, y = closed.jaxpr.invars
    separate = compat.Jaxpr([c], [y], closed.jaxpr.outvars, closed.jaxpr.eqns, closed.jaxpr.effects,
                            compat.DebugInfo("test", "separate", ("y",), ("h",)))
    leading = compat.Jaxpr([], [c, y], closed.jaxpr.outvars, closed.jaxpr.eqns, closed.jaxpr.effects,
                           compat.DebugInfo("test", "leading", ("c", "y"), ("h",)))
    for tail in (separate, leading):
        reach, reason = read_tail(tail, (V,))
        assert reason is None and _pattern(reach) == np.roll(np.eye(V, dtype=int), 1, axis=0).tolist()

"""Jaxpr utilities: jit inlining and graph walks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compatible_imports import ClosedJaxpr, scan_params
from braintrace._compiler.jaxpr_graph import (
    build_consumer_map,
    build_producer_map,
    forward_closure,
    inline_jit_calls,
)


def _names(closed: ClosedJaxpr) -> list[str]:
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _run(closed: ClosedJaxpr, *args: Any) -> Any:
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def test_identity_when_there_is_no_jit() -> None:
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    assert inline_jit_calls(closed) is closed


def test_nested_multi_output_and_repeated_calls_are_freshened() -> None:
    inner = jax.jit(lambda x: (x * 2, x + 1))
    outer = jax.jit(lambda x: inner(x)[0] + inner(x)[1])

    def f(x: Any) -> Any:
        return outer(x) * outer(x + 1.0)

    closed = jax.make_jaxpr(f)(1.5)
    flat = inline_jit_calls(closed)
    assert "jit" not in _names(flat)
    outs = [v for e in flat.jaxpr.eqns for v in e.outvars]
    assert len(outs) == len(set(outs)), "every spliced body var is fresh"
    np.testing.assert_allclose(_run(flat, 1.5)[0], f(1.5))
    g = jax.grad(lambda x: _run(flat, x)[0])(1.5)
    np.testing.assert_allclose(g, jax.grad(f)(1.5), rtol=1e-6)


def test_closure_constants_are_lifted() -> None:
    table = jnp.arange(3.0)
    g = jax.jit(lambda x: x * table)
    closed = jax.make_jaxpr(lambda x: g(x).sum())(jnp.ones(3))
    flat = inline_jit_calls(closed)
    np.testing.assert_allclose(_run(flat, jnp.ones(3))[0], 3.0)


def test_passthrough_and_jit_output_as_final_output() -> None:
    g = jax.jit(lambda x, y: (x, y * 2))
    closed = jax.make_jaxpr(lambda x, y: g(x, y))(1.0, 2.0)
    flat = inline_jit_calls(closed)
    assert flat.jaxpr.outvars[0] is flat.jaxpr.invars[0]
    assert [float(v) for v in _run(flat, 1.0, 2.0)] == [1.0, 4.0]


def test_jit_inside_a_scan_body_is_inlined_and_jit_free_bodies_are_kept() -> None:
    g = jax.jit(lambda c: c * 0.5)

    def f(x: Any) -> Any:
        return jax.lax.scan(lambda c, _: (g(c), c), x, None, length=3)[0] + jax.lax.scan(lambda c, _: (c + 1, c), x, None, length=2)[0]

    closed = jax.make_jaxpr(f)(1.0)
    flat = inline_jit_calls(closed)
    scans = [e for e in flat.jaxpr.eqns if e.primitive.name == "scan"]
    assert "jit" not in _names(scan_params(scans[0]).body)
    assert scans[1] is [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"][1]
    np.testing.assert_allclose(_run(flat, 1.0)[0], f(1.0))


def test_producer_consumer_and_forward_closure() -> None:
    closed = jax.make_jaxpr(lambda x, y: (jnp.sin(x) + y, y * 2))(1.0, 2.0)
    jaxpr = closed.jaxpr
    producers, consumers = build_producer_map(jaxpr), build_consumer_map(jaxpr)
    x, y = jaxpr.invars
    assert producers[jaxpr.outvars[0]].primitive.name == "add"
    assert [e.primitive.name for e in consumers[y]] == ["add", "mul"]
    reach = forward_closure(x, consumers)
    assert reach[0] is x and jaxpr.outvars[0] in reach and jaxpr.outvars[1] not in reach

"""How much of the trace one compiled D_RTRL or EProp training step moves (read from XLA's optimised HLO).

D_RTRL's single-step cost is dominated by the trace. In a jitted scan over time, the loop body
should write the trace once (the update, in place) and read it once more (the history term of
the gradient): no transposed or copied trace, and no second trace-sized temporary. This test
counts the loop-body instructions whose result has the trace's shape, on a LIF-like network with
a distinctive trace shape whose output reads the new potential (an output that reads the previous
one past its update needs the entering trace too, see ``groups_read_past_update``). The figures of ``make bench`` are the timing counterpart.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace

# Trace (B, I + H, H, 1): a shape nothing else in the step has, and large enough that XLA does
# not copy it anyway (it copies loop-carried buffers of a few ten thousand elements regardless).
B, I, H = 16, 60, 128
TRACE_SHAPE = f"[{B},{I + H},{H},1]"


class _LIF(brainstate.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.tau = brainstate.ParamState(jnp.full((H,), 2.0))
        self.w = brainstate.ParamState(jnp.asarray(rng.normal(size=(I + H, H)) / 4, jnp.float32))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros((batch_size, H)))

    def update(self, x: jax.Array) -> jax.Array:
        s = jax.nn.sigmoid(4 * (self.v.value - 1.0))
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.v.value = leak * self.v.value * (1 - s) + braintrace.matmul(jnp.concatenate([x, s], -1), self.w.value)
        return self.v.value


class _Tanh(_LIF):
    """``h ← σ(τ) h + tanh(matmul([x, h], W))``, the same trace shape as :class:`_LIF`."""

    def update(self, x: jax.Array) -> jax.Array:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        drive = braintrace.matmul(jnp.concatenate([x, self.v.value], -1), self.w.value)
        self.v.value = leak * self.v.value + jnp.tanh(drive)
        return self.v.value


def _loop_body_hlo(model: brainstate.nn.Module, algorithm: Any = braintrace.D_RTRL, **options: Any) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(model, algorithm, jnp.zeros((B, I)), batch_size=B, **options)
    params = learner.param_states

    def one(acc: Any, x: jax.Array) -> tuple[Any, None]:
        grads = brainstate.transform.grad(lambda: jnp.sum(learner(x) ** 2), params)()
        return jax.tree.map(jnp.add, acc, grads), None

    @brainstate.transform.jit
    def step(xs: jax.Array) -> Any:
        zeros = {p: jnp.zeros_like(st.value) for p, st in params.items()}
        return brainstate.transform.scan(one, zeros, xs)[0]

    text = step.lower(jnp.ones((50, B, I))).compile().as_text()
    computations = {c.split(" ", 1)[0]: c for c in re.split(r"\n(?=%|ENTRY)", text)}
    # The bodies of the while loops that carry the trace: the scan over time, and the loop over
    # the batch rows of the gradient solve nested in it (on CPU), which must only read it.
    loops = re.findall(r"= \(.*?\) while\(.*?body=(%[\w.\-]+)", text)
    bodies = [computations[name] for name in loops if TRACE_SHAPE in computations[name]]
    assert bodies, f"expected a while loop carrying the trace, found {loops}"
    return "\n".join(bodies)


def _trace_sized(body: str) -> list[str]:
    """The loop-body instructions that produce a trace-shaped (or transposed) array."""
    shapes = {TRACE_SHAPE, f"[{H},{I + H},{B}]", f"[{H},{I + H},1,{B}]", f"[{B},{I + H},{H}]"}
    skip = ("parameter(", "get-tuple-element(", "bitcast(", "tuple(")
    found = []
    for line in body.splitlines():
        head = line.split("=", 1)
        if len(head) < 2 or not any(s in head[1].split("(")[0] for s in shapes):
            continue
        if not any(k in line for k in skip):
            found.append(line.strip().split(" ")[0])
    return found


def test_single_step_writes_the_trace_once_and_copies_nothing() -> None:
    produced = _trace_sized(_loop_body_hlo(_LIF()))
    assert len(produced) == 1, produced


def test_filtered_eprop_writes_each_trace_once_and_copies_nothing() -> None:
    """EProp with ``κ > 0`` carries two traces, ``ε`` and its filter ``ē``: one write of each.

    The gradient reads ``ē^t`` (which holds ``κ ē^{t-1} + D ε^{t-1}``), so neither entering trace
    has a reader besides its update: no copy of either, and no trace-sized ``x ⊗ df``. (On the
    LIF cell, whose trace update is cheap, XLA recomputes ``ε^t`` inside the filter's update and
    copies the entering trace once per step.)
    """
    produced = _trace_sized(_loop_body_hlo(_Tanh(), braintrace.EProp, kappa_filter_decay=0.9))
    assert len(produced) == 2, produced
    assert not [p for p in produced if p.startswith("%copy")], produced

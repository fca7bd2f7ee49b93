"""How much of the trace one compiled D_RTRL, EProp, OTTT, OTPE or OSTLRecurrent training step moves (read from XLA's optimised HLO).

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
import pytest

import braintrace
from braintrace._algorithm.rules import otpe

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


def _compiled_hlo(model: brainstate.nn.Module, algorithm: Any = braintrace.D_RTRL, **options: Any) -> str:
    """XLA's optimised HLO of a jitted scan of 50 single-step gradients (summed)."""
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

    return step.lower(jnp.ones((50, B, I))).compile().as_text()


def _computations(text: str) -> dict[str, str]:
    """Each computation of an HLO module's text, by name."""
    return {c.split(" ", 1)[0]: c for c in re.split(r"\n(?=%|ENTRY)", text)}


def _driver_hlo(model: brainstate.nn.Module, algorithm: Any = braintrace.D_RTRL, **options: Any) -> str:
    """XLA's optimised HLO of ``etrace_grad`` over 50 steps (single-step calls)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(model, algorithm, jnp.zeros((B, I)), batch_size=B, **options)

    @brainstate.transform.jit
    def step(xs: jax.Array) -> Any:
        return learner.etrace_grad(xs, step_fn=lambda x: jnp.sum(learner(x) ** 2))

    return step.lower(jnp.ones((50, B, I))).compile().as_text()


def _loop_body_hlo(
    model: brainstate.nn.Module, algorithm: Any = braintrace.D_RTRL, trace_shape: str = TRACE_SHAPE,
    compiled: Any = _compiled_hlo, **options: Any,
) -> str:
    bodies = _trace_loop_bodies(compiled(model, algorithm, **options), trace_shape)
    assert bodies, "expected a while loop carrying the trace"
    return "\n".join(bodies)


def _trace_loop_bodies(text: str, trace_shape: str = TRACE_SHAPE) -> list[str]:
    """The bodies of the while loops that carry the trace: the scan over time, and the loops over
    the batch rows of the gradient solve nested in it (on CPU, one per read of a trace by the
    gradient), which must only read it."""
    computations = _computations(text)
    loops = re.findall(r"= \(.*?\) while\(.*?body=(%[\w.\-]+)", text)
    return [computations[name] for name in loops if trace_shape in computations[name]]


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


class _Vanilla(_LIF):
    """``h ← tanh(matmul([x, h], W))``: no history (``D ≡ 0``), the same trace shape as :class:`_LIF`."""

    def update(self, x: jax.Array) -> jax.Array:
        self.v.value = jnp.tanh(braintrace.matmul(jnp.concatenate([x, self.v.value], -1), self.w.value))
        return self.v.value


@pytest.mark.parametrize(
    ("algorithm", "options"), [(braintrace.D_RTRL, {}), (braintrace.EProp, {"feedback": "random", "random_feedback_key": 0})])
def test_a_driver_carries_no_trace_without_history_through_its_loop(algorithm: Any, options: Any) -> None:
    """The drivers write such a trace once, after their loop (``carriers/instant_traces.py``)."""
    assert not _trace_loop_bodies(_driver_hlo(_Vanilla(), algorithm, **options))
    # The negative control: in the user's own loop every call writes the trace.
    assert _trace_loop_bodies(_compiled_hlo(_Vanilla(), algorithm, **options))


def test_single_step_writes_the_trace_once_and_copies_nothing() -> None:
    produced = _trace_sized(_loop_body_hlo(_LIF()))
    assert len(produced) == 1, produced


def test_filtered_eprop_writes_each_trace_once_and_copies_nothing() -> None:
    """EProp with ``κ > 0`` carries two traces, ``ε`` and its filter ``ē``: one write of each.

    The gradient reads ``ē^t`` (which holds ``κ ē^{t-1} + D ε^{t-1}``), so neither entering trace
    has a reader besides its update: no copy of either, and no trace-sized ``x ⊗ df``. (On the
    LIF cell, whose trace update is cheap, XLA recomputes ``ε^t`` inside the filter's update and
    copies the entering trace once per step; ordering the two updates would remove that copy,
    but costs the tanh and GRU cells 6–10 %, see ``benchmarks/README.md``.)
    """
    produced = _trace_sized(_loop_body_hlo(_Tanh(), braintrace.EProp, kappa_filter_decay=0.9))
    assert len(produced) == 2, produced
    assert not [p for p in produced if p.startswith("%copy")], produced


class _PastReadLIF(_LIF):
    """:class:`_LIF` returning the spikes of the potential *before* its update: the gradient of
    the step's loss reads the entering trace (``⟨∂L/∂v^{t-1}, ε^{t-1}⟩``)."""

    def update(self, x: jax.Array) -> jax.Array:
        s = jax.nn.sigmoid(4 * (self.v.value - 1.0))
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        self.v.value = leak * self.v.value * (1 - s) + braintrace.matmul(jnp.concatenate([x, s], -1), self.w.value)
        return s


def test_a_driver_writes_a_trace_whose_entering_value_the_gradient_reads_without_copying_it() -> None:
    """``etrace_grad`` orders the trace's update after the gradient, which reads the entering
    trace: the update then runs in place. The same step without that ordering (the learner's
    hook disabled) copies the entering trace each step: the negative control."""
    produced = _trace_sized(_loop_body_hlo(_PastReadLIF(), compiled=_driver_hlo))
    assert len(produced) == 1 and not produced[0].startswith("%copy"), produced


def test_without_the_ordering_the_entering_trace_is_copied(monkeypatch: Any) -> None:
    monkeypatch.setattr(braintrace.ETraceVjpAlgorithm, "_seq_after_gradient", lambda self, grads: None)
    produced = _trace_sized(_loop_body_hlo(_PastReadLIF(), compiled=_driver_hlo))
    assert [p for p in produced if p.startswith("%copy")], produced


def test_a_driver_writes_a_filtered_trace_the_gradient_reads_entering_after_its_filter() -> None:
    """EProp (``κ > 0``) on :class:`_PastReadLIF`: the gradient reads ``ε^{t-1}`` and ``ē^{t-1}``,
    and both updates read ``ε^{t-1}``. ``etrace_grad`` orders the filter's update after the
    gradient and ``ε``'s after the filter's: one write of each trace, no copy."""
    produced = _trace_sized(_loop_body_hlo(_PastReadLIF(), braintrace.EProp, compiled=_driver_hlo,
                                           kappa_filter_decay=0.9))
    assert len(produced) == 2 and not [p for p in produced if p.startswith("%copy")], produced


def test_without_the_filter_ordering_the_entering_trace_is_copied(monkeypatch: Any) -> None:
    """The negative control: ordered after the gradient only, ``ε^{t-1}`` is copied each step."""
    monkeypatch.setattr(braintrace.ParamDimVjpAlgorithm, "_seq_after_gradient",
                        braintrace.ETraceVjpAlgorithm._seq_after_gradient)
    produced = _trace_sized(_loop_body_hlo(_PastReadLIF(), braintrace.EProp, compiled=_driver_hlo,
                                           kappa_filter_decay=0.9))
    assert [p for p in produced if p.startswith("%copy")], produced


def _driver_result(algorithm: Any, **options: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The gradient ``etrace_grad`` returns on :class:`_PastReadLIF` and the traces it leaves."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(_PastReadLIF(), algorithm, jnp.zeros((B, I)), batch_size=B, **options)
    xs = jax.random.normal(jax.random.PRNGKey(1), (6, B, I))
    grads = brainstate.transform.jit(
        lambda x: learner.etrace_grad(x, step_fn=lambda xt: jnp.sum(learner(xt) ** 2)))(xs)
    return [np.asarray(g) for g in jax.tree.leaves(grads)], [np.asarray(t) for t in _in_insertion_order(learner._get_etrace_data())]


def _in_insertion_order(traces: Any) -> list[Any]:
    """The arrays of nested trace dicts in insertion order: their keys hold object ids, which sort
    differently from one learner to the next."""
    if isinstance(traces, dict):
        return [leaf for value in traces.values() for leaf in _in_insertion_order(value)]
    return [traces]


def test_the_ordering_leaves_the_gradient_and_the_traces_unchanged(monkeypatch: Any) -> None:
    """Only the schedule changes: the same gradient and traces, element for element, with and
    without the ordering (D_RTRL, and EProp whose filter is ordered as well)."""
    for algorithm, options in ((braintrace.D_RTRL, {}), (braintrace.EProp, {"kappa_filter_decay": 0.9})):
        ordered = _driver_result(algorithm, **options)
        with monkeypatch.context() as m:
            for cls in (braintrace.ETraceVjpAlgorithm, braintrace.ParamDimVjpAlgorithm):
                m.setattr(cls, "_seq_after_gradient", lambda self, grads: None)
            plain = _driver_result(algorithm, **options)
        for got, want in zip(ordered[0] + ordered[1], plain[0] + plain[1], strict=True):
            assert np.abs(want).max() > 0
            np.testing.assert_array_equal(got, want)


# OTTT's trace is the presynaptic input (B, I + H); its gradient is one product of the weight's size.
OTTT_TRACE, WEIGHT = f"[{B},{I + H}]", f"[{I + H},{H}]"


class _FixedLeakLIF(brainstate.nn.Module):
    """``v ← λ (v − s) + matmul([x, s], W)``, ``λ`` fixed: the drive enters ``v`` unscaled (``df ≡ 1``)."""

    def __init__(self, squash: Any = None) -> None:
        super().__init__()
        self.squash = squash
        rng = np.random.default_rng(0)
        self.w = brainstate.ParamState(jnp.asarray(rng.normal(size=(I + H, H)) / 4, jnp.float32))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.v = brainstate.HiddenState(jnp.zeros((batch_size, H)))

    def update(self, x: jax.Array) -> jax.Array:
        s = jax.nn.sigmoid(4 * (self.v.value - 1.0))
        drive = braintrace.matmul(jnp.concatenate([x, s], -1), self.w.value)
        self.v.value = 0.9 * (self.v.value - s) + (drive if self.squash is None else self.squash(drive))
        return self.v.value


def _ottt_traffic(model: brainstate.nn.Module) -> tuple[list[str], list[str]]:
    """The loop-body instructions that read the entering OTTT trace, and the weight-sized products."""
    body = _loop_body_hlo(model, braintrace.OTTT, trace_shape=OTTT_TRACE, leak=0.9)
    result = {line.strip().split(" ")[0]: line.split("=", 1)[1] for line in body.splitlines() if " = " in line}
    of_shape = lambda shape: {name: rhs for name, rhs in result.items() if shape in rhs.split("(")[0]}  # noqa: E731
    entering = [name for name, rhs in of_shape(OTTT_TRACE).items() if "get-tuple-element(" in rhs]
    assert len(entering) == 1, entering
    readers = [name for name, rhs in result.items() if re.search(re.escape(entering[0]) + r"\b", rhs)]
    products = [name for name, rhs in of_shape(WEIGHT).items() if " dot(" in rhs or "__ynn_fusion" in rhs]
    return readers, products


def test_ottt_writes_its_trace_in_place_and_takes_one_weight_sized_product() -> None:
    """Where the drive enters the state unscaled, the gradient is ``â^t ⊗ L``: the engine leaves
    the weight out of the one-step VJP (whose ``x^t ⊗ L`` the new trace already holds), so a step
    takes one product of the weight's size, and the entering trace's only reader is its update.

    Negative control: under a ``tanh`` (``df ≠ 1``) the exact one-step product ``x ⊗ (df ⊙ L)``
    and the history ``λ â^{t-1} ⊗ L`` are two products, and the history's read of the entering
    trace costs a copy of it.
    """
    readers, products = _ottt_traffic(_FixedLeakLIF())
    assert len(products) == 1, products
    assert len(readers) == 1 and not readers[0].startswith("%copy"), readers
    readers, products = _ottt_traffic(_FixedLeakLIF(squash=jnp.tanh))
    assert len(products) == 2, products
    assert [r for r in readers if r.startswith("%copy")], readers


# The convolution's trace keeps one kernel per output position: (B, 6, 10, 3, 3, 1 + C, C, 1) on
# a 6×10 map, the input row read as one channel.
C = 4
CONV_TRACE = f"[{B},6,10,3,3,{1 + C},{C},1]"


class _ConvLeaky(brainstate.nn.Module):
    """``h ← σ(τ) ⊙ h + tanh(conv([x, h], K) + b)`` on the map (channel-last), as ``make bench``'s conv row."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.k = brainstate.ParamState(jnp.asarray(rng.normal(size=(3, 3, 1 + C, C)) / 6, jnp.float32))
        self.b = brainstate.ParamState(jnp.zeros(C))
        self.tau = brainstate.ParamState(jnp.ones((6, 10, C)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, 6, 10, C)))

    def update(self, x: jax.Array) -> jax.Array:
        h = self.h.value
        xh = jnp.concatenate([x.reshape(-1, 6, 10, 1), h], -1)
        drive = braintrace.conv(xh, self.k.value, self.b.value, strides=(1, 1),
                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
        self.h.value = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid) * h + jnp.tanh(drive)
        return self.h.value


def test_conv_single_step_writes_the_per_position_trace_once_and_copies_nothing() -> None:
    """The convolution's rules roll its trace (it has no closed-form kernels), in place as well.

    Every instruction of the trace's size (any shape or layout) is counted: one, the update
    ``ε ⊙ hd + patch ⊗ df``, written over the entering trace. Reading the trace through a slice
    of its state axis, or contracting the history with the entering trace, cost a copy of it.
    """
    body = _loop_body_hlo(_ConvLeaky(), trace_shape=CONV_TRACE)
    size = B * 6 * 10 * 9 * (1 + C) * C
    produced = []
    for line in body.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = \w+\[([\d,]*)\]\S* (\S+?)\(", line)
        if m and m.group(3) not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            if int(np.prod([int(d) for d in m.group(2).split(",") if d])) == size:
                produced.append(m.group(1))
    assert len(produced) == 1 and not produced[0].startswith("%copy"), produced


def _trace_update_arithmetic(
    trace_dtype: Any, model: brainstate.nn.Module | None = None, algorithm: Any = braintrace.D_RTRL
) -> list[str]:
    """The arithmetic of the fused trace update on anything smaller than the trace.

    The update ``ε ← D ε + x ⊗ df`` broadcasts ``D`` (one value per batch row and unit) over the
    trace; every operation left in the update's fusion on an array of ``D``'s size is recomputed
    for each of the ``I + H`` inputs.
    """
    options = {} if trace_dtype is None else {"trace_dtype": trace_dtype}
    text = _compiled_hlo(_LIF() if model is None else model, algorithm, **options)
    stored = "f32" if trace_dtype is None else "bf16"
    update = re.search(rf"= {stored}{re.escape(TRACE_SHAPE)}\S* fusion\(.*?calls=(%[\w.\-]+)", text)
    assert update, "expected a fusion writing the trace"
    fused = _computations(text)[update.group(1)]
    small = (f"[{B},{H}]", f"[1,{B},{H}]", f"[{B},{H},1]", f"[{B},{H},1,1]")
    structural = ("parameter(", "bitcast(", "broadcast(", "constant(")
    found = []
    for line in fused.splitlines()[1:]:
        result_shape = line.split("=", 1)[-1].split("(")[0]
        if any(shape + "{" in result_shape for shape in small) and not any(k in line for k in structural):
            found.append(line.strip().split(" ")[0])
    return found


def test_a_16_bit_trace_update_reads_d_computed_once() -> None:
    """A bfloat16 update moves half the bytes and is then bound by arithmetic: ``D`` is computed
    once, before it (``trace_storage.computed_once``), instead of per trace entry.

    Negative control: the float32 update (bound by memory, left as XLA fuses it) recomputes ``D``'s
    operations inside the trace-sized fusion.
    """
    assert _trace_update_arithmetic(jnp.bfloat16) == []
    assert _trace_update_arithmetic(None) != []


class _GRU(_LIF):
    """A GRU on one ``(I + H, 3H)`` product: its reset gate mixes before ``[x, r h] @ W_h``."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(1)
        self.w = brainstate.ParamState(jnp.asarray(rng.normal(size=(I + H, 2 * H)) / 4, jnp.float32))
        self.wh = brainstate.ParamState(jnp.asarray(rng.normal(size=(I + H, H)) / 4, jnp.float32))

    def update(self, x: jax.Array) -> jax.Array:
        h = self.v.value
        z, r = jnp.split(jax.nn.sigmoid(braintrace.matmul(jnp.concatenate([x, h], -1), self.w.value)), 2, -1)
        cand = jnp.tanh(braintrace.matmul(jnp.concatenate([x, r * h], -1), self.wh.value))
        self.v.value = (1 - z) * h + z * cand
        return self.v.value


@pytest.mark.parametrize("model", [_Tanh, _GRU], ids=["one mixing", "two mixings in series"])
def test_recurrent_mixing_blocks_are_computed_once_before_the_update(model: Any) -> None:
    """OSTLRecurrent's ``D`` keeps the recurrent weights' per-position blocks, a whole forward-mode
    pass over the transition; the float32 trace update reads it computed once, so it is left
    with no more arithmetic than D_RTRL's (``df`` and the element-wise ``D``).

    Negative control: left to XLA, the pass is fused into the update and repeated for every
    trace entry (a GRU-256 step took 4.4× D_RTRL's instead of 1.2×).
    """
    d_rtrl = _trace_update_arithmetic(None, model(), braintrace.D_RTRL)
    assert len(_trace_update_arithmetic(None, model(), braintrace.OSTLRecurrent)) <= len(d_rtrl)


def test_unmaterialised_mixing_blocks_are_recomputed_per_trace_entry(monkeypatch: Any) -> None:
    d_rtrl = _trace_update_arithmetic(None, _GRU(), braintrace.D_RTRL)
    monkeypatch.setattr(braintrace._compiler.mixing_jacobian, "materialised", lambda v: v)
    assert len(_trace_update_arithmetic(None, _GRU(), braintrace.OSTLRecurrent)) > len(d_rtrl)


# --- sparse products ------------------------------------------------------------------------

SPARSE_NEURONS, SPARSE_BATCH = 300, 1


def _sparse_recomputed_per_entry() -> list[str]:
    """The arithmetic on neuron-sized arrays inside the fusions that gather at both ends of each
    stored connection (one value per connection), in a pp_prop training step on a small
    connectome (``benchmarks/connectome.py``), batch 1 as in the benchmark.

    pp_prop's weight gradient gathers its two factors, ``x̄`` at each connection's row and the
    signal times ``df̄`` at its column; an operation on a neuron-sized array left in such a fusion
    runs once per connection instead of once per neuron. (The forward product gathers the spikes
    at one end only, and recomputes their threshold per connection: two cheap operations.)
    """
    from benchmarks import connectome

    indptr, indices = connectome.generate_connectome(SPARSE_NEURONS, 3_000, seed=1)
    model = connectome.ConnectomeLIF(indptr, indices, n_sensory=16, n_readout=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(model, braintrace.pp_prop, jnp.zeros((SPARSE_BATCH, model.n_in)),
                                     batch_size=SPARSE_BATCH, decay_or_rank=0.9)

    @brainstate.transform.jit
    def step(xs: jax.Array) -> Any:
        return learner.etrace_grad(xs, step_fn=lambda x: jnp.sum(learner(x) ** 2))

    text = step.lower(jnp.ones((20, SPARSE_BATCH, model.n_in))).compile().as_text()
    nnz, neurons = indices.size, {SPARSE_NEURONS, SPARSE_BATCH * SPARSE_NEURONS}
    structural = ("parameter(", "bitcast(", "broadcast(", "constant(", "gather(", "pad(", "slice(")

    def size(result: str) -> int:
        dims = re.search(r"\[([\d,]*)\]", result)
        return int(np.prod([int(d) for d in dims.group(1).split(",") if d])) if dims else 1

    found = []
    for name, body in _computations(text).items():
        lines = body.splitlines()
        root = next((line for line in lines if line.lstrip().startswith("ROOT ")), "")
        if body.count(" gather(") < 2 or size(root.split("=", 1)[-1].split("(")[0]) % nnz:
            continue
        for line in lines[1:]:
            result = line.split("=", 1)[-1].split("(")[0]
            if size(result) in neurons and not any(k in line for k in structural):
                found.append(f"{name}: {line.strip().split(' ')[0]}")
    return found


def test_pp_prop_gathers_its_sparse_factors_computed_once() -> None:
    """Negative control: without ``materialised`` XLA fuses the signal's and ``df̄``'s
    arithmetic into the gather and repeats it per connection (on the fly-sized connectome,
    pp_prop's step took 2.6–2.9× the forward step instead of 1.6–2.0)."""
    assert _sparse_recomputed_per_entry() == []


def test_without_materialising_the_sparse_factors_they_are_recomputed_per_connection(monkeypatch: Any) -> None:
    monkeypatch.setattr(braintrace._op.sparse, "materialised", lambda v: v)
    assert _sparse_recomputed_per_entry() != []


def _trace_loops(text: str) -> int:
    """How many while loops carry the trace (the scan over time, then one per gradient read)."""
    return len(_trace_loop_bodies(text))


RANDOM_FEEDBACK = {"feedback": "random", "random_feedback_key": 0}


@pytest.mark.parametrize("model, compiled", [(_Tanh, _compiled_hlo), (_PastReadLIF, _driver_hlo)],
                         ids=["history-from-new", "read-past"])
def test_random_feedback_eprop_moves_the_trace_as_d_rtrl_does(model: Any, compiled: Any) -> None:
    """EProp with random feedback: one write of the trace, no copy, one read by the gradient,
    as D_RTRL. On the LIF cell read past its update, the gradient reads only the entering trace,
    so its update runs in place after it."""
    text = compiled(model(), braintrace.EProp, **RANDOM_FEEDBACK)
    assert _trace_loops(text) == _trace_loops(compiled(model())) == 2
    produced = _trace_sized(_loop_body_hlo(model(), braintrace.EProp, compiled=compiled, **RANDOM_FEEDBACK))
    assert len(produced) == 1 and not produced[0].startswith("%copy"), produced


class _ThreeTermEProp(braintrace.EProp):
    """A trace roll in user code: random feedback takes its three terms as they are."""

    def _step_relation(self, *args: Any) -> Any:
        return super()._step_relation(*args)


def test_random_feedback_in_three_terms_reads_the_trace_three_times() -> None:
    """The negative control: the history, ``⟨s, ε^t⟩`` and ``⟨g, ε^t⟩`` each read a trace."""
    assert _trace_loops(_driver_hlo(_PastReadLIF(), _ThreeTermEProp, **RANDOM_FEEDBACK)) == 4


OTPE_TRACE = f"[{B},{I + H},{H}]"


def _otpe_trace_sized() -> tuple[int, list[str]]:
    """OTPE (mode ``'full'``) on the fixed-leak LIF under ``etrace_grad``: the loops carrying its
    trace and the trace-sized loop-body instructions."""
    bodies = _trace_loop_bodies(_driver_hlo(_FixedLeakLIF(), braintrace.OTPE, leak=0.9), OTPE_TRACE)
    return len(bodies), _trace_sized("\n".join(bodies))


def test_otpe_writes_its_trace_once_and_reads_it_in_one_row_sum() -> None:
    """OTPE's gradient ``λ ⟨L, R^{t-1}⟩`` is read by the shared row sum (one loop besides the scan
    over time), scaled by ``λ`` after it, and the driver orders the update after it: the update,
    in place, is the one trace-sized instruction."""
    loops, produced = _otpe_trace_sized()
    assert loops == 2
    assert len(produced) == 1 and not produced[0].startswith("%copy"), produced


def test_otpe_with_a_scaled_store_computes_a_trace_sized_temporary(monkeypatch: Any) -> None:
    """The negative control: ``λ`` applied to the stores before the estimate."""
    estimate = otpe.store_estimate
    monkeypatch.setattr(otpe, "store_estimate",
                        lambda store, *args: estimate({k: 0.9 * v for k, v in store.items()}, *args))
    _, produced = _otpe_trace_sized()
    assert len(produced) == 2, produced

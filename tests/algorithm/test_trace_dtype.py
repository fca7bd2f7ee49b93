"""``trace_dtype``: traces stored in bfloat16, arithmetic in float32 (D_RTRL and pp_prop).

The model is a leaky layer ``h ← a ⊙ h + x W + b`` with fixed leaks ``a`` spread up to
``LEAK_MAX`` and a tanh readout: D_RTRL is exact there (its ``D`` is the true Jacobian), so the
float32-trace gradient is BPTT's and the bfloat16 one is compared with both. The measured
figures are in the comments next to each tolerance.

Over long streams the rounding of a slowly decaying trace adds up: with leaks up to 0.95 the
bfloat16 gradient keeps a cosine above 0.999 to the float32 one after 1000 steps; with leaks up
to 0.99 it does not, and float16 (three more mantissa bits) does. A test pins both, as
documented in :mod:`braintrace._algorithm.carriers.trace_storage`.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._algorithm.carriers import trace_storage
from braintrace._op import _rule_helpers
from tests.algorithm import test_trace_traffic as traffic
from tests.algorithm.bptt import bptt_grads, cosine, max_rel_err, normal, single_step_grads, window_grads

B, I, H, O = 4, 4, 16, 3
LEAK_MAX = 0.95
ALGORITHMS = {"D_RTRL": ("d_rtrl", {}), "pp_prop": ("pp_prop", {"decay_or_rank": 0.9})}
TRACED = (("w",), ("b",))


class Leaky(brainstate.nn.Module):
    """``h ← a ⊙ h + x W + b`` with fixed leaks ``a`` in ``[0.8, leak_max]``; ``tanh(h) R`` out."""

    def __init__(self, leak_max: float = LEAK_MAX) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(1, (I, H), 0.5))
        self.b = brainstate.ParamState(normal(2, (H,), 0.1))
        self.r = brainstate.ParamState(normal(3, (H, O), 0.5))
        self.leak = jnp.linspace(0.8, leak_max, H)

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, H)))

    def update(self, x: jax.Array) -> jax.Array:
        self.h.value = self.leak * self.h.value + braintrace.matmul(x, self.w.value, self.b.value)
        return jnp.tanh(self.h.value) @ self.r.value


def learner(name: str, trace_dtype: Any = None, leak_max: float = LEAK_MAX, **options: Any) -> Any:
    algorithm, defaults = ALGORITHMS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the plain readout's diagnostic
        return braintrace.compile(Leaky(leak_max), algorithm, jnp.zeros((B, I)), batch_size=B,
                                  trace_dtype=trace_dtype, **{**defaults, **options})


def traced(grads: dict[Any, Any]) -> dict[Any, Any]:
    """The gradients the trace storage can change (the readout's is exact either way)."""
    return {p: grads[p] for p in TRACED}


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("bad", ["int8", jnp.int32, jnp.float8_e5m2, "half-ish"], ids=str)
def test_a_bad_trace_dtype_is_refused_at_construction(name: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"trace_dtype must be a floating dtype.*got {re.escape(repr(bad))}.*"
                                         r"trace_dtype=jnp\.bfloat16"):
        learner(name, bad)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_trace_is_stored_in_the_trace_dtype_and_stays_there(name: str) -> None:
    xs = normal(4, (3, B, I))
    bf16, f16, native = learner(name, jnp.bfloat16), learner(name, "float16"), learner(name)

    def dtypes(lrn: Any) -> set[Any]:
        return {leaf.dtype for p in TRACED for leaf in jax.tree.leaves(lrn.get_etrace_of(p))}

    assert bf16.trace_dtype == jnp.dtype(jnp.bfloat16) and f16.trace_dtype == np.dtype("float16")
    assert dtypes(bf16) == {jnp.dtype(jnp.bfloat16)} and dtypes(f16) == {np.dtype("float16")}
    assert native.trace_dtype is None and dtypes(native) == {np.dtype("float32")}
    grads = single_step_grads(bf16, xs)
    assert dtypes(bf16) == {jnp.dtype(jnp.bfloat16)}, "stepping keeps the storage dtype"
    assert {g.dtype for g in grads.values()} == {np.dtype("float32")}, "the arithmetic stays in float32"


def _bfloat16_bits(values: Any) -> np.ndarray:
    return np.asarray(values).view(np.uint16)


def test_rounding_to_bfloat16_is_to_nearest_with_ties_to_even() -> None:
    # Against ml_dtypes' rounding (numpy, no XLA): values across the exponent range, and every
    # tie between two bfloat16 neighbours of both parities, of both signs.
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(20_000) * np.exp(rng.uniform(-80, 70, 20_000))).astype(np.float32)
    neighbours = rng.standard_normal(2_000).astype(jnp.bfloat16).astype(np.float32)
    ulp = np.spacing(neighbours.astype(jnp.bfloat16)).astype(np.float32)
    ties = np.concatenate([neighbours + ulp / 2, neighbours - ulp / 2]).astype(np.float32)
    values = np.concatenate([spread, ties, [0.0, -0.0, 1.0, 5e33, -5e33]]).astype(np.float32)
    got = jax.jit(lambda v: trace_storage.rounded(v, jnp.bfloat16))(values)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bfloat16_bits(got), _bfloat16_bits(values.astype(jnp.bfloat16)))


@pytest.mark.exhaustive
def test_the_split_rounds_every_float32_as_astype_does() -> None:
    """Every float32 bit pattern, in 64 blocks: the split's bits are ``astype``'s wherever
    ``65537 · v`` is finite and ``v`` is normal (or zero); a subnormal gives a signed zero and
    everything else NaN. The check runs 64 times: it is compiled with LLVM's optimisations,
    which ``make test`` leaves out (``Makefile``)."""
    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 2})
    def mismatches(start: jax.Array) -> jax.Array:
        bits = start + jnp.arange(1 << 26, dtype=jnp.uint32)
        v = jax.lax.bitcast_convert_type(bits, jnp.float32)
        split = jax.lax.bitcast_convert_type(trace_storage._split_to_bfloat16(v), jnp.uint16)
        exact = jax.lax.bitcast_convert_type(v.astype(jnp.bfloat16), jnp.uint16)
        in_range = jnp.isfinite(v * jnp.float32(65537.0))
        normal = (jnp.abs(v) >= jnp.finfo(jnp.float32).tiny) | (v == 0)
        signed_zero = (bits >> 16).astype(jnp.uint16) & jnp.uint16(0x8000)
        nan = jnp.isnan(jax.lax.bitcast_convert_type(split, jnp.bfloat16))
        wrong = jnp.where(in_range, jnp.where(normal, split != exact, split != signed_zero), ~nan)
        return wrong.sum()

    assert sum(int(mismatches(jnp.uint32(k << 26))) for k in range(64)) == 0


def test_rounding_to_bfloat16_keeps_what_is_not_finite_not_finite() -> None:
    # Infinities, NaN and a value that overflows bfloat16; both roundings agree on these. (Only
    # the split maps a finite value of 5.2e33 or more to NaN: the exhaustive test above.)
    values = jnp.array([jnp.inf, -jnp.inf, jnp.nan, -3.4e38], jnp.float32)
    got = jax.jit(lambda v: trace_storage.rounded(v, jnp.bfloat16))(values).astype(jnp.float32)
    assert not np.isfinite(np.asarray(got)).any(), got


@pytest.mark.parametrize("options", [{}, {"kappa_filter_decay": 0.5}], ids=["D_RTRL", "EProp-filtered"])
def test_stored_traces_are_those_of_astype_bit_for_bit(options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused into the learner's update, the split rounds as ``astype`` does: the same trace bits,
    and (EProp) the same gradients, which read the filter."""
    xs = normal(5, (6, B, I))

    def traces() -> list[np.ndarray]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the plain readout's diagnostic
            lrn = braintrace.compile(Leaky(), "eprop" if options else "d_rtrl", jnp.zeros((B, I)),
                                     batch_size=B, trace_dtype=jnp.bfloat16, **options)
        grads = single_step_grads(lrn, xs)
        stored = [_bfloat16_bits(leaf) for p in TRACED for leaf in jax.tree.leaves(lrn.get_etrace_of(p))]
        return stored + [np.asarray(grads[p]).view(np.uint32) for p in TRACED]

    split = traces()
    monkeypatch.setattr(trace_storage, "_split_to_bfloat16", lambda v: v.astype(jnp.bfloat16))
    reference = traces()
    assert len(split) == len(reference) > 0
    assert any(t.any() for t in split)
    for got, expected in zip(split, reference):
        np.testing.assert_array_equal(got, expected)


def test_d_rtrl_warns_when_no_trace_takes_the_fast_path() -> None:
    with pytest.warns(UserWarning, match=r"trace_dtype=bfloat16 applies to no trace.*fast_solve=False"):
        braintrace.compile(Leaky(), "d_rtrl", jnp.zeros((B, I)), batch_size=B, trace_dtype=jnp.bfloat16,
                           fast_solve=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner("D_RTRL", jnp.bfloat16)
    assert not [w for w in caught if "trace_dtype" in str(w.message)]


# --- gradients ----------------------------------------------------------------------------

T = 16


@pytest.fixture(scope="module")
def stream() -> tuple[jax.Array, dict[Any, Any]]:
    xs = normal(7, (T, B, I))
    return xs, traced(bptt_grads(Leaky(), xs, batch_size=B))


@pytest.mark.parametrize("name, windows", [
    ("D_RTRL", None), ("D_RTRL", (8, 8)), ("pp_prop", None),
    pytest.param("pp_prop", (8, 8), marks=pytest.mark.exhaustive),
], ids=["D_RTRL-single-step", "D_RTRL-multi-step", "pp_prop-single-step", "pp_prop-multi-step"])
def test_bfloat16_trace_gradients_match_float32_and_bptt(
    stream: tuple[jax.Array, dict[Any, Any]], name: str, windows: tuple[int, ...] | None,
) -> None:
    xs, bptt = stream

    def grads(trace_dtype: Any) -> dict[Any, Any]:
        if windows is None:
            return traced(single_step_grads(learner(name, trace_dtype), xs))
        return traced(window_grads(learner(name, trace_dtype, vjp_method="multi-step"), xs, windows))

    f32, bf16 = grads(None), grads(jnp.bfloat16)
    # Measured (T=24): max rel. err 1e-3 to 5e-3, cosine > 0.99999; a stored trace is not exact.
    assert 0 < max_rel_err(f32, bf16) < 0.02
    assert cosine(f32, bf16) > 0.9999
    if name == "D_RTRL":  # exact here: the float32 trace gives BPTT, the bfloat16 one stays close
        assert max_rel_err(bptt, f32) < 1e-5
        assert max_rel_err(bptt, bf16) < 0.02 and cosine(bptt, bf16) > 0.9999
    else:  # pp_prop approximates BPTT; the storage does not move that approximation
        assert abs(cosine(bptt, bf16) - cosine(bptt, f32)) < 1e-3


def _long_stream(name: str, leak_max: float, dtypes: tuple[Any, ...], steps: int = 1000) -> list[float]:
    """The cosine to the float32-trace gradient, summed over ``steps`` single-step calls, per dtype."""
    xs = normal(8, (steps, B, I))
    reference = traced(single_step_grads(learner(name, None, leak_max), xs))
    return [cosine(reference, traced(single_step_grads(learner(name, d, leak_max), xs))) for d in dtypes]


def test_d_rtrl_bfloat16_does_not_drift_over_a_long_stream() -> None:
    # Measured: 0.99989 after 1000 steps (leaks up to 0.95).
    (cos,) = _long_stream("D_RTRL", LEAK_MAX, (jnp.bfloat16,))
    assert cos > 0.999


@pytest.mark.exhaustive
def test_pp_prop_bfloat16_does_not_drift_over_a_long_stream() -> None:
    # Measured: 0.99999 after 1000 steps (its factors decay by 0.9 and by D).
    (cos,) = _long_stream("pp_prop", LEAK_MAX, (jnp.bfloat16,))
    assert cos > 0.999


@pytest.mark.exhaustive
def test_a_slow_leak_needs_float16() -> None:
    # Measured (leaks up to 0.99): bfloat16 0.9975, float16 0.99998.
    bf16, f16 = _long_stream("D_RTRL", 0.99, (jnp.bfloat16, jnp.float16))
    assert bf16 < 0.999 < f16


# --- memory traffic -------------------------------------------------------------------------


def _bfloat16_trace_producers() -> list[str]:
    """``'name: dtype'`` of every instruction of the step's loop bodies with a trace-shaped result
    (parameters, tuple reads and bitcasts, which move no data, left out)."""
    body = traffic._loop_body_hlo(traffic._LIF(), trace_dtype=jnp.bfloat16)
    result = re.compile(rf"^\s*(?:ROOT )?(%\S+) = (\w+){re.escape(traffic.TRACE_SHAPE)}\{{")
    skip = ("parameter(", "get-tuple-element(", "bitcast(", "tuple(")
    return [f"{m.group(1)}: {m.group(2)}" for line in body.splitlines()
            if (m := result.match(line)) and not any(k in line for k in skip)]


def test_bfloat16_trace_is_written_once_and_never_widened() -> None:
    # One trace-sized result per step, in bfloat16: the update (upcast on read, one fused
    # multiply-add, rounded on write). The gradient's row loop reads it in bfloat16.
    produced = _bfloat16_trace_producers()
    assert len(produced) == 1 and produced[0].endswith(": bf16"), produced


@pytest.mark.exhaustive
def test_slicing_rows_without_the_barrier_widens_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    # The negative control of the test above: XLA on CPU hoists a float32 copy of the trace out
    # of the row loop when the rows are sliced directly.
    monkeypatch.setattr(_rule_helpers, "_row_at", lambda x, b: jax.lax.dynamic_index_in_dim(x, b, keepdims=False))
    produced = _bfloat16_trace_producers()
    assert any(p.endswith(": f32") for p in produced), produced


def _roundings_to_bfloat16(text: str, result_shape: str) -> dict[str, int]:
    """For each fused computation with a bfloat16 result of ``result_shape``, how many of its
    instructions round every element to 16 bits: a convert to bfloat16, or one to uint16 (the
    last step of :func:`~braintrace._algorithm.carriers.trace_storage.rounded` on CPU, which drops the
    low half of a float32 split to bfloat16's precision)."""
    counts = {}
    for name, body in traffic._computations(text).items():
        lines = body.splitlines()
        root = next((line for line in lines if line.lstrip().startswith("ROOT ")), "")
        if f"bf16{result_shape}" in root.split("=", 1)[-1].split("(")[0]:
            counts[name] = sum(1 for line in lines[1:] if re.search(r"= (?:bf16|u16)\[[\d,]+\]\S* convert\(", line))
    return counts


def _driver_trace_roundings() -> list[int]:
    """The roundings in the update of a bfloat16 trace whose entering value the gradient reads,
    under ``etrace_grad`` (which orders that update after the gradient)."""
    text = traffic._driver_hlo(traffic._PastReadLIF(), trace_dtype=jnp.bfloat16)
    return list(_roundings_to_bfloat16(text, traffic.TRACE_SHAPE).values())


def test_ordering_a_bfloat16_update_after_the_gradient_rounds_it_once() -> None:
    """The ordering ties the new trace to the gradient through integer bits: the update still
    rounds once. Negative control: adding a floating zero instead, which XLA computes in float32,
    rounds every element a second time."""
    assert _driver_trace_roundings() == [1]


def test_ordering_with_a_floating_zero_rounds_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(braintrace._algorithm.engine.base, "_or_zero_bits", lambda v, zero: v + zero.astype(v.dtype))
    assert _driver_trace_roundings() == [2]


def _row_loop_roundings() -> int:
    """The roundings to bfloat16 in the bodies of the gradient's row loop over a bfloat16 trace."""
    text = traffic._compiled_hlo(traffic._LIF(), trace_dtype=jnp.bfloat16)
    computations = traffic._computations(text)
    loops = re.findall(r"= \(.*?\) while\(.*?body=(%[\w.\-]+)", text)
    # The innermost loops carrying the trace and a weight-sized float32 sum.
    row_loops = [name for name in loops if f"f32[{traffic.I + traffic.H},{traffic.H}]" in computations[name]
                 and "bf16" + traffic.TRACE_SHAPE in computations[name] and " while(" not in computations[name]]
    assert row_loops, loops
    fused = [computations[c] for name in row_loops for c in re.findall(r"calls=(%[\w.\-]+)", computations[name])]
    return sum(len(re.findall(r"= bf16\[[\d,]*\]\S* convert\(", body)) for body in fused)


def test_the_row_loop_reads_a_bfloat16_trace_without_rounding_it() -> None:
    """Each row is sliced as 16-bit integers and widened once. Negative control: slicing the
    floats, which XLA on CPU does in float32, then rounds each row back to bfloat16."""
    assert _row_loop_roundings() == 0


def test_slicing_the_floats_rounds_each_row_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def float_rows(x: jax.Array, b: jax.Array) -> jax.Array:
        x, b = jax.lax.optimization_barrier((x, b))
        return jax.lax.dynamic_index_in_dim(x, b, keepdims=False)

    monkeypatch.setattr(_rule_helpers, "_row_at", float_rows)
    assert _row_loop_roundings() > 0

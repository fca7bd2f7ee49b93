"""Traces rolled in the backward pass (``braintrace._algorithm.carriers.backward_roll``), exercised on CPU.

On a TPU the drivers have a single-step learner roll its large dense traces in the backward pass,
with the gradient's history term, in one pass (a Pallas kernel). Here the learners are compiled
as if on a TPU (the trace storage of ``test_tpu_trace_storage.py``) with the size threshold
lowered to zero, so that the path runs on these small models: the kernel in Pallas's
interpreter agrees with its XLA reference, and a learner rolling in the backward pass gives
BPTT's gradient, the same gradient and traces as rolling in the forward pass, under
``etrace_grad``, ``etrace_train`` and ``check_finite``. A learner called outside the drivers,
and traces below the threshold, roll in the forward pass.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import braintrace
from benchmarks.models import LIF as ReadPastLIF
from braintrace._algorithm.carriers import backward_roll
from braintrace._op import dense, fused_roll
from tests.algorithm.bptt import _to_numpy, bptt_grads, max_rel_err, normal, target_loss
from tests.device.test_exactness_on_device import MODELS, RTOL, B, H, I, Leaky, T

pytestmark = pytest.mark.skipif(jax.default_backend() == "tpu", reason="compiles as if on a TPU on another platform")


def _random(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


# --- the kernel ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 24, 256), (2, 13, 200), (2, 40, 1024), (1, 8, 128)],
                         ids=["tiled", "whole-axes", "two-out-blocks", "one-row"])
def test_the_pallas_kernel_agrees_with_its_xla_reference(shape: tuple[int, int, int]) -> None:
    batch, n_in, n_out = shape
    trace, x = _random(shape, 0), _random((batch, n_in), 1)
    diag, df, signal = (_random((batch, n_out), s) for s in (2, 3, 4))
    want_new, want_grad = fused_roll.roll_and_contract_xla(trace, diag, x, df, signal)
    new, grad = fused_roll.roll_and_contract_pallas(trace, diag, x, df, signal, interpret=True)
    np.testing.assert_allclose(new, want_new, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 24, 256), (2, 13, 200)], ids=["tiled", "whole-axes"])
def test_the_filtering_kernel_agrees_with_its_xla_reference(shape: tuple[int, int, int]) -> None:
    batch, n_in, n_out = shape
    trace, filt, x = _random(shape, 0), _random(shape, 5), _random((batch, n_in), 1)
    diag, df, signal, filt_signal = (_random((batch, n_out), s) for s in (2, 3, 4, 6))
    want = fused_roll.roll_filter_and_contract_xla(trace, filt, diag, x, df, signal, filt_signal, 0.9)
    got = fused_roll.roll_filter_and_contract_pallas(trace, filt, diag, x, df, signal, filt_signal, 0.9, interpret=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_filtering_reference_rolls_filters_and_contracts_both() -> None:
    trace, filt, x = _random((2, 3, 4), 0), _random((2, 3, 4), 5), _random((2, 3), 1)
    diag, df, signal, filt_signal = (_random((2, 4), s) for s in (2, 3, 4, 6))
    new, new_filt, grad = fused_roll.roll_filter_and_contract_xla(trace, filt, diag, x, df, signal, filt_signal, 0.9)
    rolled = np.einsum("bo,bio->bio", diag, trace) + np.einsum("bi,bo->bio", x, df)
    np.testing.assert_allclose(new, rolled, rtol=1e-6)
    np.testing.assert_allclose(new_filt, 0.9 * np.asarray(filt) + rolled, rtol=1e-6)
    want = np.einsum("bio,bo->io", trace, signal) + np.einsum("bio,bo->io", filt, filt_signal)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)


def test_the_xla_reference_is_the_roll_and_the_contraction() -> None:
    trace, x = _random((2, 3, 4), 0), _random((2, 3), 1)
    diag, df, signal = (_random((2, 4), s) for s in (2, 3, 4))
    new, grad = fused_roll.roll_and_contract_xla(trace, diag, x, df, signal)
    np.testing.assert_allclose(new, np.einsum("bo,bio->bio", diag, trace) + np.einsum("bi,bo->bio", x, df), rtol=1e-6)
    np.testing.assert_allclose(grad, np.einsum("bio,bo->io", trace, signal), rtol=1e-6)


# --- the learners -------------------------------------------------------------------------


#: The learners as compiled here: EProp with a filter is ``eprop-kappa``, with random feedback
#: (a signal that replaces ``∂L/∂h``) ``eprop-random``.
ALGORITHMS: dict[str, tuple[str, dict[str, Any]]] = {
    "d_rtrl": ("d_rtrl", {}), "eprop": ("eprop", {}), "eprop-kappa": ("eprop", {"kappa_filter_decay": 0.9}),
    "eprop-random": ("eprop", {"feedback": "random", "random_feedback_key": 0}),
    "ostl_recurrent": ("ostl_recurrent", {}),
}


def _compile(model: Any, algorithm: str, monkeypatch: pytest.MonkeyPatch, as_on_tpu: bool = True,
             **extra: Any) -> Any:
    x0 = normal(11, (T, B, I))[0]
    name, options = ALGORITHMS[algorithm]
    with monkeypatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if as_on_tpu:
            patch.setattr(jax, "default_backend", lambda: "tpu")
        return braintrace.compile(model, name, x0, batch_size=B, **options, **extra)


@pytest.fixture
def rolls_every_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backward_roll, "ROLL_MIN_BYTES", 0)


@pytest.fixture
def one_call_per_roll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call rolls its own traces (no group of calls is rolled at once)."""
    monkeypatch.setattr(backward_roll, "MAX_CALLS_PER_ROLL", 1)


def _rolls_in_the_forward_pass(learner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(learner, "_seq_roll_sink", lambda grouped=False: None)
    monkeypatch.setattr(learner, "_seq_calls_per_roll", lambda calls: 1)


def _read_past_lif() -> brainstate.nn.Module:
    """The benchmarks' LIF network, whose readout reads the spikes past their update."""
    brainstate.random.seed(0)
    return ReadPastLIF(I, 8, 2)


MODEL_CASES = {"leaky": MODELS["leaky"], "lif": MODELS["lif"], "gru": MODELS["gru"], "read-past-lif": _read_past_lif}
CASES = [(m, a) for m in MODEL_CASES for a in ALGORITHMS]


def _assert_same(got: Any, got_traces: list[Any], want: Any, want_traces: list[Any]) -> None:
    """Gradients and traces equal to float32 rounding (the sums added in another order): an entry
    that cancels to near zero keeps the rounding of its terms, so the absolute tolerance is two
    float32 ulps (2.4e-7) of the trace's largest entry."""
    assert max_rel_err(want, got) < 1e-6
    for got_trace, want_trace in zip(got_traces, want_traces, strict=True):
        for name, value in want_trace.items():
            scale = float(np.max(np.abs(value)))
            np.testing.assert_allclose(got_trace[name], value, rtol=1e-6, atol=2.4e-7 * scale)


def _etrace_grad(learner: Any) -> tuple[Any, list[Any]]:
    """The summed estimate and the final traces and filters (keyed by compiled variables: listed in order)."""
    xs = normal(11, (T, B, I))
    grads = learner.etrace_grad(xs, jnp.arange(T), step_fn=lambda x, t: target_loss(t, learner(x)), reduction="sum")
    states = [*learner.etrace_bwg.values(), *learner._trace_filters.values()]
    return _to_numpy(grads), [jax.tree.map(np.asarray, st.value) for st in states]


@pytest.mark.parametrize("model, algorithm", CASES, ids=[f"{m}-{a}" for m, a in CASES])
def test_rolled_in_the_backward_pass_the_learner_computes_what_it_does_in_the_forward_pass(
    model: str, algorithm: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None, one_call_per_roll: None,
) -> None:
    backward = _compile(MODEL_CASES[model](), algorithm, monkeypatch)
    forward = _compile(MODEL_CASES[model](), algorithm, monkeypatch)
    _rolls_in_the_forward_pass(forward, monkeypatch)
    got, got_traces = _etrace_grad(backward)
    want, want_traces = _etrace_grad(forward)
    assert backward._rolled_now and not forward._rolled_now
    _assert_same(got, got_traces, want, want_traces)


@pytest.mark.parametrize("model", ["lif", "leaky"])
def test_rolled_by_the_pallas_kernel_the_gradient_matches_bptt(
    model: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None, one_call_per_roll: None,
) -> None:
    monkeypatch.setattr(dense, "roll_and_contract",
                        lambda *a: fused_roll.roll_and_contract_pallas(*a, interpret=True))
    learner = _compile(MODELS[model](), "d_rtrl", monkeypatch)
    got, _ = _etrace_grad(learner)
    assert learner._rolled_now
    ref = bptt_grads(MODELS[model](), normal(11, (T, B, I)), batch_size=B)
    assert max_rel_err(ref, got) <= RTOL


def test_a_filtered_trace_rolled_by_the_pallas_kernel_gives_what_the_forward_roll_gives(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    monkeypatch.setattr(dense, "roll_filter_and_contract",
                        lambda *a: fused_roll.roll_filter_and_contract_pallas(*a, interpret=True))
    backward = _compile(MODELS["lif"](), "eprop-kappa", monkeypatch)
    forward = _compile(MODELS["lif"](), "eprop-kappa", monkeypatch)
    _rolls_in_the_forward_pass(forward, monkeypatch)
    (got, got_traces), (want, want_traces) = _etrace_grad(backward), _etrace_grad(forward)
    assert backward._rolled_now
    _assert_same(got, got_traces, want, want_traces)


def test_etrace_train_and_check_finite_roll_in_the_backward_pass_too(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    xs, ts = normal(11, (T, B, I)), jnp.arange(T)
    weights = []
    for rolls in (True, False):
        learner = _compile(MODELS["gru"](), "d_rtrl", monkeypatch)
        if not rolls:
            _rolls_in_the_forward_pass(learner, monkeypatch)
        learner.etrace_train(xs, ts, step_fn=lambda x, t, lr=learner: target_loss(t, lr(x)),
                             optimizer=optax.adam(1e-2), check_finite=True)
        assert bool(learner._rolled_now) == rolls
        weights.append(_to_numpy({k: st.value for k, st in learner.param_states.items()}))
    assert max_rel_err(weights[1], weights[0]) < 1e-5


# --- traces rolled over groups of calls ------------------------------------------------------

GROUPED = [(m, a) for m in MODEL_CASES for a in ALGORITHMS]


@pytest.mark.parametrize("model, algorithm", GROUPED, ids=[f"{m}-{a}" for m, a in GROUPED])
def test_rolled_over_a_group_of_calls_the_learner_computes_what_it_does_call_by_call(
    model: str, algorithm: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    grouped = _compile(MODEL_CASES[model](), algorithm, monkeypatch)
    forward = _compile(MODEL_CASES[model](), algorithm, monkeypatch)
    _rolls_in_the_forward_pass(forward, monkeypatch)
    assert grouped._seq_calls_per_roll(T) == T  # the loop's calls are one group
    got, got_traces = _etrace_grad(grouped)
    want, want_traces = _etrace_grad(forward)
    assert grouped._rolled_now and grouped._sink_keys == grouped._grouped_keys()
    _assert_same(got, got_traces, want, want_traces)


def _replace_steps_kernel(learner: Any, monkeypatch: pytest.MonkeyPatch, replace: Any) -> None:
    """Give ``learner``'s fast paths the kernel ``replace(roll_and_solve_steps)`` over several steps."""
    fast_path = learner._fast_path

    def replaced(rel: Any) -> Any:
        fp = fast_path(rel)
        return None if fp is None else fp._replace(roll_and_solve_steps=replace(fp.roll_and_solve_steps))

    monkeypatch.setattr(learner, "_fast_path", replaced)


def _tpu_group_form(large_trace: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the groups roll their traces and sum their steps' own terms as a TPU does: by
    products, or element-wise as for a trace of ``dense.ELEMENTWISE_TRACE_BYTES`` or more."""

    def as_on_a_tpu(function: Any) -> Any:
        def run(*args: Any) -> Any:
            with monkeypatch.context() as patch:
                patch.setattr(jax, "default_backend", lambda: "tpu")
                if large_trace:
                    patch.setattr(dense, "ELEMENTWISE_TRACE_BYTES", 0)
                return function(*args)
        return run

    for name in ("_steps_outer_sums", "_steps_own_terms"):
        monkeypatch.setattr(dense, name, as_on_a_tpu(getattr(dense, name)))


def _in_two_groups(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's ``T`` calls in two groups of three, rolled in ``form`` (``cpu``, ``tpu``, or
    ``tpu-large-trace``: :func:`_tpu_group_form`)."""
    monkeypatch.setattr(backward_roll, "MAX_CALLS_PER_ROLL", 3)
    if form != "cpu":
        _tpu_group_form(form == "tpu-large-trace", monkeypatch)


def _error_without_history(model: str, ref: Any, monkeypatch: pytest.MonkeyPatch, **extra: Any) -> float:
    """The negative control: D_RTRL on ``model`` (compiled with ``extra``) whose group's roll
    drops the history terms; its gradient's max. rel. error against ``ref``."""
    blind = _compile(MODELS[model](), "d_rtrl", monkeypatch, **extra)
    _replace_steps_kernel(blind, monkeypatch, lambda steps: lambda old, d, x, df, q, bias, **own: steps(
        old, d, x, df, 0 * q, bias, **own))
    missed, _ = _etrace_grad(blind)
    assert blind._rolled_now
    return max_rel_err(ref, missed)


@pytest.mark.parametrize("form", ["cpu", "tpu", "tpu-large-trace"])
@pytest.mark.parametrize("model", ["leaky", "lif"])
def test_rolled_over_groups_of_calls_the_gradient_matches_bptt(
    model: str, form: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    _in_two_groups(form, monkeypatch)
    learner = _compile(MODELS[model](), "d_rtrl", monkeypatch)
    assert learner._seq_calls_per_roll(T) == 3
    got, _ = _etrace_grad(learner)
    assert learner._rolled_now
    ref = bptt_grads(MODELS[model](), normal(11, (T, B, I)), batch_size=B)
    assert max_rel_err(ref, got) <= RTOL
    assert _error_without_history(model, ref, monkeypatch) > 100 * RTOL  # misses BPTT by far


@pytest.mark.parametrize("algorithm", ["d_rtrl", "eprop-kappa"])
def test_a_16_bit_trace_is_rolled_over_its_group_in_float32_and_rounded_once(
    algorithm: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    """One group over the loop, from fresh traces: the bfloat16 learner computes the float32
    learner's gradient bit for bit and stores the float32 traces (and filters) rounded once."""
    f32 = _compile(MODELS["lif"](), algorithm, monkeypatch)
    bf16 = _compile(MODELS["lif"](), algorithm, monkeypatch, trace_dtype=jnp.bfloat16)
    assert bf16._seq_calls_per_roll(T) == T and len(bf16._grouped_keys()) == len(f32._grouped_keys()) > 0
    (want, want_traces), (got, got_traces) = _etrace_grad(f32), _etrace_grad(bf16)
    assert bf16._rolled_now
    jax.tree.map(np.testing.assert_array_equal, got, want)
    rounded = [st.value for key in bf16._grouped_keys()
               for st in (bf16.etrace_bwg[key], *([bf16._trace_filters[key]] if bf16._trace_filters else []))]
    assert rounded and all(leaf.dtype == jnp.bfloat16 for trace in rounded for leaf in trace.values())
    for got_trace, want_trace in zip(got_traces, want_traces, strict=True):
        jax.tree.map(lambda g, w: np.testing.assert_array_equal(g, np.asarray(jnp.asarray(w).astype(g.dtype))),
                     got_trace, want_trace)


@pytest.mark.parametrize("form", ["cpu", "tpu", "tpu-large-trace"])
@pytest.mark.parametrize("model", ["leaky", "lif"])
def test_a_16_bit_trace_rolled_over_groups_keeps_the_gradient_within_its_rounding_of_bptt(
    model: str, form: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    _in_two_groups(form, monkeypatch)
    grouped = _compile(MODELS[model](), "d_rtrl", monkeypatch, trace_dtype=jnp.bfloat16)
    per_call = _compile(MODELS[model](), "d_rtrl", monkeypatch, trace_dtype=jnp.bfloat16)
    _rolls_in_the_forward_pass(per_call, monkeypatch)
    assert grouped._seq_calls_per_roll(T) == 3
    (got, _), (by_call, _) = _etrace_grad(grouped), _etrace_grad(per_call)
    assert grouped._rolled_now and not per_call._rolled_now
    ref = bptt_grads(MODELS[model](), normal(11, (T, B, I)), batch_size=B)
    # The entering trace of the second group is rounded (as every call's is when rolled call by call).
    assert 0 < max_rel_err(ref, got) < 0.02 and max_rel_err(ref, by_call) < 0.02
    assert _error_without_history(model, ref, monkeypatch, trace_dtype=jnp.bfloat16) > 0.1  # misses BPTT by far


class _SharedBiasLeaky(Leaky):
    """The leaky model whose readout adds its bias too: the weight is left out of the one-step
    VJP, the bias (read outside its relation) is not."""

    def update(self, x: jax.Array) -> jax.Array:
        return super().update(x) + self.b.value


@pytest.mark.parametrize("model", ["leaky", "shared-bias"])
def test_a_group_sums_its_calls_own_terms_where_the_whole_trace_is_left_out_of_the_step(
    model: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    """Where every operand of a rolled trace is left out of the one-step VJP, its calls return
    their own terms' signal and the group's roll adds those terms; where only some are, each
    call adds theirs. Both give BPTT's gradient."""
    make = Leaky if model == "leaky" else _SharedBiasLeaky
    monkeypatch.setattr(backward_roll, "MAX_CALLS_PER_ROLL", 3)
    learner = _compile(make(), "d_rtrl", monkeypatch)
    (key,) = learner._grouped_keys()
    left_out = dict(learner._local_relation_weights().keys)[learner._rolled_relations[key][0]]
    assert left_out == ({"weight", "bias"} if model == "leaky" else {"weight"})
    assert learner._group_sums_own_terms(key) == (model == "leaky")
    got, _ = _etrace_grad(learner)
    assert learner._rolled_now
    assert max_rel_err(bptt_grads(make(), normal(11, (T, B, I)), batch_size=B), got) <= RTOL


def test_a_kernel_over_several_steps_written_without_own_keeps_each_calls_own_term(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    """A rule record's ``roll_and_solve_steps`` of the signature before ``own``: the group's roll
    leaves the calls' own terms to each call, and the gradient is BPTT's."""
    monkeypatch.setattr(backward_roll, "MAX_CALLS_PER_ROLL", 3)
    learner = _compile(Leaky(), "d_rtrl", monkeypatch)
    _replace_steps_kernel(learner, monkeypatch,
                          lambda steps: lambda old, d, x, df, q, bias: steps(old, d, x, df, q, bias))
    (key,) = learner._grouped_keys()
    assert not learner._group_sums_own_terms(key)
    got, _ = _etrace_grad(learner)
    assert learner._rolled_now
    assert max_rel_err(bptt_grads(Leaky(), normal(11, (T, B, I)), batch_size=B), got) <= RTOL


def test_a_group_is_the_largest_divisor_of_the_loop_up_to_the_cap(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    learner = _compile(MODELS["leaky"](), "d_rtrl", monkeypatch)
    monkeypatch.setattr(backward_roll, "MAX_CALLS_PER_ROLL", 20)
    assert [learner._seq_calls_per_roll(n) for n in (100, 1000, 64, 17, 23, 6, 1)] == [20, 20, 16, 17, 1, 6, 1]
    filtered = _compile(MODELS["leaky"](), "eprop-kappa", monkeypatch)  # a filter rolls with its trace
    assert filtered._rolled_relations and filtered._seq_calls_per_roll(100) == 20


def test_etrace_train_rolls_each_span_in_groups_and_keeps_masks_and_aux(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    """Spans of 4 and 2 calls (groups of 4 and 2), a mask and an aux: the same training, losses
    and aux as rolling call by call."""
    xs, ts, mask = normal(11, (T, B, I)), jnp.arange(T), jnp.asarray([1.0, 0.0, 2.0, 1.0, 0.5, 1.0])
    results = []
    for grouped in (True, False):
        learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch)
        if not grouped:
            _rolls_in_the_forward_pass(learner, monkeypatch)

        def step_fn(x: jax.Array, t: jax.Array, lr: Any = learner) -> tuple[jax.Array, jax.Array]:
            out = lr(x)
            return target_loss(t, out), jnp.sum(out)

        run = learner.etrace_train(xs, ts, step_fn=step_fn, optimizer=optax.sgd(0.1), update_every=4, mask=mask,
                                   has_aux=True)
        assert bool(learner._rolled_now) == grouped
        weights = _to_numpy({k: st.value for k, st in learner.param_states.items()})
        results.append((weights, np.asarray(run.losses), np.asarray(run.aux)))
    (w_got, loss_got, aux_got), (w_want, loss_want, aux_want) = results
    assert max_rel_err(w_want, w_got) < 1e-5
    np.testing.assert_allclose(loss_got, loss_want, rtol=1e-5)
    np.testing.assert_allclose(aux_got, aux_want, rtol=1e-5)
    assert loss_got.shape == (T,) and aux_got.shape == (T,)


def test_a_failed_grouped_loop_leaves_the_learner_as_it_was(
    monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch)
    _etrace_grad(learner)  # traces that are not zero
    before = [np.asarray(leaf) for leaf in jax.tree.leaves(brainstate.graph.states(learner))]

    def failing(x: jax.Array, t: jax.Array) -> jax.Array:
        target_loss(t, learner(x))
        raise ValueError("a user's mistake, after the call")

    with pytest.raises(ValueError, match="a user's mistake"):
        learner.etrace_grad(normal(11, (T, B, I)), jnp.arange(T), step_fn=failing)
    after = [np.asarray(leaf) for leaf in jax.tree.leaves(brainstate.graph.states(learner))]
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))
    _etrace_grad(learner)
    assert learner._rolled_now


def test_below_the_size_threshold_and_outside_the_drivers_traces_roll_in_the_forward_pass(
    monkeypatch: pytest.MonkeyPatch, one_call_per_roll: None,
) -> None:
    """Call by call (a loop whose length has no divisor up to the cap, here the cap at one)."""
    learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch)
    assert learner._rolled_relations  # it could, but its trace is below ROLL_MIN_BYTES
    _etrace_grad(learner)
    assert not learner._rolled_now
    monkeypatch.setattr(backward_roll, "ROLL_MIN_BYTES", 0)
    learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch)
    x = normal(11, (T, B, I))[0]
    brainstate.transform.grad(lambda: jnp.sum(learner(x) ** 2), learner.param_states)()
    assert not learner._rolled_now


def test_on_cpu_storage_no_trace_is_rolled_in_the_backward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    learner = _compile(MODELS["lif"](), "d_rtrl", monkeypatch, as_on_tpu=False)
    assert not learner._rolled_relations


@pytest.mark.parametrize("model", ["leaky", "lif", "gru"])
def test_osttp_rolled_over_a_group_of_calls_computes_what_it_does_call_by_call(
    model: str, monkeypatch: pytest.MonkeyPatch, rolls_every_trace: None,
) -> None:
    """OSTTP's target projection replaces ``∂L/∂h`` as random feedback does: its unfiltered
    traces roll over the group too, to the same gradients and traces."""
    x0, xs, targets = normal(11, (T, B, I))[0], normal(11, (T, B, I)), normal(12, (T, B, 2))
    learners = []
    for _ in range(2):
        with monkeypatch.context() as patch, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            patch.setattr(jax, "default_backend", lambda: "tpu")
            learners.append(braintrace.compile(MODEL_CASES[model](), "osttp", x0, batch_size=B,
                                               B_list=[normal(13, (2, H))]))  # one hidden group
    grouped, forward = learners
    _rolls_in_the_forward_pass(forward, monkeypatch)
    results = []
    for learner in (grouped, forward):
        grads = learner.etrace_grad(xs, targets, step_fn=lambda x, y, lr=learner: jnp.sum(lr(x, y) ** 2),
                                    reduction="sum")
        states = [*learner.etrace_bwg.values(), *learner._trace_filters.values()]
        results.append((_to_numpy(grads), [jax.tree.map(np.asarray, st.value) for st in states]))
    assert grouped._rolled_now and not forward._rolled_now
    (got, got_traces), (want, want_traces) = results
    _assert_same(got, got_traces, want, want_traces)

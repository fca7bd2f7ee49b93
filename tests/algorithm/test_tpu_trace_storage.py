"""The TPU storage of single-state traces, exercised on CPU by compiling as if on a TPU.

On a TPU, ``ParamDimVjpAlgorithm`` stores the trace of a group of one state without its trailing
state axis (see ``ParamDimVjpAlgorithm._stored``). Compiled with ``jax.default_backend()``
reading ``'tpu'``, a learner here stores its traces that way; it must then compute what the
learner with the axis computes (single step, windows, the EProp filter, a convolution, a vmapped
learner), show the axis through ``get_etrace_of``, reset and resize its stored traces, and resume
them from a checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from tests.algorithm.bptt import max_rel_err, normal, single_step_grads, window_grads
from tests.device.test_exactness_on_device import MODELS, B, I, T

# On a TPU both learners of a comparison would store without the axis.
pytestmark = pytest.mark.skipif(jax.default_backend() == "tpu", reason="compares the TPU storage with the others'")

#: ``(model, algorithm, options, windows)``.
CASES = [
    ("leaky", "d_rtrl", {}, None),
    ("leaky", "d_rtrl", {"vjp_method": "multi-step"}, (2, 3, 1)),
    ("leaky", "eprop", {"kappa_filter_decay": 0.5}, None),
    ("leaky", "eprop", {"kappa_filter_decay": 0.5, "vjp_method": "multi-step"}, (3, 3)),
    ("lif", "d_rtrl", {"trace_dtype": jnp.bfloat16}, None),
    ("conv", "d_rtrl", {}, None),
    ("gru", "ostl_recurrent", {}, None),
]


def _compile(model: str, algorithm: str, as_on_tpu: bool, monkeypatch: pytest.MonkeyPatch, **options: Any) -> Any:
    x0 = normal(11, (T, B, I))[0]
    with monkeypatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if as_on_tpu:
            patch.setattr(jax, "default_backend", lambda: "tpu")
        return braintrace.compile(MODELS[model](), algorithm, x0, batch_size=B, **options)


def _grads(learner: Any, windows: Any) -> Any:
    xs = normal(11, (T, B, I))
    return single_step_grads(learner, xs) if windows is None else window_grads(learner, xs, windows)


@pytest.mark.parametrize("model, algorithm, options, windows", CASES,
                         ids=[f"{m}-{a}{'-multi' if w else ''}{'-' + '-'.join(o) if o else ''}" for m, a, o, w in CASES])
def test_stored_without_the_state_axis_the_learner_computes_the_same(
    model: str, algorithm: str, options: dict[str, Any], windows: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = _compile(model, algorithm, False, monkeypatch, **options)
    squeezed = _compile(model, algorithm, True, monkeypatch, **options)
    assert squeezed._squeezed and not plain._squeezed
    # Traces are keyed by the compiled variables: the two learners list them in the same order.
    for stored, full in zip(squeezed.etrace_bwg.values(), plain.etrace_bwg.values(), strict=True):
        assert {k: v.shape for k, v in stored.value.items()} == {k: v.shape[:-1] for k, v in full.value.items()}
    assert max_rel_err(_grads(plain, windows), _grads(squeezed, windows)) < 1e-6
    relation = squeezed.graph.hidden_param_op_relations[0]
    weight = next(iter(relation.trainable_paths.values()))
    seen, want = squeezed.get_etrace_of(weight), plain.get_etrace_of(weight)
    for got, ref in zip(seen.values(), want.values(), strict=True):
        for name in ref:
            assert got[name].shape == ref[name].shape
            np.testing.assert_allclose(np.asarray(got[name], np.float32), np.asarray(ref[name], np.float32),
                                       rtol=1e-5, atol=1e-7)


def test_reset_zeroes_and_resizes_the_stored_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    learner = _compile("leaky", "eprop", True, monkeypatch, kappa_filter_decay=0.5)
    _grads(learner, None)
    learner.reset_state(batch_size=2 * B)
    for st in [*learner.etrace_bwg.values(), *learner._trace_filters.values()]:
        for leaf in st.value.values():
            assert leaf.shape[0] == 2 * B and leaf.shape[-1] != 1 and not np.any(np.asarray(leaf))
    (trace,) = learner.get_etrace_of(("w",)).values()
    assert trace["weight"].shape == (2 * B, I, 5, 1)


def test_a_checkpoint_of_stored_traces_resumes_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    learner = _compile("leaky", "eprop", True, monkeypatch, kappa_filter_decay=0.5)
    _grads(learner, None)
    saved = jax.tree.map(np.asarray, learner._get_etrace_data())
    path = braintrace.save_checkpoint(tmp_path / "run.ckpt", learner)
    learner.reset()
    braintrace.load_checkpoint(path, learner)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, learner._get_etrace_data()), saved)


def test_a_vmapped_learner_stores_its_traces_without_the_axis(monkeypatch: pytest.MonkeyPatch) -> None:
    xs = normal(11, (T, B, I))

    def compile_cell() -> Any:
        brainstate.random.seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return braintrace.compile(braintrace.nn.ValinaRNNCell(I, 5), "d_rtrl", xs[0], batch_size=B, vmap=True)

    with monkeypatch.context() as patch:
        patch.setattr(jax, "default_backend", lambda: "tpu")
        squeezed = compile_cell()
    plain = compile_cell()
    ranks = [[leaf.ndim for leaf in jax.tree.leaves(st.value)]
             for st in (*squeezed.states(braintrace.EligibilityTrace).values(),
                        *plain.states(braintrace.EligibilityTrace).values())]
    half = len(ranks) // 2
    assert half and all(r + 1 == q for a, b in zip(ranks[:half], ranks[half:]) for r, q in zip(a, b))

    def run(learner: Any) -> Any:
        return learner.etrace_grad(xs, step_fn=lambda x: jnp.sum(learner(x) ** 2))

    got, want = run(squeezed), run(plain)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)


@pytest.mark.parametrize("saved_on_tpu", [True, False], ids=["tpu-to-cpu", "cpu-to-tpu"])
def test_a_checkpoint_restores_across_the_two_storages(saved_on_tpu: bool, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Any) -> None:
    """A checkpoint keeps the state axis, so that one saved on a TPU restores elsewhere and back."""
    source = _compile("leaky", "eprop", saved_on_tpu, monkeypatch, kappa_filter_decay=0.5)
    target = _compile("leaky", "eprop", not saved_on_tpu, monkeypatch, kappa_filter_decay=0.5)
    _grads(source, None)
    braintrace.load_checkpoint(braintrace.save_checkpoint(tmp_path / "run.ckpt", source), target)
    def in_order(learner: Any) -> list[Any]:  # traces keyed by compiled variables: compile order
        data = learner._get_etrace_data()
        return [leaf for part in ("eps", "filt") for trace in data[part].values() for leaf in trace.values()]

    got, want = in_order(target), in_order(source)
    assert len(got) == len(want) and any(np.any(np.asarray(w)) for w in want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

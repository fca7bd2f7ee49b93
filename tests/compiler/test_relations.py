"""The relation scenario matrix: which weights learn online through which hidden states."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import pytest

import braintrace
from braintrace import DiagnosticKind
from braintrace._compiler.hid_param_op import PathClassification
from braintrace._op import etp_mm_p, etp_mv_p, etp_elemwise_p
from tests.compiler import models


def _graph(model: Any, x: Any = None) -> braintrace.ETraceGraph:
    return braintrace.compile_etrace_graph(model, jnp.ones(model.n_in if hasattr(model, "n_in") else 3) if x is None else x)


def _profile(graph: braintrace.ETraceGraph) -> list[tuple[Any, tuple, list]]:
    return [
        (r.primitive, tuple(sorted(set(r.trainable_paths.values()))), list(r.connected_hidden_paths))
        for r in graph.hidden_param_op_relations
    ]


@pytest.mark.parametrize(
    "model, expected",
    [
        (models.VanillaRNN, [(etp_mv_p, (("W",),), [("h",)])]),
        (models.LeakyRNN, [(etp_mv_p, (("W_in",),), [("h",)])]),
        (models.GRU, [(etp_mv_p, (("Wz",),), [("h",)]), (etp_mv_p, (("Wh",),), [("h",)])]),
        (models.LSTM, [(etp_mv_p, ((f"W{g}",),), [("c",), ("h",)]) for g in "ifgo"][:3] + [(etp_mv_p, (("Wo",),), [("h",)])]),
        (models.FanIn, [(etp_mv_p, (("Wa",),), [("h",)]), (etp_mv_p, (("Wb",),), [("h",)])]),
        (models.FanOut, [(etp_mv_p, (("W",),), [("h1",), ("h2",)])]),
        (models.Independent, [(etp_mv_p, (("W1",),), [("h1",)]), (etp_mv_p, (("W2",),), [("h2",)])]),
        (models.PlainMatmul, []),
        (models.TiedWeight, [(etp_mv_p, (("W",),), [("h",)]), (etp_mv_p, (("W",),), [("h",)])]),
        (models.ConstWeightParamBias, [(etp_mv_p, (("b",),), [("h",)])]),
        (models.ElemwiseChain, [(etp_elemwise_p, (("g",),), [("h",)]), (etp_mv_p, (("W",),), [("h",)])]),
        (models.Residual, [(etp_mv_p, (("W",),), [("h",)])]),
        (models.SelfProduct, [(etp_mv_p, (("W",),), [("h",)])]),
        (models.JitInside, [(etp_mv_p, (("W",),), [("h",)])]),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_relation_profiles(model: Any, expected: list, quiet: list) -> None:
    assert _profile(_graph(model())) == expected


def test_lif_profile(quiet: list) -> None:
    graph = _graph(models.LIF())
    assert _profile(graph) == [
        (etp_elemwise_p, (("tau",),), [("v",)]),
        (etp_mv_p, (("W_in",),), [("v",)]),
        (etp_mv_p, (("W_rec",),), [("v",)]),
    ]


def test_two_matmuls_in_series_keep_only_the_last(quiet: list) -> None:
    graph = _graph(models.TwoMatmulsInSeries())
    assert _profile(graph) == [(etp_mv_p, (("W2",),), [("h",)])]
    (w2w,) = graph.explain(kind=DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT)
    assert w2w.weight_path == ("W1",) and etp_mv_p in w2w.context["blocking_primitives"]
    assert not graph.explain(kind=DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL)
    assert any("W1" in str(w.message) for w in quiet)


def test_stacked_layers_are_scoped_to_their_own_hidden(quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(models.Stacked(), jnp.ones(3))
    assert _profile(graph) == [
        (etp_mv_p, (("layers", 0, "W"),), [("layers", 0, "h")]),
        (etp_mv_p, (("layers", 1, "W"),), [("layers", 1, "h")]),
    ]
    assert [g.hidden_paths for g in graph.hidden_groups] == [[("layers", 0, "h")], [("layers", 1, "h")]]


def test_nested_paths(quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(models.Nested(), jnp.ones(3))
    assert _profile(graph) == [(etp_mv_p, (("outer", "inner", "W"),), [("outer", "inner", "h")])]


def test_batched_input_uses_the_batched_primitive(quiet: list) -> None:
    model = models.LeakyRNN()
    model.init_state(batch_size=2)
    graph = braintrace.compile_etrace_graph(model, jnp.ones((2, 3)))
    assert _profile(graph) == [(etp_mm_p, (("W_in",),), [("h",)])]


def test_vmap_inside_update_compiles_to_the_batched_relation(quiet: list) -> None:
    class VmapInside(models.LeakyRNN):
        def update(self, x: Any) -> Any:
            import jax
            drive = jax.vmap(lambda xi: braintrace.matmul(xi, self.W_in.value))(x)
            self.h.value = 0.8 * self.h.value + jnp.tanh(drive)
            return self.h.value

    model = VmapInside()
    model.init_state(batch_size=2)
    graph = braintrace.compile_etrace_graph(model, jnp.ones((2, 3)))
    assert _profile(graph) == [(etp_mm_p, (("W_in",),), [("h",)])]


def test_dict_param_state_leaf_indices(quiet: list) -> None:
    graph = _graph(models.GRU())
    rel = graph.hidden_param_op_relations[0]
    assert rel.trainable_paths == {"weight": ("Wz",), "bias": ("Wz",)}
    assert rel.trainable_leaf_indices == {"weight": 1, "bias": 0}
    assert rel.path == ("Wz",)
    assert rel.trainable_param_states["weight"] is graph.module_info.retrieved_model_states[("Wz",)]


def test_constant_weight_records_the_unresolved_key(quiet: list) -> None:
    graph = _graph(models.ConstWeightParamBias())
    (rec,) = graph.explain(kind=DiagnosticKind.TRAINABLE_INVAR_NOT_PARAMSTATE)
    assert rec.context["key"] == "weight"
    assert graph.hidden_param_op_relations[0].trainable_paths == {"bias": ("b",)}


def test_partial_path_classification(quiet: list) -> None:
    graph = _graph(models.PartialPath())
    by_weight = {r.path: r for r in graph.hidden_param_op_relations}
    assert by_weight[("W1",)].path_classification == {("h",): PathClassification.MIXED}
    assert by_weight[("W2",)].path_classification == {("h",): PathClassification.ALL_DIRECT}
    (rec,) = graph.explain(kind=DiagnosticKind.RELATION_PARTIAL_PATH)
    assert rec.weight_path == ("W1",)


def test_non_temporal_weight_is_excluded_with_a_warning(quiet: list) -> None:
    class Readout(models.LeakyRNN):
        def __init__(self) -> None:
            super().__init__()
            self.W_out = models._w(40, (4, 2))

        def update(self, x: Any) -> Any:
            h = super().update(x)
            return braintrace.matmul(h, self.W_out.value)

    graph = _graph(Readout())
    assert [r.path for r in graph.hidden_param_op_relations] == [("W_in",)]
    (rec,) = graph.explain(kind=DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL)
    assert rec.weight_path == ("W_out",)


def test_elemwise_chain_with_a_transform(quiet: list) -> None:
    graph = _graph(models.ElemwiseChain(weight_fn=jnp.exp))
    assert [r.path for r in graph.hidden_param_op_relations] == [("g",), ("W",)]


def test_shape_mismatch_excludes_the_target(quiet: list) -> None:
    class Mismatch(models._Base):
        def __init__(self) -> None:
            super().__init__(3, 4)
            self.W = models._w(41, (3, 5))
            self.init_state()

        def update(self, x: Any) -> Any:
            self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.W.value)[:4]
            return self.h.value

    graph = _graph(Mismatch())
    assert graph.hidden_param_op_relations == ()
    kinds = [r.kind for r in graph.diagnostics if r.weight_path == ("W",)]
    assert kinds == [DiagnosticKind.RELATION_EXCLUDED_SHAPE_MISMATCH, DiagnosticKind.RELATION_EXCLUDED_NON_TEMPORAL]
    assert graph.explain(weight_path=("W",))[0].context == {"y_shape": (5,), "hidden_shape": (4,)}

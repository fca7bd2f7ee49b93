"""``ETraceGraph``, ``CompilationReport``, tail Jacobians and determinism."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace import DiagnosticKind, DiagnosticLevel
from braintrace._compiler.hid_param_op import tail_constvars
from tests.compiler import models


def test_report_of_a_gru(quiet: list) -> None:
    report = braintrace.CompilationReport(braintrace.compile_etrace_graph(models.GRU(), jnp.ones(3)))
    assert report.hidden_groups == [(0, [("h",)])]
    assert report.etrace_weights == [(("Wz",), [0]), (("Wz",), [0]), (("Wh",), [0]), (("Wh",), [0])]
    assert report.excluded_weights == [(("Wr",), "relation_excluded_weight_to_weight")]
    assert report.counts == {"hidden_groups": 1, "etrace_weights": 4, "excluded_weights": 1, "warnings": 1, "errors": 0}
    text1, text2 = report.to_str(1), report.to_str(2)
    assert "The hidden groups are:" in text1 and "   Group 0: [('h',)]" in text1
    associated = [line for line in text1.splitlines() if "is associated with hidden group" in line]
    assert associated == [  # the text lists what counts counts
        "   Weight 0: ('Wz',) ('weight')  is associated with hidden group 0",
        "   Weight 1: ('Wz',) ('bias')  is associated with hidden group 0",
        "   Weight 2: ('Wh',) ('weight')  is associated with hidden group 0",
        "   Weight 3: ('Wh',) ('bias')  is associated with hidden group 0",
    ]
    assert len(associated) == report.counts["etrace_weights"]
    assert "(excluded: relation_excluded_weight_to_weight)" in text1
    assert text2.startswith(text1) and "Compiler diagnostics (warnings / errors):" in text2
    assert "Compiler diagnostics" not in text1
    assert repr(report).startswith("CompilationReport(hidden_groups=1")


def test_report_lists_dynamic_states(quiet: list) -> None:
    import brainstate

    class WithCounter(models.LeakyRNN):
        def __init__(self) -> None:
            super().__init__()
            self.count = brainstate.ShortTermState(jnp.zeros(()))

        def update(self, x: Any) -> Any:
            self.count.value = self.count.value + 1
            return super().update(x)

    report = braintrace.CompilationReport(braintrace.compile_etrace_graph(WithCounter(), jnp.ones(3)))
    assert report.dynamic_states == [("count",)]
    assert "   Dynamic state 0: ('count',)" in report.to_str()


def test_show_prints(capsys: Any, quiet: list) -> None:
    braintrace.CompilationReport(braintrace.compile_etrace_graph(models.LIF(), jnp.ones(3))).show()
    assert "The weight parameters which are associated with the hidden states are:" in capsys.readouterr().out


def test_explain_filters(quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(models.TwoMatmulsInSeries(), jnp.ones(3))
    assert graph.explain() == graph.diagnostics and isinstance(graph.diagnostics, tuple)
    assert [r.kind for r in graph.explain(weight_path=("W1",))] == [DiagnosticKind.RELATION_EXCLUDED_WEIGHT_TO_WEIGHT]
    assert all(("h",) in r.hidden_paths for r in graph.explain(hidden_path=("h",)))
    (included,) = graph.explain(kind=DiagnosticKind.RELATION_INCLUDED)
    assert included.level is DiagnosticLevel.INFO and "RELATION_INCLUDED" in repr(included)


def test_public_classes_live_in_braintrace() -> None:
    for cls in (braintrace.ETraceGraph, braintrace.HiddenGroup, braintrace.HiddenParamOpRelation,
                braintrace.HiddenPerturbation, braintrace.CompilationRecord, braintrace.CompilationReport,
                braintrace.DiagnosticKind, braintrace.DiagnosticLevel, braintrace.ControlFlowPolicy,
                braintrace.NotSupportedError, braintrace.CompilationError):
        assert cls.__module__ == "braintrace", cls


def test_recursive_compile_is_refused(quiet: list) -> None:
    class Recursive(models.LeakyRNN):
        def update(self, x: Any) -> Any:
            braintrace.compile_etrace_graph(models.LeakyRNN(), jnp.ones(3))
            return super().update(x)

    with pytest.raises(NotImplementedError, match="recursive"):
        braintrace.compile_etrace_graph(Recursive(), jnp.ones(3))


@pytest.mark.parametrize("model", [models.LeakyRNN, models.GRU, models.ElemwiseChain], ids=lambda m: m.__name__)
def test_tail_jacobian_matches_analytic_and_finite_differences(model: Any, quiet: list) -> None:
    graph = braintrace.compile_etrace_graph(model(), jnp.ones(3))
    _, _, _, temps = graph.module_info.jaxpr_call(jnp.linspace(-1, 1, 3))
    for rel in graph.hidden_param_op_relations:
        if rel.primitive.name != "etp_mv":
            continue
        y = temps.get(rel.y_var)
        if y is None:
            y = jnp.zeros(rel.y_var.aval.shape)
        consts = {v: temps[v] for tail in rel.y_to_hidden_group_jaxprs for v in tail_constvars(tail)}

        def tail(y: Any) -> Any:
            return rel.y_to_hidden_groups(y, consts)[0][..., -1]

        jac = jax.jacfwd(tail)(y)
        eps = 1e-3
        fd = jnp.stack([(tail(y.at[i].add(eps)) - tail(y.at[i].add(-eps))) / (2 * eps) for i in range(y.shape[0])], -1)
        np.testing.assert_allclose(jac, fd, atol=2e-3)
        if model is models.LeakyRNN:
            np.testing.assert_allclose(jnp.diag(jac), 1 - jnp.tanh(y + consts_term(graph, temps, rel)) ** 2, rtol=1e-4)


def consts_term(graph: Any, temps: Any, rel: Any) -> Any:
    """For the leaky RNN, the tail is ``y -> 0.8 h + tanh(y + h @ W_rec)``; return ``h @ W_rec``."""
    (tail,) = rel.y_to_hidden_group_jaxprs
    add = next(e for e in tail.eqns if e.primitive.name == "add")
    other = add.invars[1] if add.invars[0] is rel.y_var else add.invars[0]
    return temps[other]


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import jax.numpy as jnp, braintrace, warnings
warnings.simplefilter('ignore')
from tests.compiler import models
for m in (models.GRU(), models.LSTM(), models.FanIn(), models.FanOut(), models.JitInside(), models.LIF()):
    g = braintrace.compile_etrace_graph(m, jnp.ones(3))
    print([g_.hidden_paths for g_ in g.hidden_groups],
          [(r.primitive.name, r.trainable_paths, r.connected_hidden_paths) for r in g.hidden_param_op_relations],
          [len(g_.transition_jaxpr.eqns) for g_ in g.hidden_groups],
          [r.kind.value for r in g.diagnostics])
"""


@pytest.mark.slow
def test_compilation_is_identical_across_processes() -> None:
    runs = [
        subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, cwd=ROOT).stdout
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and runs[0].count("\n") == 6

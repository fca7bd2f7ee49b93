"""Weights that drive hidden states outside every relation: learned, but not online.

A weight whose value reaches a hidden state only through plain JAX operations (``x @ W``, not
``braintrace.matmul(x, W)``) has no eligibility trace: a learner gives it the exact gradient
within each step (or window), never the credit its earlier steps earn through the hidden state.
When other weights of the model do learn online, that is almost always an oversight, so the
compiler warns about each such weight, names the hidden states it drives and the fix.

Examples
--------
>>> import warnings, brainstate, jax.numpy as jnp, braintrace
>>> class Mixed(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.u = brainstate.ParamState(jnp.eye(2))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = braintrace.matmul(x, self.w.value) + self.h.value @ self.u.value
...         return self.h.value
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter('always')
...     graph = braintrace.compile_etrace_graph(Mixed(), jnp.ones(3))
>>> 'learns only its gradient within each step' in str(caught[0].message)
True
"""

from __future__ import annotations

from typing import Sequence

from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit, get_reporter
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.jaxpr_graph import backward_closure, build_consumer_map, build_producer_map, forward_closure
from braintrace._compiler.module_info import ModuleInfo, Path

__all__ = ["warn_untraced_weights"]


def warn_untraced_weights(minfo: ModuleInfo, relations: Sequence[HiddenParamOpRelation]) -> list[Path]:
    """Warn about every weight that drives a hidden state but takes part in no relation.

    Only when some relation exists (otherwise compiling fails anyway). Weights a relation's
    trainable operand is computed from count as traced, and so do weights already reported as
    excluded for a reason of their own.

    Returns
    -------
    list
        The paths warned about.
    """
    if not relations:
        return []
    jaxpr = minfo.closed_jaxpr.jaxpr
    operands = [v for rel in relations if rel.control_flow_context is None for v in rel.trainable_vars.values()]
    traced = {p for rel in relations for p in rel.trainable_paths.values()}
    traced |= {minfo.invar_to_weight_path[v] for v in backward_closure(operands, build_producer_map(jaxpr))
               if v in minfo.invar_to_weight_path}
    reporter = get_reporter()
    records = reporter.records() if reporter is not None else ()
    reported = {r.weight_path for r in records} | {p for r in records for p in (r.context or {}).get("weight_paths", ())}
    consumers = build_consumer_map(jaxpr)
    warned = []
    for path, invars in minfo.weight_path_to_invars.items():
        if path in traced or path in reported:
            continue
        reached = {v for invar in invars for v in forward_closure(invar, consumers)}
        driven = tuple(h for out, h in minfo.outvar_to_hidden_path.items() if out in reached)
        if driven:
            emit(
                DiagnosticKind.WEIGHT_DRIVES_HIDDEN_UNTRACED, DiagnosticLevel.WARNING,
                f"The weight {path} drives the hidden states {list(driven)} through plain JAX "
                f"operations, so it has no eligibility trace: it learns only its gradient within each "
                f"step (or window), not online. To learn it online, pass it through a braintrace "
                f"operator (braintrace.matmul(x, W) instead of x @ W, braintrace.element_wise, ...); "
                f"if that is intended, silence this warning with warnings.filterwarnings.",
                weight_path=path, hidden_paths=driven,
            )
            warned.append(path)
    return warned

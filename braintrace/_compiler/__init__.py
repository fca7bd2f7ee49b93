"""The eligibility-trace compiler: from a brainstate module and an example input to an ``ETraceGraph``.

Pipeline: trace one step (:mod:`.module_info`, user ``jit`` bodies inlined by
:mod:`.jaxpr_graph`, control flow flattened by :mod:`.canonicalize`), descend long ETP scans
(:mod:`.scan_descent`), discover hidden groups (:mod:`.hidden_group_discovery`), relations from
ETP equations to groups (:mod:`.hid_param_op`), hoist the intermediates the learners read and
build the perturbed step (:mod:`.hidden_pertubation`); :mod:`.graph` runs it, recording every
decision (:mod:`.diagnostics`) for :mod:`.report`.
"""

from braintrace._compiler.base import (
    JaxprEvaluation,
    check_unsupported_op,
    find_element_exist_in_the_set,
    find_matched_vars,
)
from braintrace._compiler.canonicalize import canonicalize_control_flow, if_convert_conds, unroll_inner_scans
from braintrace._compiler.control_flow_policy import DEFAULT_CONTROL_FLOW_POLICY, ControlFlowPolicy
from braintrace._compiler.diagnostics import (
    CompilationRecord,
    DiagnosticKind,
    DiagnosticLevel,
    DiagnosticReporter,
    diagnostic_context,
    emit,
    get_reporter,
)
from braintrace._compiler.graph import ETraceGraph, compile_etrace_graph
from braintrace._compiler.snap_pattern import DEFAULT_MAX_JACOBIAN_ELEMENTS, SnapPattern
from braintrace._compiler.hid_param_op import (
    HiddenParamOpRelation,
    find_hidden_param_op_relations_from_minfo,
    find_hidden_param_op_relations_from_module,
)
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.hidden_group_discovery import (
    find_hidden_groups_from_minfo,
    find_hidden_groups_from_module,
)
from braintrace._compiler.hidden_pertubation import (
    HiddenPerturbation,
    add_hidden_perturbation_from_minfo,
    LocalRelationWeights,
    groups_read_past_update,
    local_relation_weights,
    add_hidden_perturbation_in_module,
)
from braintrace._compiler.module_info import ModuleInfo, extract_module_info
from braintrace._compiler.report import CompilationReport

__all__ = [
    "ControlFlowPolicy",
    "DEFAULT_CONTROL_FLOW_POLICY",
    "ETraceGraph",
    "compile_etrace_graph",
    "DEFAULT_MAX_JACOBIAN_ELEMENTS",
    "SnapPattern",
    "HiddenGroup",
    "find_hidden_groups_from_minfo",
    "find_hidden_groups_from_module",
    "HiddenParamOpRelation",
    "find_hidden_param_op_relations_from_minfo",
    "find_hidden_param_op_relations_from_module",
    "ModuleInfo",
    "extract_module_info",
    "HiddenPerturbation",
    "add_hidden_perturbation_from_minfo",
    "groups_read_past_update",
    "LocalRelationWeights",
    "local_relation_weights",
    "add_hidden_perturbation_in_module",
    "CompilationRecord",
    "CompilationReport",
    "DiagnosticKind",
    "DiagnosticLevel",
    "DiagnosticReporter",
    "diagnostic_context",
    "emit",
    "get_reporter",
    "JaxprEvaluation",
    "check_unsupported_op",
    "find_element_exist_in_the_set",
    "find_matched_vars",
    "canonicalize_control_flow",
    "if_convert_conds",
    "unroll_inner_scans",
]

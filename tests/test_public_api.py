"""The top-level namespace is exactly upstream 0.2.4's, plus 0.2.5's additions, our checkpoints, sharding and the rule contract."""

from __future__ import annotations

import subprocess
import sys

import pytest

import braintrace

EXPECTED_ALL = [
    "__version__", "__version_info__",
    "ETraceAlgorithm", "BPTT", "SequenceDriverMixin", "ETraceVmap",
    "EligibilityTrace", "ETraceVjpAlgorithm", "ETraceVjpGraphExecutor",
    "ParamDimVjpAlgorithm", "D_RTRL", "pp_prop", "ES_D_RTRL", "IODimVjpAlgorithm",
    "compile",
    "matmul", "grouped_matmul", "embedding", "einsum", "element_wise", "conv", "sparse_matmul", "lora_matmul",
    "ETPPrimitive", "register_primitive",
    "SingleStepData", "MultiStepData",
    "ETraceGraphExecutor",
    "ControlFlowPolicy", "ETraceGraph", "compile_etrace_graph",
    "HiddenGroup", "find_hidden_groups_from_minfo", "find_hidden_groups_from_module",
    "HiddenParamOpRelation", "find_hidden_param_op_relations_from_minfo",
    "find_hidden_param_op_relations_from_module",
    "ModuleInfo", "extract_module_info",
    "HiddenPerturbation", "add_hidden_perturbation_from_minfo", "add_hidden_perturbation_in_module",
    "CompilationRecord", "CompilationReport", "DiagnosticKind", "DiagnosticLevel",
    "GradExpon",
    "EProp", "OSTLRecurrent", "OSTLFeedforward", "OTPE", "OTTT", "OSTTP",
    "FixedRandomFeedback", "KappaFilter", "PresynapticTrace",
    "NotSupportedError", "CompilationError", "NonFiniteError", "NonFiniteWarning", "EagerCallWarning",
    "ConcurrentCallError",
    "nn", "trainer",
    "save_checkpoint", "load_checkpoint",
    "RandomProjectionVjpAlgorithm", "UORO", "SnAp",
    "ThreeFactor", "DNI", "SyntheticGradient", "train_synthetic_gradient",
    "check_gradients", "compare_learners", "GradientAudit", "GradientRow", "LearnerComparison",
    "estimate_memory", "learner_memory", "MemoryPlan", "MemoryEstimate",
    "ETraceConfig",
    "Sharding",
    "TraceRule", "RelationStep", "RelationInfo",
    "d_rtrl_rule", "pp_prop_rule", "ottt_rule", "otpe_rule", "GroupRule", "GroupStep", "GroupInfo", "uoro_rule",
]


def test_all_is_exactly_upstreams() -> None:
    assert braintrace.__all__ == EXPECTED_ALL
    assert len(EXPECTED_ALL) == 95
    for name in EXPECTED_ALL:
        assert hasattr(braintrace, name), name


def test_version() -> None:
    # Our own version, not upstream's 0.2.4 release number.
    assert braintrace.__version__ == "1.0.0.dev0"
    assert braintrace.__version_info__ == (1, 0, 0, "dev0")


def test_aliases_and_shadowing() -> None:
    assert braintrace.ES_D_RTRL is braintrace.pp_prop
    assert callable(braintrace.compile)


@pytest.mark.parametrize("name", ["DEFAULT_CONTROL_FLOW_POLICY", "stop_param_gradients", "general_y2w",
                                  "ETraceState", "OSTL", "ETP_RULES_YW_TO_W", "ETPPrimitiveSpec"])
def test_names_that_do_not_exist(name: str) -> None:
    with pytest.raises(AttributeError, match=f"module 'braintrace' has no attribute '{name}'"):
        getattr(braintrace, name)


def test_the_namespace_holds_no_stray_public_names() -> None:
    stray = [n for n in vars(braintrace) if not n.startswith("_") and n not in braintrace.__all__]
    assert not stray, stray


def test_import_leaves_the_layers_and_braintools_for_first_use() -> None:
    # `import braintrace` stays cheap over `import brainstate`: braintrace.nn (whose layer
    # defaults need braintools, about a second) and braintools load on first use.
    code = (
        "import sys, braintrace\n"
        "print('braintools' in sys.modules, 'braintrace.nn' in sys.modules)\n"
        "from braintrace import nn\n"
        "print(nn is braintrace.nn, 'braintools' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True", "True"]

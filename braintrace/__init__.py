"""braintrace: online learning of recurrent and spiking networks with eligibility traces.

Mark the weights that should learn online with an ETP operator (``braintrace.matmul``,
``braintrace.element_wise``, ...) and compile the model into an online learner.
"""

from braintrace._algorithm import (
    D_RTRL,
    EligibilityTrace,
    ETraceAlgorithm,
    ETraceGraphExecutor,
    ETraceVjpAlgorithm,
    ETraceVjpGraphExecutor,
    MultiStepData,
    ParamDimVjpAlgorithm,
    SingleStepData,
)
from braintrace._compile import compile
from braintrace._compiler import (
    CompilationRecord,
    CompilationReport,
    ControlFlowPolicy,
    DiagnosticKind,
    DiagnosticLevel,
    ETraceGraph,
    HiddenGroup,
    HiddenParamOpRelation,
    HiddenPerturbation,
    ModuleInfo,
    add_hidden_perturbation_from_minfo,
    add_hidden_perturbation_in_module,
    compile_etrace_graph,
    extract_module_info,
    find_hidden_groups_from_minfo,
    find_hidden_groups_from_module,
    find_hidden_param_op_relations_from_minfo,
    find_hidden_param_op_relations_from_module,
)
from braintrace._errors import CompilationError, NotSupportedError
from braintrace._op import (
    ETPPrimitive,
    element_wise,
    embedding,
    grouped_matmul,
    lora_matmul,
    matmul,
    register_primitive,
)

__version__ = "0.2.4"
__version_info__ = tuple(int(part) for part in __version__.split("."))

__all__ = [
    "__version__",
    "__version_info__",
    "ETraceAlgorithm",
    "EligibilityTrace",
    "ETraceVjpAlgorithm",
    "ETraceVjpGraphExecutor",
    "ParamDimVjpAlgorithm",
    "D_RTRL",
    "compile",
    "matmul",
    "grouped_matmul",
    "embedding",
    "element_wise",
    "lora_matmul",
    "ETPPrimitive",
    "register_primitive",
    "SingleStepData",
    "MultiStepData",
    "ETraceGraphExecutor",
    "ControlFlowPolicy",
    "ETraceGraph",
    "compile_etrace_graph",
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
    "add_hidden_perturbation_in_module",
    "CompilationRecord",
    "CompilationReport",
    "DiagnosticKind",
    "DiagnosticLevel",
    "NotSupportedError",
    "CompilationError",
]

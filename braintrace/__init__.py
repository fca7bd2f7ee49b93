"""braintrace: online learning of recurrent and spiking networks with eligibility traces.

Mark the weights that should learn online with an ETP operator (``braintrace.matmul``,
``braintrace.element_wise``, ...) and compile the model into an online learner.
"""

import typing as _std_typing

from braintrace._float64 import float64_asked as _float64_asked

_FLOAT64_ASKED = _float64_asked()  # before brainstate loads and resets jax_enable_x64

from braintrace._tested_versions import warn_untested_releases as _warn_untested_releases

# Before the imports below, which may fail on a release newer than tested: the warning names it.
_warn_untested_releases()

from braintrace._algorithm import (
    BPTT,
    D_RTRL,
    DNI,
    ES_D_RTRL,
    OSTTP,
    OTPE,
    OTTT,
    EProp,
    FixedRandomFeedback,
    KappaFilter,
    OSTLFeedforward,
    OSTLRecurrent,
    PresynapticTrace,
    RandomProjectionVjpAlgorithm,
    SnAp,
    SyntheticGradient,
    ThreeFactor,
    UORO,
    EligibilityTrace,
    ETraceAlgorithm,
    ETraceConfig,
    ETraceVmap,
    ETraceGraphExecutor,
    ETraceVjpAlgorithm,
    ETraceVjpGraphExecutor,
    GroupInfo,
    GroupRule,
    GroupStep,
    IODimVjpAlgorithm,
    MultiStepData,
    ParamDimVjpAlgorithm,
    SequenceDriverMixin,
    RelationInfo,
    RelationStep,
    Sharding,
    SingleStepData,
    TraceRule,
    d_rtrl_rule,
    otpe_rule,
    ottt_rule,
    pp_prop,
    pp_prop_rule,
    train_synthetic_gradient,
    uoro_rule,
)
from braintrace._audit import GradientAudit, GradientRow, LearnerComparison, check_gradients, compare_learners
from braintrace._compile import compile
from braintrace._memory import MemoryEstimate, MemoryPlan, estimate_memory, learner_memory
from braintrace._checkpoint import load_checkpoint, save_checkpoint
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
from braintrace._errors import CompilationError, ConcurrentCallError, EagerCallWarning, NonFiniteError, NonFiniteWarning, NotSupportedError
from braintrace._grad_exponential import GradExpon
from braintrace._op import (
    ETPPrimitive,
    conv,
    einsum,
    element_wise,
    embedding,
    grouped_matmul,
    lora_matmul,
    matmul,
    register_primitive,
    sparse_matmul,
)

if _std_typing.TYPE_CHECKING:
    from braintrace import nn, trainer
    from braintrace._legacy import (
        ConvOp,
        ElemWiseOp,
        ElemWiseParam,
        ETraceOp,
        ETraceParam,
        FakeElemWiseParam,
        FakeETraceParam,
        LoraOp,
        MatMulOp,
        NonTempParam,
        SpMatMulOp,
    )

from braintrace._float64 import warn_if_float64_dropped as _warn_if_float64_dropped

_warn_if_float64_dropped(_FLOAT64_ASKED)

# This project's own version: its API is upstream braintrace 0.2.4's plus the later additions
# listed in docs/compatibility.md; the number does not track upstream's releases.
__version__ = "1.0.0.dev0"
__version_info__ = (1, 0, 0, "dev0")

__all__ = [
    "__version__",
    "__version_info__",
    "ETraceAlgorithm",
    "BPTT",
    "SequenceDriverMixin",
    "ETraceVmap",
    "EligibilityTrace",
    "ETraceVjpAlgorithm",
    "ETraceVjpGraphExecutor",
    "ParamDimVjpAlgorithm",
    "D_RTRL",
    "pp_prop",
    "ES_D_RTRL",
    "IODimVjpAlgorithm",
    "compile",
    "matmul",
    "grouped_matmul",
    "embedding",
    "einsum",
    "element_wise",
    "conv",
    "sparse_matmul",
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
    "GradExpon",
    "EProp",
    "OSTLRecurrent",
    "OSTLFeedforward",
    "OTPE",
    "OTTT",
    "OSTTP",
    "FixedRandomFeedback",
    "KappaFilter",
    "PresynapticTrace",
    "NotSupportedError",
    "CompilationError",
    "NonFiniteError",
    "NonFiniteWarning",
    "EagerCallWarning",
    "ConcurrentCallError",
    "nn",
    "trainer",
    "save_checkpoint",
    "load_checkpoint",
    "RandomProjectionVjpAlgorithm",
    "UORO",
    "SnAp",
    "ThreeFactor",
    "DNI",
    "SyntheticGradient",
    "train_synthetic_gradient",
    "check_gradients",
    "compare_learners",
    "GradientAudit",
    "GradientRow",
    "LearnerComparison",
    "estimate_memory",
    "learner_memory",
    "MemoryPlan",
    "MemoryEstimate",
    "ETraceConfig",
    "Sharding",
    "TraceRule",
    "RelationStep",
    "RelationInfo",
    "d_rtrl_rule",
    "pp_prop_rule",
    "ottt_rule",
    "otpe_rule",
    "GroupRule",
    "GroupStep",
    "GroupInfo",
    "uoro_rule",
]

# deprecated v0.1 names, served lazily by __getattr__ with a one-time DeprecationWarning
_LEGACY_NAMES = (
    "MatMulOp",
    "ElemWiseOp",
    "ConvOp",
    "SpMatMulOp",
    "LoraOp",
    "ETraceOp",
    "ETraceParam",
    "ElemWiseParam",
    "NonTempParam",
    "FakeETraceParam",
    "FakeElemWiseParam",
)


def __getattr__(name: str) -> _std_typing.Any:
    if name in ("nn", "trainer"):
        # Imported on first use: they pull in braintools' layers and trainer (about a second).
        import importlib

        return importlib.import_module(f"braintrace.{name}")
    if name in _LEGACY_NAMES:
        from braintrace._legacy._deprecation import legacy_attribute

        return legacy_attribute(name, stacklevel=2)
    raise AttributeError(f"module 'braintrace' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted([*__all__, *_LEGACY_NAMES])

"""Learning rules over the compiled ``ETraceGraph``.

The graph executors (:mod:`.graph_executor`) run model steps and extract ``x``, ``df`` and
``D``; the custom-VJP engine (:mod:`.base`) turns a call into online gradients; each learning
rule is one module filling in the trace hooks (:mod:`.d_rtrl`, ...).
"""

from braintrace._algorithm.base import EligibilityTrace, ETraceAlgorithm, ETraceVjpAlgorithm
from braintrace._algorithm.bptt import BPTT
from braintrace._algorithm.config import ETraceConfig
from braintrace._algorithm.d_rtrl import D_RTRL, ParamDimVjpAlgorithm
from braintrace._algorithm.graph_executor import ETraceGraphExecutor, ETraceVjpGraphExecutor
from braintrace._algorithm.input_data import MultiStepData, SingleStepData
from braintrace._algorithm.sequence import SequenceDriverMixin
from braintrace._algorithm.sharding import Sharding
from braintrace._algorithm.vmap import ETraceVmap
from braintrace._algorithm.pp_prop import ES_D_RTRL, IODimVjpAlgorithm, pp_prop
from braintrace._algorithm.eprop import EProp
from braintrace._algorithm.ostl import OSTLFeedforward, OSTLRecurrent
from braintrace._algorithm.osttp import OSTTP
from braintrace._algorithm.otpe import OTPE
from braintrace._algorithm.ottt import OTTT
from braintrace._algorithm.snn_helpers import FixedRandomFeedback, KappaFilter, PresynapticTrace
from braintrace._algorithm.snap import SnAp
from braintrace._algorithm.random_projection import RandomProjectionVjpAlgorithm
from braintrace._algorithm.uoro import UORO
from braintrace._algorithm.three_factor import ThreeFactor
from braintrace._algorithm.dni import DNI
from braintrace._algorithm.synthetic_gradient import SyntheticGradient
from braintrace._algorithm.synthetic_training import train_synthetic_gradient
from braintrace._algorithm.trace_rule import RelationInfo, RelationStep, TraceRule

__all__ = [
    "ETraceAlgorithm",
    "BPTT",
    "SequenceDriverMixin",
    "ETraceVmap",
    "EligibilityTrace",
    "ETraceVjpAlgorithm",
    "ETraceGraphExecutor",
    "ETraceVjpGraphExecutor",
    "ParamDimVjpAlgorithm",
    "D_RTRL",
    "IODimVjpAlgorithm",
    "pp_prop",
    "ES_D_RTRL",
    "EProp",
    "OSTLRecurrent",
    "OSTLFeedforward",
    "OTPE",
    "OTTT",
    "OSTTP",
    "FixedRandomFeedback",
    "KappaFilter",
    "PresynapticTrace",
    "SingleStepData",
    "MultiStepData",
    "RandomProjectionVjpAlgorithm",
    "UORO",
    "SnAp",
    "ThreeFactor",
    "DNI",
    "SyntheticGradient",
    "train_synthetic_gradient",
    "ETraceConfig",
    "Sharding",
    "TraceRule",
    "RelationStep",
    "RelationInfo",
]

"""Learning rules over the compiled ``ETraceGraph``.

One sub-package per concern, importing downward only:

* :mod:`.engine` — the graph executors (run model steps, extract ``x``, ``df`` and ``D``), the
  custom-VJP engine that turns a call into online gradients (:mod:`.engine.base`), and what every
  call shares (checks, lock, placement, configuration, exactness labels);
* :mod:`.carriers` — where traces live: one store for every engine's carriers
  (:mod:`.carriers.carrier_store`), reduced-precision storage, the roll in the backward pass;
* :mod:`.param_trace` — per-parameter traces: D_RTRL's engine and the rules on it;
* :mod:`.io_trace` — factored input/output traces: pp_prop's engine;
* :mod:`.rules` — the other learning rules and the learners of the public :class:`~braintrace.TraceRule` and :class:`~braintrace.GroupRule` contracts;
* :mod:`.drive` — the sequence drivers, as functions of a learner.
"""

from braintrace._algorithm.engine.base import EligibilityTrace, ETraceAlgorithm, ETraceVjpAlgorithm
from braintrace._algorithm.rules.bptt import BPTT
from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._algorithm.param_trace.d_rtrl import D_RTRL, ParamDimVjpAlgorithm
from braintrace._algorithm.engine.graph_executor import ETraceGraphExecutor, ETraceVjpGraphExecutor
from braintrace._algorithm.engine.input_data import MultiStepData, SingleStepData
from braintrace._algorithm.drive.sequence import SequenceDriverMixin
from braintrace._algorithm.engine.sharding import Sharding
from braintrace._algorithm.engine.vmap import ETraceVmap
from braintrace._algorithm.io_trace.pp_prop import ES_D_RTRL, IODimVjpAlgorithm, pp_prop
from braintrace._algorithm.param_trace.eprop import EProp
from braintrace._algorithm.param_trace.ostl import OSTLFeedforward, OSTLRecurrent
from braintrace._algorithm.param_trace.osttp import OSTTP
from braintrace._algorithm.rules.otpe import OTPE
from braintrace._algorithm.rules.ottt import OTTT
from braintrace._algorithm.rules.snn_helpers import FixedRandomFeedback, KappaFilter, PresynapticTrace
from braintrace._algorithm.param_trace.snap import SnAp
from braintrace._algorithm.rules.random_projection import RandomProjectionVjpAlgorithm
from braintrace._algorithm.rules.uoro import UORO
from braintrace._algorithm.rules.three_factor import ThreeFactor
from braintrace._algorithm.rules.dni import DNI
from braintrace._algorithm.rules.synthetic_gradient import SyntheticGradient
from braintrace._algorithm.rules.synthetic_training import train_synthetic_gradient
from braintrace._algorithm.engine.rule_contract import GroupInfo, GroupRule, GroupStep, RelationInfo, RelationStep, TraceRule
from braintrace._algorithm.io_trace.relation_rule import pp_prop_rule
from braintrace._algorithm.param_trace.relation_rule import d_rtrl_rule
from braintrace._algorithm.rules.otpe import otpe_rule
from braintrace._algorithm.rules.ottt import ottt_rule
from braintrace._algorithm.rules.projection_rule import uoro_rule

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
    "d_rtrl_rule",
    "pp_prop_rule",
    "ottt_rule",
    "otpe_rule",
    "GroupRule",
    "GroupStep",
    "GroupInfo",
    "uoro_rule",
]

"""The deprecated v0.1 class-based API, kept as thin shims over the ETP operators.

``braintrace.MatMulOp`` & co. are served lazily by ``braintrace.__getattr__``, which warns
(``DeprecationWarning``) on the first access of each name in a process. Importing from this
private package does not warn.

Migration: ``braintrace.ETraceParam({'weight': W}, braintrace.MatMulOp())`` with
``p.execute(x)`` becomes ``brainstate.ParamState({'weight': W})`` with
``braintrace.matmul(x, p.value['weight'])``; ``ElemWiseParam``/``ElemWiseOp`` become a
``ParamState`` with ``braintrace.element_wise``; ``NonTempParam`` / ``FakeETraceParam``
become a ``ParamState`` (or a plain value) used with ordinary JAX ops.
"""

from braintrace._legacy.ops import (
    ConvOp,
    ElemWiseOp,
    ETraceOp,
    LoraOp,
    MatMulOp,
    SpMatMulOp,
)
from braintrace._legacy.params import (
    ElemWiseParam,
    ETraceGrad,
    ETraceParam,
    FakeElemWiseParam,
    FakeETraceParam,
    NonTempParam,
)
from braintrace._legacy.utils import general_y2w, stop_param_gradients

__all__ = [
    "ETraceOp",
    "MatMulOp",
    "ElemWiseOp",
    "ConvOp",
    "SpMatMulOp",
    "LoraOp",
    "ETraceGrad",
    "ETraceParam",
    "ElemWiseParam",
    "NonTempParam",
    "FakeETraceParam",
    "FakeElemWiseParam",
    "stop_param_gradients",
    "general_y2w",
]

"""``braintrace.nn``: layers and recurrent cells whose parameters learn online.

Every trainable forward pass goes through an ETP operator (:func:`braintrace.matmul`,
:func:`braintrace.conv`, ...), so the compiler links the parameters to the hidden states
they drive. Most layers subclass the ``brainstate.nn`` layer of the same name and keep its
constructor.

Names that moved elsewhere (neurons and synapses to ``brainpy.state``; activations,
dropout, pooling and normalisation to ``brainstate.nn``) are served here with a
``DeprecationWarning`` pointing at their new home.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> cell = braintrace.nn.MiniGRU(3, 8)
>>> learner = braintrace.compile(cell, braintrace.D_RTRL, jnp.ones(3))
>>> learner(jnp.ones(3)).shape
(8,)
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from braintrace.nn._conv import Conv1d, Conv2d, Conv3d
from braintrace.nn._embedding import Embedding
from braintrace.nn._linear import Linear, ScaledWSLinear, SignedWLinear
from braintrace.nn._linear_structured import GroupedLinear, LoRA, SparseLinear
from braintrace.nn._readout import LeakyRateReadout
from braintrace.nn._rnn import LRUCell
from braintrace.nn._rnn_cells import CFNCell, GRUCell, LSTMCell, MGUCell, URLSTMCell, ValinaRNNCell
from braintrace.nn._rnn_minimal import MiniGRU, MiniLSTM, MinimalRNNCell

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "Linear",
    "GroupedLinear",
    "SignedWLinear",
    "ScaledWSLinear",
    "SparseLinear",
    "LoRA",
    "Embedding",
    "LeakyRateReadout",
    "ValinaRNNCell",
    "GRUCell",
    "MGUCell",
    "LSTMCell",
    "URLSTMCell",
    "MinimalRNNCell",
    "MiniGRU",
    "MiniLSTM",
    "LRUCell",
    "CFNCell",
]

#: Neuron and synapse models, now in ``brainpy.state``.
_MOVED_TO_BRAINPY = frozenset({"IF", "LIF", "ALIF", "Expon", "Alpha", "DualExpon", "STP", "STD"})

#: Activations, dropout, shape, pooling and normalisation layers, now in ``brainstate.nn``.
_MOVED_TO_BRAINSTATE = frozenset(
    {
        "ReLU", "RReLU", "Hardtanh", "ReLU6", "Sigmoid", "Hardsigmoid", "Tanh", "SiLU", "Mish",
        "Hardswish", "ELU", "CELU", "SELU", "GLU", "GELU", "Hardshrink", "LeakyReLU",
        "LogSigmoid", "Softplus", "Softshrink", "PReLU", "Softsign", "Tanhshrink", "Softmin",
        "Softmax", "Softmax2d", "LogSoftmax", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d",
        "Identity", "SpikeBitwise", "Flatten", "Unflatten",
        "AvgPool1d", "AvgPool2d", "AvgPool3d", "MaxPool1d", "MaxPool2d", "MaxPool3d",
        "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
        "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
        "BatchNorm0d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
        "LayerNorm", "RMSNorm", "GroupNorm",
    }
)


def _from_brainpy(name: str) -> Any:
    try:
        module = importlib.import_module("brainpy.state")
    except ImportError:
        raise AttributeError(
            f"module 'braintrace.nn' has no attribute '{name}': it moved to brainpy.state.{name}. "
            f"Install brainpy (pip install brainpy) and use brainpy.state.{name}."
        ) from None
    warnings.warn(
        f"braintrace.nn.{name} is deprecated. Use brainpy.state.{name} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(module, name)


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_BRAINPY:
        return _from_brainpy(name)
    if name in _MOVED_TO_BRAINSTATE:
        import brainstate

        warnings.warn(
            f"braintrace.nn.{name} is deprecated. Use brainstate.nn.{name} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(brainstate.nn, name)
    raise AttributeError(f"module 'braintrace.nn' has no attribute '{name}'")

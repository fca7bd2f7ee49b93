"""``braintrace.nn``: layers, recurrent cells and spiking neurons whose parameters learn online.

Every trainable forward pass goes through an ETP operator (:func:`braintrace.matmul`,
:func:`braintrace.conv`, :func:`braintrace.element_wise`, ...), so the compiler links the
parameters to the hidden states they drive. Most layers subclass the ``brainstate.nn`` layer of
the same name and keep its constructor.

The spiking neurons ``IF``, ``LIF``, ``ALIF`` and the synaptic filters ``Expon``, ``Alpha``,
``DualExpon`` have the constructors and updates of the ``brainpy.state`` classes of the same
names (units, exponential-Euler steps, ``dt`` from ``brainstate.environ``, surrogate spikes)
without depending on brainpy. Their time constants and thresholds may be given as
``brainstate.ParamState`` objects, which are then trained online with the weights.

The short-term plasticity models ``STP`` and ``STD`` live in ``brainpy.state`` only; they and the
layers that moved to ``brainstate.nn`` (activations, dropout, pooling, normalisation) are served
here with a ``DeprecationWarning`` pointing at their home. To use ``brainpy.state`` models with
braintrace, install the extra ``pip install 'braintrace[brainpy]'`` (brainpy 2.8.2 with
brainpy-state 0.1.0, which run on Python 3.11 next to braintrace's brainstate, brainunit and
braintools) and drive them with ETP operations; their constants stay fixed, the weights learn:

.. code-block:: python

    import brainpy, brainstate, brainunit as u, jax.numpy as jnp, braintrace

    class Net(brainstate.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = brainstate.ParamState(jnp.ones((3, 4)))
            self.lif = brainpy.state.LIF(4, tau=10.0 * u.ms)

        def update(self, x):
            return self.lif(braintrace.matmul(x, self.w.value) * u.mA)

    with brainstate.environ.context(dt=1.0 * u.ms):
        learner = braintrace.compile(Net(), braintrace.D_RTRL, jnp.ones(3))

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> cell = braintrace.nn.MiniGRU(3, 8)
>>> learner = braintrace.compile(cell, braintrace.D_RTRL, jnp.ones(3))
>>> learner(jnp.ones(3)).shape
(8,)

A LIF layer driven by a trainable matmul, with a trainable membrane time constant:

>>> import brainstate, brainunit as u
>>> class SpikingLayer(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.full((3, 4), 0.5))
...         tau = brainstate.ParamState(u.math.full(4, 10.0 * u.ms))
...         self.lif = braintrace.nn.LIF(4, tau=tau, V_th=1.0 * u.mV)
...     def update(self, x):
...         return self.lif(braintrace.matmul(x, self.w.value) * u.mA)
>>> with brainstate.environ.context(dt=1.0 * u.ms):
...     learner = braintrace.compile(SpikingLayer(), braintrace.D_RTRL, jnp.ones(3))
...     spikes = learner(jnp.ones(3))
>>> sorted(path for path in learner.param_states)
[('lif', 'tau'), ('w',)]

``VanillaRNNCell`` is the correctly spelt name of upstream's ``ValinaRNNCell`` (the same class):

>>> braintrace.nn.VanillaRNNCell is braintrace.nn.ValinaRNNCell
True
"""

# The namespace holds the public layers (``__all__``) and private names only: helpers are imported
# under private aliases, and no ``from __future__`` import (it would bind ``annotations`` here).
# ``dir()`` adds the deprecated names ``__getattr__`` forwards to brainstate.nn / brainpy.state.
import importlib as _importlib
import warnings as _warnings

from braintrace.nn._conv import Conv1d, Conv2d, Conv3d
from braintrace.nn._embedding import Embedding
from braintrace.nn._linear import Linear, ScaledWSLinear, SignedWLinear
from braintrace.nn._linear_structured import GroupedLinear, LoRA, SparseLinear
from braintrace.nn._neurons import ALIF, IF, LIF
from braintrace.nn._readout import LeakyRateReadout
from braintrace.nn._rnn import LRUCell
from braintrace.nn._rnn_cells import CFNCell, GRUCell, LSTMCell, MGUCell, URLSTMCell, ValinaRNNCell
from braintrace.nn._rnn_minimal import MiniGRU, MiniLSTM, MinimalRNNCell
from braintrace.nn._synapses import Alpha, DualExpon, Expon

#: The correctly spelt name of upstream's ``ValinaRNNCell``: the same class, under either name.
VanillaRNNCell = ValinaRNNCell

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
    "VanillaRNNCell",
    "GRUCell",
    "MGUCell",
    "LSTMCell",
    "URLSTMCell",
    "MinimalRNNCell",
    "MiniGRU",
    "MiniLSTM",
    "LRUCell",
    "CFNCell",
    "IF",
    "LIF",
    "ALIF",
    "Expon",
    "Alpha",
    "DualExpon",
]

#: Short-term plasticity models, served from ``brainpy.state`` (the neurons and synapse filters
#: are native: ``_neurons.py``, ``_synapses.py``).
_MOVED_TO_BRAINPY = frozenset({"STP", "STD"})

#: How to get ``brainpy.state``: the extra pins the pair verified next to braintrace's pins.
_BRAINPY_INSTALL = (
    "pip install 'braintrace[brainpy]' (brainpy 2.8.2 and brainpy-state 0.1.0, which run on "
    "Python 3.11 with braintrace's brainstate/brainunit/braintools)"
)

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


def _from_brainpy(name: str) -> type:
    try:
        module = _importlib.import_module("brainpy.state")
    except ImportError as err:
        raise AttributeError(
            f"module 'braintrace.nn' has no attribute '{name}': {name} lives in "
            f"brainpy.state.{name}, and brainpy.state cannot be imported here ({err}). Install "
            f"it with {_BRAINPY_INSTALL} and use brainpy.state.{name}."
        ) from None
    _warnings.warn(
        f"braintrace.nn.{name} is deprecated. Use brainpy.state.{name} instead.",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(module, name)


def __getattr__(name: str) -> type:
    if name in _MOVED_TO_BRAINPY:
        return _from_brainpy(name)
    if name in _MOVED_TO_BRAINSTATE:
        import brainstate

        _warnings.warn(
            f"braintrace.nn.{name} is deprecated. Use brainstate.nn.{name} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(brainstate.nn, name)
    raise AttributeError(f"module 'braintrace.nn' has no attribute '{name}'")


def __dir__() -> list[str]:
    """The exports and the deprecated names forwarded to ``brainstate.nn`` / ``brainpy.state``."""
    return sorted({*__all__, *_MOVED_TO_BRAINSTATE, *_MOVED_TO_BRAINPY})

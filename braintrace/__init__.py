"""braintrace: online learning of recurrent and spiking networks with eligibility traces.

Mark the weights that should learn online with an ETP operator (``braintrace.matmul``,
``braintrace.element_wise``, ...) and compile the model into an online learner.
"""

from braintrace._op import ETPPrimitive, element_wise, matmul, register_primitive

__version__ = "0.2.4"
__version_info__ = tuple(int(part) for part in __version__.split("."))

__all__ = [
    "__version__",
    "__version_info__",
    "matmul",
    "element_wise",
    "ETPPrimitive",
    "register_primitive",
]

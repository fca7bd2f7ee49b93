"""Type aliases shared across braintrace."""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import numpy as np

__all__ = ["Array", "ArrayLike", "WeightFn", "PyTree", "Params"]

#: A JAX array (or a tracer standing for one).
Array = jax.Array
#: Anything an ETP operator accepts as an operand: arrays, NumPy arrays, ``brainunit`` quantities.
ArrayLike = Union[jax.Array, np.ndarray, Any]
#: A shape-preserving parameter transform applied inside an ETP primitive (``weight_fn`` & co).
WeightFn = Callable[[jax.Array], jax.Array]
#: Any JAX pytree.
PyTree = Any
#: The static parameters of a primitive equation (``eqn.params``).
Params = dict[str, Any]

"""The one place that reaches into JAX's interpreter modules.

Everything else in braintrace imports JAX's internals from here, so that a JAX upgrade that
moves them touches a single file.
"""

from __future__ import annotations

from jax.core import ShapedArray
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.interpreters import ad, batching, mlir

__all__ = ["CustomVJPPrimal", "ShapedArray", "SymbolicZero", "ad", "batching", "mlir"]

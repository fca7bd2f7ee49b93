"""``Embedding``: a lookup table whose rows learn online through :func:`braintrace.embedding`."""

from __future__ import annotations

import math
from typing import Any

import brainstate
import brainunit as u
import jax.numpy as jnp

from braintrace._op import embedding

__all__ = ["Embedding"]


class Embedding(brainstate.nn.Embedding):
    """Lookup table ``y = table[indices]`` whose rows learn online.

    The constructor, table and validation are those of ``brainstate.nn.Embedding``; the
    lookup runs through :func:`braintrace.embedding`, so the rows read at each step carry an
    eligibility trace when the output drives a hidden state.

    Parameters
    ----------
    num_embeddings : int
        Vocabulary size ``V``.
    embedding_size : int
        Feature size ``D`` of each row.
    embedding_init : initializer or array
        Table initialiser (default ``LecunUniform()``).
    padding_idx, max_norm, norm_type, scale_grad_by_freq, freeze
        Accepted for compatibility with ``brainstate.nn.Embedding``; the online layer
        supports only the defaults (see Raises).
    name : str, optional
    param_type : type
        State class of the table (default ``brainstate.ParamState``).

    Attributes
    ----------
    weight : ParamState
        The bare ``(V, D)`` table.

    Raises
    ------
    NotImplementedError
        At call time, if ``max_norm``, ``freeze``, ``scale_grad_by_freq`` or ``padding_idx``
        is set, or ``embedding_size`` has more than one axis.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> table = jnp.arange(6.0).reshape(3, 2)
    >>> layer = braintrace.nn.Embedding(3, 2, embedding_init=table)
    >>> layer(jnp.array([[2, 0], [1, 1]])).shape
    (2, 2, 2)
    >>> layer(1)
    Array([2., 3.], dtype=float32)
    """

    __module__ = "braintrace.nn"

    def _check_supported(self) -> None:
        options = {
            "max_norm": self.max_norm is not None,
            "freeze": self.freeze,
            "scale_grad_by_freq": self.scale_grad_by_freq,
            "padding_idx": self.padding_idx is not None,
        }
        used = [name for name, on in options.items() if on]
        if used:
            raise NotImplementedError(
                f"braintrace.nn.Embedding does not support {', '.join(used)} in online learning; "
                f"construct it with the defaults (max_norm=None, freeze=False, "
                f"scale_grad_by_freq=False, padding_idx=None), or use brainstate.nn.Embedding "
                f"with plain (non-online) gradients."
            )
        if len(self.embedding_size) != 1:
            raise NotImplementedError(
                f"braintrace.nn.Embedding supports a single feature axis, got embedding_size="
                f"{self.embedding_size}; use embedding_size={math.prod(self.embedding_size)} "
                f"and reshape the output."
            )

    def update(self, indices: Any) -> Any:
        self._check_supported()
        idx = jnp.asarray(indices)
        table = self.weight.value
        if idx.ndim <= 1:
            return embedding(idx, table)
        rows = embedding(idx.reshape(-1), table)
        return u.math.reshape(rows, (*idx.shape, rows.shape[-1]))

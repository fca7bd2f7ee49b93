"""``Embedding``: a lookup table whose rows learn online through :func:`braintrace.embedding`."""

from __future__ import annotations

import inspect
import math
from typing import Any

import brainstate
import brainunit as u
import jax.numpy as jnp

from braintrace._op import embedding

__all__ = ["Embedding"]

#: The options of brainstate.nn.Embedding the online layer supports only at their defaults.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "max_norm": None,
    "freeze": False,
    "scale_grad_by_freq": False,
    "padding_idx": None,
}


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
    ValueError
        From ``brainstate.nn.Embedding``'s own checks (a negative ``num_embeddings``, an
        out-of-range ``padding_idx``, a non-positive ``max_norm``), before the check below.
    NotImplementedError
        On construction, if ``max_norm``, ``freeze``, ``scale_grad_by_freq`` or ``padding_idx``
        is set (again at call time, if one is set on the layer afterwards); at call time, if
        ``embedding_size`` has more than one axis.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> table = jnp.arange(6.0).reshape(3, 2)
    >>> layer = braintrace.nn.Embedding(3, 2, embedding_init=table)
    >>> layer(jnp.array([[2, 0], [1, 1]])).shape
    (2, 2, 2)
    >>> layer(1)
    Array([2., 3.], dtype=float32)
    >>> braintrace.nn.Embedding(3, 2, padding_idx=0)
    Traceback (most recent call last):
        ...
    NotImplementedError: braintrace.nn.Embedding does not support padding_idx in online learning; ...
    """

    __module__ = "braintrace.nn"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._check_options()

    def _check_options(self) -> None:
        used = [name for name, default in _UNSUPPORTED_DEFAULTS.items() if getattr(self, name) != default]
        if used:
            defaults = ", ".join(f"{name}={_UNSUPPORTED_DEFAULTS[name]!r}" for name in used)
            raise NotImplementedError(
                f"braintrace.nn.Embedding does not support {', '.join(used)} in online learning; "
                f"leave the default ({defaults}), or use brainstate.nn.Embedding with plain "
                f"(non-online) gradients."
            )

    def _check_embedding_size(self) -> None:
        if len(self.embedding_size) != 1:
            raise NotImplementedError(
                f"braintrace.nn.Embedding supports a single feature axis, got embedding_size="
                f"{self.embedding_size}; use embedding_size={math.prod(self.embedding_size)} "
                f"and reshape the output."
            )

    def update(self, indices: Any) -> Any:
        self._check_options()
        self._check_embedding_size()
        idx = jnp.asarray(indices)
        table = self.weight.value
        if idx.ndim <= 1:
            return embedding(idx, table)
        rows = embedding(idx.reshape(-1), table)
        return u.math.reshape(rows, (*idx.shape, rows.shape[-1]))


setattr(Embedding.__init__, "__signature__", inspect.signature(brainstate.nn.Embedding.__init__))

"""``Embedding``: a lookup table whose rows learn online through :func:`braintrace.embedding`."""

from __future__ import annotations

import inspect
import math

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compatible_imports import Tracer
from braintrace._op import embedding
from braintrace._op.embedding import _integer_indices
from braintrace._typing import Value
from braintrace.nn._arguments import ArgumentCheck, check_constructor_arguments, positive_int, size_tuple

__all__ = ["Embedding"]

#: The table's sizes, checked before brainstate's constructor runs.
_TABLE_SIZES: dict[str, ArgumentCheck] = {"num_embeddings": positive_int, "embedding_size": size_tuple}

#: The options of brainstate.nn.Embedding the online layer supports only at their defaults.
_UNSUPPORTED_DEFAULTS: dict[str, object] = {
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

    Indices must be integers in ``[0, num_embeddings)``. Where they are known at the call (not
    under ``jit``, ``vmap`` or a scan), one outside that range, negative ones included, is
    refused with a ``ValueError`` naming it. Under tracing their values are unknown: an
    out-of-range or negative index then reads a row of NaN (for a float table) instead of being
    clamped to the last row, as ``brainstate.nn.Embedding`` does, or wrapping around; a driver
    run with ``check_finite=True`` reports it. Gradients of in-range rows are unchanged.

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
        If ``num_embeddings`` is not a positive int or ``embedding_size`` not a positive int or
        a tuple of them; from ``brainstate.nn.Embedding``'s own checks (an out-of-range
        ``padding_idx``, a non-positive ``max_norm``), before the check below; at call time, if
        a concrete index is outside ``[0, num_embeddings)``.
    TypeError
        At call time, if the indices are not integers (a float array, a quantity with a unit).
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
    >>> layer(jnp.array([0, 3]))
    Traceback (most recent call last):
        ...
    ValueError: braintrace.nn.Embedding: index 3 at position (1,) is outside the table's rows [0, 3) ...
    >>> import jax
    >>> jax.jit(layer)(jnp.array([0, 3]))  # under tracing: a NaN row, not the last one
    Array([[ 0.,  1.],
           [nan, nan]], dtype=float32)
    >>> braintrace.nn.Embedding(3, 2, padding_idx=0)
    Traceback (most recent call last):
        ...
    NotImplementedError: braintrace.nn.Embedding does not support padding_idx in online learning; ...
    """

    __module__ = "braintrace.nn"

    def __init__(self, *args: object, **kwargs: object) -> None:
        check_constructor_arguments(type(self).__name__, super().__init__, args, kwargs, _TABLE_SIZES)
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

    def _indices(self, indices: object) -> jax.Array:
        """Integer indices, refused when known to be out of range, marked out of range when not."""
        idx = _integer_indices(indices, "braintrace.nn.Embedding")
        vocab = self.num_embeddings
        if not isinstance(idx, Tracer):
            self._check_range(np.asarray(idx), vocab)
            return idx
        # Under jit, vmap or scan the values are unknown here: a negative index is sent past the
        # end so that, like an index >= vocab, it reads a NaN row (the lookup's fill mode)
        # instead of wrapping around to the end of the table.
        if jnp.issubdtype(idx.dtype, jnp.signedinteger):
            idx = jnp.where(idx < 0, vocab, idx)
        return idx

    @staticmethod
    def _check_range(idx: np.ndarray, vocab: int) -> None:
        bad = (idx < 0) | (idx >= vocab)
        if not bad.any():
            return
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        value = int(idx[where])
        at = f" at position {where}" if where else ""
        n_bad = int(bad.sum())
        count = f" ({n_bad} of the {idx.size} indices {'is' if n_bad == 1 else 'are'})" if idx.size > 1 else ""
        if value < 0:
            fix = (
                f"A negative index is not a row here (it does not count from the end of the "
                f"table): map the indices into [0, {vocab}), e.g. indices % {vocab} to count "
                f"from the end."
            )
        else:
            fix = (
                f"Map the indices into [0, {vocab}) (e.g. reserve a row for unknown tokens), or "
                f"build the layer with num_embeddings > {int(idx.max())}."
            )
        raise ValueError(
            f"braintrace.nn.Embedding: index {value}{at} is outside the table's rows "
            f"[0, {vocab}){count}. {fix}"
        )

    def update(self, indices: object) -> Value:
        self._check_options()
        self._check_embedding_size()
        idx = self._indices(indices)
        table = self.weight.value
        if idx.ndim <= 1:
            return embedding(idx, table)
        rows = embedding(idx.reshape(-1), table)
        return u.math.reshape(rows, (*idx.shape, rows.shape[-1]))


setattr(Embedding.__init__, "__signature__", inspect.signature(brainstate.nn.Embedding.__init__))

"""``HiddenGroup``: recurrently coupled hidden states, their transition and its Jacobian.

A hidden group is a set of hidden states of one shape (``varshape``) whose step-``t`` values
depend on each other's step-``t-1`` values through element-wise (per-position) operations.
Stacking the ``S = num_state`` members on a trailing axis gives ``(*varshape, S)``; the group's
per-position hidden Jacobian ``D[p, a, b] = ∂h^t[p, a] / ∂h^{t-1}[p, b]`` is what the
D-RTRL family propagates traces with.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._compiler.hidden_group import jacrev_last_dim
>>> f = lambda h: jnp.stack([0.5 * h[..., 0], h[..., 0] + 0.2 * h[..., 1]], axis=-1)
>>> jacrev_last_dim(f, jnp.ones((3, 2)))[0]
Array([[0.5, 0. ],
       [1. , 0.2]], dtype=float32)
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import brainstate
import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr, Var

from braintrace._compiler.jaxpr_graph import contains_eqn
from braintrace._errors import NotSupportedError

__all__ = [
    "HiddenGroup",
    "jacrev_last_dim",
    "jacfwd_last_dim",
    "block_diagonal_last_dim",
    "group_merging",
]

Path = tuple[Any, ...]
Array = jax.Array


def _basis(shape: tuple[int, ...], num_state: int, dtype: Any) -> Array:
    """Cotangents/tangents ``e_a`` broadcast over every position: ``(S, *varshape, S)``."""
    eye = jnp.eye(num_state, dtype=dtype)
    eye = eye.reshape(num_state, *([1] * len(shape)), num_state)
    return jnp.broadcast_to(eye, (num_state, *shape, num_state))


def jacrev_last_dim(fn: Callable[[Array], Array], hidden: Array) -> Array:
    """Per-position ``(S, S)`` Jacobian of a map ``(*varshape, S) -> (*varshape, S)`` (reverse mode).

    Exact when positions do not interact (each output position depends only on the same
    input position): one VJP per state, with the cotangent set on every position at once.
    """
    out, vjp = jax.vjp(fn, hidden)
    rows = jax.vmap(lambda ct: vjp(ct)[0])(_basis(out.shape[:-1], out.shape[-1], out.dtype))
    return jnp.moveaxis(rows, 0, -2)  # rows[a, ..., b] -> [..., a, b]


def jacfwd_last_dim(fn: Callable[[Array], Array], hidden: Array) -> Array:
    """The forward-mode twin of :func:`jacrev_last_dim` (for transitions containing a while)."""
    tangents = _basis(hidden.shape[:-1], hidden.shape[-1], hidden.dtype)
    cols = jax.vmap(lambda t: jax.jvp(fn, (hidden,), (t,))[1])(tangents)
    return jnp.moveaxis(cols, 0, -1)  # cols[b, ..., a] -> [..., a, b]


def block_diagonal_last_dim(fn: Callable[[Array], Array], hidden: Array, forward: bool = False) -> Array:
    """The per-position blocks of the full Jacobian (exact even when positions interact)."""
    shape, num_state = hidden.shape[:-1], hidden.shape[-1]
    full = (jax.jacfwd if forward else jax.jacrev)(fn)(hidden)
    positions = math.prod(shape)
    full = full.reshape(positions, num_state, positions, num_state)
    idx = jnp.arange(positions)
    return full[idx, :, idx, :].reshape(*shape, num_state, num_state)


class HiddenGroup(NamedTuple):
    """Recurrently coupled hidden states and their transition.

    Attributes
    ----------
    index : int
        Position of the group in the graph.
    hidden_paths : list
        Member paths, in compiled-state order.
    hidden_states : list
        Member states.
    hidden_invars, hidden_outvars : list
        ``h^{t-1}`` and ``h^t`` variables of the members.
    transition_jaxpr : Jaxpr
        ``h^{t-1} -> h^t`` of the members; other inputs are its constvars.
    transition_jaxpr_constvars : list
        Those other inputs (hoisted by the graph as extra step outputs).
    is_diagonal_recurrence : bool
        Whether positions are independent (per-position Jacobians by one VJP per state).
    descent : object, optional
        Set when the group lives inside a descended scan.
    """

    index: int  # type: ignore[assignment]  # the field name is part of the public API
    hidden_paths: list[Path]
    hidden_states: list[brainstate.HiddenState]
    hidden_invars: list[Var]
    hidden_outvars: list[Any]
    transition_jaxpr: Jaxpr
    transition_jaxpr_constvars: list[Var]
    is_diagonal_recurrence: bool = True
    descent: Any = None

    @property
    def varshape(self) -> tuple[int, ...]:
        """Shape of one member (without the trailing state axis of a group state)."""
        return tuple(self.hidden_states[0].varshape)

    @property
    def num_state(self) -> int:
        """``S``: the number of stacked member states."""
        return sum(st.num_state for st in self.hidden_states)

    def check_consistent_varshape(self) -> None:
        """Raise :class:`NotSupportedError` unless every member has the same ``varshape``."""
        shapes = [tuple(st.varshape) for st in self.hidden_states]
        if len(set(shapes)) > 1:
            raise NotSupportedError(
                f"The hidden states {self.hidden_paths} are coupled recurrently but have different "
                f"shapes {shapes}; give coupled states one shape (e.g. use HiddenGroupState)."
            )

    def transition(self, hidden_vals: Sequence[Array], input_vals: Sequence[Array]) -> list[Array]:
        """``h^t`` of every member from their ``h^{t-1}`` and the transition's other inputs."""
        return list(jax.core.eval_jaxpr(self.transition_jaxpr, list(input_vals), *hidden_vals))

    def concat_hidden(self, splitted_hid_vals: Sequence[Array]) -> Array:
        """Stack member values on a trailing state axis: ``(*varshape, S)``."""
        parts = [
            v if isinstance(st, brainstate.HiddenGroupState) else jnp.expand_dims(v, -1)
            for st, v in zip(self.hidden_states, splitted_hid_vals)
        ]
        return jnp.concatenate(parts, axis=-1)

    def split_hidden(self, concat_hid_vals: Array) -> list[Array]:
        """The inverse of :meth:`concat_hidden`."""
        out, start = [], 0
        for st in self.hidden_states:
            piece = concat_hid_vals[..., start:start + st.num_state]
            out.append(piece if isinstance(st, brainstate.HiddenGroupState) else piece[..., 0])
            start += st.num_state
        return out

    def diagonal_jacobian(self, hidden_vals: Sequence[Array], input_vals: Sequence[Array]) -> Array:
        """``D``: ``(*varshape, S, S)`` with ``D[p, a, b] = ∂h^t[p, a] / ∂h^{t-1}[p, b]``."""

        def fn(stacked: Array) -> Array:
            return self.concat_hidden(self.transition(self.split_hidden(stacked), input_vals))

        stacked = self.concat_hidden(hidden_vals)
        forward = contains_eqn(self.transition_jaxpr, lambda e: e.primitive.name == "while")
        if self.is_diagonal_recurrence:
            return (jacfwd_last_dim if forward else jacrev_last_dim)(fn, stacked)
        return block_diagonal_last_dim(fn, stacked, forward=forward)

    def dict(self) -> dict[str, Any]:
        return self._asdict()

    def __repr__(self) -> str:
        return (
            f"HiddenGroup(index={self.index}, hidden_paths={self.hidden_paths}, "
            f"varshape={self.varshape}, num_state={self.num_state}, "
            f"n_transition_eqns={len(self.transition_jaxpr.eqns)})"
        )


HiddenGroup.__module__ = "braintrace"


def group_merging(groups: Sequence[Sequence[Any]], version: int = 1) -> list[frozenset[Any]]:
    """Transitive union of intersecting groups (versions 0 and 1 give the same result)."""
    if version not in (0, 1):
        raise ValueError(f"group_merging: version must be 0 or 1, got {version!r}.")
    merged: list[set[Any]] = []
    for group in groups:
        current = set(group)
        rest = []
        for existing in merged:
            if existing & current:
                current |= existing
            else:
                rest.append(existing)
        merged = [*rest, current]
    return [frozenset(g) for g in merged]

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
from typing import Callable, Hashable, NamedTuple, Sequence, TypeVar

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from braintrace._compatible_imports import CUSTOM_VJP_PRIMITIVES, Jaxpr, Var, eval_jaxpr, split_jaxpr_invars
from braintrace._compiler.descended_scan import GroupDescent
from braintrace._compiler.jaxpr_graph import contains_eqn, differentiable_reach
from braintrace._compiler.mixing_jacobian import BlockDiagonalPlan, block_diagonal_plan, structured_block_diagonal
from braintrace._compiler.position_dependence import group_adjacency
from braintrace._compiler.snap_pattern import SnapPattern, widened_jacobian
from braintrace._errors import NotSupportedError
from braintrace._typing import Path

__all__ = [
    "HiddenGroup",
    "jacrev_last_dim",
    "jacfwd_last_dim",
    "block_diagonal_last_dim",
    "group_merging",
    "calls_custom_vjp",
    "state_basis",
]

Array = jax.Array
#: What a merged group holds (a hidden path, a variable).
Member = TypeVar("Member", bound=Hashable)
# The structured-extraction plan of each transition jaxpr (the jaxpr is kept to guard the id).
_PLANS: dict[int, tuple[Jaxpr, BlockDiagonalPlan | None]] = {}
# The axes along which each transition mixes positions (``None``: read conservatively).
_AXES: dict[int, tuple[Jaxpr, list[int] | None]] = {}
_MAX_PLANS = 64


def calls_custom_vjp(jaxpr: Jaxpr) -> bool:
    """Whether ``jaxpr`` (or one of its sub-jaxprs) calls a ``custom_vjp`` function, which has a
    reverse-mode rule only (forward mode cannot differentiate it)."""
    return contains_eqn(jaxpr, lambda e: e.primitive.name in CUSTOM_VJP_PRIMITIVES)


def state_basis(shape: tuple[int, ...], num_state: int, dtype: DTypeLike) -> Array:
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
    rows = jax.vmap(lambda ct: vjp(ct)[0])(state_basis(out.shape[:-1], out.shape[-1], out.dtype))
    return jnp.moveaxis(rows, 0, -2)  # rows[a, ..., b] -> [..., a, b]


def jacfwd_last_dim(fn: Callable[[Array], Array], hidden: Array) -> Array:
    """The forward-mode twin of :func:`jacrev_last_dim`: one JVP per state."""
    if hidden.shape[-1] == 1:  # a single tangent, no batch of them
        return jax.jvp(fn, (hidden,), (jnp.ones_like(hidden),))[1][..., None]
    tangents = state_basis(hidden.shape[:-1], hidden.shape[-1], hidden.dtype)
    cols = jax.vmap(lambda t: jax.jvp(fn, (hidden,), (t,))[1])(tangents)
    return jnp.moveaxis(cols, 0, -1)  # cols[b, ..., a] -> [..., a, b]


def block_diagonal_last_dim(
    fn: Callable[[Array], Array], hidden: Array, forward: bool = False, chunk_size: int | None = None,
    mixing_axes: Sequence[int] | None = None,
) -> Array:
    """The per-position blocks of the full Jacobian (exact even when positions interact).

    Probes one position of the ``mixing_axes`` at a time (default: every axis; one VJP per
    state, or one JVP per state with ``forward=True``) after a single linearisation,
    ``chunk_size`` positions per batch, so the dense ``(P·S)²`` Jacobian is never materialised.
    Along the other axes, whose positions never read each other (a batch axis), one probe sets
    every position at once: ``∏(mixing axes)·S`` probes, memory ``O(chunk_size · P · S²)``.
    ``chunk_size`` defaults to what keeps a batch near 2**22 elements.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> w = jnp.array([[0.5, 0.1], [0.2, 0.3]])
    >>> fn = lambda h: jnp.tanh(h @ w)  # (batch, units, 1): units mix, the batch does not
    >>> h = jnp.ones((3, 2, 1))
    >>> blocks = block_diagonal_last_dim(lambda s: fn(s[..., 0])[..., None], h, mixing_axes=[1])
    >>> blocks.shape, bool(jnp.allclose(blocks[0, :, 0, 0], (1 - jnp.tanh(h[0, :, 0] @ w) ** 2) * jnp.diag(w)))
    ((3, 2, 1, 1), True)
    """
    shape, num_state = hidden.shape[:-1], hidden.shape[-1]
    mixing = list(range(len(shape))) if mixing_axes is None else sorted(mixing_axes)
    others = [i for i in range(len(shape)) if i not in mixing]
    order = [*mixing, *others]  # the mixing axes first, flattened into one
    probed = math.prod(shape[i] for i in mixing)
    others_shape = tuple(shape[i] for i in others)
    back = [order.index(i) for i in range(len(shape))] + [len(shape)]

    def flat_fn(h: Array) -> Array:
        unflat = jnp.transpose(h.reshape(*(shape[i] for i in order), num_state), back)
        return jnp.transpose(fn(unflat), [*order, len(shape)]).reshape(h.shape)

    flat = jnp.transpose(hidden, [*order, len(shape)]).reshape(probed, *others_shape, num_state)
    if chunk_size is None:
        chunk_size = max(1, min(probed, 2**22 // max(1, flat.size * num_state)))
    eye = jnp.eye(num_state, dtype=hidden.dtype).reshape(num_state, *([1] * len(others_shape)), num_state)
    if forward:
        _, probe = jax.linearize(flat_fn, flat)
    else:
        _, vjp = jax.vjp(flat_fn, flat)
        probe = lambda ct: vjp(ct)[0]  # noqa: E731

    def one(r: Array) -> Array:
        basis = jnp.zeros((num_state, *flat.shape), hidden.dtype).at[:, r].set(eye)
        out = jax.vmap(probe)(basis)[:, r]  # [probe state, *others, other state]
        return jnp.moveaxis(out, 0, -1 if forward else -2)  # -> [*others, a, b]

    blocks = jax.lax.map(one, jnp.arange(probed), batch_size=chunk_size)
    blocks = blocks.reshape(*(shape[i] for i in order), num_state, num_state)
    return jnp.transpose(blocks, [*back[:-1], len(shape), len(shape) + 1])


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
    descent : GroupDescent, optional
        Set when the group lives inside a descended scan.
    snap : SnapPattern, optional
        The SnAp-n neighbourhoods of the group, set when the graph is compiled with
        ``sparse_n >= 2`` (see :mod:`braintrace._compiler.snap_pattern`).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> group = braintrace.compile_etrace_graph(cell, jnp.ones(3)).hidden_groups[0]
    >>> group.index, group.hidden_paths, group.is_diagonal_recurrence
    (0, [('h',)], True)
    """

    index: int  # type: ignore[assignment]  # the field name is part of the public API
    hidden_paths: list[Path]
    hidden_states: list[brainstate.HiddenState]
    hidden_invars: list[Var]
    hidden_outvars: list[Var]
    transition_jaxpr: Jaxpr
    transition_jaxpr_constvars: list[Var]
    is_diagonal_recurrence: bool = True
    descent: GroupDescent | None = None
    snap: SnapPattern | None = None

    @property
    def varshape(self) -> tuple[int, ...]:
        """Shape of one member (without the trailing state axis of a group state)."""
        return tuple(self.hidden_states[0].varshape)

    @property
    def num_state(self) -> int:
        """``S``: the number of stacked member states."""
        return sum(st.num_state for st in self.hidden_states)

    @property
    def trace_state_width(self) -> int:
        """The trailing width of a per-parameter trace of the group: ``K·S`` under SnAp, else ``S``."""
        return self.num_state if self.snap is None else self.snap.num_neighbour * self.num_state

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
        return eval_jaxpr(self.transition_jaxpr, input_vals, *hidden_vals)

    def concat_hidden(self, splitted_hid_vals: Sequence[Array]) -> Array:
        """Stack member values on a trailing state axis: ``(*varshape, S)``.

        Raises
        ------
        ValueError
            Unless there is exactly one value per hidden state of the group.
        """
        values = list(splitted_hid_vals)
        if len(values) != len(self.hidden_states):
            raise ValueError(
                f"Hidden group {self.index}: concat_hidden needs exactly one value per hidden state "
                f"({len(self.hidden_states)}, for {self.hidden_paths}), got {len(values)}; pass the "
                f"members' values in the order of hidden_paths."
            )
        parts = [
            v if isinstance(st, brainstate.HiddenGroupState) else jnp.expand_dims(v, -1)
            for st, v in zip(self.hidden_states, values)
        ]
        return jnp.concatenate(parts, axis=-1)

    def split_hidden(self, concat_hid_vals: Array) -> list[Array]:
        """The inverse of :meth:`concat_hidden`.

        Raises
        ------
        ValueError
            If the trailing width of ``concat_hid_vals`` is not :attr:`num_state`.
        """
        shape = tuple(jnp.shape(concat_hid_vals))
        if not shape or shape[-1] != self.num_state:
            raise ValueError(
                f"Hidden group {self.index} ({self.hidden_paths}): split_hidden needs a trailing "
                f"state axis of width num_state={self.num_state}, got a value of shape {shape}; pass "
                f"what concat_hidden returns, shape (*varshape, {self.num_state})."
            )
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
        forward = self._forward_mode()
        if self.is_diagonal_recurrence:
            return (jacfwd_last_dim if forward else jacrev_last_dim)(fn, stacked)
        # Weight mixing: the structured extraction is exact and O(P); otherwise probe positions.
        plan = self._mixing_plan()
        if plan is not None:
            return structured_block_diagonal(
                plan, self.transition_jaxpr, input_vals, hidden_vals, self.concat_hidden, self.split_hidden
            )
        return block_diagonal_last_dim(fn, stacked, forward=forward, mixing_axes=self._mixing_axes(stacked))

    def full_jacobian(self, hidden_vals: Sequence[Array], input_vals: Sequence[Array]) -> Array:
        """The whole within-group Jacobian, ``(*varshape, S, *varshape, S)``.

        ``J[p, a, q, b] = ∂h^t[p, a] / ∂h^{t-1}[q, b]``: dense, ``(P·S)²`` entries, for rules
        whose scope reaches across positions and for checking matrix-free products against.
        """

        def fn(stacked: Array) -> Array:
            return self.concat_hidden(self.transition(self.split_hidden(stacked), input_vals))

        forward = self._forward_mode()
        jacobian: Array = (jax.jacfwd if forward else jax.jacrev)(fn)(self.concat_hidden(hidden_vals))
        return jacobian

    def _forward_mode(self) -> bool:
        """Whether the transition's Jacobians are taken in forward mode (JVPs) rather than reverse.

        Forward mode traces one pass where reverse mode traces a linearisation and its
        transpose, and a ``while`` has no transpose; a ``custom_vjp`` function has no forward
        rule, so a transition calling one (and no ``while``) is differentiated in reverse.

        Raises
        ------
        NotSupportedError
            If the transition holds a ``while`` and calls a ``custom_vjp`` function.
        """
        jaxpr = self.transition_jaxpr
        if not contains_eqn(jaxpr, lambda e: e.primitive.name == "while"):
            return not calls_custom_vjp(jaxpr)
        if calls_custom_vjp(jaxpr):
            raise NotSupportedError(
                f"The transition of hidden group {self.index} ({self.hidden_paths}) holds a while_loop, "
                f"which reverse mode cannot enter, and calls a jax.custom_vjp function, which forward "
                f"mode cannot differentiate. Define that function with jax.custom_jvp (its forward "
                f"rule serves both modes)."
            )
        return True

    def _mixing_plan(self) -> BlockDiagonalPlan | None:
        key = id(self.transition_jaxpr)
        cached = _PLANS.get(key)
        if cached is None or cached[0] is not self.transition_jaxpr:
            has_axis = [isinstance(st, brainstate.HiddenGroupState) for st in self.hidden_states]
            cached = (self.transition_jaxpr, block_diagonal_plan(self.transition_jaxpr, has_axis, self.varshape))
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = cached
        return cached[1]

    def _mixing_axes(self, stacked: Array) -> list[int] | None:
        """The axes of ``varshape`` along which the transition reads other positions (``None``:
        every axis, where the adjacency is not read precisely or ``stacked`` is laid out otherwise)."""
        if tuple(stacked.shape[:-1]) != tuple(self.varshape):
            return None
        key = id(self.transition_jaxpr)
        cached = _AXES.get(key)
        if cached is None or cached[0] is not self.transition_jaxpr:
            adjacency, reason = group_adjacency(self)
            mixing = None if reason is not None else [
                i for i, a in enumerate(adjacency) if not np.array_equal(a, np.eye(a.shape[0], dtype=bool))]
            cached = (self.transition_jaxpr, mixing)
            if len(_AXES) >= _MAX_PLANS:
                _AXES.pop(next(iter(_AXES)))
            _AXES[key] = cached
        return cached[1]

    def reads_its_past(self) -> bool:
        """Whether a member's new value reads a member's previous value within the transition.

        ``False`` where the group's past reaches its new state only through the relations'
        outputs, as in a plain ``h = tanh([x, h] W)`` cell: :meth:`diagonal_jacobian`,
        :meth:`history_jacobian` and :meth:`snap_jacobian` are then identically zero, and a
        trace of the group holds no history (``ε^t = x ⊗ df``). Read off the transition's
        equations, conservatively (an equation with a body reads every input into every
        output); a group inside a descended scan counts as reading its past.

        Examples
        --------
        >>> import brainstate, jax.numpy as jnp, braintrace
        >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
        >>> braintrace.compile_etrace_graph(cell, jnp.ones(3)).hidden_groups[0].reads_its_past()
        False
        >>> cell = brainstate.nn.init_all_states(braintrace.nn.GRUCell(3, 4))
        >>> braintrace.compile_etrace_graph(cell, jnp.ones(3)).hidden_groups[0].reads_its_past()
        True
        """
        if self.descent is not None:
            return True
        _, hidden_invars = split_jaxpr_invars(self.transition_jaxpr, len(self.hidden_invars))
        reached = differentiable_reach(self.transition_jaxpr, hidden_invars)
        return any(isinstance(v, Var) and v in reached for v in self.transition_jaxpr.outvars)

    def reads_new_members(self) -> bool:
        """Whether a member's update reads another member's *new* value within the step."""
        outs = {v for v in self.hidden_outvars if isinstance(v, Var)}
        return any(isinstance(a, Var) and a in outs for e in self.transition_jaxpr.eqns for a in e.invars)

    def history_jacobian(self, hidden_vals: Sequence[Array], input_vals: Sequence[Array]) -> Array:
        """``D`` with every in-step read of a member's new value held fixed.

        A learning signal read off the hidden perturbation, ``∂L/∂h^t``, already contains the
        paths from one member's new value to the loss through another member's update within the
        step (an adaptation current reading the new membrane potential). Contracting it with the
        total ``D`` would count those paths twice; this partial Jacobian is the one to contract
        it with. It equals :meth:`diagonal_jacobian` when no member reads another's new value.
        """
        fn = self._held_new_reads(hidden_vals, input_vals)
        stacked = self.concat_hidden(hidden_vals)
        forward = self._forward_mode()
        if self.is_diagonal_recurrence:
            return (jacfwd_last_dim if forward else jacrev_last_dim)(fn, stacked)
        return block_diagonal_last_dim(fn, stacked, forward=forward, mixing_axes=self._mixing_axes(stacked))

    def _held_new_reads(self, hidden_vals: Sequence[Array], input_vals: Sequence[Array]) -> Callable[[Array], Array]:
        """The stacked transition with every in-step read of a member's new value held at its value."""
        outs = [v for v in self.hidden_outvars if isinstance(v, Var)]
        cut = {v: Var(v.aval) for v in outs}
        eqns = [e.replace(invars=[cut.get(a, a) if isinstance(a, Var) else a for a in e.invars])
                for e in self.transition_jaxpr.eqns]
        constvars, hidden_invars = split_jaxpr_invars(self.transition_jaxpr, len(self.hidden_invars))
        jaxpr = self.transition_jaxpr.replace(constvars=[*constvars, *cut.values()], invars=hidden_invars, eqns=eqns)
        new_vals = self.transition(hidden_vals, input_vals)
        fixed = [new_vals[self.hidden_outvars.index(v)] for v in outs]

        def fn(stacked: Array) -> Array:
            hs = self.split_hidden(stacked)
            return self.concat_hidden(eval_jaxpr(jaxpr, [*input_vals, *fixed], *hs))

        return fn

    def snap_jacobian(self, hidden_vals: Sequence[Array], input_vals: Sequence[Array], history: bool = False) -> Array:
        """The SnAp-widened Jacobian ``Dg``, ``(*varshape, K·S, K·S)`` (see :attr:`snap`).

        ``Dg[p, (k, a), (k', b)] = ∂h^t[nbr[p, k], a] / ∂h^{t-1}[nbr[p, k'], b]`` over the
        neighbourhood of ``p``, zero on padded slots; with ``history=True``, of the partial
        Jacobian of :meth:`history_jacobian`.

        Raises
        ------
        ValueError
            If the group has no SnAp pattern.
        """
        if self.snap is None:
            raise ValueError(f"Hidden group {self.index} has no SnAp pattern; compile with sparse_n >= 2.")
        fn = self._held_new_reads(hidden_vals, input_vals) if history else self._stacked_transition(input_vals)
        return widened_jacobian(fn, self.concat_hidden(hidden_vals), self.snap)

    def _stacked_transition(self, input_vals: Sequence[Array]) -> Callable[[Array], Array]:
        """The transition on the stacked group ``(*varshape, S) -> (*varshape, S)``."""

        def fn(stacked: Array) -> Array:
            return self.concat_hidden(self.transition(self.split_hidden(stacked), input_vals))

        return fn

    def dict(self) -> dict[str, object]:
        return self._asdict()

    def __repr__(self) -> str:
        return (
            f"HiddenGroup(index={self.index}, hidden_paths={self.hidden_paths}, "
            f"varshape={self.varshape}, num_state={self.num_state}, "
            f"n_transition_eqns={len(self.transition_jaxpr.eqns)})"
        )


HiddenGroup.__module__ = "braintrace"


def group_merging(groups: Sequence[Sequence[Member]], version: int = 1) -> list[frozenset[Member]]:
    """Transitive union of intersecting groups (versions 0 and 1 give the same result)."""
    if version not in (0, 1):
        raise ValueError(f"group_merging: version must be 0 or 1, got {version!r}.")
    merged: list[set[Member]] = []
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

"""The modulator of ``learning_signal='modulatory'``: a third factor in place of ``∂L/∂h``.

A three-factor rule multiplies each relation's eligibility trace ``ε`` by a global signal ``m``
(a reward, a neuromodulator, a broadcast error) instead of the loss's derivative with respect to
the hidden state: an ETP parameter's gradient is ``Σ_groups ⟨expand(m), ε⟩``. One array serves
every hidden group, expanded by shape, never by group index:

* a scalar broadcasts to the group's signal ``(*varshape, S)``;
* an array of the group's ``varshape`` gains a trailing state axis;
* any other array must broadcast to ``(*varshape, S)`` (a per-sample reward of a batch ``B``
  is ``(B, 1, ..., 1)``).

:class:`ModulatorSlot` gives an engine the two ways to supply ``m``: per call
(``learner(x, modulator=m)``, which wins for that call) and a standing value
(``learner.modulator = m``) kept in a :class:`brainstate.State`, so that code already compiled
by ``jit`` reads the new value of the same shape.

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.engine.modulator import expand_modulator
>>> expand_modulator(jnp.array([1.0, -1.0]), (2,), 1, "group 0").shape  # varshape (2,), S = 1
(2, 1)
>>> expand_modulator(0.5, (2, 3), 2, "group 0")[0, 0].tolist()
[0.5, 0.5]
"""

from __future__ import annotations

from typing import Sequence

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._compiler import ETraceGraph
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._typing import Path, PyTree

__all__ = ["ModulatorSlot", "expand_modulator", "modulator_signals", "without_etp_gradients"]


def _as_array(modulator: object, learner: str) -> jax.Array:
    if isinstance(modulator, (list, tuple)):
        raise TypeError(
            f"{learner}: the modulator is one array for every hidden group (a scalar, the group's varshape, "
            f"or anything broadcasting to (*varshape, num_state)), got a {type(modulator).__name__}; "
            f"there is no per-group spelling. Pass e.g. modulator=reward or modulator=jnp.asarray(values).")
    if isinstance(modulator, u.Quantity) and not modulator.is_unitless:
        raise ValueError(
            f"{learner}: the modulator must be unitless (it replaces the learning signal), got unit "
            f"{modulator.unit}; pass its mantissa, e.g. modulator=u.get_magnitude(m).")
    value = jnp.asarray(u.get_mantissa(modulator))
    if not jnp.issubdtype(value.dtype, jnp.floating):
        value = value.astype(jnp.result_type(float))
    return value


def expand_modulator(modulator: jax.Array, varshape: tuple[int, ...], num_state: int, where: str) -> jax.Array:
    """``modulator`` expanded to a group's signal shape ``(*varshape, num_state)``.

    Raises
    ------
    ValueError
        If it does not broadcast to that shape (the message names ``where`` and both shapes).
    """
    value = jnp.asarray(modulator)
    target = (*varshape, num_state)
    if value.ndim and tuple(value.shape) == tuple(varshape):
        value = value[..., None]
    try:
        np.broadcast_shapes(value.shape, target)
        shape_ok = len(value.shape) <= len(target) and np.broadcast_shapes(value.shape, target) == target
    except ValueError:
        shape_ok = False
    if not shape_ok:
        hint = ""
        if value.ndim == 1 and len(varshape) > 1 and value.shape[0] == varshape[0]:
            hint = f" A per-sample value of the batch needs shape {(varshape[0], *[1] * len(varshape))}."
        raise ValueError(
            f"{where}: the modulator has shape {tuple(jnp.shape(modulator))}, which does not broadcast to "
            f"the group's signal (*varshape, num_state) = {target}. Give a scalar, an array of the "
            f"varshape {tuple(varshape)}, or one broadcasting to {target}.{hint}")
    return jnp.broadcast_to(value, target)


def modulator_signals(modulator: jax.Array, signals: Sequence[jax.Array], graph: ETraceGraph) -> list[jax.Array]:
    """The learning signal of every hidden group: ``modulator`` expanded to the shape of the
    group's signal (a vmapped lane's, inside ``vmap``) and cast to its dtype."""
    out = []
    for group, signal in zip(graph.hidden_groups, signals):
        expanded = expand_modulator(modulator, tuple(signal.shape[:-1]), signal.shape[-1], _where(group))
        out.append(expanded.astype(signal.dtype))
    return out


def without_etp_gradients(grads: dict[Path, PyTree], etp_paths: frozenset[Path]) -> dict[Path, PyTree]:
    """``grads`` with the ETP parameters' entries zeroed: a modulated rule gives them its trace
    term alone (no same-step autodiff term, whatever path it took), so ``m = 0`` zeroes them."""
    return {p: jax.tree.map(jnp.zeros_like, g) if p in etp_paths else g for p, g in grads.items()}


def _where(group: HiddenGroup) -> str:
    return f"hidden group {group.index} {list(group.hidden_paths)}"


class ModulatorSlot:
    """An engine's modulator: the ``modulator=`` option of a call, or the standing :attr:`modulator`.

    The host is a learner with a compiled ``graph``, an ``is_compiled`` flag and a ``config``
    whose ``learning_signal`` is ``'modulatory'`` when the slot is used.
    """

    _standing_modulator: brainstate.State | None = None

    @property
    def modulator(self) -> jax.Array | None:
        """The standing modulator, read by every call that passes none (``None``: unset).

        Assigning an array of the same shape updates the value in place, which code already
        traced by ``jit`` reads; a value of another shape is refused (assign ``None`` first, then
        the new value, and trace again), and ``None`` removes it.
        """
        state = self._standing_modulator
        return None if state is None else state.value

    @modulator.setter
    def modulator(self, value: object) -> None:
        name = type(self).__name__
        if value is None:
            self._standing_modulator = None
            return
        array = _as_array(value, name)
        state = self._standing_modulator
        if state is None:
            self._standing_modulator = brainstate.State(array)
            return
        if array.shape != state.value.shape:
            raise ValueError(
                f"{name}.modulator has shape {tuple(state.value.shape)}, and compiled code reads it in "
                f"place, so a new standing value must keep that shape; got {tuple(array.shape)}. Pass "
                f"modulator= per call for another shape, or assign None first and trace again.")
        state.value = array.astype(state.value.dtype)

    @property
    def _modulated(self) -> bool:
        """Whether the host's coordinate is ``learning_signal='modulatory'``."""
        return bool(self.config.learning_signal == "modulatory")  # type: ignore[attr-defined]

    def _get_update_aux(self, args: tuple[PyTree, ...], **options: object) -> PyTree:
        """Under ``learning_signal='modulatory'``, the call's ``modulator=`` (the other options go
        to the host's own check); elsewhere ``modulator=`` is refused like any unknown option."""
        host_check = getattr(super(), "_get_update_aux")
        if not self._modulated:
            return host_check(args, **options)
        modulator = options.pop("modulator", None)
        host_check(args, **options)
        return self._call_modulator(modulator)

    def _call_modulator(self, modulator: object) -> jax.Array:
        """The call's modulator (the keyword wins over the standing value), checked against
        every hidden group before tracing.

        Raises
        ------
        RuntimeError
            If neither is given (the symmetric signal is never substituted).
        """
        name = type(self).__name__
        if modulator is None:
            if self._standing_modulator is None:
                raise RuntimeError(
                    f"{name}: learning_signal='modulatory' needs a modulator and none was given. Pass it "
                    f"per call, learner(x, modulator=reward), or set a standing one, learner.modulator = "
                    f"reward (the gradient ∂L/∂h is never used in its place).")
            value = self._standing_modulator.value
        else:
            value = _as_array(modulator, name)
        graph: ETraceGraph = self.graph  # type: ignore[attr-defined]
        for group in graph.hidden_groups:  # the values' shapes: a lane's inside vmap
            varshape = tuple(group.hidden_states[0].value.shape)
            expand_modulator(value, varshape, group.num_state, f"{name}, {_where(group)}")
        return value

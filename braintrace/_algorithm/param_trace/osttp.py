"""``OSTTP``: online spatio-temporal learning with target projection.

The relation weights learn from a *target-driven* learning signal instead of the loss: for
hidden group ``l`` with a fixed matrix ``B_l`` of shape ``(n_target, n_l)`` the signal is
``y_target @ B_l``, broadcast over the group's states. The eligibility trace is D-RTRL's with
the recurrent weight mixing kept in the per-position hidden Jacobian (as ``OSTLRecurrent``).

What a call adds to the engine's gradient (see :mod:`braintrace._algorithm.engine.base`):

* single-step: ``⟨L, ε^t⟩ − ⟨g, ε^t⟩ + ⟨Dᵀ g, ε^{t-1}⟩`` — the target-projection estimate
  replaces the same-step path ``W -> y -> h^t -> loss`` of the exact one-step gradient, so a
  relation weight's gradient no longer depends on the loss through its hidden group
  (parameters outside relations, and any direct ``y -> loss`` path, keep their exact
  gradient);
* multi-step: the exact gradient within the window plus ``⟨L, ε⟩`` at the state entering it.

The target is an input of the call, ``learner(x, y_target)``, threaded through the custom VJP
as a real argument. This rule is target-driven and not comparable to backpropagation.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> B = jnp.ones((1, 2))
>>> learner = braintrace.compile(Leaky(), braintrace.OSTTP, jnp.ones(3), B_list=[B])
>>> f = lambda x, y: learner(x, y).sum()
>>> grads = brainstate.transform.grad(f, learner.param_states)(jnp.ones(3), jnp.full((1,), 2.0))
>>> grads[('w',)][0]  # the target projection y_target @ B times the trace x
Array([2., 2.], dtype=float32)
"""

from __future__ import annotations

from typing import Any, Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._algorithm.param_trace.d_rtrl import ParamDimVjpAlgorithm
from braintrace._algorithm.rules.snn_helpers import extract_y_target
from braintrace._typing import PyTree

__all__ = ["OSTTP"]


class OSTTP(ParamDimVjpAlgorithm):
    """Online spatio-temporal learning with target projection (see the module docstring).

    Parameters
    ----------
    model : brainstate.nn.Module
        A model called with exactly one input per step.
    B_list : sequence of arrays
        One ``(n_target, n_l)`` matrix per hidden group, in the order of
        ``learner.graph.hidden_groups``; ``n_l`` is the last axis of the group's shape.
    target_timing : {'per-step', 'sequence-end'}
        ``'per-step'``: every call needs a target. ``'sequence-end'``: calls without a target
        get a zero learning signal for the relation weights.
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
    fast_solve : bool
    trace_dtype : dtype, optional
    chunked_trace : bool
    control_flow : ControlFlowPolicy, optional
    config : ETraceConfig, optional
        The trace's coordinate (default ``ETraceConfig(recurrence_scope='coupled')``); its
        learning signal must stay ``'symmetric'``, which the target projection replaces.
    random_feedback_key : int or PRNG key, optional
        Unused (the target projection is the learning signal).
    snap_max_jacobian_elements : int
        Keyword options forwarded to :class:`ParamDimVjpAlgorithm`.

    Attributes
    ----------
    config : ETraceConfig
        The coordinate of the trace (OSTTP's target-projection signal has no ETraceConfig value).

    Raises
    ------
    ValueError
        For an unknown ``target_timing``, a ``B_list`` entry that is not a matrix, or a config
        with another learning signal; at
        :meth:`compile_graph`, when ``B_list`` does not fit the hidden groups (the learner
        then stays uncompiled); at a call, when a ``'per-step'`` call has no target.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> B = jnp.ones((2, 4))  # 2 targets projected onto the 4 hidden units
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.OSTTP, jnp.ones(3),
    ...                              B_list=[B])
    >>> loss = lambda x, y_target: learner(x, y_target).sum()
    >>> grads = brainstate.transform.grad(loss, learner.param_states)(jnp.ones(3), jnp.ones(2))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    """

    rule_approximations = ("the target projection replaces ∂L/∂h (OSTTP's y_target @ B, not the loss gradient)",)
    _default_config = ETraceConfig(recurrence_scope="coupled")

    def __init__(
        self,
        model: brainstate.nn.Module,
        B_list: Sequence[jax.typing.ArrayLike],
        target_timing: str = "per-step",
        name: str | None = None,
        vjp_method: str = "single-step",
        fast_solve: bool = True,
        **kwargs: Any,
    ) -> None:
        if target_timing not in ("per-step", "sequence-end"):
            raise ValueError(
                f"OSTTP: target_timing must be 'per-step' or 'sequence-end', got {target_timing!r}."
            )
        if isinstance(B_list, (str, bytes)) or not isinstance(B_list, Sequence):
            raise ValueError(
                f"OSTTP: B_list must be a list of (n_target, n_hidden) matrices, got {type(B_list).__name__}."
            )
        matrices = tuple(jax.lax.stop_gradient(jnp.asarray(B)) for B in B_list)
        for i, B in enumerate(matrices):
            if B.ndim != 2:
                raise ValueError(f"OSTTP: B_list[{i}] must be a (n_target, n_hidden) matrix, got shape {B.shape}.")
        super().__init__(model, name=name, vjp_method=vjp_method, fast_solve=fast_solve, **kwargs)
        self.B_list = matrices
        self.target_timing = target_timing
        self._y_target: jax.typing.ArrayLike | None = None

    def _check_config(self, config: ETraceConfig | None) -> ETraceConfig:
        checked = super()._check_config(config)
        if checked.learning_signal != "symmetric":
            raise ValueError(
                f"OSTTP: config has learning_signal={checked.learning_signal!r}, but OSTTP's learning "
                f"signal is the target projection of B_list; give a config with the symmetric signal.")
        return checked

    @property
    def replaces_signal(self) -> bool:
        return True

    def compile_graph(self, *args: PyTree) -> None:
        """Compile, then check ``B_list`` against the hidden groups (uncompiled on failure)."""
        super().compile_graph(*args)
        if not self.is_compiled:  # the state-probe pass of a vmapped compile builds nothing
            return
        try:
            self._check_b_list()
        except ValueError:
            self.is_compiled = False
            raise

    def _check_b_list(self) -> None:
        groups = self.graph.hidden_groups
        if len(self.B_list) != len(groups):
            raise ValueError(
                f"OSTTP: B_list has {len(self.B_list)} matrices but the model has {len(groups)} hidden "
                f"groups {[g.hidden_paths for g in groups]}; give one (n_target, n_hidden) matrix per group."
            )
        for i, (B, group) in enumerate(zip(self.B_list, groups)):
            n = group.varshape[-1] if group.varshape else 1
            if B.shape[1] != n:
                raise ValueError(
                    f"OSTTP: B_list[{i}] has shape {B.shape}, but hidden group {i} "
                    f"({group.hidden_paths}) has {n} units on its last axis; use shape (n_target, {n})."
                )

    def update(self, x: PyTree, y_target: jax.typing.ArrayLike | None = None) -> PyTree:
        """One call on input ``x`` with the target ``y_target`` of shape ``(..., n_target)``."""
        if y_target is None and self.target_timing == "per-step":
            raise ValueError(
                "OSTTP: target_timing='per-step' needs a target at every call: learner(x, y_target)."
            )
        self._y_target = y_target
        try:
            return super().update(x)
        finally:
            self._y_target = None

    def _get_update_aux(self, args: tuple[PyTree, ...], **options: object) -> jax.typing.ArrayLike | None:
        super()._get_update_aux(args, **options)
        return self._y_target

    def _learning_signals(self, signals: Sequence[jax.Array], args: tuple[PyTree, ...]) -> list[jax.Array]:
        y_target = extract_y_target(args)
        if y_target is None:
            return [jnp.zeros_like(s) for s in signals]
        out = []
        for B, s in zip(self.B_list, signals):
            projected = jnp.asarray(y_target) @ B.astype(s.dtype)
            out.append(jnp.broadcast_to(projected.reshape(*s.shape[:-1], 1), s.shape).astype(s.dtype))
        return out


OSTTP.__module__ = "braintrace"

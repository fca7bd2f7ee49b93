"""``ThreeFactor``: a local eligibility trace times a global modulatory signal.

The per-parameter engine (:class:`~braintrace.ParamDimVjpAlgorithm`) at D-RTRL's coordinate with
``learning_signal='modulatory'``: each relation weight's gradient is ``Σ_groups ⟨expand(m), ε⟩``,
its D-RTRL trace ``ε`` met by a modulator ``m`` (a reward, a dopamine-like signal, a broadcast
error) in place of ``∂L/∂h``. The trace and its cost are D-RTRL's. Parameters no relation
trains keep the exact one-step gradient of the call's loss, so for a pure three-factor update
leave them out of ``weights``. ``m = ∂L/∂h`` reproduces single-step D-RTRL exactly and ``m = 0``
gives the relation weights an exact zero.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'three_factor', jnp.ones(3))
>>> type(learner).__name__, learner.config.learning_signal
('ThreeFactor', 'modulatory')
>>> reward = 0.5
>>> grads = brainstate.transform.grad(lambda x: learner(x, modulator=reward).sum(),
...                                   learner.param_states)(jnp.ones(3))
>>> grads[('W', 'weight')]['weight'].shape
(7, 4)
"""

from __future__ import annotations

from typing import ClassVar

import brainstate
import jax

from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._algorithm.param_trace.d_rtrl import ParamDimVjpAlgorithm
from braintrace._compiler import DEFAULT_MAX_JACOBIAN_ELEMENTS, ControlFlowPolicy

__all__ = ["ThreeFactor"]


class ThreeFactor(ParamDimVjpAlgorithm):
    """Three-factor learning: D-RTRL's trace met by a modulator (see the module docstring).

    The modulator is one array for every hidden group: a scalar, an array of a group's
    ``varshape``, or anything that broadcasts to ``(*varshape, num_state)`` (a per-sample reward
    of a batch ``B`` is ``(B, 1, ..., 1)``). Give it per call, ``learner(x, modulator=m)``
    (never passed to the model; it wins for that call), or as the standing value
    ``learner.modulator = m`` that calls without one read. The standing value lives in a
    ``brainstate.State``: reassigning it with the same shape reaches code already compiled by
    ``jit``. Through the sequence drivers, pass the modulators as one more sequence and hand
    each slice to the learner in ``step_fn``. The loss differentiated must read the learner's
    output (any function of it will do, its ``∂L/∂h`` is replaced): a loss that does not depend on
    the output has no backward pass at all.

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'single-step'}
        Only single step: in a multi-step window the exact in-window term of the relation
        weights would stay unmodulated.
    modulator : array_like, optional
        The initial standing modulator.
    fast_solve, trace_dtype, chunked_trace, control_flow, snap_max_jacobian_elements
        As for :class:`~braintrace.ParamDimVjpAlgorithm`.

    Raises
    ------
    ValueError
        At construction, for ``vjp_method='multi-step'``; at a call, for a modulator that does
        not broadcast to a group's signal (naming the group and both shapes).
    TypeError
        At a call, for a list or tuple of modulators (there is no per-group spelling).
    RuntimeError
        At a call, when no modulator is given and none is standing.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.ThreeFactor,
    ...                              jnp.ones((2, 3)), batch_size=2)
    >>> def step_fn(x, r):  # r: one reward per sample, shaped (2, 1, 1) to meet (batch, units, state)
    ...     return learner(x, modulator=r).sum()
    >>> rewards = jnp.ones((5, 2, 1, 1))
    >>> grads = learner.etrace_grad(jnp.ones((5, 2, 3)), rewards, step_fn=step_fn)
    >>> grads[('W', 'weight')]['bias'].shape
    (4,)
    >>> learner.modulator = 0.0  # a standing modulator: calls without one read it
    >>> g = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones((2, 3)))
    >>> float(abs(g[('W', 'weight')]['weight']).max())
    0.0
    """

    _default_config: ClassVar[ETraceConfig] = ETraceConfig(learning_signal="modulatory")

    def __init__(
        self,
        model: brainstate.nn.Module,
        name: str | None = None,
        vjp_method: str = "single-step",
        modulator: jax.typing.ArrayLike | None = None,
        fast_solve: bool = True,
        trace_dtype: jax.typing.DTypeLike | None = None,
        chunked_trace: bool = True,
        control_flow: ControlFlowPolicy | None = None,
        snap_max_jacobian_elements: int = DEFAULT_MAX_JACOBIAN_ELEMENTS,
    ) -> None:
        super().__init__(
            model, name=name, vjp_method=vjp_method, fast_solve=fast_solve, trace_dtype=trace_dtype,
            chunked_trace=chunked_trace, control_flow=control_flow,
            snap_max_jacobian_elements=snap_max_jacobian_elements,
        )
        if modulator is not None:
            self.modulator = modulator


ThreeFactor.__module__ = "braintrace"

"""``UORO``: unbiased online recurrent optimisation (Tallec & Ollivier, 2018).

The random-projection engine (:class:`~braintrace.RandomProjectionVjpAlgorithm`) at its one
coordinate: a rank-one pair of factors per hidden group, rolled through the group's whole
within-group Jacobian (coupled scope) with the symmetric learning signal. In expectation over
the draws its gradient is the exact within-group real-time recurrent gradient, so on a model
with one hidden group and an element-wise ``y -> h`` tail it is an unbiased estimate of
backpropagation through time, with a carrier of ``|θ| + P·S`` numbers (``P·S`` the hidden size
including any batch) instead of D_RTRL's ``|θ|·S`` per sample.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'uoro', jnp.ones(3))
>>> type(learner).__name__, learner.vjp_method
('UORO', 'multi-step')
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> grads[('W', 'weight')]['weight'].shape
(7, 4)
"""

from __future__ import annotations

import brainstate
import jax

from braintrace._algorithm.rules.random_projection import RandomProjectionVjpAlgorithm
from braintrace._compiler import ControlFlowPolicy

__all__ = ["UORO"]


class UORO(RandomProjectionVjpAlgorithm):
    """Unbiased online recurrent optimisation: the random-projection engine at its fixed
    coordinate (see the module docstring and :class:`~braintrace.RandomProjectionVjpAlgorithm`).

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'multi-step', 'single-step'}
        The estimator (see :class:`~braintrace.ETraceVjpAlgorithm`); windows of
        :class:`~braintrace.MultiStepData` need ``'multi-step'`` (the default).
    fast_solve : bool
        Project with the primitive's closed-form kernels where they apply.
    control_flow : ControlFlowPolicy, optional
    projection_key : int or key array
        Seed (or key) of the Rademacher draws (default 42).
    projection_eps : float
        The normalisers' regulariser (default ``1e-12``); positive, also in float32.
    random_feedback_key : int or key array, optional
        Unused by UORO's symmetric learning signal.

    Notes
    -----
    Variance grows with the number of steps between reset and the gradient; negating every
    draw leaves the estimate unchanged, so antithetic pairs do not reduce it. Each step costs
    one JVP of every group's transition (the dense Jacobian is never built) and one projection
    per relation.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.UORO, jnp.ones(3),
    ...                              projection_key=7)
    >>> xs = jnp.ones((6, 3))
    >>> def step_fn(x):  # one call of this learner per step
    ...     return jnp.sum(learner(x) ** 2)
    >>> grads = learner.etrace_grad(xs, step_fn=step_fn)
    >>> grads[('W', 'weight')]['bias'].shape
    (4,)
    >>> learner.reset_state()  # factors and counters zeroed, the key re-derived from 7
    >>> int(learner.projection_step.value)
    0
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        name: str | None = None,
        vjp_method: str = "multi-step",
        fast_solve: bool = True,
        control_flow: ControlFlowPolicy | None = None,
        projection_key: int | jax.Array = 42,
        projection_eps: float = 1e-12,
        random_feedback_key: int | jax.Array | None = None,
    ) -> None:
        super().__init__(
            model, name=name, vjp_method=vjp_method, fast_solve=fast_solve, control_flow=control_flow,
            projection_key=projection_key, projection_eps=projection_eps, random_feedback_key=random_feedback_key,
        )


UORO.__module__ = "braintrace"

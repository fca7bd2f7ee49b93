"""``OSTLRecurrent`` and ``OSTLFeedforward``: online spatio-temporal learning.

* :class:`OSTLRecurrent` ("with H") is D-RTRL whose per-position hidden Jacobian ``D`` keeps
  the diagonal of the recurrent weight mixing: for ``v' = f(v, s(v) @ W_rec + ...)`` the
  entry ``∂v'[p] / ∂v[p]`` includes ``s'(v[p]) · W_rec[p, p]``, which plain D-RTRL cuts. The
  blocks are extracted exactly without the dense ``(P·S)²`` Jacobian (see
  :mod:`braintrace._compiler.mixing_jacobian`). It equals backpropagation through time when
  the true ``∂h^t/∂h^{t-1}`` is block-diagonal per position; cross-unit coupling (the
  off-diagonal part of a recurrent matmul) is dropped.
* :class:`OSTLFeedforward` ("without H") is ``pp_prop`` with a vanishing decay (rank 1): the
  factored trace holds only the current step.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Rec(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.r = brainstate.ParamState(jnp.array([[0.5, 1.0], [1.0, 0.5]]))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value) + self.h.value @ self.r.value
...         return self.h.value
>>> learner = braintrace.compile(Rec(), braintrace.OSTLRecurrent, jnp.ones(3))
>>> _ = learner(jnp.ones(3))
>>> learner.graph.hidden_groups[0].is_diagonal_recurrence  # D keeps the diagonal of h @ r
False
"""

from __future__ import annotations

from typing import Any

import brainstate

from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._algorithm.param_trace.d_rtrl import ParamDimVjpAlgorithm
from braintrace._algorithm.io_trace.pp_prop import DecayOrRank, pp_prop

__all__ = ["OSTLRecurrent", "OSTLFeedforward"]


class OSTLRecurrent(ParamDimVjpAlgorithm):
    """D-RTRL with the recurrent weight mixing kept in the per-position Jacobian (see the module
    docstring).

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
        The estimator (see :class:`~braintrace.ETraceVjpAlgorithm`).
    fast_solve : bool
        Use the primitive's closed-form kernels when the library's rules are in force.
    trace_dtype : dtype, optional
        Storage dtype of fast-path traces.
    chunked_trace : bool
        Roll multi-step windows in closed form where the kernels allow it.
    control_flow : ControlFlowPolicy, optional
    config : ETraceConfig, optional
        The coordinate, default ``ETraceConfig(recurrence_scope='coupled')``.
    random_feedback_key : int or PRNG key, optional
    snap_max_jacobian_elements : int
        As :class:`ParamDimVjpAlgorithm`.

    Raises
    ------
    NotImplementedError
        At compile time, for hidden states inside a descended scan (the coupled scope cannot
        follow the mixing there; unroll the loop or use D_RTRL).

    Notes
    -----
    Exact versus backpropagation through time when the true hidden Jacobian is
    block-diagonal per position (element-wise recurrences, where it equals D-RTRL). With a
    dense recurrent matmul only its diagonal enters the trace, so it is an approximation;
    the upstream docstring's claim that coupling through a traced weight is retained does
    not hold there either.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.OSTLRecurrent,
    ...                              jnp.ones(3))
    >>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    >>> learner.config.recurrence_scope
    'coupled'
    """

    _default_config = ETraceConfig(recurrence_scope="coupled")
    regime = "with-H"


class OSTLFeedforward(pp_prop):
    """``pp_prop`` with a vanishing decay: the trace keeps only the current step.

    Parameters
    ----------
    model : brainstate.nn.Module
    decay_or_rank : float, int or pair, optional
        As :class:`pp_prop`; default ``1e-6`` (the coordinate ``('scalar_leak', 'jacobian')`` with
        decays ``(1e-6, 1e-6)``), or the ``config``'s decays when one is given. ``0.0`` (or rank
        ``1``) is the exact feedforward coordinate ``('none', 'none')``.
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}, fast_solve : bool, control_flow : ControlFlowPolicy
    trace_dtype : dtype, optional
    config : ETraceConfig, optional
    random_feedback_key : int or PRNG key, optional
        Keyword options forwarded to :class:`pp_prop`.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.OSTLFeedforward,
    ...                              jnp.ones(3))
    >>> learner.decay, isinstance(learner, braintrace.pp_prop)
    (1e-06, True)
    >>> braintrace.OSTLFeedforward(braintrace.nn.ValinaRNNCell(3, 4), 0.0).config.temporal_recursion
    ('none', 'none')
    """

    regime = "without-H"

    def __init__(
        self, model: brainstate.nn.Module, decay_or_rank: DecayOrRank | None = None, name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if decay_or_rank is None and kwargs.get("config") is None:
            decay_or_rank = 1e-6
        super().__init__(model, decay_or_rank, name=name, **kwargs)


OSTLRecurrent.__module__ = "braintrace"
OSTLFeedforward.__module__ = "braintrace"

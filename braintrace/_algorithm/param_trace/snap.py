"""``SnAp``: SnAp-n, RTRL masked to the ``n``-step sparsity pattern of each parameter's influence.

RTRL carries ``J^t = ∂h^t/∂θ`` with ``J^t = D^t J^{t-1} + I^t`` (``D^t`` the whole within-group
hidden Jacobian). SnAp-n (Menick et al., 2021) keeps that recursion on the entries of ``J`` that
the instantaneous term reaches within ``n - 1`` steps: a parameter whose trace slot lands on
hidden position ``p`` follows its influence on the positions ``p`` reaches,
``N(p) = column p of nz(⋁_{k<n} A^k)`` (``A[q, p]``: ``h_q`` reads ``h_p`` in one step; see
:mod:`braintrace._compiler.snap_pattern`).

The D-RTRL engine does the work unchanged, on a widened state axis: the trace's trailing ``S``
becomes ``M = K·S`` (slot ``m = k·S + a`` = influence on ``h[nbr[p, k], a]``, ``nbr[p, 0] = p``,
``K = max_p |N(p)|``). The executor hands the engine, per widened group,

* ``Dg[p, (k, a), (k', b)] = ∂h^t[nbr[p, k], a] / ∂h^{t-1}[nbr[p, k'], b]`` on valid slots (the
  within-group Jacobian gathered onto each neighbourhood) in place of the per-position ``D``;
* ``df`` zero-padded to ``M`` (the instantaneous term sits in slot 0, at ``p`` itself), or, for
  a ``y -> h`` tail that moves values between positions (a roll of the drive, a weight that
  reaches ``h`` only through another trainable operation, like a GRU's reset gate), the tail's
  Jacobian gathered onto the neighbourhood, ``df[p, (k, a)] = ∂h[nbr[p, k], a] / ∂y[p]``;

and the learner gathers the learning signal, ``sig[p, (k, a)] = ∂L/∂h[nbr[p, k], a]``. So
``⟨sig, ε⟩ = Σ_q ∂L/∂h_q · J_masked[q, θ]``, and the ETP rules never see the difference.

* ``n = 1`` is the coupled scope (:class:`OSTLRecurrent`): the trace is not widened, and a weight
  reached through another trainable operation is left out, as under D_RTRL.
* ``n ≥ diameter`` saturates to full within-group RTRL, which equals BPTT when the model has
  one hidden group (whatever its tails move, as long as the neighbourhoods hold it: the compiler
  warns with ``TAIL_RELABELS_POSITIONS`` where they do not). Influence across groups is never kept.

Cost: traces ``|θ|·K·S`` per sample (linear in ``K``), ``Dg`` of ``P·(K·S)²`` per step (bounded
by ``snap_max_jacobian_elements``), and the within-group Jacobian it is gathered from, probed
once per state and position of the axes that mix (a batch axis never does).

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class RNN(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w_in = brainstate.ParamState(0.3 * jnp.ones((3, 4)))
...         self.w_rec = brainstate.ParamState(0.5 * jnp.eye(4))
...         self.h = brainstate.HiddenState(jnp.zeros(4))
...     def update(self, x):
...         drive = braintrace.matmul(x, self.w_in.value) + braintrace.matmul(self.h.value, self.w_rec.value)
...         self.h.value = jnp.tanh(drive)
...         return self.h.value
>>> learner = braintrace.compile(RNN(), braintrace.SnAp, jnp.ones(3), n=2)
>>> learner.graph.hidden_groups[0].snap  # a dense recurrence saturates at n = 2
SnapPattern(n=2, varshape=(4,), P=4, K=4)
>>> trace, = learner.get_etrace_of(learner.param_states[('w_in',)]).values()
>>> trace['weight'].shape  # (in, out, K·S)
(3, 4, 4)
"""

from __future__ import annotations

import operator
from typing import Any

import brainstate

from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._algorithm.param_trace.d_rtrl import ParamDimVjpAlgorithm
from braintrace._compiler.snap_pattern import DEFAULT_MAX_JACOBIAN_ELEMENTS

__all__ = ["SnAp"]


class SnAp(ParamDimVjpAlgorithm):
    """SnAp-n: per-parameter traces widened onto each position's ``n``-step neighbourhood.

    See the module docstring for the math and the cost.

    Parameters
    ----------
    model : brainstate.nn.Module
    n : int
        The order (``>= 1``). ``1`` is the coupled scope (:class:`OSTLRecurrent`, no widening);
        from the group's diameter on, it is full within-group RTRL.
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
        The estimator (see :class:`~braintrace.ETraceVjpAlgorithm`).
    fast_solve : bool
        Use the primitive's closed-form kernels when the library's rules are in force.
    snap_max_jacobian_elements : int
        Ceiling on each widened group's block Jacobian ``P·(K·S)²`` (default ``2**24``).
    **kwargs
        ``trace_dtype``, ``chunked_trace``, ``control_flow``, ``random_feedback_key``: as
        :class:`ParamDimVjpAlgorithm`.

    Attributes
    ----------
    n : int
        The requested order.
    config : ETraceConfig
        ``ETraceConfig(recurrence_scope='sparse_n', sparse_n=n)``: OSTLRecurrent's coupled
        coordinate at ``n = 1``.

    Raises
    ------
    TypeError
        For a non-integer (or ``bool``) ``n`` or ceiling, or a ``config`` (the coordinate of
        SnAp is fixed by ``n``).
    ValueError
        For ``n < 1`` or a ceiling below 1.
    NotImplementedError
        At compile time, for a relation whose primitive is not SnAp-anchored (embeddings,
        shared-axis einsums, user primitives without ``snap_anchor``; at every ``n``), or
        hidden states inside a descended scan.
    NotSupportedError
        At compile time, when a group's ``P·(K·S)²`` exceeds the ceiling.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'snap', jnp.ones(3))
    >>> learner.n, learner.graph.hidden_groups[0].snap.num_neighbour
    (2, 4)
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.SnAp, jnp.ones(3), n=1)
    >>> learner.graph.hidden_groups[0].snap is None  # the coupled scope: nothing widened
    True
    >>> learner.config == braintrace.ETraceConfig(recurrence_scope='coupled')
    True
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if "config" in kwargs:
            raise TypeError(
                f"{cls.__name__} takes no config: its coordinate is fixed (per-parameter traces, "
                f"jacobian recursion, recurrence_scope='sparse_n' with the order n). Choose the "
                f"order with n=..., or pass the config to ParamDimVjpAlgorithm instead.")
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        model: brainstate.nn.Module,
        n: int = 2,
        name: str | None = None,
        vjp_method: str = "single-step",
        fast_solve: bool = True,
        snap_max_jacobian_elements: int = DEFAULT_MAX_JACOBIAN_ELEMENTS,
        **kwargs: Any,
    ) -> None:
        order = _positive_int(n, "n", "n = 1 is the coupled scope; the diagonal scope is not n = 0")
        config = ETraceConfig(recurrence_scope="sparse_n", sparse_n=order)  # n = 1 is 'coupled'
        super().__init__(model, name=name, vjp_method=vjp_method, fast_solve=fast_solve, config=config,
                         snap_max_jacobian_elements=snap_max_jacobian_elements, **kwargs)
        self.n = n
        self._requested_order = order
        # The compiler checks every relation's anchor at the requested order, also at n = 1.
        self.vjp_executor.sparse_n = order


def _positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"SnAp: {name} must be an int, got the bool {value!r}.")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"SnAp: {name} must be an int, got {type(value).__name__} {value!r}.") from None
    if number < 1:
        raise ValueError(f"SnAp: {name} must be >= 1 ({hint}), got {number}.")
    return number


SnAp.__module__ = "braintrace"

"""``EProp``: eligibility propagation, D-RTRL with a filtered trace and optional random feedback.

EProp is a coordinate of the per-parameter engine (:class:`~braintrace.ParamDimVjpAlgorithm`):
``ETraceConfig(learning_signal=..., trace_filter='kappa', kappa=κ)``. It keeps the D-RTRL trace
``ε^t = D^t ε^{t-1} + diag(df^t) ⊗ x^t`` and adds two knobs:

* ``kappa_filter_decay = κ``: the gradient reads the *filtered* trace
  ``ē^t = κ ē^{t-1} + ε^t`` instead of ``ε^t``; the estimate of a loss at step ``t`` is
  ``⟨s^t, ē^t⟩`` with ``s^t`` the learning signal.
* ``feedback='random'``: the learning signal of a hidden group is not ``g = ∂L/∂h^t`` but
  its normalised projection through a fixed random matrix ``B`` per group,
  ``L[..., k, a] = Σ_l ŝ[..., l, a] B[l, k]`` with ``ŝ = g / (‖g‖₂ over the hidden axis + 1e-8)``.

What a call adds to the engine's gradient (see :mod:`braintrace._algorithm.engine.base`; the one-step gradient of every
parameter is exact and already holds the same-step path ``W -> y -> h^t -> loss``):

* single-step, symmetric feedback: the history of the estimate,
  ``⟨Dᵀ g, ε^{t-1}⟩ + κ ⟨g, ē^{t-1}⟩`` (with ``κ = 0`` this is exactly D-RTRL);
* single-step, random feedback: the estimate with the random signal replaces the same-step
  relation path, ``⟨L, ē^t⟩ − ⟨g, ε^t⟩ + ⟨Dᵀ g, ε^{t-1}⟩`` (the last two terms remove
  the autodiff's ``⟨g, diag(df) ⊗ x⟩``);
* multi-step: the exact gradient within the window plus ``⟨s, ē⟩`` at the state entering the
  window (zero for the first window after a reset).

The filter advances in the forward pass, once per time step, whether or not a gradient is
taken (``reset_state`` zeroes it).

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
>>> learner = braintrace.compile(Leaky(), braintrace.EProp, jnp.ones(3), kappa_filter_decay=0.5)
>>> loss = lambda x: learner(x).sum()
>>> g1 = brainstate.transform.grad(loss, learner.param_states)(jnp.ones(3))[('w',)]
>>> g2 = brainstate.transform.grad(loss, learner.param_states)(jnp.ones(3))[('w',)]
>>> float(g1[0, 0]), float(g2[0, 0])  # 1, then 1 + D·ε + κ·ē = 1 + 0.5 + 0.5
(1.0, 2.0)
"""

from __future__ import annotations

from typing import Any

import brainstate

from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._algorithm.param_trace.d_rtrl import ParamDimVjpAlgorithm

__all__ = ["EProp"]


class EProp(ParamDimVjpAlgorithm):
    """Eligibility propagation (see the module docstring).

    Parameters
    ----------
    model : brainstate.nn.Module
    feedback : {'symmetric', 'random'}
        ``'symmetric'``: the learning signal is ``∂L/∂h``. ``'random'``: its normalised
        projection through a fixed random ``(n, n)`` matrix per hidden group (``n`` the last
        axis of the group's shape), drawn at compilation from ``random_feedback_key``.
    kappa_filter_decay : float
        ``κ`` of the trace filter ``ē ← κ ē + ε``, ``0 ≤ κ < 1`` (``0``: no filter).
    random_feedback_key : int or PRNG key, optional
        Required with ``feedback='random'``.
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
    fast_solve : bool
    trace_dtype : dtype, optional
    chunked_trace : bool
    control_flow : ControlFlowPolicy, optional
    snap_max_jacobian_elements : int
        Keyword options forwarded to :class:`ParamDimVjpAlgorithm`.

    Attributes
    ----------
    config : ETraceConfig
        ``learning_signal='random_feedback'`` with ``feedback='random'``, and
        ``trace_filter='kappa', kappa=κ`` when ``κ > 0``.

    Raises
    ------
    ValueError
        For an unknown ``feedback``, ``'random'`` without a key, or ``κ`` outside ``[0, 1)``.
    TypeError
        For a ``config`` (EProp's coordinate is given by ``feedback`` and ``kappa_filter_decay``).

    Notes
    -----
    With ``κ = 0`` and symmetric feedback EProp is D-RTRL exactly. The random feedback
    projects the back-propagated ``∂L/∂h`` (only its scale is normalised away), as upstream
    braintrace does; the matrix is square, ``hidden × hidden``.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.EProp, jnp.ones(3),
    ...                              feedback='random', random_feedback_key=0, kappa_filter_decay=0.5)
    >>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    >>> learner.config.describe()
    "trace_factorization='per_param', learning_signal='random_feedback', trace_filter='kappa', kappa=0.5"
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        feedback: str = "symmetric",
        kappa_filter_decay: float = 0.0,
        random_feedback_key: Any = None,
        name: str | None = None,
        vjp_method: str = "single-step",
        fast_solve: bool = True,
        **kwargs: Any,
    ) -> None:
        if "config" in kwargs:
            raise TypeError(
                "EProp takes no config: its coordinate is given by feedback and kappa_filter_decay. "
                "Pass a config to ParamDimVjpAlgorithm instead.")
        if feedback not in ("symmetric", "random"):
            raise ValueError(f"EProp: feedback must be 'symmetric' or 'random', got {feedback!r}.")
        if feedback == "random" and random_feedback_key is None:
            raise ValueError(
                "EProp: feedback='random' needs random_feedback_key (an int seed or a PRNG key) to "
                "draw the fixed feedback matrices, e.g. EProp(model, 'random', random_feedback_key=0)."
            )
        kappa = _check_kappa(kappa_filter_decay)
        config = ETraceConfig(
            learning_signal="random_feedback" if feedback == "random" else "symmetric",
            trace_filter="kappa", kappa=kappa)  # κ = 0 is canonically trace_filter='none'
        super().__init__(model, name=name, vjp_method=vjp_method, fast_solve=fast_solve, config=config,
                         random_feedback_key=random_feedback_key, **kwargs)
        self.feedback = feedback
        self.kappa_filter_decay = kappa


EProp.__module__ = "braintrace"


def _check_kappa(kappa: Any) -> float:
    if isinstance(kappa, bool) or not isinstance(kappa, (int, float)) or not 0.0 <= float(kappa) < 1.0:
        raise ValueError(
            f"EProp: kappa_filter_decay must be a number with 0 <= kappa < 1 (0 turns the filter "
            f"off), got {kappa!r}."
        )
    return float(kappa)

"""``EProp``: eligibility propagation, D-RTRL with a filtered trace and optional random feedback.

EProp keeps the D-RTRL trace ``ε^t = D^t ε^{t-1} + diag(df^t) ⊗ x^t`` and adds two knobs:

* ``kappa_filter_decay = κ``: the gradient reads the *filtered* trace
  ``ē^t = κ ē^{t-1} + ε^t`` instead of ``ε^t``; the estimate of a loss at step ``t`` is
  ``⟨s^t, ē^t⟩`` with ``s^t`` the learning signal.
* ``feedback='random'``: the learning signal of a hidden group is not ``g = ∂L/∂h^t`` but
  its normalised projection through a fixed random matrix ``B`` per group,
  ``L[..., k, a] = Σ_l ŝ[..., l, a] B[l, k]`` with ``ŝ = g / (‖g‖₂ over the hidden axis + 1e-8)``.

What a call adds to the engine's gradient (see :mod:`.base`; the one-step gradient of every
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

from typing import Any, NamedTuple, Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.d_rtrl import ParamDimVjpAlgorithm
from braintrace._algorithm.snn_helpers import FixedRandomFeedback

__all__ = ["EProp", "LearningSignalDRTRL", "SignalPair", "project_feedback"]

Path = tuple[Any, ...]
Traces = dict[Any, dict[str, jax.Array]]


class SignalPair(NamedTuple):
    """A group's autodiff signal ``g = ∂L/∂h`` next to the learning signal that replaces it."""

    autodiff: jax.Array
    learning: jax.Array


class LearningSignalDRTRL(ParamDimVjpAlgorithm):
    """D-RTRL whose trace term may read a filtered trace and a replaced learning signal.

    Subclasses set :attr:`kappa` (the trace filter, ``0`` for none) and override
    :meth:`_learning_signals` to replace ``g``; :attr:`replaces_signal` tells the engine whether
    they do (so the same-step relation path of the autodiff gradient is swapped out).
    """

    kappa: float = 0.0
    # The trace term reads a filtered trace and a replaced signal, not ⟨∂L/∂h^t, x ⊗ df⟩.
    _history_holds_same_step = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trace_filters: dict[Any, brainstate.ShortTermState] = {}

    @property
    def replaces_signal(self) -> bool:
        return False

    def _learning_signals(self, signals: Sequence[jax.Array], args: Any) -> list[jax.Array]:
        return list(signals)

    # --- trace storage: (ε, ē) when filtered ----------------------------------------------

    def init_etrace_state(self, *args: Any, **kwargs: Any) -> None:
        super().init_etrace_state(*args, **kwargs)
        self._trace_filters = {}
        if self.kappa > 0:
            self._trace_filters = {
                k: brainstate.ShortTermState(jax.tree.map(jnp.zeros_like, st.value))
                for k, st in self.etrace_bwg.items()
            }

    def _get_etrace_data(self) -> Any:
        eps = super()._get_etrace_data()
        if not self._trace_filters:
            return eps
        return {"eps": eps, "filt": {k: st.value for k, st in self._trace_filters.items()}}

    def _assign_etrace_data(self, etrace_vals: Any) -> None:
        if not self._trace_filters:
            super()._assign_etrace_data(etrace_vals)
            return
        super()._assign_etrace_data(etrace_vals["eps"])
        for k, v in etrace_vals["filt"].items():
            self._trace_filters[k].value = v

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        """D-RTRL's reset (traces and step counter) plus zeroed filters of the traces' shapes."""
        super().reset_state(batch_size, **kwargs)
        for key, st in self._trace_filters.items():
            st.value = jax.tree.map(jnp.zeros_like, self.etrace_bwg[key].value)

    def _filter(self, filt: Traces, eps: Traces) -> Traces:
        kappa = self.kappa
        return {k: jax.tree.map(lambda f, e: (kappa * f + e).astype(f.dtype), filt[k], eps[k]) for k in filt}

    def _update_etrace_data(
        self, running_index: Any, etrace_vals_util_t_1: Any, hid2weight_jac_single_or_multi_times: Any,
        hid2hid_jac_single_or_multi_times: Any, weight_vals: Any, input_is_multi_step: bool,
    ) -> Any:
        if not self._trace_filters:
            return super()._update_etrace_data(
                running_index, etrace_vals_util_t_1, hid2weight_jac_single_or_multi_times,
                hid2hid_jac_single_or_multi_times, weight_vals, input_is_multi_step,
            )
        xs, dfs = hid2weight_jac_single_or_multi_times
        Ds = hid2hid_jac_single_or_multi_times
        if input_is_multi_step:
            stepper = self._make_etrace_stepper(weight_vals)
            rolled, _ = jax.lax.scan(stepper, etrace_vals_util_t_1, (xs, dfs, Ds))
            return rolled
        eps = self._step_all(etrace_vals_util_t_1["eps"], xs, dfs, Ds, weight_vals)
        return {"eps": eps, "filt": self._filter(etrace_vals_util_t_1["filt"], eps)}

    def _make_etrace_stepper(self, weight_vals: Any) -> Any:
        if not self._trace_filters:
            return super()._make_etrace_stepper(weight_vals)

        # The filter needs every step's trace, so windows always roll step by step.
        def stepper(carry: Any, jac: Any) -> tuple[Any, None]:
            xs, dfs, Ds = jac
            eps = self._step_all(carry["eps"], xs, dfs, Ds, weight_vals)
            return {"eps": eps, "filt": self._filter(carry["filt"], eps)}, None

        return stepper

    # --- the gradient ---------------------------------------------------------------------

    def _trace_for_backward(self, old_etrace: Any, new_etrace: Any, jac: Any, single_step: bool) -> Any:
        # (D-RTRL's residual, ē^{t-1}, ē^t, ε^t): only what the configured terms read is kept.
        filtered = bool(self._trace_filters)
        old_eps = old_etrace["eps"] if filtered else old_etrace
        new_eps = new_etrace["eps"] if filtered else new_etrace
        if not single_step:
            # The trace term of the state entering the window: the (filtered) entering trace.
            entering = old_etrace["filt"] if filtered else old_etrace
            return super()._trace_for_backward(entering, new_eps, jac, False), None, None, None
        base = super()._trace_for_backward(old_eps, new_eps, jac, True)
        if not self.replaces_signal:
            return base, old_etrace["filt"] if filtered else None, None, None
        return base, None, new_etrace["filt"] if filtered else new_eps, new_eps

    def _with_previous_signal(self, trace_for_bwd: Any, previous: list[Any]) -> Any:
        base, *rest = trace_for_bwd
        return (super()._with_previous_signal(base, previous), *rest)

    def _compute_learning_signal(self, dl_to_hidden_from_autodiff: list[Any], args: Any) -> list[Any]:
        if not self.replaces_signal:
            return dl_to_hidden_from_autodiff
        learning = self._learning_signals(dl_to_hidden_from_autodiff, args)
        return [SignalPair(g, s) for g, s in zip(dl_to_hidden_from_autodiff, learning)]

    def _solve_weight_gradients(
        self, running_index: Any, etrace_h2w_at_t: Any, dl_to_hidden_groups: Sequence[Any],
        weight_vals: dict[Path, Any], dl_to_nonetws_at_t: dict[Path, Any], dl_to_etws_at_t: dict[Path, Any],
    ) -> dict[Path, Any]:
        base, old_filt, new_filt, new_eps = etrace_h2w_at_t
        if self.replaces_signal:
            g = [p.autodiff for p in dl_to_hidden_groups]
            s = [p.learning for p in dl_to_hidden_groups]
        else:
            g = s = list(dl_to_hidden_groups)
        solve = super()._solve_weight_gradients
        if not self.vjp_executor.is_single_step_vjp:  # multi-step: ⟨s, (filtered) entering trace⟩
            return solve(running_index, base, s, weight_vals, dl_to_nonetws_at_t, dl_to_etws_at_t)
        # D-RTRL's single-step history, ⟨Dᵀ g, ε^{t-1}⟩.
        grads = solve(running_index, base, g, weight_vals, dl_to_nonetws_at_t, dl_to_etws_at_t)
        if not self.replaces_signal:
            if old_filt is not None:  # + κ ⟨g, ē^{t-1}⟩
                grads = solve(running_index, (old_filt, None), [self.kappa * x for x in g], weight_vals, {}, grads)
            return grads
        # Swap the same-step relation path: + ⟨s, ē^t⟩ − ⟨g, ε^t⟩ (ē = ε without a filter).
        grads = solve(running_index, (new_filt, None), s, weight_vals, {}, grads)
        return solve(running_index, (new_eps, None), [-x for x in g], weight_vals, {}, grads)


class EProp(LearningSignalDRTRL):
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
        Keyword options forwarded to :class:`ParamDimVjpAlgorithm`.

    Raises
    ------
    ValueError
        For an unknown ``feedback``, ``'random'`` without a key, or ``κ`` outside ``[0, 1)``.

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
        if feedback not in ("symmetric", "random"):
            raise ValueError(f"EProp: feedback must be 'symmetric' or 'random', got {feedback!r}.")
        if feedback == "random" and random_feedback_key is None:
            raise ValueError(
                "EProp: feedback='random' needs random_feedback_key (an int seed or a PRNG key) to "
                "draw the fixed feedback matrices, e.g. EProp(model, 'random', random_feedback_key=0)."
            )
        kappa = _check_kappa(kappa_filter_decay)
        super().__init__(model, name=name, vjp_method=vjp_method, fast_solve=fast_solve, **kwargs)
        self.feedback = feedback
        self.kappa_filter_decay = kappa
        self.kappa = kappa
        self.random_feedback_key = random_feedback_key
        self._feedback_matrices: dict[int, FixedRandomFeedback] = {}

    @property
    def replaces_signal(self) -> bool:
        return self.feedback == "random"

    def init_etrace_state(self, *args: Any, **kwargs: Any) -> None:
        """D-RTRL traces, the trace filters (``κ > 0``) and the random feedback matrices."""
        super().init_etrace_state(*args, **kwargs)
        self._feedback_matrices = {}
        if self.feedback != "random":
            return
        with brainstate.random.seed_context(self.random_feedback_key):
            for rel in self.graph.hidden_param_op_relations:
                for group in rel.hidden_groups:
                    if group.index not in self._feedback_matrices:
                        n = group.varshape[-1] if group.varshape else 1
                        self._feedback_matrices[group.index] = FixedRandomFeedback(
                            n, n, key=brainstate.random.split_key(), init_scale=0.1
                        )

    def _learning_signals(self, signals: Sequence[jax.Array], args: Any) -> list[jax.Array]:
        out = []
        for index, s in enumerate(signals):
            fb = self._feedback_matrices.get(index)
            out.append(s if fb is None else project_feedback(s, fb.B))
        return out


EProp.__module__ = "braintrace"


def project_feedback(signal: jax.Array, B: jax.Array) -> jax.Array:
    """``L[..., k, a] = Σ_l ŝ[..., l, a] B[l, k]`` with ``ŝ`` normalised over the hidden axis."""
    if signal.ndim < 2:  # a scalar group has one hidden unit
        signal = signal[None]
        return project_feedback(signal, B)[0]
    norm = jnp.linalg.norm(signal, axis=-2, keepdims=True)
    unit = signal / (norm + 1e-8)
    return jnp.einsum("...la,lk->...ka", unit, B.astype(signal.dtype))


def _check_kappa(kappa: Any) -> float:
    if isinstance(kappa, bool) or not isinstance(kappa, (int, float)) or not 0.0 <= float(kappa) < 1.0:
        raise ValueError(
            f"EProp: kappa_filter_decay must be a number with 0 <= kappa < 1 (0 turns the filter "
            f"off), got {kappa!r}."
        )
    return float(kappa)

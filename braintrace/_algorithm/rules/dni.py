"""``DNI``: D_RTRL with a synthetic gradient of the future loss injected at every window exit.

A multi-step learner sees the loss of its window only: a call over steps ``[a_k, b_k)``
differentiates that window exactly and meets the trace entering it with the exact ``∂L/∂h`` at
its entry. What the window's parameters do to the loss *after* ``b_k`` reaches the parameters
some relation reads through their eligibility traces (the next windows meet them), but never the
plain parameters (an input weight outside any ETP operation): they are truncated at the window.

DNI (decoupled neural interfaces; Jaderberg et al., 2017) adds at each window exit an estimate
``g_k ≈ ∂(Σ_{t ≥ b_k} l_t)/∂h^{b_k}`` of the strictly future gradient, computed by a
:class:`~braintrace.SyntheticGradient` from the exit hidden values, as an extra cotangent on
``h^{b_k}`` pushed through the window's transposed computation (a second linear pass, traced
only when a synthesiser is attached, which :meth:`DNI.update` requires). It is routed:

* the boundary learning signal and the gradients of relation parameters: first pass only (their
  cross-window credit is already in the trace; adding ``g_k`` would count it twice), so they are
  bit-identical to multi-step D_RTRL;
* plain parameters, input cotangents, other states' cotangents and the returned hidden cotangent
  (the previous window's input, and :func:`~braintrace.train_synthetic_gradient`'s regression
  target): both passes.

With the exact future gradient injected, the plain parameters' summed window gradients telescope
to BPTT; with the default zero synthesiser DNI is multi-step D_RTRL. Its coordinate is D_RTRL's
with ``learning_signal='bootstrapped'``.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'dni', jnp.ones(3))
>>> learner.group_signal_shapes()
{0: (4, 1)}
>>> learner.attach_synthesizer(braintrace.SyntheticGradient(learner.group_signal_shapes(), scale=0.1))
>>> xs = braintrace.MultiStepData(jnp.ones((2, 3)))
>>> grads = brainstate.transform.grad(lambda: learner(xs).sum(), learner.param_states)()
>>> grads[('W', 'weight')]['weight'].shape
(7, 4)
>>> learner.config.learning_signal
'bootstrapped'
"""

from __future__ import annotations

from typing import Union

import brainstate
import brainunit as u
import jax
from jax.typing import DTypeLike

from braintrace._algorithm.engine.config import ETraceConfig, engine_config
from braintrace._algorithm.param_trace.d_rtrl import ParamDimVjpAlgorithm
from braintrace._algorithm.engine.input_data import has_multistep_data, sequence_length, split_input_data_types
from braintrace._algorithm.rules.synthetic_gradient import SynthParams, SyntheticGradient
from braintrace._compiler import DEFAULT_MAX_JACOBIAN_ELEMENTS, ControlFlowPolicy
from braintrace._errors import internal_error
from braintrace._typing import Path, PyTree

__all__ = ["DNI", "window_length"]


#: DNI's coordinate: D_RTRL's, with the synthetic future gradient as the learning signal.
DNI_CONFIG = ETraceConfig(learning_signal="bootstrapped")


#: A hidden state's value: an array, or a ``brainunit`` quantity.
HiddenValue = Union[jax.Array, u.Quantity]


def window_length(args: tuple[PyTree, ...]) -> int:
    """The number of steps a call runs: the :class:`MultiStepData` leading axis, ``1`` for a plain call."""
    if not has_multistep_data(*args):
        return 1
    return sequence_length(split_input_data_types(*args)[1])


class DNI(ParamDimVjpAlgorithm):
    """Multi-step D_RTRL plus a synthetic future gradient at every window exit (see the module docstring).

    Parameters
    ----------
    model : brainstate.nn.Module
    synthesizer : SyntheticGradient, optional
        The estimator of the future gradient; attach one later with :meth:`attach_synthesizer`
        (needed before the first call).
    name : str, optional
    vjp_method : {'multi-step'}
        The synthetic gradient is injected at window exits, so only multi-step windows (a
        :class:`~braintrace.MultiStepData` call, or a plain call as a window of one step).
    fast_solve, trace_dtype, chunked_trace, control_flow, snap_max_jacobian_elements
        As :class:`~braintrace.ParamDimVjpAlgorithm`.

    Attributes
    ----------
    synthesizer : SyntheticGradient or None
    config : ETraceConfig
        ``ETraceConfig(learning_signal='bootstrapped')``.

    Raises
    ------
    ValueError
        ``vjp_method='single-step'``; at :meth:`attach_synthesizer` (or compile), a synthesiser
        whose groups or shapes differ from :meth:`group_signal_shapes`; at a call, a window
        length other than the synthesiser's ``fitted_chunk_size``, or an estimate whose shape
        is not the group's ``(*varshape, S)``.
    RuntimeError
        A call with no synthesiser attached.

    Notes
    -----
    Routing is by parameter path: a parameter that some relation reads gets no future credit
    for any other, plain, use of it; and only hidden states receive the injection (other
    persistent states do not). The synthesiser's states are not the model's: save them
    (``states_dict()``) next to a checkpoint of the learner.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.DNI, jnp.ones(3))
    >>> learner.vjp_method, learner.synthesizer is None
    ('multi-step', True)
    >>> learner.attach_synthesizer(braintrace.SyntheticGradient({0: (4, 1)}))  # zero: plain D_RTRL
    >>> learner(jnp.ones(3)).shape  # a plain call is a window of one step
    (4,)
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        synthesizer: SyntheticGradient | None = None,
        name: str | None = None,
        vjp_method: str = "multi-step",
        fast_solve: bool = True,
        trace_dtype: DTypeLike | None = None,
        chunked_trace: bool = True,
        control_flow: ControlFlowPolicy | None = None,
        snap_max_jacobian_elements: int = DEFAULT_MAX_JACOBIAN_ELEMENTS,
    ) -> None:
        if vjp_method == "single-step":
            raise ValueError(
                "DNI: vjp_method='single-step' is not supported: the synthetic gradient is injected "
                "at the exit of a multi-step window (pushed back through the window's own steps), and "
                "a single-step learner has no window to push it through. Use vjp_method='multi-step' "
                "(the default); a plain call is then a window of one step.")
        super().__init__(model, name=name, vjp_method=vjp_method, fast_solve=fast_solve,
                         trace_dtype=trace_dtype, chunked_trace=chunked_trace, control_flow=control_flow,
                         snap_max_jacobian_elements=snap_max_jacobian_elements)
        self.synthesizer: SyntheticGradient | None = None
        if synthesizer is not None:
            self.attach_synthesizer(synthesizer)

    def _check_config(self, config: ETraceConfig | None) -> ETraceConfig:
        if config is not None:
            raise TypeError("DNI takes no config: its coordinate is ETraceConfig(learning_signal='bootstrapped').")
        return engine_config(DNI_CONFIG, "per_param", "DNI", ("bootstrapped",))

    # --- the synthesiser ------------------------------------------------------------------

    def group_signal_shapes(self) -> dict[int, tuple[int, ...]]:
        """``{group index: (*varshape, S)}``: the shape of every hidden group's estimate (needs compile)."""
        self._assert_compiled_for("group_signal_shapes")
        return {g.index: (*g.varshape, g.num_state) for g in self.graph.hidden_groups}

    def attach_synthesizer(self, synthesizer: SyntheticGradient) -> None:
        """Use ``synthesizer`` from the next call on; once compiled, its group shapes are checked.

        Raises
        ------
        TypeError
            If it is not a :class:`~braintrace.SyntheticGradient`.
        ValueError
            If its groups or their shapes differ from :meth:`group_signal_shapes`.
        """
        if not isinstance(synthesizer, SyntheticGradient):
            raise TypeError(f"DNI.attach_synthesizer: expected a braintrace.SyntheticGradient (or a subclass), "
                            f"got {type(synthesizer).__name__}.")
        if self.is_compiled:
            self._check_synthesizer_shapes(synthesizer)
        self.synthesizer = synthesizer

    def compile_graph(self, *args: PyTree) -> None:
        super().compile_graph(*args)
        if self.is_compiled and self.synthesizer is not None:
            self._check_synthesizer_shapes(self.synthesizer)

    def _check_synthesizer_shapes(self, synthesizer: SyntheticGradient) -> None:
        expected = self.group_signal_shapes()
        given = synthesizer.group_shapes
        for index in sorted(set(expected) | set(given)):
            if expected.get(index) != given.get(index):
                raise ValueError(
                    f"DNI: the synthesiser's hidden group {index} has shape {given.get(index)}, but the "
                    f"learner's group {index} has shape {expected.get(index)} (None: no such group). Build "
                    f"it as braintrace.SyntheticGradient(learner.group_signal_shapes(), ...).")

    def _get_update_aux(self, args: tuple[PyTree, ...], **options: object) -> PyTree:
        if options:
            return super()._get_update_aux(args, **options)
        synth = self.synthesizer
        if synth is None:
            raise RuntimeError(
                "DNI has no synthesiser: attach one with learner.attach_synthesizer("
                "braintrace.SyntheticGradient(learner.group_signal_shapes())) or pass synthesizer= "
                "to DNI / braintrace.compile.")
        length = window_length(args)
        fitted = synth.fitted_chunk_size
        if fitted is not None and length != fitted:
            raise ValueError(
                f"DNI: the synthesiser was fitted at chunk_size={fitted}, but this call is a window of "
                f"{length} step(s): it predicts the gradient of the loss beyond a window of {fitted}. Drive "
                f"the learner in windows of {fitted} steps, or refit with "
                f"train_synthetic_gradient(learner, inputs, chunk_size={length}).")
        aux = synth.param_values()
        # The exit values have the entry values' shapes: check the estimates now, also for a
        # call that is not differentiated (which never reaches the exit injection).
        jax.eval_shape(lambda a, h: self._group_estimates(a, h), aux,
                       {p: st.value for p, st in self.hidden_states.items()})
        return aux

    def _group_estimates(self, aux: SynthParams, hidden: dict[Path, HiddenValue]) -> dict[int, jax.Array]:
        """The synthesiser's estimate per group from per-path hidden values, shape-checked."""
        synth = self.synthesizer
        if synth is None:
            raise internal_error("a synthesiser estimate without a synthesiser (_get_update_aux refuses those calls)")
        groups = self.graph.hidden_groups
        values = {g.index: g.concat_hidden([u.get_mantissa(hidden[p]) for p in g.hidden_paths]) for g in groups}
        estimates = synth.apply(aux, values)
        for group in groups:
            if group.index not in estimates:
                raise ValueError(f"DNI: the synthesiser gave no estimate for hidden group {group.index}.")
            expected = tuple(jax.numpy.shape(values[group.index]))  # (*varshape, S) as this call sees it
            if tuple(jax.numpy.shape(estimates[group.index])) != expected:
                raise ValueError(
                    f"DNI: the synthesiser's estimate for hidden group {group.index} has shape "
                    f"{tuple(jax.numpy.shape(estimates[group.index]))}, but the group's signal has shape "
                    f"{expected} (*varshape, S).")
        return estimates

    def _exit_cotangent(self, aux: SynthParams, new_hidden: dict[Path, HiddenValue]) -> dict[Path, HiddenValue]:
        estimates = self._group_estimates(aux, new_hidden)
        out: dict[Path, HiddenValue] = {}
        for group in self.graph.hidden_groups:
            estimate = jax.lax.stop_gradient(estimates[group.index])
            for path, piece in zip(group.hidden_paths, group.split_hidden(estimate)):
                out[path] = _like_hidden(piece, new_hidden[path])
        return out


def _like_hidden(estimate: HiddenValue, hidden: HiddenValue) -> HiddenValue:
    """``estimate`` in ``hidden``'s unit (converted, when it carries one) and dtype."""
    if isinstance(hidden, u.Quantity):
        mantissa = estimate.to_decimal(hidden.unit) if isinstance(estimate, u.Quantity) else estimate
        return u.Quantity(mantissa.astype(hidden.mantissa.dtype), unit=hidden.unit)
    if isinstance(estimate, u.Quantity):
        estimate = estimate.to_decimal()
    return estimate.astype(jax.numpy.result_type(hidden))


DNI.__module__ = "braintrace"

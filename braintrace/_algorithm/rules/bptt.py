"""``BPTT``: backpropagation through time, behind the interface of the online learners.

The reference every online learner is compared against. ``braintrace.compile(model, 'bptt', x0,
batch_size=B)`` gives a learner with the same public surface as ``'d_rtrl'`` or ``'eprop'``
(calls, ``reset``, ``param_states``, ``hidden_states``, ``running_index``, the sequence drivers
with their signatures, ``predict``, checkpoints), so switching the name switches a script between
BPTT and online learning.

A call runs one step of the model (or a :class:`~braintrace.MultiStepData` window) and keeps no
traces. The drivers take the exact gradient of the objective the online drivers estimate,
``J = Σ_t mask_t · loss_t`` (divided by ``max(Σ_t mask_t, 1)`` under ``reduction='mean'``),
through the whole loop (:class:`BpttRun`): ``etrace_grad`` is ``jax.grad`` of ``J`` over the
sequence from the current states, and ``etrace_train(update_every=k)`` is truncated BPTT, each
span of ``k`` steps differentiated through itself, the states carried from span to span and the
optimizer applied after each. Only the model's step is compiled (its state tables, see
:func:`~braintrace.extract_module_info`); no weight has to go through an ETP operation.
"""

from __future__ import annotations

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import ETraceAlgorithm
from braintrace._algorithm.engine.compiled_model import check_hidden_shapes, check_step_keeps_hidden_shapes
from braintrace._algorithm.drive.grad_run import GradRun, windows
from braintrace._algorithm.drive.host import Grads
from braintrace._algorithm.drive.finite import Status, StateGuard, advance, all_finite
from braintrace._algorithm.engine.graph_executor import ETraceGraphExecutor, _arg_dtypes, _arg_signature
from braintrace._algorithm.engine.input_data import get_single_step_data, run_model
from braintrace._compiler import ETraceGraph, extract_module_info
from braintrace._typing import Path, PyTree

__all__ = ["BPTT", "BpttRun", "ModelStepExecutor"]


class ModelStepExecutor(ETraceGraphExecutor):
    """The compiled model step of a learner that needs its state tables only (no relation, no group).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> executor = ModelStepExecutor(cell)
    >>> executor.compile_graph(jnp.ones(3))
    >>> list(executor.states), executor.graph.hidden_param_op_relations
    ([('W', 'weight'), ('h',)], ())
    """

    def compile_graph(self, *args: PyTree) -> None:
        """Trace one step for example inputs (multi-step inputs contribute their first step)."""
        args = get_single_step_data(*args)
        minfo = extract_module_info(self.model, *args, control_flow=self.control_flow)
        self._graph = ETraceGraph(minfo, [], {}, (), None)
        self._state_id_to_path = None
        self._out_treedef = minfo.stateful_model.get_out_treedef(*args)
        self._compiled_signature = _arg_signature(args)
        self._compiled_dtypes = _arg_dtypes(args)


class BpttRun(GradRun):
    """The gradient of ``J = Σ_t mask_t · loss_t`` through the whole loop, for the sequence drivers.

    Called as :class:`~braintrace._algorithm.drive.grad_run.GradRun` is, with the same results
    ``(grads, losses, aux, status)``: the step function runs in a scan under one
    ``brainstate.transform.grad``, so the hidden states carry the gradient from step to step.
    Under ``check_finite`` every step is checked as the online drivers check it (and its state
    updates frozen from the first non-finite step on); the gradient, known only once the loop
    has run, is checked last and reported at the last step.
    """

    def __call__(
        self, sequences: tuple[PyTree, ...], mask: jax.Array, steps: jax.Array, status: Status | None = None
    ) -> tuple[Grads, jax.Array, PyTree, Status | None]:
        xs = windows(sequences, self.window)
        mask_rows = mask if self.window is None else mask.reshape((-1, self.window))
        starts = steps if self.window is None else steps[:: self.window]
        entering = Status.fresh() if self.guarded is not None and status is None else status

        def objective() -> tuple[jax.Array, tuple[jax.Array, PyTree, Status | None]]:
            last, (losses, aux) = brainstate.transform.scan(self._scored, entering, (xs, mask_rows, starts))
            return u.math.sum(mask_rows * losses), (losses, aux, last)

        grads, (losses, aux, last) = brainstate.transform.grad(objective, self.weights, has_aux=True)()
        if last is not None:
            last = advance(last, steps[-1], {"gradient": all_finite(grads)})
        return grads, losses, aux, last

    def _scored(
        self, status: Status | None, inputs: tuple[tuple[PyTree, ...], jax.Array, jax.Array]
    ) -> tuple[Status | None, tuple[jax.Array, PyTree]]:
        """One call's ``(loss, aux)``; checked, and its updates frozen once bad, under ``check_finite``."""
        slices, w, step = inputs
        if status is None:
            return None, self._loss(self.step_fn(*slices))
        guard = StateGuard(self.guarded or ())
        entering = [st.value for st in self.weights.values()]
        loss, aux = self._loss(self.step_fn(*slices))
        status = advance(status, step, self._step_checks(slices, w, entering, loss, guard))
        guard.keep_if(status.fine)
        return status, (loss, aux)


class BPTT(ETraceAlgorithm):
    """Backpropagation through time with the online learners' interface (see the module docstring).

    Build it with ``braintrace.compile(model, 'bptt', x0, batch_size=B)`` (or
    ``braintrace.BPTT``). A call is one model step (or a ``MultiStepData`` window) with no
    traces: under a user's own ``grad`` it gives the gradient of that call with the entering
    states held fixed. The drivers take the exact gradient through their loop:

    * :meth:`etrace_grad` returns ``jax.grad`` of the masked, reduced objective ``J`` over the
      sequence, with the arguments, return values and errors of the online drivers; it equals
      an online learner's ``etrace_grad`` wherever that learner is exact. It starts from the
      current states and holds them fixed: unlike an exact online learner, whose traces carry
      the steps of earlier calls, it does not reach into steps driven before the call (reset
      first for the gradient of fresh sequences);
    * :meth:`etrace_train` with ``update_every=k`` is truncated BPTT: the gradient of each span of
      ``k`` steps through that span, the states carried, the optimizer applied after each span;
    * :meth:`etrace_evolve` and :meth:`predict` run the model forward.

    ``chunk_size=k`` hands ``step_fn`` windows of ``k`` steps, as for a multi-step learner
    (``learner(braintrace.MultiStepData(x))``); the gradient is the same exact one.

    Parameters
    ----------
    model : brainstate.nn.Module
        The model; its states are initialised by :func:`braintrace.compile`.
    name : str, optional

    Attributes
    ----------
    vjp_method : str
        ``'multi-step'``: a call may be a window of steps, differentiated exactly.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'bptt', jnp.ones((2, 3)), batch_size=2)
    >>> xs, ys = jnp.ones((6, 2, 3)), jnp.zeros((6, 2, 4))
    >>> def step_fn(x, y):  # one call of this learner per step, as for any learner
    ...     return jnp.mean((learner(x) - y) ** 2)
    >>> grads, loss = learner.etrace_grad(xs, ys, step_fn=step_fn, return_value=True, loss_output='scalar')
    >>> type(learner).__name__, grads[('W', 'weight')]['weight'].shape, int(learner.running_index.value)
    ('BPTT', (7, 4), 6)
    """

    vjp_method = "multi-step"

    def __init__(self, model: brainstate.nn.Module, name: str | None = None) -> None:
        super().__init__(model, ModelStepExecutor(model), name=name)

    @property
    def _seq_run_type(self) -> type[GradRun]:
        return BpttRun

    @property
    def _seq_vjp_method(self) -> str:
        return self.vjp_method

    def compile_graph(self, *args: PyTree) -> None:
        """Compile the model step for example inputs (once): its state tables, no traces."""
        probe = getattr(brainstate.transform, "in_new_state_probe", None)
        if (probe is not None and probe()) or self.is_compiled:
            return
        self._split_cache = None
        self.graph_executor.compile_graph(*args)
        check_step_keeps_hidden_shapes(self.graph.module_info)
        self._split_states()  # the state tables, made once, as the online learners make them
        self.is_compiled = True

    def update(self, *args: PyTree, **options: object) -> PyTree:
        """One call: the model on ``args`` (one step, or a ``MultiStepData`` window), no traces."""
        if self._forward_only:
            return self._forward_step(args)
        self.calls_traced += 1
        self._assert_compiled_for("BPTT")
        if options:
            raise TypeError(
                f"BPTT.update() got keyword option(s) {', '.join(f'{k}=' for k in sorted(options))}: BPTT has "
                f"no options (a learning rule's, such as modulator=, do not apply), and model inputs are "
                f"passed positionally, learner(x).")
        self._check_traces_and_states()
        self.graph_executor._check_call_args(args)
        check_hidden_shapes(self.graph.module_info, {p: st.value for p, st in self.hidden_states.items()})
        out = run_model(self.model4compile, args)
        ri = self.running_index.value + 1
        self.running_index.value = jax.lax.stop_gradient(jnp.where(ri >= 0, ri, 0))
        return out

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zero the step counter (BPTT keeps no traces; the model's states are not touched)."""
        self.running_index.value = jnp.zeros_like(self.running_index.value)

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> PyTree:
        raise ValueError(
            "BPTT keeps no eligibility traces: it differentiates through the whole loop. Use an online "
            "learner (braintrace.compile(model, 'd_rtrl', ...)) to inspect traces."
        )


BPTT.__module__ = "braintrace"

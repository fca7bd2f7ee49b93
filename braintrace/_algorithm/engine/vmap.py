"""``ETraceVmap``: a learner mapped over a batch of independent samples, with the sequence drivers.

``braintrace.compile(..., vmap=True)`` builds per-sample hidden states and traces and returns
``ETraceVmap(learner, vmap_states='new')``. The parameters stay shared by all lanes, so the
online estimate for a loss summed over lanes is the sum of the per-lane estimates.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import ETraceAlgorithm
from braintrace._algorithm.engine.call_lock import serialised
from braintrace._algorithm.drive.host import SequenceRunType, StepFn
from braintrace._algorithm.engine.eager_calls import watched_call
from braintrace._algorithm.drive.predict import forward_step, predict_sequences
from braintrace._algorithm.drive.sequence import SequenceDriverMixin
from braintrace._algorithm.engine.sharding import ShardingPlan, sharded_call
from braintrace._compiler import CompilationReport, ETraceGraph
from braintrace._typing import Path, PyTree

__all__ = ["ETraceVmap"]


class ETraceVmap(SequenceDriverMixin, brainstate.nn.Vmap):
    """A learner vectorised over the batch axis (``brainstate.nn.Vmap``) with the sequence drivers.

    Call it with batched inputs ``(batch, ...)``; ``.module`` is the unbatched learner, whose
    per-sample states are mapped. Drive whole sequences through **this wrapper**:
    ``vmapped.etrace_grad(xs, ys, step_fn=...)`` with a ``step_fn`` that calls ``vmapped(x)``
    once per step. Driving ``vmapped.module.etrace_grad(...)``, or calling ``.module`` inside
    ``step_fn``, runs the unbatched learner on batched data and gives per-lane-wrong results.
    Window mode (``chunk_size >= 2``) is refused: the map's ``in_axes=0`` would take a window's
    time axis for the batch; use ``chunk_size=None``, or compile the batched learner
    (``vmap=False``) for windows.

    The read-only diagnostics ``graph``, ``report``, ``show_graph``, ``param_states``,
    ``hidden_states`` and ``vjp_method`` are forwarded from ``.module``.

    Parameters
    ----------
    module : ETraceAlgorithm
        The compiled unbatched learner.
    **kwargs
        Forwarded to ``brainstate.nn.Vmap`` (``in_axes``, ``vmap_states``, ...).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> vmapped = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((2, 3)),
    ...                              batch_size=2, vmap=True)
    >>> type(vmapped).__name__, type(vmapped.module).__name__, vmapped.vjp_method
    ('ETraceVmap', 'D_RTRL', 'single-step')
    >>> def step_fn(x, y):  # sums the lanes' losses: the estimate is the sum of the per-lane estimates
    ...     return jnp.sum((vmapped(x) - y) ** 2)
    >>> grads = vmapped.etrace_grad(jnp.ones((5, 2, 3)), jnp.zeros((5, 2, 4)), step_fn=step_fn, reduction='sum')
    >>> grads[('W', 'weight')]['weight'].shape  # the shared parameters
    (7, 4)
    """

    _seq_is_vmapped: ClassVar[bool] = True
    #: The compiled unbatched learner whose lanes this wrapper maps (set by ``brainstate.nn.Vmap``).
    module: ETraceAlgorithm

    def __init__(
        self, module: ETraceAlgorithm, *, vmap_states: brainstate.typing.Filter | None = None, **kwargs: object,
    ) -> None:
        super().__init__(module, vmap_states=vmap_states, **kwargs)
        self._lane_states = vmap_states
        self._calls_traced = 0  # the wrapper's own calls (the vmap may trace the learner's more than once)
        #: Set while :meth:`predict` runs: a call maps the model forward over ``_forward_lanes``
        #: (the per-sample states of the run; ``None``: one unbatched sequence).
        self._forward_only = False
        self._forward_lanes: Mapping[Path, brainstate.State] | None = None

    #: Where the states live on a device mesh (set by ``braintrace.compile(..., sharding=...)``).
    sharding_plan: ShardingPlan | None = None

    @serialised
    def __call__(self, *args: PyTree, **options: object) -> PyTree:
        """:meth:`update`, its inputs and written states constrained to a sharding's placement (if any).

        Called eagerly, the third call warns once (:class:`~braintrace.EagerCallWarning`), as
        :meth:`ETraceAlgorithm.__call__ <braintrace.ETraceAlgorithm.__call__>` does.
        """
        return watched_call(self, lambda: sharded_call(self.sharding_plan, self.update, args, options),
                            lambda out: (args, options, out, self.module.running_index.value))

    def update(self, *args: PyTree, **options: object) -> PyTree:
        """One call of every lane; keyword options (``modulator=``) are mapped over the lanes too.

        An option's every leaf carries the lanes on axis 0, like the inputs: a value shared by all
        lanes is broadcast first (``jnp.full((batch_size,), r)``).

        Raises
        ------
        ValueError
            For an option leaf without the lanes on axis 0.
        """
        self._calls_traced += 1
        if self._forward_only:
            return forward_step(self.module.model4compile, args, self._forward_lanes, self.in_axes, self.out_axes)
        if not options:
            return super().update(*args)
        lanes = self._lane_count()
        for name, value in options.items():
            for leaf in jax.tree.leaves(value):
                if jnp.ndim(leaf) == 0 or (lanes is not None and jnp.shape(leaf)[0] != lanes):
                    raise ValueError(
                        f"ETraceVmap: the option {name}= is mapped over the {lanes} lanes like the inputs, so "
                        f"its leaves need the lanes on axis 0; got shape {tuple(jnp.shape(leaf))}. Broadcast a "
                        f"shared value first, e.g. {name}=jnp.full(({lanes},), value).")
        learner = self.module
        lanes_states = learner.states(self._lane_states)

        @brainstate.transform.vmap(in_axes=(self.in_axes if isinstance(self.in_axes, int) else tuple(self.in_axes), 0),
                                   out_axes=self.out_axes, in_states=lanes_states, out_states=lanes_states)
        def run(call_args: tuple[PyTree, ...], call_options: dict[str, object]) -> PyTree:
            return learner(*call_args, **call_options)

        return run(args, options)

    def _lane_count(self) -> int | None:
        leaves = jax.tree.leaves(self.module.states(self._lane_states).to_dict_values())
        sizes = {int(jnp.shape(leaf)[0]) for leaf in leaves if jnp.ndim(leaf)}
        return sizes.pop() if len(sizes) == 1 else None

    @serialised
    def reset(self) -> None:
        """Start new sequences in every lane: :meth:`ETraceAlgorithm.reset` of each sample.

        Every per-sample state is re-initialised in place (into the state objects the learner
        was compiled with) and the traces and counters are zeroed; the shared parameters are
        not touched. Works eagerly and inside ``jit``.

        Examples
        --------
        >>> import jax.numpy as jnp, braintrace
        >>> vmapped = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL,
        ...                              jnp.ones((2, 3)), batch_size=2, vmap=True)
        >>> _ = vmapped(jnp.ones((2, 3)))
        >>> vmapped.reset()
        >>> float(abs(vmapped.hidden_states[('h',)].value).sum())
        0.0
        """
        learner = self.module
        lanes = learner.states(self._lane_states)

        @brainstate.transform.vmap(in_states=lanes, out_states=lanes, axis_size=self._lane_count())
        def reset_lanes() -> None:
            learner.reset()

        reset_lanes()
        if self.sharding_plan is not None:
            self.sharding_plan.place()

    @serialised
    def predict(self, *sequences: PyTree, step_fn: StepFn | None = None, time_axis: int = 0) -> PyTree:
        """The model's per-step outputs over a batch of sequences, mapped over the batch, from fresh states.

        :meth:`ETraceAlgorithm.predict <braintrace.ETraceAlgorithm.predict>` for the vmapped
        learner: the model (written for one sample) runs over every sequence of the batch, at
        any batch size, each sample from states made afresh by its ``init_state``; a single
        sequence without a batch axis runs unmapped. ``step_fn`` calls this wrapper once per
        step, as in training. The learner is left exactly as it was.

        Parameters
        ----------
        *sequences : pytree
            Time-major ``(T, batch, ...)`` (``time_axis=0``) or batch-major ``(batch, T, ...)``
            (``time_axis=1``) sequences; the first is the model's input.
        step_fn : callable, optional
            ``step_fn(*slices) -> output``, calling this wrapper once. Default: the output for
            the first sequence's slice.
        time_axis : {0, 1}
            The layout of the sequences, and of the outputs returned.

        Returns
        -------
        pytree
            The per-step outputs, ``(T, batch, ...)`` or, with ``time_axis=1``, ``(batch, T, ...)``.

        Raises
        ------
        TypeError, ValueError
            As :meth:`ETraceAlgorithm.predict <braintrace.ETraceAlgorithm.predict>`.

        Examples
        --------
        >>> import jax.numpy as jnp, braintrace
        >>> vmapped = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones((2, 3)),
        ...                              batch_size=2, vmap=True)
        >>> vmapped.predict(jnp.ones((6, 5, 3))).shape  # 5 sequences, mapped over the batch
        (6, 5, 4)
        """
        return predict_sequences(self, self.module, sequences, step_fn, time_axis, mapped=True)

    @property
    def _seq_param_states(self) -> Mapping[Path, brainstate.ParamState]:
        return self.module.param_states

    @property
    def _seq_batch_size(self) -> int | None:
        return self._lane_count()

    @property
    def _seq_run_type(self) -> SequenceRunType:
        # The lanes' learner decides how a sequence's gradient is taken (BPTT: through the whole loop).
        return self.module._seq_run_type

    @property
    def _seq_calls(self) -> int:
        return self._calls_traced

    @property
    def _seq_vjp_method(self) -> str | None:
        # brainstate.nn.Vmap forwards no attributes: read the learner's, not the wrapper's.
        return self.module._seq_vjp_method

    # --- read-only diagnostics of the wrapped learner ---------------------------------------

    @property
    def graph(self) -> ETraceGraph:
        """The wrapped learner's compiled :class:`~braintrace.ETraceGraph`."""
        return self.module.graph

    @property
    def report(self) -> CompilationReport:
        """The wrapped learner's :class:`~braintrace.CompilationReport`."""
        return self.module.report

    @property
    def param_states(self) -> Mapping[Path, brainstate.ParamState]:
        """``path -> ParamState`` of the shared parameters (those of ``.module``)."""
        return self.module.param_states

    @property
    def hidden_states(self) -> Mapping[Path, brainstate.HiddenState]:
        """``path -> HiddenState`` of the wrapped learner (per-sample, batch on axis 0)."""
        return self.module.hidden_states

    @property
    def vjp_method(self) -> str:
        """The wrapped learner's ``vjp_method``."""
        vjp_method = self.module._seq_vjp_method
        if vjp_method is None:
            raise AttributeError(f"ETraceVmap: the wrapped {type(self.module).__name__} has no vjp_method.")
        return vjp_method

    def show_graph(self, verbose: bool = True, return_msg: bool = False) -> str | None:
        """The wrapped learner's :meth:`~braintrace.ETraceAlgorithm.show_graph`."""
        return self.module.show_graph(verbose=verbose, return_msg=return_msg)


ETraceVmap.__module__ = "braintrace"

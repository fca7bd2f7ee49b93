"""XLA's memory of one compiled training step: an online learner's, or BPTT's over a sequence.

The steps are jitted with ``brainstate.transform.jit``, lowered and compiled for the example
shapes, and never run: ``jitted.lower(*inputs).compile().memory_analysis()`` reports the
buffers XLA assigned. The states the step reads are arguments of the compiled computation, the
states it writes and the gradients are outputs (``brainstate.transform.jit`` donates nothing,
so a written state is both), and the rest is the temporary buffer.

* The online step: ``brainstate.transform.grad`` of the loss of one learner call with respect
  to ``learner.param_states`` (the forward step, the trace update and the online gradient).
* The BPTT step: ``brainstate.transform.grad`` of the loss summed over ``seq_len`` calls of the
  model in a ``brainstate.transform.for_loop``, with respect to the model's ``ParamState``\\ s.

The loss is the sum of every floating-point leaf of the output: the memory of a step barely
depends on the loss, as long as it reads the output.

Examples
--------
>>> import jax.numpy as jnp, braintrace
>>> from braintrace._footprint.step_memory import online_step_memory
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones((2, 3)), batch_size=2)
>>> memory = online_step_memory(learner, (jnp.ones((2, 3)),))
>>> memory.total_bytes == memory.argument_bytes + memory.output_bytes + memory.temp_bytes - memory.alias_bytes
True
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._typing import Path, PyTree

__all__ = ["StepMemory", "output_loss", "online_step", "bptt_step", "online_step_memory", "bptt_step_memory",
           "sequence_inputs", "OnlineLearner", "JittedStep", "Grads"]

#: A training step's gradients: ``path -> gradient`` (a pytree for a dict-valued parameter).
Grads = dict[Path, PyTree]


class OnlineLearner(Protocol):
    """What the online step reads of a compiled learner (an ``ETraceAlgorithm`` or its ``ETraceVmap``)."""

    @property
    def param_states(self) -> Mapping[Path, brainstate.ParamState]:
        """``path -> ParamState``: the weights the step differentiates with respect to."""

    def __call__(self, *inputs: PyTree) -> PyTree:
        """One step of the learner: its model's output."""


class JittedStep(Protocol):
    """A ``brainstate.transform.jit`` training step: call it for the gradients, or lower it for XLA."""

    def __call__(self, *inputs: PyTree) -> Grads:
        """The gradients of one training step."""

    def lower(self, *inputs: PyTree) -> jax.stages.Lowered:
        """The step lowered for ``inputs`` (arrays or ``jax.ShapeDtypeStruct``), ready to compile."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The buffers XLA assigned to one compiled step, in bytes.

    Attributes
    ----------
    argument_bytes : int
        The step's inputs: the states it reads (parameters, hidden states, traces) and the
        model inputs.
    output_bytes : int
        The step's outputs: the gradients and the states it writes.
    temp_bytes : int
        The temporary buffer (intermediates, residuals of the backward pass).
    alias_bytes : int
        Outputs written into argument buffers (counted in both above).

    Examples
    --------
    >>> from braintrace._footprint.step_memory import StepMemory
    >>> StepMemory(argument_bytes=100, output_bytes=80, temp_bytes=40, alias_bytes=30).total_bytes
    190
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int

    @property
    def total_bytes(self) -> int:
        """``argument + output + temp − alias``: every buffer the step needs at once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @classmethod
    def of_compiled(cls, compiled: jax.stages.Compiled) -> StepMemory | None:
        """Read a ``jax.stages.Compiled``'s ``memory_analysis()``.

        ``None`` where the backend reports no memory analysis (it returns ``None``, or raises
        ``NotImplementedError``).

        Examples
        --------
        >>> import jax, jax.numpy as jnp
        >>> from braintrace._footprint.step_memory import StepMemory
        >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
        >>> StepMemory.of_compiled(compiled).argument_bytes
        16
        """
        try:
            stats = compiled.memory_analysis()
        except NotImplementedError:
            return None
        if stats is None:
            return None
        return cls(
            argument_bytes=int(stats.argument_size_in_bytes),
            output_bytes=int(stats.output_size_in_bytes),
            temp_bytes=int(stats.temp_size_in_bytes),
            alias_bytes=int(stats.alias_size_in_bytes),
        )


def output_loss(output: PyTree) -> jax.Array:
    """The sum of every floating-point leaf of a model's output (units dropped).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._footprint.step_memory import output_loss
    >>> float(output_loss({'y': jnp.ones((2, 3)), 'spikes': jnp.ones(2, jnp.int32)}))
    6.0
    """
    leaves = [u.get_mantissa(leaf) for leaf in jax.tree.leaves(output, is_leaf=u.math.is_quantity)]
    floats = [leaf for leaf in leaves if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    if not floats:
        raise ValueError(
            "the model's output has no floating-point leaf, so no loss of it can be differentiated; "
            "return the (floating-point) output the training loss reads from the model's update()."
        )
    return sum((jnp.sum(leaf).real for leaf in floats), start=jnp.zeros((), jnp.float32))


def online_step(learner: OnlineLearner) -> JittedStep:
    """One online training step of ``learner``, jitted: the gradient of the loss of one call.

    A ``brainstate.transform.jit`` function: call it, or ``.lower(*inputs)`` it.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> from braintrace._footprint.step_memory import online_step
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones(3))
    >>> grads = online_step(learner)(jnp.ones(3))
    >>> list(grads)
    [('W', 'weight')]
    """
    params = learner.param_states

    def step(*inputs: PyTree) -> Grads:
        return brainstate.transform.grad(lambda: output_loss(learner(*inputs)), params)()

    return brainstate.transform.jit(step)


def bptt_step(model: brainstate.nn.Module) -> JittedStep:
    """One BPTT training step, jitted: the gradient of the loss summed over a sequence.

    The returned ``brainstate.transform.jit`` function takes the inputs of the whole sequence,
    time on axis 0.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._footprint.step_memory import bptt_step
    >>> cell = braintrace.nn.ValinaRNNCell(3, 4)
    >>> _ = brainstate.nn.init_all_states(cell)
    >>> grads = bptt_step(cell)(jnp.ones((5, 3)))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    """
    params = model.states(brainstate.ParamState)

    def loss(*sequences: PyTree) -> jax.Array:
        return output_loss(brainstate.transform.for_loop(model, *sequences))

    def step(*sequences: PyTree) -> Grads:
        return brainstate.transform.grad(loss, params)(*sequences)

    return brainstate.transform.jit(step)


def sequence_inputs(example_inputs: tuple[PyTree, ...], seq_len: int) -> tuple[PyTree, ...]:
    """Abstract inputs of a whole sequence: every example leaf with ``seq_len`` prepended.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from braintrace._footprint.step_memory import sequence_inputs
    >>> sequence_inputs((jnp.ones((2, 3)),), 10)
    (ShapeDtypeStruct(shape=(10, 2, 3), dtype=float32),)
    """
    def stacked(leaf: ArrayLike | jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        return jax.ShapeDtypeStruct((seq_len, *jnp.shape(leaf)), dtype)

    return tuple(jax.tree.map(stacked, example_inputs))


def online_step_memory(learner: OnlineLearner, example_inputs: tuple[PyTree, ...]) -> StepMemory | None:
    """XLA's memory of one online training step of ``learner`` (compiled, not run).

    Returns ``None`` where the backend reports no memory analysis.
    """
    compiled = online_step(learner).lower(*example_inputs).compile()
    return StepMemory.of_compiled(compiled)


def bptt_step_memory(model: brainstate.nn.Module, example_inputs: tuple[PyTree, ...], seq_len: int) -> StepMemory | None:
    """XLA's memory of one BPTT step over ``seq_len`` steps of ``model`` (states initialised).

    Returns ``None`` where the backend reports no memory analysis.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._footprint.step_memory import bptt_step_memory
    >>> cell = braintrace.nn.ValinaRNNCell(3, 4)
    >>> _ = brainstate.nn.init_all_states(cell)
    >>> short, long = (bptt_step_memory(cell, (jnp.ones(3),), n) for n in (4, 64))
    >>> long.total_bytes > short.total_bytes  # BPTT keeps every step's residuals
    True
    """
    compiled = bptt_step(model).lower(*sequence_inputs(example_inputs, seq_len)).compile()
    return StepMemory.of_compiled(compiled)

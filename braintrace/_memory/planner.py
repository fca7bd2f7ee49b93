"""``estimate_memory``: how much memory a training step of each method needs, before a run.

For each method the planner builds the learner at the user's sizes (``braintrace.compile`` on
a deep copy of the model, so the model's own states stay as they are), compiles one training
step with XLA and reads its memory analysis; no step runs. BPTT's step covers the whole
sequence, so its memory grows with ``seq_len``; an online learner's step covers one time step
and is the same for any sequence length (the learner carries its traces from step to step in
the same buffers). The measurement of one learner (:func:`~braintrace.learner_memory`) sits below
the learners, in :mod:`braintrace._footprint`; the planner, which compiles learners, sits above.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._memory import estimate_memory
>>> class Net(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.cell = braintrace.nn.ValinaRNNCell(3, 8)
...         self.readout = brainstate.ParamState(jnp.ones((8, 2)))
...     def update(self, x):
...         return self.cell(x) @ self.readout.value
>>> plan = estimate_memory(Net(), ['bptt', 'd_rtrl'], jnp.ones((4, 3)), batch_size=4, seq_len=200)
>>> plan['BPTT'].total_bytes > plan['d_rtrl'].total_bytes  # 200 steps of residuals vs one step
True
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import brainstate
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from braintrace._algorithm.engine.batch_size import checked_batch_size
from braintrace._compile import AlgorithmSpec
from braintrace._compile import compile as compile_learner
from braintrace._errors import CompilationError
from braintrace._footprint.estimate import MemoryEstimate
from braintrace._footprint.inventory import model_state_bytes, state_bytes
from braintrace._footprint.step_memory import bptt_step_memory, online_step_memory
from braintrace._memory.batch_fit import largest_fitting_batch
from braintrace._memory.methods import Method, read_methods
from braintrace._memory.plan import MemoryPlan
from braintrace._typing import PyTree

__all__ = ["estimate_memory"]


# --- checks of the arguments --------------------------------------------------------------------

def _checked_seq_len(seq_len: object) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1:
        raise ValueError(
            f"estimate_memory: seq_len must be an int of at least 1 (the time steps of one BPTT step), "
            f"got {seq_len!r}; pass the sequence length of the run, e.g. seq_len=100."
        )
    return int(seq_len)


def _checked_budget(budget_bytes: object) -> float | None:
    if budget_bytes is None:
        return None
    if (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real)
            or not math.isfinite(budget_bytes) or budget_bytes <= 0):
        raise ValueError(
            f"estimate_memory: budget_bytes must be a positive number of bytes, got {budget_bytes!r}; e.g. "
            f"budget_bytes=16 * 2**30 for 16 GiB (or None for no budget)."
        )
    return int(budget_bytes) if isinstance(budget_bytes, numbers.Integral) else float(budget_bytes)


def _checked_options(compile_options: object) -> dict[str, Any]:
    if compile_options is None:
        return {}
    if not isinstance(compile_options, Mapping):
        raise TypeError(
            f"estimate_memory: compile_options must be a dict of braintrace.compile options, got "
            f"{type(compile_options).__name__}; e.g. compile_options={{'vjp_method': 'multi-step'}}."
        )
    if "batch_size" in compile_options:
        raise ValueError(
            f"estimate_memory: compile_options holds batch_size={compile_options['batch_size']!r}; pass it as "
            f"estimate_memory(..., batch_size=...), which every method shares."
        )
    return dict(compile_options)


def _check_model_and_inputs(model: object, example_inputs: tuple[PyTree, ...]) -> None:
    if not isinstance(model, brainstate.nn.Module):
        raise TypeError(f"estimate_memory: model must be a brainstate.nn.Module, got {type(model).__name__}.")
    if not example_inputs:
        raise ValueError(
            "estimate_memory: give an example input of one step, e.g. "
            "estimate_memory(model, ['bptt', 'd_rtrl'], x0, batch_size=32)."
        )


def _budget_batch_size(example_inputs: tuple[PyTree, ...], batch_size: int | None) -> int:
    """A budget resizes the batch: ``batch_size`` must be given, on axis 0 of some example input."""
    shapes = [tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(example_inputs)]
    if batch_size is None:
        raise ValueError(
            "estimate_memory: budget_bytes needs batch_size (the largest batch is searched from it); "
            "pass batch_size= with example inputs that have the batch on axis 0."
        )
    if not any(shape[:1] == (batch_size,) for shape in shapes):
        raise ValueError(
            f"estimate_memory: budget_bytes resizes the batch, but no example input has batch_size={batch_size} "
            f"on axis 0 (shapes {shapes}); give one step of a batch, shape (batch_size, ...)."
        )
    return batch_size


# --- building and measuring one method ----------------------------------------------------------

def _inputs_at(example_inputs: tuple[PyTree, ...], batch_size: int | None, batch: int | None) -> tuple[PyTree, ...]:
    """The example inputs with the batch axis (axis 0 of size ``batch_size``) resized to ``batch``."""
    if batch == batch_size or batch_size is None or batch is None:
        return example_inputs

    def resized(leaf: ArrayLike | jax.ShapeDtypeStruct) -> ArrayLike | jax.ShapeDtypeStruct:
        shape = tuple(jnp.shape(leaf))
        if shape[:1] != (batch_size,):
            return leaf
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        return jax.ShapeDtypeStruct((batch, *shape[1:]), dtype)

    return tuple(jax.tree.map(resized, example_inputs))


def _private_copy(model: brainstate.nn.Module) -> brainstate.nn.Module:
    """A deep copy of ``model`` to build on (the model itself if it cannot be copied)."""
    try:
        return copy.deepcopy(model)
    except Exception:  # a model holding something uncopyable is built on directly
        return model


def _measure(model: brainstate.nn.Module, method: Method, inputs: tuple[PyTree, ...], batch: int | None,
             seq_len: int, options: dict[str, Any]) -> MemoryEstimate:
    """Build ``method`` on a copy of ``model`` at ``batch`` and measure its training step."""
    built = _private_copy(model)
    try:
        if method.is_bptt:
            brainstate.nn.init_all_states(built, batch_size=batch)
            parts = model_state_bytes(built)
            step = bptt_step_memory(built, inputs, seq_len)
            steps = seq_len
        else:
            learner = compile_learner(built, method.algorithm, *inputs, batch_size=batch,
                                      **{**options, **method.options})
            parts = state_bytes(learner)
            step = online_step_memory(learner, inputs)
            steps = 1
    except Exception as err:
        raise CompilationError(
            f"estimate_memory: {method.label} could not be built and compiled at batch size {batch}: "
            f"{type(err).__name__}: {err}"
        ) from err
    return MemoryEstimate(method=method.label, batch_size=batch, steps=steps, trace_bytes=parts.traces,
                          param_bytes=parts.params, state_bytes=parts.states, step=step)


def _fitting_batch(row: MemoryEstimate, measure: Callable[[int], MemoryEstimate], budget: float,
                   batch_size: int) -> int:
    """The largest batch size of ``row``'s method that fits ``budget`` (see ``batch_fit``)."""
    def total_at(batch: int) -> int:
        estimate = row if batch == batch_size else measure(batch)
        if estimate.total_bytes is None:
            raise ValueError(
                f"estimate_memory: budget_bytes needs XLA's memory analysis, which the {jax.default_backend()} "
                f"backend does not report; run without budget_bytes, or plan on a backend that reports it (cpu, gpu)."
            )
        return estimate.total_bytes

    return largest_fitting_batch(total_at, budget, batch_size)


def estimate_memory(
    model: brainstate.nn.Module,
    algorithms: AlgorithmSpec | Sequence[AlgorithmSpec],
    *example_inputs: PyTree,
    batch_size: int | None = None,
    seq_len: int = 1,
    budget_bytes: float | None = None,
    compile_options: Mapping[str, Any] | None = None,
) -> MemoryPlan:
    """How much memory one training step of each method needs, without running one.

    Each method is built on a deep copy of ``model`` (``braintrace.compile(copy, algorithm,
    *example_inputs, batch_size=batch_size, **options)``; BPTT: the copy's states initialised),
    its states are counted, and one training step is compiled by XLA and its memory analysis
    read (see :mod:`braintrace._footprint.step_memory`): an online learner's step is one time step,
    the same for any ``seq_len``; BPTT's step is ``seq_len`` time steps. The states are
    allocated at the measured sizes; no step runs.

    Parameters
    ----------
    model : brainstate.nn.Module
        The model, left as it is: the methods are built on deep copies (a model that cannot be
        deep-copied is built on directly, and its states end up initialised at the last
        measured batch size).
    algorithms : method or list of methods
        ``'bptt'``, a learner's name (``'d_rtrl'``, ...), an ETraceAlgorithm subclass, an
        :class:`~braintrace.ETraceConfig`, or a pair ``(algorithm, {option: value})`` for a
        learner's own options (``('pp_prop', {'decay_or_rank': 0.9})``); see
        :mod:`braintrace._memory.methods`.
    *example_inputs
        Inputs of one time step (arrays or ``jax.ShapeDtypeStruct``), the batch on axis 0
        when batched.
    batch_size : int, optional
        The batch size of the run.
    seq_len : int
        The sequence length BPTT differentiates through (default 1).
    budget_bytes : int or float, optional
        A memory budget: each method's ``max_batch_size`` is then the largest batch size whose
        step total fits it (the step's memory is taken to be affine in the batch size, and the
        answer ``b`` is checked by compiling ``b`` and ``b + 1``; see
        :mod:`braintrace._memory.batch_fit`). Needs ``batch_size``.
    compile_options : dict, optional
        Options for ``braintrace.compile`` shared by every learner (``vjp_method``, ``seed``,
        ...); a pair's own options take precedence. BPTT takes none.

    Returns
    -------
    MemoryPlan
        One :class:`~braintrace.MemoryEstimate` per method: trace, parameter and
        state bytes (what the method keeps between steps), and the compiled step's
        ``total_bytes = argument + output + temp − alias`` bytes (``None`` on a backend without
        a memory analysis).

    Raises
    ------
    ValueError
        For an unknown algorithm name, a ``batch_size`` that is not a positive int, a
        ``seq_len`` below 1, a ``budget_bytes`` that is not positive (or given without
        ``batch_size``), or no example input.
    TypeError
        For a model that is no ``brainstate.nn.Module`` or an entry of ``algorithms`` that is
        no method.
    CompilationError
        When a method cannot be built or its step cannot be compiled; the message names the
        method and the cause.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._memory import estimate_memory
    >>> cell = braintrace.nn.ValinaRNNCell(3, 8)
    >>> plan = estimate_memory(cell, ['bptt', 'd_rtrl', ('pp_prop', {'decay_or_rank': 0.9})],
    ...                        jnp.ones((4, 3)), batch_size=4, seq_len=100)
    >>> plan.methods
    ['BPTT', 'd_rtrl', 'pp_prop(decay_or_rank=0.9)']
    >>> plan['d_rtrl'].trace_bytes == 4 * (11 * 8 + 8) * 4  # per sample |θ|·S floats: W (11, 8), b (8,)
    True
    >>> plan['pp_prop(decay_or_rank=0.9)'].trace_bytes == 4 * (11 + 8) * 4  # per sample |x| + |y|
    True
    >>> print(plan.table())
    method ...
    BPTT ...
    d_rtrl ...
    pp_prop(decay_or_rank=0.9) ...
    step total: arguments + outputs + temporaries - aliased bytes of the compiled training step ...
    """
    _check_model_and_inputs(model, example_inputs)
    methods = read_methods(algorithms)
    batch_size = checked_batch_size(batch_size, "estimate_memory")
    seq_len = _checked_seq_len(seq_len)
    budget = _checked_budget(budget_bytes)
    options = _checked_options(compile_options)
    budget_batch = None if budget is None else _budget_batch_size(example_inputs, batch_size)
    rows = []
    for method in methods:
        def measure(batch: int | None, method: Method = method) -> MemoryEstimate:
            return _measure(model, method, _inputs_at(example_inputs, batch_size, batch), batch, seq_len, options)

        row = measure(batch_size)
        if budget is not None and budget_batch is not None:
            row = dataclasses.replace(row, max_batch_size=_fitting_batch(row, measure, budget, budget_batch))
        rows.append(row)
    return MemoryPlan(tuple(rows), batch_size=batch_size, seq_len=seq_len, budget_bytes=budget,
                      backend=jax.default_backend())

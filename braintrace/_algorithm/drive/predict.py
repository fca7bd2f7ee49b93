"""``predict``: a learner's model run forward over sequences, from fresh states, at any batch size.

``learner.predict(*sequences)`` runs the model the learner wraps over the sequences and returns
its per-step outputs stacked along the time axis. The run starts from states made afresh at the
batch size of the sequences (the model's ``init_state(batch_size=n)``; a vmapped learner's model
is mapped over the batch), keeps no eligibility traces and takes no gradient, so a test set of
any size runs without padding and without a new ``compile``. With a ``step_fn``, each step calls
``step_fn(*slices)``, which calls the learner once, exactly as in training; while ``predict``
runs, that call runs the model forward only (:func:`forward_step`).

The learner is left exactly as it was: within the run the model's modules hold the fresh states;
afterwards every module's attributes are put back (the learner's state objects, with their
values), and its traces and ``running_index`` are never touched.

Each batch size (and ``step_fn``) is one program, traced and compiled on its first call and kept
on the learner; a later call with sequences of the same shapes runs it without tracing again.
This module imports only the layers below the learners; ``base`` and ``vmap`` call into it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping, Sequence

import brainstate
import jax
import numpy as np

from braintrace._algorithm.drive.checks import checked_step_fn, validate
from braintrace._algorithm.drive.host import StepFn
from braintrace._algorithm.engine.input_data import run_model
from braintrace._algorithm.drive.layout import in_declared_layout
from braintrace._op._rule_helpers import shape_of
from braintrace._typing import Path, PyTree

__all__ = ["predict_sequences", "forward_step"]

#: The tag of the per-sample states a vmapped learner's model is given for a batched run.
LANES_TAG = "braintrace.predict"
#: Programs kept per learner; the oldest goes first (a ``step_fn`` made anew at every call
#: would otherwise keep one program per call).
MAX_PROGRAMS = 16

#: A compiled predict program: the per-step outputs of time-major sequences.
Program = Callable[[tuple[PyTree, ...]], PyTree]


class Programs:
    """A learner's compiled predict programs, by ``(batch size, id(step_fn))``.

    A plain object: the learner's state graph does not descend into it, so checkpoints and
    ``learner.states()`` do not see the programs.
    """

    def __init__(self) -> None:
        self.by_key: dict[tuple[int | None, int], tuple[StepFn | None, Program]] = {}

    def get(self, batch: int | None, step_fn: StepFn | None, build: Callable[[], Program]) -> Program:
        """The program for ``batch`` and ``step_fn``, built on first use."""
        key = (batch, id(step_fn))
        found = self.by_key.get(key)
        if found is None:
            if len(self.by_key) >= MAX_PROGRAMS:
                del self.by_key[next(iter(self.by_key))]
            # The step_fn is kept with its program, so that its id is not reused by another.
            found = self.by_key[key] = (step_fn, build())
        return found[1]


def predict_sequences(
    host: brainstate.nn.Module, learner: brainstate.nn.Module, sequences: tuple[PyTree, ...], step_fn: StepFn | None,
    time_axis: object, mapped: bool,
) -> PyTree:
    """The per-step outputs of ``host`` over ``sequences`` (see the module docstring).

    ``host`` is what the user calls (a learner, or a vmapped learner); ``learner`` is the
    compiled learner whose model runs (``host`` itself, or the one a vmap wraps); ``mapped``:
    ``host`` maps ``learner`` over the batch.
    """
    drive = validate(host, "predict", sequences, None, needs_multi_step=False, time_axis=time_axis, any_batch=True)
    stepper = checked_step_fn(host, "predict", step_fn) if step_fn is not None else None
    batch = run_batch_size(learner, drive.sequences[0], mapped)
    programs = host.__dict__.get("_predict_programs")
    if programs is None:
        programs = host._predict_programs = Programs()

    def build() -> Program:
        def step(*slices: PyTree) -> PyTree:
            return host(slices[0]) if stepper is None else stepper(*slices)

        def run(seqs: tuple[PyTree, ...]) -> PyTree:
            with _running_forward(host, learner, batch, mapped):
                return brainstate.transform.for_loop(step, *seqs)

        return brainstate.transform.jit(run)

    outputs = programs.get(batch, step_fn, build)(drive.sequences)
    return in_declared_layout(outputs, drive.time_axis, batch)


def run_batch_size(learner: brainstate.nn.Module, sequence: PyTree, mapped: bool) -> int | None:
    """The batch size of a time-major ``sequence`` for ``learner``'s model (``None``: one sequence).

    A step of the sequence (its first leaf) is either one sample, shaped like a step of one
    sample of the compiled example input, or a batch of them, with one more leading axis.

    Raises
    ------
    ValueError
        For a step of another shape.
    """
    example = shape_of(learner.graph.module_info.jaxpr.invars[0])
    sample = example if mapped or learner.batch_size is None else example[1:]
    step = tuple(np.shape(jax.tree.leaves(sequence)[0]))[1:]
    if step == sample:
        return None
    if step[1:] == sample:
        return int(step[0])
    raise ValueError(
        f"predict: a step of the first sequence has shape {step}, but the learner was compiled for steps of "
        f"shape {example}: predict runs a batch of samples, each step (batch, *{sample}), or one "
        f"sequence, each step {sample}. The first sequence is the model's input; check its shape and "
        f"time_axis (0: (time, batch, ...), 1: (batch, time, ...))."
    )


@contextlib.contextmanager
def _running_forward(host: brainstate.nn.Module, learner: brainstate.nn.Module, batch: int | None,
                     mapped: bool) -> Iterator[None]:
    """Within the block, the model holds fresh states for ``batch`` and ``host``'s calls run it
    forward only; afterwards the model's modules and states are as they were."""
    model = learner.model4compile
    attributes = [(node, dict(vars(node))) for _, node in brainstate.graph.iter_node(model) if hasattr(node, "__dict__")]
    values = [(st, st.value) for st in brainstate.graph.states(model).values()]
    plan = host.sharding_plan  # the fresh states are not the ones the plan places
    tables = learner._split_cache
    try:
        lanes = _fresh_states(model, batch, mapped)
        if mapped:
            host._forward_lanes = lanes
        # learner.hidden_states (read by a step_fn, as in training) shows the run's states.
        now = dict(brainstate.graph.states(model))
        learner._split_cache = tuple({p: now.get(p, st) for p, st in table.items()} for table in learner._split_states())
        host.sharding_plan = None
        host._forward_only = True
        yield
    finally:
        host._forward_only = False
        host.sharding_plan = plan
        learner._split_cache = tables
        for node, attrs in attributes:
            vars(node).clear()
            vars(node).update(attrs)
        for st, value in values:
            if st.value is not value:  # an init_state that writes into an existing state
                st.value = value


def _fresh_states(model: brainstate.nn.Module, batch: int | None, mapped: bool) -> Mapping[Path, brainstate.State] | None:
    """Initialise ``model``'s states for ``batch``: per sample on a leading axis when ``mapped``
    (those states are returned), else with ``init_state(batch_size=batch)`` (``None``)."""
    if mapped and batch is not None:
        def init_one_sample() -> None:
            brainstate.nn.init_all_states(model)

        brainstate.transform.vmap_new_states(init_one_sample, state_tag=LANES_TAG, axis_size=batch)()
        return model.states(LANES_TAG)
    brainstate.nn.init_all_states(model, batch_size=batch)
    return None


def forward_step(
    model: brainstate.nn.Module, args: tuple[PyTree, ...], lanes: Mapping[Path, brainstate.State] | None = None,
    in_axes: int | None | Sequence[int | None] = 0, out_axes: int | None | Sequence[int | None] = 0,
) -> PyTree:
    """One forward call of ``model`` inside ``predict``: no traces, no gradient; mapped over the
    samples of ``lanes`` (their per-sample states) when given."""
    if lanes is None:
        return run_model(model, args)

    @brainstate.transform.vmap(in_axes=in_axes, out_axes=out_axes, in_states=lanes, out_states=lanes)
    def mapped(*call_args: PyTree) -> PyTree:
        return run_model(model, call_args)

    return mapped(*args)

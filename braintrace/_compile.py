"""``braintrace.compile``: a model and a learning rule in, a compiled online learner out.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...     def init_state(self, batch_size=None, **kwargs):
...         self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, 2)))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), 'd_rtrl', jnp.ones((4, 3)), batch_size=4)
>>> learner(jnp.ones((4, 3))).shape
(4, 2)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Union

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm import (
    BPTT,
    D_RTRL,
    DNI,
    OSTTP,
    OTPE,
    OTTT,
    EProp,
    ETraceAlgorithm,
    ETraceConfig,
    ETraceVmap,
    IODimVjpAlgorithm,
    OSTLFeedforward,
    OSTLRecurrent,
    ParamDimVjpAlgorithm,
    RandomProjectionVjpAlgorithm,
    SnAp,
    ThreeFactor,
    UORO,
    pp_prop,
)
from braintrace._algorithm.engine.batch_size import checked_batch_size
from braintrace._algorithm.engine.rule_contract import GroupRule
from braintrace._algorithm.rules.group_rule import GroupRuleLearner
from braintrace._algorithm.rules.trace_rule import RuleLearner, TraceRule
from braintrace._algorithm.engine.sharding import Sharding, check_batch_size, plan_sharding
from braintrace._errors import CompilationError
from braintrace._typing import PyTree

__all__ = ["compile", "ALGORITHM_NAMES", "ENGINES", "Learner", "Algorithm", "AlgorithmSpec"]

#: A compiled learner, what :func:`compile` returns: the learning rule around the model, or
#: its :class:`~braintrace.ETraceVmap` (``vmap=True``).
Learner = Union[ETraceAlgorithm, ETraceVmap]

#: A learning rule by name, class or coordinate: a name (see :data:`ALGORITHM_NAMES`), an
#: ``ETraceAlgorithm`` subclass or an :class:`~braintrace.ETraceConfig`.
Algorithm = Union[str, type[ETraceAlgorithm], ETraceConfig]
#: A learning rule, or one paired with its compile options, ``('pp_prop', {'decay_or_rank': 0.9})``:
#: what the planner and the audit compare.
AlgorithmSpec = Union[Algorithm, tuple[Algorithm, Mapping[str, object]]]

#: Case-insensitive names accepted by :func:`compile`.
ALGORITHM_NAMES: dict[str, type[ETraceAlgorithm]] = {
    "d_rtrl": D_RTRL,
    "pp_prop": pp_prop,
    "es_d_rtrl": pp_prop,
    "esd_rtrl": pp_prop,
    "eprop": EProp,
    "e_prop": EProp,
    "ostl_recurrent": OSTLRecurrent,
    "ostl_feedforward": OSTLFeedforward,
    "otpe": OTPE,
    "ottt": OTTT,
    "osttp": OSTTP,
    "uoro": UORO,
    "snap": SnAp,
    "three_factor": ThreeFactor,
    "dni": DNI,
    "bptt": BPTT,
}

#: The engine of each ``trace_factorization`` (an :class:`ETraceConfig` given to :func:`compile`).
ENGINES: dict[str, type[ETraceAlgorithm]] = {
    "per_param": ParamDimVjpAlgorithm,
    "io_factorized": IODimVjpAlgorithm,
    "random_projection": RandomProjectionVjpAlgorithm,
}


def _engine_options(config: ETraceConfig, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``config`` forwarded (and the IO engine's decays defaulted to the config's)."""
    if "config" in options:
        raise TypeError(
            "compile: the algorithm is already an ETraceConfig; pass it once (as the algorithm, "
            "without config=...).")
    options = {**options, "config": config}
    if config.is_factorized:
        options.setdefault("decay_or_rank", config.decay)
    return options


def _resolve(algorithm: object) -> type[ETraceAlgorithm]:
    if isinstance(algorithm, type):
        if issubclass(algorithm, ETraceAlgorithm):
            return algorithm
        raise TypeError(f"compile: algorithm {algorithm.__name__} is not a braintrace.ETraceAlgorithm subclass.")
    if isinstance(algorithm, str):
        key = algorithm.strip().lower()
        if key in ALGORITHM_NAMES:
            return ALGORITHM_NAMES[key]
        raise ValueError(
            f"compile: unknown algorithm {algorithm!r}; valid names are {sorted(ALGORITHM_NAMES)}, or "
            f"pass an ETraceAlgorithm subclass or a braintrace.ETraceConfig."
        )
    raise TypeError(
        f"compile: algorithm must be an ETraceAlgorithm subclass, its name, a braintrace.ETraceConfig or "
        f"a braintrace.TraceRule or GroupRule, got {type(algorithm).__name__}."
    )


def _one_sample(example: jax.Array | jax.ShapeDtypeStruct) -> jax.Array | jax.ShapeDtypeStruct:
    """The example input of one sample: axis 0 dropped (from a shape, or indexed from an array)."""
    if isinstance(example, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(example.shape[1:], example.dtype)
    return example[0]


def _check_vmap_batch_axis(example_inputs: tuple[PyTree, ...], batch_size: int) -> None:
    """Under ``vmap`` every example input is mapped over axis 0, which must be the batch."""
    shapes = [tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(example_inputs)]
    if all(s[:1] == (batch_size,) for s in shapes):
        return
    raise ValueError(
        f"compile: batch_size={batch_size}, but the example input has shape "
        f"{shapes[0] if len(shapes) == 1 else shapes}. vmap=True maps axis 0 of every example input "
        f"over the batch, so every example input needs the batch on axis 0. {_one_step_hint(shapes, batch_size)}"
    )


def _batch_mismatch(example_inputs: tuple[PyTree, ...], batch_size: int | None) -> str | None:
    """Why the example may not fit ``batch_size`` (``None``: it may well fit)."""
    shapes = [tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(example_inputs)]
    if batch_size is None or any(s[:1] == (batch_size,) for s in shapes):
        return None
    return (
        f"batch_size={batch_size}, but no example input has the batch on axis 0 (shapes "
        f"{shapes[0] if len(shapes) == 1 else shapes}). {_one_step_hint(shapes, batch_size)}"
    )


def _one_step_hint(shapes: list[tuple[int, ...]], batch_size: int) -> str:
    """The fixes for an example whose axis 0 is not ``batch_size``: one step of the sequence, or
    the batch size the example has."""
    leading = {s[0] for s in shapes if s}
    its_batch = f" If axis 0 is the batch, pass batch_size={leading.pop()}." if len(leading) == 1 else ""
    if any(len(s) >= 2 and s[1] == batch_size for s in shapes):
        return f"If it is a whole sequence (time, batch, ...), pass one step, xs[0].{its_batch}"
    return f"Give one step of a batch, shape (batch_size, ...).{its_batch}"


def _compile_graph(learner: ETraceAlgorithm, example_inputs: tuple[PyTree, ...], batch_size: int | None) -> None:
    """``learner.compile_graph``; a failure that an example/batch mismatch explains says so."""
    try:
        learner.compile_graph(*example_inputs)
    except (TypeError, ValueError) as err:
        mismatch = _batch_mismatch(example_inputs, batch_size)
        if mismatch is None:
            raise
        raise ValueError(f"compile: {mismatch} Compiling the step failed with: {err}") from err


def _no_hidden_state_hint(learner: ETraceAlgorithm) -> str:
    """When the model has no ``HiddenState``: that, and the short-term states that may be meant as one."""
    if learner.hidden_states:
        return ""
    short_term = [path for path, st in learner.other_states.items() if type(st) is brainstate.ShortTermState]
    meant = (f" Its short-term state{'s' if len(short_term) > 1 else ''} "
             f"{', '.join(map(str, short_term))} {'are' if len(short_term) > 1 else 'is'} not followed: "
             f"declare a recurrent state as brainstate.HiddenState(...)." if short_term else "")
    return (" The model has no brainstate.HiddenState, and eligibility traces follow hidden states "
            f"only.{meant}")


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
    else:
        with brainstate.random.seed_context(seed):
            yield


def compile(
    model: brainstate.nn.Module,
    algorithm: Algorithm | TraceRule | GroupRule,
    *example_inputs: PyTree,
    batch_size: int | None = None,
    seed: int | None = None,
    verbose: int = 0,
    vmap: bool = False,
    sharding: Sharding | None = None,
    **options: Any,
) -> Learner:
    """Initialise ``model``'s states, wrap it in ``algorithm`` and compile its eligibility-trace graph.

    Parameters
    ----------
    model : brainstate.nn.Module
        The model; ``init_state(batch_size=...)`` is called on it (and its children).
    algorithm : ETraceAlgorithm subclass, str, ETraceConfig, TraceRule or GroupRule
        The learning rule, its case-insensitive name (see :data:`~braintrace._compile.ALGORITHM_NAMES`),
        or its coordinate: a :class:`~braintrace.ETraceConfig` runs on the engine of its
        ``trace_factorization`` (``ParamDimVjpAlgorithm``, ``IODimVjpAlgorithm``,
        ``RandomProjectionVjpAlgorithm``), which receives it as ``config``. ``'bptt'``
        (:class:`~braintrace.BPTT`) is backpropagation through time behind the same interface.
        A :class:`~braintrace.TraceRule` (a rule written as pure functions) runs on
        :class:`~braintrace._algorithm.rules.trace_rule.RuleLearner`, a
        :class:`~braintrace.GroupRule` (one carrier per hidden group) on
        :class:`~braintrace._algorithm.rules.group_rule.GroupRuleLearner`.
    *example_inputs
        Inputs of one step (with the batch on axis 0 when batched): arrays, or
        ``jax.ShapeDtypeStruct`` shapes.
    batch_size : int, optional
        Batch size the states are initialised with.
    seed : int, optional
        Seed for state initialisation (the global random state is restored afterwards).
    verbose : {0, 1, 2}
        Print the compilation report at this level.
    vmap : bool
        Build per-sample states and return :class:`~braintrace.ETraceVmap`
        ``(learner, vmap_states='new')`` (a ``brainstate.nn.Vmap``); requires ``batch_size``.
    sharding : Sharding, optional
        Split the learner over a device mesh: the batch over ``sharding.batch`` (data parallel),
        the hidden units, their weights' output axis and their traces over ``sharding.hidden``
        (model parallel). Every state is placed on the mesh, and every call keeps them there;
        the gradients are those of one device. See :class:`~braintrace.Sharding`.
    **options
        Forwarded to the algorithm's constructor: ``vjp_method`` (``'single-step'`` or
        ``'multi-step'``, the estimator; see :class:`~braintrace.ETraceVjpAlgorithm`),
        ``control_flow``, ``fast_solve``; ``trace_dtype``, ``chunked_trace`` (D_RTRL and its
        family; ``trace_dtype`` also pp_prop); ``decay_or_rank`` (pp_prop, required);
        ``feedback``, ``kappa_filter_decay``
        (EProp); ``leak`` (OTTT, OTPE, required); ... each learner's docstring lists its own. An
        option the learner does not take is refused, naming the valid ones.

    Returns
    -------
    ETraceAlgorithm or ETraceVmap

    Raises
    ------
    TypeError, ValueError
        For a bad ``algorithm`` or option, a ``config=`` next to an ETraceConfig algorithm, no
        example input, a ``verbose`` outside ``{0, 1, 2}``, a ``batch_size`` that is not a
        positive int, ``vmap=True`` without ``batch_size``, an example input whose axis 0 is not
        ``batch_size``, a step that would change a hidden state's shape (a batched example
        compiled without ``batch_size``), a ``sharding`` that is not a :class:`~braintrace.Sharding`,
        or a batch size or hidden unit count that its mesh axis's device count does not divide.
    CompilationError
        When no weight of the model is routed through an ETP operation to a hidden state (an
        online learner; BPTT needs none).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'pp_prop', jnp.ones((2, 3)),
    ...                              batch_size=2, decay_or_rank=0.9)
    >>> type(learner).__name__, learner(jnp.ones((2, 3))).shape
    ('pp_prop', (2, 4))
    >>> vmapped = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL,
    ...                              jnp.ones((2, 3)), batch_size=2, vmap=True)
    >>> type(vmapped).__name__, vmapped(jnp.ones((2, 3))).shape
    ('ETraceVmap', (2, 4))
    >>> config = braintrace.ETraceConfig(trace_factorization='io_factorized', decay=(0.9, 0.5))
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), config, jnp.ones(3))
    >>> type(learner).__name__, learner.decay_x, learner.decay_f
    ('IODimVjpAlgorithm', 0.9, 0.5)
    """
    if isinstance(algorithm, ETraceConfig):
        options = _engine_options(algorithm, options)
        cls = ENGINES[algorithm.trace_factorization]
    elif isinstance(algorithm, TraceRule):
        options = {**options, "rule": algorithm}
        cls = RuleLearner
    elif isinstance(algorithm, GroupRule):
        options = {**options, "rule": algorithm}
        cls = GroupRuleLearner
    else:
        cls = _resolve(algorithm)
    if not example_inputs:
        raise ValueError(
            'compile: give an example input of one step, e.g. braintrace.compile(model, "D_RTRL", x0).'
        )
    if verbose not in (0, 1, 2):
        raise ValueError(f"compile: verbose must be 0, 1 or 2, got {verbose!r}.")
    batch_size = checked_batch_size(batch_size, "compile")
    if vmap and batch_size is None:
        raise ValueError("compile: vmap=True needs the batch_size to build per-sample states.")
    if vmap and batch_size is not None:
        _check_vmap_batch_axis(example_inputs, batch_size)
    if sharding is not None:
        if not isinstance(sharding, Sharding):
            raise TypeError(
                f"compile: sharding must be a braintrace.Sharding(mesh, batch=..., hidden=...), got "
                f"{type(sharding).__name__}.")
        check_batch_size(sharding, batch_size)
    if vmap:
        learner = cls(model, **options)
        unbatched = jax.tree.map(_one_sample, example_inputs)

        def init_per_sample() -> None:
            # Runs twice (a discovery probe, then the mapped pass); compile_graph skips the probe.
            brainstate.nn.init_all_states(model)
            learner.compile_graph(*unbatched)

        with _seeded(seed):
            brainstate.transform.vmap_new_states(init_per_sample, state_tag="new", axis_size=batch_size)()
        result: Learner = ETraceVmap(learner, vmap_states="new")
    else:
        with _seeded(seed):
            brainstate.nn.init_all_states(model, batch_size=batch_size)
        learner = cls(model, **options)
        learner.batch_size = batch_size
        _compile_graph(learner, example_inputs, batch_size)
        result = learner
    if verbose:  # before the refusal below, whose message points at this report
        learner.report.show(level=verbose)
    if len(learner.graph.hidden_param_op_relations) == 0 and not isinstance(learner, BPTT):
        raise CompilationError(
            "No trainable weights are routed through ETP ops to a hidden state, so nothing can learn "
            f"online.{_no_hidden_state_hint(learner)} Use braintrace.matmul / element_wise / conv ... for "
            "the weights that drive hidden states; compile(..., verbose=2) shows why each weight was excluded."
        )
    if sharding is not None:
        result.sharding_plan = plan_sharding(result, learner, sharding, batch_size, vmapped=vmap)
        result.sharding_plan.place()
    return result

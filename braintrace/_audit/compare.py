"""``compare_learners``: several learning rules audited against one BPTT reference on the same model.

Each rule is compiled on the same model, in turn, and audited at once by
:func:`~braintrace._audit.check.audit_learner` (compiling the next one gives the model new hidden
state objects, which detaches the previous learner, so they are not kept). Every learner starts
from the states the first one was compiled with, and from the same parameters (an audit leaves
them untouched), so the BPTT reference is computed once, with the first learner, and shared.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> from braintrace._audit import compare_learners
>>> brainstate.random.seed(0)
>>> xs, ys = brainstate.random.normal(size=(6, 3)), jnp.zeros((6, 4))
>>> comparison = compare_learners(braintrace.nn.ValinaRNNCell(3, 4), ['d_rtrl', ('pp_prop', {'decay_or_rank': 0.9})],
...                               xs, ys, loss_fn=lambda out, y: jnp.sum((out - y) ** 2))
>>> comparison.labels
('d_rtrl', 'pp_prop(decay_or_rank=0.9)')
>>> [audit.exact for audit in comparison.audits]
[False, False]
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import brainstate
import jax
import numpy as np
from jax.typing import ArrayLike

from braintrace._algorithm import ETraceAlgorithm, ETraceConfig, MultiStepData
from braintrace._algorithm.drive.checks import check_sequences
from braintrace._algorithm.drive.host import StepFn
from braintrace._audit.check import (
    BPTTReference,
    GradientRequest,
    audit_learner,
    check_rtol,
)
from braintrace._audit.report import (
    GradientAudit,
    Path,
    axes_for,
    finish_error_axes,
    format_table,
    plotted_error,
)
from braintrace._compile import ALGORITHM_NAMES, Algorithm, AlgorithmSpec, Learner, compile
from braintrace._typing import PyTree

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["compare_learners", "LearnerComparison"]

class _Candidate(NamedTuple):
    label: str
    algorithm: Algorithm
    options: dict[str, object]


@dataclasses.dataclass(frozen=True)
class LearnerComparison:
    """Several learners' audits against one BPTT reference (see :func:`compare_learners`).

    Attributes
    ----------
    audits : tuple of GradientAudit
        One audit per learner, in the order given; ``audit.learner`` is its label.
    rtol : float
    objective : float
        The audited objective ``J`` (the same for every learner).

    Examples
    --------
    >>> import numpy as np
    >>> from braintrace._audit import GradientAudit, LearnerComparison
    >>> ref = {('w',): np.array([1.0, 0.0])}
    >>> audits = tuple(GradientAudit.from_gradients(name, {('w',): g}, ref, rtol=1e-4, objective=0.0)
    ...                for name, g in [('a', np.array([1.0, 0.0])), ('b', np.array([1.0, 1.0]))])
    >>> print(LearnerComparison(audits, rtol=1e-4, objective=0.0).table())
    Learners vs BPTT (rtol=0.0001)
    learner  parameter  cosine    rel. error  norm ratio  verdict
    a        w          1.000000  0.000e+00   1.000000    exact
    a        overall    1.000000  0.000e+00   1.000000    exact
    b        w          0.707107  1.000e+00   1.414214    approximate
    b        overall    0.707107  1.000e+00   1.414214    approximate
    """

    audits: tuple[GradientAudit, ...]
    rtol: float
    objective: float

    @property
    def labels(self) -> tuple[str, ...]:
        """The learners' labels, in order."""
        return tuple(audit.learner for audit in self.audits)

    def __getitem__(self, label: str) -> GradientAudit:
        for audit in self.audits:
            if audit.learner == label:
                return audit
        raise KeyError(f"no learner labelled {label!r}; the labels are {list(self.labels)}.")

    def table(self) -> str:
        """One line per learner and parameter leaf, and an ``overall`` line per learner."""
        lines = [((audit.learner,), row) for audit in self.audits for row in (*audit.rows, audit.overall)]
        return format_table(f"Learners vs BPTT (rtol={self.rtol:g})", ("learner",), lines)

    def __repr__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, object]:
        """Plain Python values (JSON-serialisable): the tolerance, the objective and every audit."""
        return {"rtol": self.rtol, "objective": self.objective,
                "learners": [audit.to_dict() for audit in self.audits]}

    def plot(self, ax: Axes | None = None) -> Axes:
        """Grouped bars of the relative error per parameter leaf (one bar per learner), log axis, ``rtol`` line.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, optional
            Where to draw (default: a new figure's axes).

        Returns
        -------
        matplotlib.axes.Axes
        """
        ax = axes_for(ax)
        names = [row.name for row in self.audits[0].rows]
        width = 0.8 / len(self.audits)
        for i, audit in enumerate(self.audits):
            offsets = np.arange(len(names)) - 0.4 + (i + 0.5) * width
            ax.bar(offsets, [plotted_error(row.relative_error) for row in audit.rows], width, label=audit.learner)
        finish_error_axes(ax, names, self.rtol, "Learners vs BPTT")
        return ax


def compare_learners(
    model: brainstate.nn.Module,
    algorithms: Sequence[AlgorithmSpec] | Mapping[str, AlgorithmSpec],
    *sequences: PyTree,
    loss_fn: Callable[..., jax.Array],
    example_inputs: PyTree = None,
    batch_size: int | None = None,
    vmap: bool = False,
    chunk_size: int | None = None,
    mask: ArrayLike | None = None,
    rtol: float = 1e-4,
    **options: Any,
) -> LearnerComparison:
    """Audit several learning rules on one model against one BPTT reference of the same loss.

    Each rule is compiled on ``model`` (:func:`braintrace.compile`) and audited as
    :func:`check_gradients` does, with the step ``loss_fn(learner(x), *rest)`` (``x`` the slice
    of the first sequence, ``rest`` those of the others; in window mode ``learner`` gets
    ``MultiStepData(x)`` and ``loss_fn`` returns one loss per step, shape ``(k,)``). Every learner
    starts from the same initial states and parameters; BPTT runs once.

    Parameters
    ----------
    model : brainstate.nn.Module
        The model; it is left compiled for the last learner, with its parameters unchanged.
    algorithms : sequence or mapping
        The rules: names (``'d_rtrl'``), ``ETraceAlgorithm`` subclasses, ``ETraceConfig``
        instances, or ``(rule, options)`` pairs such as ``('pp_prop', {'decay_or_rank': 0.9})``.
        A mapping ``label -> rule`` names them; otherwise they are labelled by themselves.
    *sequences : pytree
        The sequences; the first is the model's input.
    loss_fn : callable
        ``loss_fn(output, *rest) -> loss`` of one step (or window).
    example_inputs : tuple, optional
        The model's example inputs for :func:`braintrace.compile` (default: the first step of
        the first sequence).
    batch_size : int, optional
    vmap : bool
        Compile ``vmap=True`` learners (requires ``batch_size``).
    chunk_size, mask, rtol
        As for :func:`check_gradients`.
    **options
        Compile options shared by every rule (``vjp_method='multi-step'``, ``seed`` ...); a
        pair's own options take precedence.

    Returns
    -------
    LearnerComparison

    Raises
    ------
    TypeError, ValueError
        For an unknown rule name, a malformed rule, duplicate labels, no rule, a ``model`` that
        is not a module, a ``loss_fn`` that is not callable, a bad ``rtol``, missing or ragged
        sequences; and the errors of :func:`braintrace.compile` and of ``etrace_grad``.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> from braintrace._audit import compare_learners
    >>> brainstate.random.seed(0)
    >>> comparison = compare_learners(braintrace.nn.ValinaRNNCell(3, 4), {'D-RTRL': 'd_rtrl', 'UORO': 'uoro'},
    ...                               brainstate.random.normal(size=(6, 3)), loss_fn=lambda out: jnp.sum(out ** 2))
    >>> comparison.labels, comparison['D-RTRL'].rows[0].name
    (('D-RTRL', 'UORO'), "W.weight['bias']")
    """
    check_rtol("compare_learners", rtol)
    candidates = _candidates(algorithms)
    if not isinstance(model, brainstate.nn.Module):
        raise TypeError(
            f"compare_learners: model must be a brainstate.nn.Module (the model every rule is compiled on), "
            f"got {type(model).__name__}.")
    if not callable(loss_fn):
        raise TypeError(
            f"compare_learners: loss_fn must be a callable loss_fn(output, *rest) -> loss, got "
            f"{type(loss_fn).__name__}.")
    check_sequences("compare_learners", sequences)
    example_inputs = _example_inputs(sequences, example_inputs)
    window = chunk_size is not None and isinstance(chunk_size, int) and chunk_size >= 2
    audits: list[GradientAudit] = []
    reference: BPTTReference | None = None
    initial: dict[Path, PyTree] | None = None
    for candidate in candidates:
        learner = compile(model, candidate.algorithm, *example_inputs, batch_size=batch_size, vmap=vmap,
                          **{**options, **candidate.options})
        initial = _same_initial_states(model, initial)
        request = GradientRequest(_step_fn(learner, loss_fn, window), mask, chunk_size)
        audit = audit_learner(learner, sequences, request, rtol, candidate.label, reference)
        reference = BPTTReference(audit.bptt_grads, audit.objective)
        audits.append(audit)
    return LearnerComparison(tuple(audits), float(rtol), audits[0].objective)


def _step_fn(learner: Learner, loss_fn: Callable[..., jax.Array], window: bool) -> StepFn:
    """``loss_fn(learner(x), *rest)``, the learner given ``MultiStepData(x)`` in window mode."""
    if window:
        return lambda x, *rest: loss_fn(learner(MultiStepData(x)), *rest)
    return lambda x, *rest: loss_fn(learner(x), *rest)


def _example_inputs(sequences: tuple[PyTree, ...], example_inputs: PyTree) -> tuple[PyTree, ...]:
    if example_inputs is None:
        return (jax.tree.map(lambda a: a[0], sequences[0]),)
    return tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)


def _same_initial_states(model: brainstate.nn.Module, initial: dict[Path, PyTree] | None) -> dict[Path, PyTree]:
    """The model's state values after the first compile; later compiles get them written back."""
    states = dict(model.states().items())
    if initial is None:
        return {path: st.value for path, st in states.items()}
    if set(states) != set(initial):
        raise ValueError(
            f"compare_learners: compiling another rule changed the model's states (paths "
            f"{sorted(map(str, set(states) ^ set(initial)))} differ), so the learners cannot start from the "
            f"same states. Create every state of the model in __init__ or init_state.")
    for path, st in states.items():
        st.value = initial[path]
    return initial


# --- the rules --------------------------------------------------------------------------------


def _candidates(algorithms: object) -> list[_Candidate]:
    """The rules checked and labelled, before anything is compiled."""
    if isinstance(algorithms, (str, ETraceConfig, type)) or not isinstance(algorithms, (Sequence, Mapping)):
        raise TypeError(
            f"compare_learners: algorithms must be a list of rules (or a mapping label -> rule), got "
            f"{algorithms!r}. Pass e.g. ['d_rtrl', ('pp_prop', {{'decay_or_rank': 0.9}})].")
    labelled = list(algorithms.items()) if isinstance(algorithms, Mapping) else [(None, a) for a in algorithms]
    if not labelled:
        raise ValueError("compare_learners: algorithms is empty; give at least one rule, e.g. ['d_rtrl'].")
    candidates = [_candidate(spec, label) for label, spec in labelled]
    labels = [c.label for c in candidates]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(
            f"compare_learners: the rules {repeated} appear more than once. Give each its own label with a "
            f"mapping, e.g. {{'pp_prop 0.9': ('pp_prop', {{'decay_or_rank': 0.9}}), 'pp_prop 0.5': ...}}.")
    return candidates


def _candidate(spec: object, label: str | None) -> _Candidate:
    rule, options = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, {})
    if not isinstance(options, Mapping) or isinstance(spec, tuple) and len(spec) != 2:
        raise TypeError(
            f"compare_learners: a rule with options is a pair (rule, options_dict), got {spec!r}. "
            f"Write e.g. ('pp_prop', {{'decay_or_rank': 0.9}}).")
    checked = _checked_rule(rule)
    return _Candidate(label if label is not None else _label(checked, options), checked, dict(options))


def _checked_rule(rule: object) -> Algorithm:
    """``rule``, refused unless it is a known name, an ``ETraceAlgorithm`` subclass or an ``ETraceConfig``."""
    if isinstance(rule, str):
        if rule.strip().lower() not in ALGORITHM_NAMES:
            raise ValueError(
                f"compare_learners: unknown algorithm {rule!r}; valid names are {sorted(ALGORITHM_NAMES)}, or "
                f"pass an ETraceAlgorithm subclass or a braintrace.ETraceConfig.")
        return rule
    if isinstance(rule, type):
        if not issubclass(rule, ETraceAlgorithm):
            raise TypeError(f"compare_learners: {rule.__name__} is not a braintrace.ETraceAlgorithm subclass.")
        return rule
    if not isinstance(rule, ETraceConfig):
        raise TypeError(
            f"compare_learners: a rule is a name, an ETraceAlgorithm subclass or a braintrace.ETraceConfig "
            f"(optionally paired with its options), got {rule!r} of type {type(rule).__name__}.")
    return rule


def _label(rule: Algorithm, options: Mapping[str, object]) -> str:
    name = rule if isinstance(rule, str) else rule.__name__ if isinstance(rule, type) else repr(rule)
    if not options:
        return name
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in options.items())})"

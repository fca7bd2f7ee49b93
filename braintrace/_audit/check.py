"""``check_gradients``: a learner's online gradient against BPTT of the same objective.

The audit runs the learner's own driver, ``etrace_grad(*sequences, step_fn=..., reduction='sum')``,
then the same ``step_fn`` over the same slices once more, from the same starting states, with
the learner's calls switched to the bare model, and takes ``brainstate.transform.grad`` of the
summed objective through the whole loop: backpropagation through time of exactly the objective
the learner estimated.

The switch replaces, on the learner instance and only for the BPTT run, the function its
``update`` applies to the model step (``_true_update_fun``, the custom-VJP step of
:class:`~braintrace.ETraceVjpAlgorithm`) by a plain call of the wrapped model: one step, or
a ``MultiStepData`` window run step by step. Everything else of a call happens as usual, so
the learner's own arguments (``modulator=`` of ThreeFactor, the target of OSTTP) are accepted
and the model sees exactly the inputs it sees online; they do not enter the loss, so the
reference is the gradient of the loss. Every state the learner holds, and brainstate's global
random state, is snapshotted first and restored after each run, also when a run raises.

BPTT takes the starting hidden states as constants; the learner's traces at the start carry
the history before it. The two agree on a fresh start (after compiling or ``learner.reset()``),
which ``reset=True`` gives without disturbing the learner.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.full((3, 2), 0.5))
...     def init_state(self, batch_size=None, **kwargs):
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.8 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), 'd_rtrl', jnp.ones(3))
>>> xs, ys = jnp.ones((5, 3)), jnp.zeros((5, 2))
>>> from braintrace._audit import check_gradients
>>> audit = check_gradients(learner, xs, ys, step_fn=lambda x, y: jnp.sum((learner(x) - y) ** 2))
>>> audit.exact, [row.name for row in audit.rows], round(audit.overall.cosine, 4)
(True, ['w'], 1.0)
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from typing import Callable, Iterator, Mapping, NamedTuple

import brainstate
import brainunit as u
import jax
import numpy as np
from jax.typing import ArrayLike

from braintrace._algorithm import ETraceAlgorithm, ETraceVjpAlgorithm, ETraceVmap
from braintrace._algorithm.drive.checks import check_mask, checked_weights, validate
from braintrace._algorithm.drive.drivers import run_program
from braintrace._algorithm.drive.grad_run import GradRun, windows
from braintrace._algorithm.drive.host import Grads, StepFn
from braintrace._algorithm.engine.input_data import merge_data, split_input_data_types
from braintrace._algorithm.engine.jaxpr_eval import eval_jaxpr
from braintrace._algorithm.engine.while_vjp import bind_reversibly
from braintrace._compiler.jaxpr_graph import contains_eqn
from braintrace._audit.report import GradientAudit, Path
from braintrace._compile import Learner
from braintrace._typing import PyTree

__all__ = ["check_gradients", "audit_learner", "bptt_gradients", "BPTTReference", "GradientRequest"]


class GradientRequest(NamedTuple):
    """What the driver is asked for, shared by the online run and the BPTT run."""

    step_fn: StepFn
    mask: ArrayLike | None = None
    chunk_size: int | None = None
    weights: Mapping[Path, brainstate.ParamState] | None = None
    has_aux: bool = False


class BPTTReference(NamedTuple):
    """The BPTT gradient (``path -> gradient``) and the objective's value."""

    grads: Grads
    objective: float


def check_gradients(
    learner: Learner,
    *sequences: PyTree,
    step_fn: StepFn,
    mask: ArrayLike | None = None,
    chunk_size: int | None = None,
    weights: Mapping[Path, brainstate.ParamState] | None = None,
    has_aux: bool = False,
    rtol: float = 1e-4,
    reset: bool = False,
) -> GradientAudit:
    """Compare a learner's online gradient with BPTT of the same objective, on your model and data.

    Runs ``learner.etrace_grad(*sequences, step_fn=step_fn, reduction='sum', ...)`` and the
    backpropagation-through-time gradient of the same objective ``J = Σ_t mask_t · loss_t``, from
    the same starting states with respect to the same weights, and
    reports per parameter leaf the cosine, the relative error ``‖g − g_BPTT‖ / ‖g_BPTT‖`` and the
    norm ratio ``‖g‖ / ‖g_BPTT‖``. Every state of the learner (hidden states, traces, counters,
    parameters) is left exactly as it was, also when ``step_fn`` raises. Both runs use
    ``jax.default_matmul_precision('highest')``: on an accelerator, float32 products in full
    rather than in bfloat16 passes, so that the audit measures the rule, not the hardware's rounding.

    The reference is always the gradient of the loss: for a learner driven by something else
    than ``∂L/∂h`` (a modulator, a synthetic gradient, a target projection) the audit measures
    how far its update is from the loss gradient.

    Parameters
    ----------
    learner : ETraceAlgorithm or ETraceVmap
        A compiled learner (:func:`braintrace.compile`), ``vmap=True`` included.
    *sequences : pytree
        The sequences, sliced along their leading time axis, as for ``etrace_grad``.
    step_fn : callable
        ``step_fn(*slices) -> loss`` calling **this** learner once (see ``etrace_grad``); it may
        pass the learner's keyword options (``learner(x, modulator=m)``).
    mask : array, optional
        ``(T,)`` per-step loss weights (default all ones).
    chunk_size : int, optional
        ``None``/``1``: one call per step; ``k >= 2``: one ``MultiStepData`` window of ``k``
        steps per call (a multi-step learner; ``step_fn`` returns ``(k,)`` losses).
    weights : dict, optional
        ``path -> ParamState`` to audit (default: the learner's ``param_states``).
    has_aux : bool
        ``step_fn`` returns ``(loss, aux)``; ``aux`` is discarded.
    rtol : float
        A leaf is exact when its relative error is at most ``rtol`` (> 0).
    reset : bool
        Start both runs from ``learner.reset()`` (a new sequence) instead of the current states;
        the current states are restored afterwards either way. BPTT starts from the current
        hidden states as constants, while a learner that has run since its last reset carries
        that history in its traces: auditing it as it is warns, and measures that history too.

    Returns
    -------
    GradientAudit

    Raises
    ------
    TypeError
        For a ``learner`` that is not a compiled braintrace learner, a ``step_fn`` that is not
        callable, a non-numeric ``rtol`` or a non-boolean ``reset``; and ``etrace_grad``'s own
        errors.
    ValueError
        For an ``rtol`` that is not a positive finite number; and ``etrace_grad``'s own
        errors (ragged sequences, a ``chunk_size`` that does not divide ``T``, window mode on a
        single-step learner, ...), with its message unchanged.

    Warns
    -----
    UserWarning
        When the learner has run since its last reset and ``reset`` is False.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> brainstate.random.seed(0)
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), 'd_rtrl', jnp.ones(3))
    >>> xs = brainstate.random.normal(size=(6, 3))
    >>> from braintrace._audit import check_gradients
    >>> audit = check_gradients(learner, xs, step_fn=lambda x: jnp.sum(learner(x) ** 2))
    >>> audit.exact  # the dense recurrence mixes units, which D-RTRL's diagonal trace drops
    False
    >>> [row.name for row in audit.rows]
    ["W.weight['bias']", "W.weight['weight']"]
    """
    check_rtol("check_gradients", rtol)
    check_learner("check_gradients", learner)
    check_step_fn("check_gradients", step_fn)
    if not isinstance(reset, bool):
        raise TypeError(f"check_gradients: reset must be True or False, got {reset!r}.")
    calls = 0 if reset else calls_since_reset(learner)
    if calls:
        warnings.warn(
            f"check_gradients: the learner has made {calls} call(s) since its last reset, so its traces carry "
            f"history from before these sequences, which the BPTT reference (starting from the current "
            f"hidden states) does not see: the figures then include that history, not only the rule's "
            f"approximation. Pass reset=True to audit from a fresh start (the states are restored "
            f"afterwards), or call learner.reset() first.", UserWarning, stacklevel=2)
    request = GradientRequest(step_fn, mask, chunk_size, weights, has_aux)
    return audit_learner(learner, sequences, request, rtol, label=learner_label(learner), reset=reset)


def audit_learner(
    learner: Learner, sequences: tuple[PyTree, ...], request: GradientRequest, rtol: float, label: str,
    reference: BPTTReference | None = None, reset: bool = False,
) -> GradientAudit:
    """The audit of a checked ``learner``; ``reference`` is computed by :func:`bptt_gradients` if not given.

    Both runs start from the learner's states as they are (after ``learner.reset()`` with
    ``reset``); every state is restored afterwards. Both run at the highest matrix-product
    precision: an accelerator's default multiplies float32 in bfloat16 passes (about three
    digits on a TPU), which would measure the hardware's rounding rather than the rule. On CPU
    that is the default.
    """
    restore_caller = snapshot(learner)
    try:
        with jax.default_matmul_precision("highest"):
            if reset:
                learner.reset()
            restore_start = snapshot(learner)
            online = learner.etrace_grad(
                *sequences, step_fn=request.step_fn, mask=request.mask, chunk_size=request.chunk_size,
                weights=request.weights, reduction="sum", has_aux=request.has_aux)
            online = online[0] if request.has_aux else online
            restore_start()
            if reference is None:
                reference = bptt_gradients(learner, sequences, request)
    finally:
        restore_caller()
    return GradientAudit.from_gradients(label, online, reference.grads, rtol, reference.objective)


def bptt_gradients(learner: Learner, sequences: tuple[PyTree, ...], request: GradientRequest) -> BPTTReference:
    """BPTT of ``Σ_t mask_t · loss_t`` through the whole loop, the learner's calls running the bare model.

    The slicing (plain steps or ``k``-step windows), the loss checks and the mask are those of
    ``etrace_grad``. The learner's states advance as in a run; the caller restores them.
    """
    drive = validate(learner, "check_gradients", sequences, request.chunk_size, needs_multi_step=False)
    mask = check_mask("check_gradients", request.mask, drive.length)
    weights = checked_weights(learner, "check_gradients", request.weights)
    scorer = GradRun("check_gradients", request.step_fn, weights, drive.window, request.has_aux, learner)
    mask_rows = mask if drive.window is None else mask.reshape((-1, drive.window))

    def objective(windows: tuple[PyTree, ...], mask_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        def call(_: None, inputs: tuple[tuple[PyTree, ...], jax.Array]) -> tuple[None, jax.Array]:
            slices, w = inputs
            loss, _aux = scorer._loss(request.step_fn(*slices))
            return None, u.math.sum(w * loss)

        _, per_call = brainstate.transform.scan(call, None, (windows, mask_rows))
        total = u.math.sum(per_call)
        return total, total

    with calls_run_the_bare_model(learner):
        grads, total = run_program(brainstate.transform.grad(objective, weights, has_aux=True),
                                   windows(sequences, drive.window), mask_rows)
    return BPTTReference(dict(grads), float(u.get_mantissa(total)))


# --- the switch to the bare model -------------------------------------------------------------

_SWITCHED = "_true_update_fun"


class _BareModelStep:
    """In place of a learner's custom-VJP step: the wrapped model run plainly (differentiable by JAX).

    Takes and returns what the custom-VJP step does, ``(out, new hidden, new other, traces)``;
    the traces are passed through unchanged (nothing reads them in the BPTT run). A step holding
    a ``while_loop``, which JAX's reverse mode cannot cross, runs as the step the compiler traced
    with every loop bound by :func:`~braintrace._algorithm.engine.while_vjp.bind_reversibly` (the same
    values; reverse mode recomputes the loop's iterations).
    """

    def __init__(self, learner: ETraceVjpAlgorithm) -> None:
        self.learner = learner
        self.has_while = contains_eqn(learner.graph.module_info.jaxpr, lambda eqn: eqn.primitive.name == "while")

    def _model_step(self, args: tuple[PyTree, ...]) -> PyTree:
        """The model's output on ``args``, its states written as the model writes them."""
        if not self.has_while:
            return self.learner.model4compile(*args)
        minfo = self.learner.graph.module_info
        flat = jax.tree.leaves((args, [st.value for st in minfo.compiled_model_states]))
        outs = eval_jaxpr(minfo.jaxpr, minfo.closed_jaxpr.consts, flat, bind_reversibly)
        out, hidden, other, _ = minfo._process(*args, jaxpr_outs=outs)
        for states, values in ((self.learner.hidden_states, hidden), (self.learner.other_states, other)):
            for path, value in values.items():
                states[path].value = value
        return out

    def __call__(
        self, args: tuple[PyTree, ...], weight_vals: dict[Path, PyTree], hidden_vals: dict[Path, PyTree],
        other_vals: dict[Path, PyTree], etrace_vals: PyTree, running_index: jax.Array, aux: PyTree = None,
        roll_sink: PyTree = None,
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Path, PyTree], PyTree]:
        single, multi, treedef = split_input_data_types(*args)
        if multi:
            out = brainstate.transform.for_loop(lambda step: self._model_step(merge_data(treedef, single, step)), multi)
        else:
            out = self._model_step(merge_data(treedef, single))
        hidden = {path: st.value for path, st in self.learner.hidden_states.items()}
        other = {path: st.value for path, st in self.learner.other_states.items()}
        return out, hidden, other, etrace_vals


@contextlib.contextmanager
def calls_run_the_bare_model(learner: Learner) -> Iterator[None]:
    """Within the block, every call of ``learner`` (of its lanes' learner under vmap) runs the bare model."""
    core = learner.module if isinstance(learner, ETraceVmap) else learner
    missing = object()
    original = core.__dict__.get(_SWITCHED, missing)
    setattr(core, _SWITCHED, _BareModelStep(core))
    try:
        yield
    finally:
        if original is missing:
            delattr(core, _SWITCHED)
        else:
            setattr(core, _SWITCHED, original)


def snapshot(learner: Learner) -> Callable[[], None]:
    """The values of every state of ``learner`` and of the global random state, as a function restoring them."""
    states = [*learner.states().values(), brainstate.random.DEFAULT]
    values = [st.value for st in states]

    def restore() -> None:
        for st, value in zip(states, values):
            st.value = value

    return restore


def calls_since_reset(learner: Learner) -> int:
    """The learner's ``running_index`` (the largest over the lanes of a vmapped learner)."""
    core = learner.module if isinstance(learner, ETraceVmap) else learner
    return int(np.max(np.asarray(core.running_index.value)))


# --- argument checks --------------------------------------------------------------------------


def check_rtol(call: str, rtol: object) -> None:
    """``rtol`` must be a positive finite real number."""
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real):
        raise TypeError(
            f"{call}: rtol must be a positive float (the relative error up to which a parameter counts "
            f"as exact), got {rtol!r} of type {type(rtol).__name__}. Pass e.g. rtol=1e-4.")
    if not (math.isfinite(float(rtol)) and float(rtol) > 0.0):
        raise ValueError(
            f"{call}: rtol must be a positive finite number, got {rtol!r}. A relative error is >= 0, so "
            f"use a small positive tolerance, e.g. rtol=1e-4 (float32) or rtol=1e-10 (float64).")


def check_learner(call: str, learner: object) -> None:
    """``learner`` must be a compiled custom-VJP learner, or an ``ETraceVmap`` of one."""
    core = learner.module if isinstance(learner, ETraceVmap) else learner
    if not isinstance(core, ETraceAlgorithm):
        raise TypeError(
            f"{call}: learner must be a compiled braintrace learner (an ETraceAlgorithm, or the "
            f"ETraceVmap of braintrace.compile(..., vmap=True)), got {type(learner).__name__}. Build one "
            f"with braintrace.compile(model, algorithm, example_input).")
    if not isinstance(core, ETraceVjpAlgorithm):
        raise TypeError(
            f"{call}: {type(core).__name__} is not an ETraceVjpAlgorithm, so its calls cannot be switched "
            f"to the bare model for the BPTT reference. Audit a learner built by braintrace.compile.")
    if not core.is_compiled:
        raise ValueError(
            f"{call}: {type(core).__name__} is not compiled. Build it with braintrace.compile(model, "
            f"algorithm, example_input), or call learner.compile_graph(example_input) first.")


def check_step_fn(call: str, step_fn: object) -> None:
    if not callable(step_fn):
        raise TypeError(
            f"{call}: step_fn must be a callable step_fn(*slices) -> loss that calls the learner once, "
            f"got {step_fn!r} of type {type(step_fn).__name__}.")


def learner_label(learner: Learner) -> str:
    """``'D_RTRL'``, or ``'ETraceVmap(D_RTRL)'`` for a vmapped learner."""
    if isinstance(learner, ETraceVmap):
        return f"ETraceVmap({type(learner.module).__name__})"
    return type(learner).__name__


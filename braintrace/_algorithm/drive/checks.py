"""The sequence drivers' argument checks, all made before tracing: :func:`validate` and the checks it is made of.

A driver refuses a bad argument at its call, naming the driver, the value and the fix: the
sequences (:func:`check_sequences`: present, non-empty, with a time axis, of one length, in the
declared layout, bare arrays), ``chunk_size`` and ``time_axis`` against what the learner admits
(:func:`validate`, which also puts the sequences time-major), ``mask``, ``reduction`` and
``update_every``, the ``weights`` to differentiate, the ``step_fn`` (:func:`checked_step_fn`, which
also refuses at trace time a step that does not call the learner exactly once) and
``check_finite`` (:func:`guarded_states`).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.drive.host import SequenceHost, StepFn
from braintrace._algorithm.drive.finite import refuse_traced
from braintrace._algorithm.engine.input_data import ETraceInputData
from braintrace._algorithm.drive.layout import check_layout, checked_time_axis, time_major
from braintrace._errors import internal_error
from braintrace._typing import Path, PyTree

__all__ = [
    "Drive", "validate", "check_sequences", "check_reduction", "check_loss_output", "check_mask",
    "check_update_every", "checked_weights", "checked_step_fn", "guarded_states",
]

_REDUCTIONS = ("mean", "sum")
_LOSS_OUTPUTS = ("per_step", "masked", "scalar")


class Drive(NamedTuple):
    """A validated request: ``T`` steps, driven in windows of ``window`` steps (``None``: plain), over
    ``sequences`` put time-major from the declared ``time_axis``."""

    length: int
    window: int | None
    sequences: tuple[PyTree, ...]
    time_axis: int


def validate(
    host: SequenceHost, call: str, sequences: tuple[PyTree, ...], chunk_size: object, needs_multi_step: bool,
    time_axis: object = 0, any_batch: bool = False,
) -> Drive:
    """Checks every argument before tracing (rows 3-13 of the driver contract, in order, with
    ``time_axis`` after ``chunk_size`` and the layout before the lengths), and puts the
    sequences time-major.

    The layout is checked against the learner's batch size, unless the call runs at the batch
    size of the sequences (``any_batch``: ``predict``).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> drive = validate(learner, 'etrace_evolve', (jnp.ones((6, 3)),), 2, needs_multi_step=False)
    >>> drive.length, drive.window
    (6, 2)
    >>> validate(learner, 'etrace_grad', (jnp.ones((6, 3)),), 2, needs_multi_step=True)
    Traceback (most recent call last):
    ...
    ValueError: etrace_grad: window mode (chunk_size=2) needs a multi-step learner, ...
    """
    window = _checked_window(call, chunk_size)
    time_axis = checked_time_axis(call, time_axis)
    batch_size = None if any_batch else host._seq_batch_size
    if time_axis == 1 and batch_size is None and not any_batch:
        raise ValueError(
            f"{call}: time_axis=1 declares batch-major sequences (batch, time, ...), but this learner "
            f"is unbatched (compiled without batch_size), so its sequences have no batch axis. Pass "
            f"them time-major, (time, ...), with time_axis=0, or compile with batch_size=B."
        )
    length = check_sequences(call, sequences, time_axis, batch_size)
    sequences = time_major(sequences, time_axis)
    if window is not None and host._seq_is_vmapped:
        raise ValueError(
            f"{call}: window mode (chunk_size={window}) is refused on a vmapped learner "
            f"(braintrace.ETraceVmap): the vmap maps axis 0 of every input, which in a window "
            f"slice (k, batch, ...) is time. Use chunk_size=None to drive it one step per call, "
            f"or compile the batched learner (vmap=False, batch_size=B) for window mode."
        )
    if window is not None and needs_multi_step and host._seq_vjp_method != "multi-step":
        raise ValueError(
            f"{call}: window mode (chunk_size={window}) needs a multi-step learner, but this "
            f"learner's vjp_method is {host._seq_vjp_method!r}. Build it with "
            f"braintrace.compile(..., vjp_method='multi-step'), or use chunk_size=None. "
            f"(etrace_evolve drives any learner in window mode.)"
        )
    if window is not None and length % window != 0:
        trimmed = length - length % window
        advice = f"Trim the sequences to {trimmed} steps, or choose" if trimmed else "Choose"
        raise ValueError(
            f"{call}: chunk_size={window} does not divide the sequence length {length} (T must be "
            f"a multiple of chunk_size; a ragged tail is never truncated). {advice} a chunk_size "
            f"that divides {length}."
        )
    return Drive(length, window, sequences, time_axis)


def _checked_window(call: str, chunk_size: object) -> int | None:
    """The window length of ``chunk_size`` (``None`` for ``None`` or 1), refused unless ``None`` or an int >= 1."""
    if chunk_size is None:
        return None
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool):
        raise TypeError(
            f"{call}: chunk_size must be None or a Python int >= 1, got {chunk_size!r} of type "
            f"{type(chunk_size).__name__}. Pass a plain int (int(k) converts a NumPy or JAX integer)."
        )
    if chunk_size < 1:
        raise ValueError(
            f"{call}: chunk_size must be >= 1, got {chunk_size}. Use None (or 1) for one learner "
            f"call per step, or k >= 2 for one call per window of k steps."
        )
    return chunk_size if chunk_size >= 2 else None


def _is_marker(x: object) -> bool:
    return isinstance(x, ETraceInputData)


def check_sequences(call: str, sequences: tuple[PyTree, ...], time_axis: int = 0, batch_size: int | None = None) -> int:
    """The common length ``T`` of every leaf of every sequence along ``time_axis`` (rows 5-10), each
    leaf's layout checked against ``batch_size`` where it is known (:func:`check_layout`).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> check_sequences('etrace_grad', (jnp.ones((6, 3)), {'y': jnp.zeros((6,))}))
    6
    >>> check_sequences('etrace_grad', (jnp.ones((6, 3)), jnp.zeros((5,))))
    Traceback (most recent call last):
    ...
    ValueError: etrace_grad: every leaf must have the same leading (time) length, ...
    """
    if not sequences:
        raise ValueError(
            f"{call}: no sequences given. Pass one or more sequences with a leading time axis, "
            f"e.g. learner.{call}(xs, ys, step_fn=...)."
        )
    for i, seq in enumerate(sequences):
        marker = next((m for m in jax.tree.leaves(seq, is_leaf=_is_marker) if _is_marker(m)), None)
        if marker is not None:
            raise TypeError(
                f"{call}: sequence {i} is or contains a {type(marker).__name__}; the driver slices bare "
                f"arrays. Pass the arrays and wrap inside step_fn, e.g. "
                f"learner(braintrace.MultiStepData(x))."
            )
    reference: tuple[str, int] | None = None
    for i, seq in enumerate(sequences):
        leaves = jax.tree_util.tree_flatten_with_path(seq)[0]
        if not leaves:
            raise ValueError(
                f"{call}: sequence {i} is an empty pytree ({seq!r}); every sequence needs at least one "
                f"array with a leading time axis. Drop it, or close over it in step_fn."
            )
        for keypath, leaf in leaves:
            where = f"sequences[{i}]{jax.tree_util.keystr(keypath)}"
            if np.ndim(leaf) == 0:
                raise ValueError(
                    f"{call}: {where} is a scalar ({leaf!r}) with no time axis to slice. Close over "
                    f"constants in step_fn instead of passing them as sequences."
                )
            check_layout(call, where, tuple(np.shape(leaf)), time_axis, batch_size)
            n = int(np.shape(leaf)[time_axis])
            if reference is None:
                reference = (where, n)
            elif n != reference[1]:
                raise ValueError(
                    f"{call}: every leaf must have the same {'leading ' if time_axis == 0 else ''}(time) "
                    f"length, but {reference[0]} has length {reference[1]} and {where} has length {n}."
                )
    if reference is None:
        raise internal_error("non-empty sequences without leaves")
    if reference[1] == 0:
        raise ValueError(f"{call}: the sequences are empty (length 0 along the time axis); give at least one step.")
    return reference[1]


def check_reduction(call: str, reduction: object) -> None:
    """Refuse a ``reduction`` other than ``'mean'`` and ``'sum'``.

    Examples
    --------
    >>> check_reduction('etrace_grad', 'max')
    Traceback (most recent call last):
    ...
    ValueError: etrace_grad: reduction must be one of ('mean', 'sum'), got 'max'. ...
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{call}: reduction must be one of {_REDUCTIONS}, got {reduction!r}. Use 'mean' "
            f"to divide by the total mask weight or 'sum' to add the steps' contributions."
        )


def check_loss_output(call: str, loss_output: object) -> None:
    """Refuse a ``loss_output`` other than ``'per_step'``, ``'masked'`` and ``'scalar'``.

    Examples
    --------
    >>> check_loss_output('etrace_grad', 'mean')
    Traceback (most recent call last):
    ...
    ValueError: etrace_grad: loss_output must be one of ('per_step', 'masked', 'scalar'), got 'mean' ...
    """
    if loss_output not in _LOSS_OUTPUTS:
        raise ValueError(
            f"{call}: loss_output must be one of {_LOSS_OUTPUTS}, got {loss_output!r} "
            f"(raw per-step losses, mask-weighted losses, or the reduced objective)."
        )


def check_update_every(update_every: object, drive: Drive) -> int:
    """The steps between optimizer updates of ``etrace_train`` (the whole stream for ``None``).

    Examples
    --------
    >>> drive = Drive(length=8, window=2, sequences=(), time_axis=0)
    >>> check_update_every(None, drive), check_update_every(4, drive)
    (8, 4)
    """
    if update_every is None:
        return drive.length
    if not isinstance(update_every, int) or isinstance(update_every, bool):
        raise TypeError(
            f"etrace_train: update_every must be None or a Python int >= 1, got {update_every!r} of "
            f"type {type(update_every).__name__}."
        )
    if update_every < 1:
        raise ValueError(
            f"etrace_train: update_every must be >= 1 step, got {update_every}. Use None to update "
            f"once, at the end of the stream."
        )
    if drive.window is not None and update_every % drive.window:
        raise ValueError(
            f"etrace_train: update_every={update_every} is not a multiple of chunk_size={drive.window}; "
            f"updates happen between windows. Use a multiple of {drive.window}."
        )
    return update_every


def check_mask(call: str, mask: jax.typing.ArrayLike | None, length: int) -> jax.Array:
    """The ``(T,)`` floating mask (all ones by default).

    Examples
    --------
    >>> import numpy as np
    >>> check_mask('etrace_grad', None, 3), check_mask('etrace_grad', np.array([True, False]), 2)
    (Array([1., 1., 1.], dtype=float32), Array([1., 0.], dtype=float32))
    """
    if mask is None:
        return jnp.ones((length,), jnp.float32)
    shape = tuple(np.shape(mask))
    if shape != (length,):
        raise ValueError(
            f"{call}: mask must have shape (T,) = ({length},), one loss weight per step, got "
            f"shape {shape}."
        )
    dtype = np.dtype(mask.dtype) if hasattr(mask, "dtype") else np.asarray(mask).dtype
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer) or dtype == np.bool_):
        raise TypeError(
            f"{call}: mask must hold real numbers (per-step loss weights; bool, int or float), got "
            f"dtype {dtype}. Pass e.g. jnp.asarray(mask, jnp.float32)."
        )
    mask = jnp.asarray(mask)
    return mask if jnp.issubdtype(mask.dtype, jnp.floating) else mask.astype(jnp.float32)


def checked_weights(
    host: SequenceHost, call: str, weights: Mapping[Path, brainstate.ParamState] | None,
) -> dict[Path, brainstate.ParamState]:
    """The ``path -> ParamState`` mapping to differentiate (default: the learner's parameters).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> list(checked_weights(learner, 'etrace_grad', None))
    [('W', 'weight')]
    """
    weights = host._seq_param_states if weights is None else weights
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{call}: weights must be a mapping path -> ParamState (like learner.param_states), "
            f"got {type(weights).__name__}."
        )
    return dict(weights)


def checked_step_fn(host: SequenceHost, call: str, step_fn: StepFn) -> StepFn:
    """``step_fn`` (refused unless callable), refused at each traced call that does not call
    ``host`` exactly once.

    A ``step_fn`` that never calls the learner would leave every estimate zero (or fail
    with a message about states missing from a trace); the learner counts its calls as they
    are traced, so a ``step_fn`` that made none is caught while tracing, without reading any
    state (a read would change the traced program).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> checked_step_fn(learner, 'etrace_grad', lambda x: jnp.sum(x))(jnp.ones(3))
    Traceback (most recent call last):
    ...
    ValueError: etrace_grad: step_fn did not call this learner, so its step never ran. ...
    """
    if not callable(step_fn):
        raise TypeError(
            f"{call}: step_fn must be a function step_fn(*slices) that calls this learner once and "
            f"returns what the driver needs (the loss), got {step_fn!r} of type {type(step_fn).__name__}; "
            f"e.g. step_fn=lambda x, y: jnp.mean((learner(x) - y) ** 2)."
        )

    def stepped(*slices: PyTree) -> PyTree:
        before = host._seq_calls
        result = step_fn(*slices)
        calls = host._seq_calls - before
        if calls == 0:
            raise ValueError(
                f"{call}: step_fn did not call this learner, so its step never ran. Call the learner "
                f"on the step's inputs inside step_fn, once, e.g. "
                f"step_fn=lambda x, y: jnp.mean((learner(x) - y) ** 2)."
            )
        if calls > 1:
            raise ValueError(
                f"{call}: step_fn called this learner {calls} times in one step. Each call advances the "
                f"hidden states and traces by a step, so the driver's per-step gradient would be wrong. "
                f"Call the learner once per step and reuse its output, e.g. "
                f"out = learner(x); loss = loss_a(out, y) + loss_b(out)."
            )
        return result

    return stepped


def guarded_states(
    host: SequenceHost, call: str, check_finite: object, *data: PyTree,
) -> list[brainstate.State] | None:
    """The states to freeze after a non-finite step under ``check_finite`` (``None``: unchecked).

    ``data`` (the sequences, the mask) and the states must be concrete: a checked run reports
    after its loop, on the host.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> guarded_states(learner, 'etrace_grad', False) is None, len(guarded_states(learner, 'etrace_grad', True)) > 0
    (True, True)
    """
    if not isinstance(check_finite, bool):
        raise TypeError(
            f"{call}: check_finite must be True or False, got {check_finite!r} of type "
            f"{type(check_finite).__name__}."
        )
    if not check_finite:
        return None
    guarded = host._seq_guarded
    refuse_traced(call, *data, [st.value for st in guarded])
    return guarded

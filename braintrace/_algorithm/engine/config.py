"""``ETraceConfig``: a learning rule as a point in the space of eligibility-trace axes.

Every online rule of this package is one coordinate of six axes and their coefficients:

* ``trace_factorization`` — what the trace stores: a per-parameter trace (``'per_param'``,
  :class:`~braintrace.ParamDimVjpAlgorithm`), an input factor and an output factor
  (``'io_factorized'``, :class:`~braintrace.IODimVjpAlgorithm`), or a random rank-one pair
  (``'random_projection'``, :class:`~braintrace.RandomProjectionVjpAlgorithm`);
* ``temporal_recursion`` — what the trace roll reads in place of the hidden Jacobian ``D``:
  ``D`` itself (``'jacobian'``), a scalar leak (``'scalar_leak'`` with ``decay``) or nothing
  (``'none'``); under ``io_factorized`` a pair ``(x side, f side)``;
* ``recurrence_scope`` — what enters ``D``: the element-wise part only (``'diagonal'``), the
  recurrent weight mixing too (``'coupled'``), or SnAp's ``n``-step neighbourhoods
  (``'sparse_n'`` with ``sparse_n``);
* ``learning_signal`` — what meets the trace: ``∂L/∂h`` (``'symmetric'``), its projection
  through fixed random matrices (``'random_feedback'``), a modulator (``'modulatory'``) or a
  synthetic future gradient (``'bootstrapped'``);
* ``trace_filter`` — ``'kappa'``: the gradient reads ``ē ← κ ē + ε`` instead of ``ε``;
* ``update_schedule`` — ``'per_step'`` (``'window'`` and ``'sequence_end'`` are recognised and refused).

Execution options (``vjp_method``, ``fast_solve``, ``trace_dtype``, ``chunked_trace``,
``control_flow``, ``snap_max_jacobian_elements``) are not part of the coordinate.

Construction checks the vocabulary, rewrites equivalent spellings into one canonical form, and
then refuses incompatible combinations (each with a ``ValueError`` naming the combination and
the legal alternative), so two configs are equal exactly when they are the same rule.

Examples
--------
>>> import braintrace
>>> braintrace.ETraceConfig(trace_factorization='io_factorized', decay=0.9)  # pp_prop(0.9)
ETraceConfig(trace_factorization='io_factorized', temporal_recursion=('scalar_leak', 'jacobian'), decay=(0.9, 0.9))
>>> braintrace.ETraceConfig(recurrence_scope='sparse_n', sparse_n=1) == braintrace.ETraceConfig(recurrence_scope='coupled')
True
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import operator
from typing import Any, NamedTuple, NoReturn, Sequence, SupportsIndex, TypeVar

import jax
import jax.numpy as jnp

from braintrace._errors import internal_error

__all__ = [
    "ETraceConfig", "Recurrence", "recurrence", "engine_config", "require_feedback_key",
    "require_single_step_modulator",
]

TRACE_FACTORIZATIONS = ("per_param", "io_factorized", "random_projection")
TEMPORAL_RECURSIONS = ("jacobian", "scalar_leak", "none")
RECURRENCE_SCOPES = ("diagonal", "coupled", "sparse_n")
LEARNING_SIGNALS = ("symmetric", "random_feedback", "modulatory", "bootstrapped")
TRACE_FILTERS = ("none", "kappa")
UPDATE_SCHEDULES = ("per_step", "window", "sequence_end")

#: The engine of each trace factorization, as error messages name it.
ENGINES = {
    "per_param": "ParamDimVjpAlgorithm (the per-parameter trace engine)",
    "io_factorized": "IODimVjpAlgorithm (the input/output-factorised trace engine)",
    "random_projection": "RandomProjectionVjpAlgorithm (the random-projection trace engine)",
}

#: A recursion or decay under ``io_factorized``: ``(x side, f side)``.
Recursion = str | tuple[str, str]
Decay = float | tuple[float, float]
#: The value of one side of an ``io_factorized`` recursion or decay.
Side = TypeVar("Side", str, float)


@dataclasses.dataclass(frozen=True)
class ETraceConfig:
    """The coordinate of a learning rule (see the module docstring for the axes).

    Parameters
    ----------
    trace_factorization : {'per_param', 'io_factorized', 'random_projection'}
    temporal_recursion : {'jacobian', 'scalar_leak', 'none'} or a pair of them
        A pair ``(x side, f side)`` only under ``io_factorized``, where a single value applies
        to both sides and an x-side ``'jacobian'`` means ``'scalar_leak'`` (the input trace
        never involves a Jacobian), so ``'jacobian'`` is ``('scalar_leak', 'jacobian')``.
    recurrence_scope : {'diagonal', 'coupled', 'sparse_n'}
    learning_signal : {'symmetric', 'random_feedback', 'modulatory', 'bootstrapped'}
    trace_filter : {'none', 'kappa'}
    update_schedule : {'per_step'}
        ``'window'`` and ``'sequence_end'`` are recognised but not implemented.
    decay : float or pair of floats, optional
        In ``[0, 1)``: the leak of ``'scalar_leak'`` under ``per_param``; under
        ``io_factorized`` the smoothing ``(α_x, α_f)`` of the two factors (a float: both sides).
    kappa : float, optional
        In ``[0, 1)``: the filter of ``trace_filter='kappa'``.
    sparse_n : int, optional
        ``>= 1``: the SnAp order of ``recurrence_scope='sparse_n'``.
    window_size : int, optional
        The coefficient of ``update_schedule='window'`` (never legal today).

    Attributes
    ----------
    is_factorized : bool
        ``trace_factorization == 'io_factorized'``.
    recursion_x, recursion_f, decay_x, decay_f
        The two sides under ``io_factorized`` (``AttributeError`` otherwise).
    include_recurrent_mixing : bool
        Whether the scope traces recurrent weight mixing (``coupled`` and ``sparse_n``).

    Raises
    ------
    ValueError
        For an unknown axis value, a coefficient out of range, or an incompatible combination.
    TypeError
        For a coefficient of the wrong type (``decay='0.9'``, ``kappa=True``, ``sparse_n=2.0``).

    Notes
    -----
    Canonical spellings (applied before the compatibility rules): ``scalar_leak`` with decay 0
    is ``'none'`` (whose decay is 0.0); under ``io_factorized`` a zero decay makes its side
    ``'none'``; ``sparse_n`` with order 1 is ``'coupled'``; ``kappa`` 0 is ``trace_filter='none'``.

    Examples
    --------
    >>> import braintrace
    >>> cfg = braintrace.ETraceConfig(trace_filter='kappa', kappa=0.5, learning_signal='random_feedback')
    >>> cfg.describe()  # EProp(feedback='random', kappa_filter_decay=0.5)
    "trace_factorization='per_param', learning_signal='random_feedback', trace_filter='kappa', kappa=0.5"
    >>> cfg.replace(kappa=0.0) == braintrace.ETraceConfig(learning_signal='random_feedback')
    True
    >>> braintrace.ETraceConfig(trace_factorization='random_projection')
    Traceback (most recent call last):
    ...
    ValueError: ETraceConfig: trace_factorization='random_projection' needs recurrence_scope='coupled', got 'diagonal': ...
    """

    trace_factorization: str = "per_param"
    temporal_recursion: Recursion = "jacobian"
    recurrence_scope: str = "diagonal"
    learning_signal: str = "symmetric"
    trace_filter: str = "none"
    update_schedule: str = "per_step"
    decay: Decay | None = None
    kappa: float | None = None
    sparse_n: int | None = None
    window_size: int | None = None

    def __post_init__(self) -> None:
        _check_vocabulary(self)
        for name, value in _canonical(self).items():
            object.__setattr__(self, name, value)
        _check_compatibility(self)

    def __repr__(self) -> str:
        return f"ETraceConfig({self.describe()})"

    # --- derived views --------------------------------------------------------------------

    @property
    def is_factorized(self) -> bool:
        return self.trace_factorization == "io_factorized"

    @property
    def recursion_x(self) -> str:
        return str(self._side("recursion_x", self.temporal_recursion, 0))

    @property
    def recursion_f(self) -> str:
        return str(self._side("recursion_f", self.temporal_recursion, 1))

    @property
    def decay_x(self) -> float:
        return float(self._side("decay_x", self.decay, 0))

    @property
    def decay_f(self) -> float:
        return float(self._side("decay_f", self.decay, 1))

    def _side(self, view: str, pair: Side | tuple[Side, Side] | None, index: int) -> Side:
        if not self.is_factorized:
            raise AttributeError(
                f"ETraceConfig.{view} exists only under trace_factorization='io_factorized' (this "
                f"config is {self.trace_factorization!r}); read temporal_recursion / decay instead.")
        if not isinstance(pair, tuple):  # the canonical io_factorized config holds both sides
            raise internal_error(f"ETraceConfig.{view} of {pair!r}, not a pair")
        return pair[index]

    @property
    def include_recurrent_mixing(self) -> bool:
        return self.recurrence_scope in ("coupled", "sparse_n")

    # --- methods --------------------------------------------------------------------------

    def replace(self, **changes: Any) -> ETraceConfig:
        """A copy with ``changes`` applied, canonicalised and validated again."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """``field=value, ...`` of ``trace_factorization``, the other non-default axes and the set
        coefficients; ``ETraceConfig(**fields)`` of the parsed line is this config again."""
        shown = [
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
            if f.name == "trace_factorization" or getattr(self, f.name) != f.default
        ]
        return ", ".join(shown)


ETraceConfig.__module__ = "braintrace"


# --- construction: vocabulary, canonical form, compatibility --------------------------------------

_AXES = {
    "trace_factorization": TRACE_FACTORIZATIONS,
    "recurrence_scope": RECURRENCE_SCOPES,
    "learning_signal": LEARNING_SIGNALS,
    "trace_filter": TRACE_FILTERS,
    "update_schedule": UPDATE_SCHEDULES,
}


def _unknown(field: str, value: object, legal: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(value, legal, n=1) if isinstance(value, str) else []
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"ETraceConfig: {field}={value!r} is not a known value; the legal values are {tuple(legal)}.{hint}")


def _check_vocabulary(cfg: ETraceConfig) -> None:
    for field, legal in _AXES.items():
        value = getattr(cfg, field)
        if not (isinstance(value, str) and value in legal):
            raise _unknown(field, value, legal)
    recursion = cfg.temporal_recursion
    if isinstance(recursion, (tuple, list)):
        if len(recursion) != 2:
            raise ValueError(
                f"ETraceConfig: temporal_recursion={recursion!r} must be one value or a pair "
                f"(x_side, f_side), got {len(recursion)} entries.")
        for side in recursion:
            if not (isinstance(side, str) and side in TEMPORAL_RECURSIONS):
                raise _unknown("temporal_recursion", side, TEMPORAL_RECURSIONS)
    elif not (isinstance(recursion, str) and recursion in TEMPORAL_RECURSIONS):
        raise _unknown("temporal_recursion", recursion, TEMPORAL_RECURSIONS)


def _coefficient(value: object, name: str) -> float:
    """``value`` as a float in ``[0, 1)`` (``TypeError`` for a bool or non-number, else ``ValueError``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"ETraceConfig: {name} must be a float in [0, 1), got {type(value).__name__} {value!r}.")
    if not 0.0 <= float(value) < 1.0:
        hint = (" An integer rank (e.g. 19) is not a decay here: ranks belong to decay_or_rank of "
                "pp_prop / IODimVjpAlgorithm.") if name == "decay" else ""
        raise ValueError(f"ETraceConfig: {name}={value!r} is outside [0, 1).{hint}")
    return float(value)


def _order(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"ETraceConfig: sparse_n must be an int >= 1, got the bool {value!r}.")
    not_an_int = TypeError(f"ETraceConfig: sparse_n must be an int >= 1, got {type(value).__name__} {value!r}.")
    if not isinstance(value, SupportsIndex):
        raise not_an_int
    try:
        order = operator.index(value)
    except TypeError:
        raise not_an_int from None
    if order < 1:
        raise ValueError(
            f"ETraceConfig: sparse_n must be >= 1, got {order} (n = 1 is recurrence_scope='coupled'; "
            f"'diagonal' is not n = 0).")
    return order


def _one_side(recursion: str, decay: float | None, where: str) -> tuple[str, float | None]:
    """One trace's recursion and decay, canonical: a zero-decay leak is ``'none'``, whose decay is 0."""
    if recursion == "scalar_leak" and decay == 0.0:
        return "none", 0.0
    if recursion == "none":
        if decay not in (None, 0.0):
            raise ValueError(
                f"ETraceConfig: {where} is 'none' (no recursion) but its decay is {decay!r}; give "
                f"decay 0.0 (or none), or use 'scalar_leak' for a leak.")
        return "none", 0.0
    return recursion, decay


def _io_sides(
    recursion: Recursion, decay: Decay | None,
) -> tuple[tuple[str, str], tuple[float | None, float | None] | None]:
    if isinstance(recursion, str):
        # A single value applies to both sides; the input trace never involves a Jacobian.
        recursions = ("scalar_leak" if recursion == "jacobian" else recursion, recursion)
    else:
        recursions = (recursion[0], recursion[1])
    decays: tuple[float | None, ...]
    if isinstance(decay, (tuple, list)):
        if len(decay) != 2:
            raise ValueError(f"ETraceConfig: decay={decay!r} must be one float or a pair (x_side, f_side).")
        decays = tuple(None if d is None else _coefficient(d, "decay") for d in decay)
    else:
        decays = (None, None) if decay is None else (_coefficient(decay, "decay"),) * 2
    sides = []
    for name, r, d in zip(("x side", "f side"), recursions, decays):
        # ε ← α·(Rε) + ... drops the old trace at α = 0, whatever R is.
        sides.append(_one_side("none" if d == 0.0 else r, d, f"the {name} of temporal_recursion"))
    (rx, dx), (rf, df) = sides
    return (rx, rf), (None if dx is None and df is None else (dx, df))


def _canonical(cfg: ETraceConfig) -> dict[str, object]:
    recursion: Recursion
    decay: float | tuple[float | None, float | None] | None
    if cfg.trace_factorization == "io_factorized":
        recursion, decay = _io_sides(cfg.temporal_recursion, cfg.decay)
    else:
        recursion, decay = _one_trace(cfg)
    scope, sparse_n = cfg.recurrence_scope, cfg.sparse_n
    if sparse_n is not None:
        sparse_n = _order(sparse_n)
        if scope == "sparse_n" and sparse_n == 1:
            scope, sparse_n = "coupled", None
    trace_filter, kappa = cfg.trace_filter, cfg.kappa
    if trace_filter == "kappa" and isinstance(kappa, numbers.Real) and not isinstance(kappa, bool):
        kappa = float(kappa)  # its range is checked with the coefficients (R7)
        if kappa == 0.0:
            trace_filter, kappa = "none", None
    return {"temporal_recursion": recursion, "decay": decay, "recurrence_scope": scope, "sparse_n": sparse_n,
            "trace_filter": trace_filter, "kappa": kappa}


def _one_trace(cfg: ETraceConfig) -> tuple[str, float | None]:
    """The canonical recursion and decay of a factorization that keeps one trace (refusing pairs)."""
    recursion, decay = cfg.temporal_recursion, cfg.decay
    if isinstance(recursion, (tuple, list)):
        raise _pair_refused("temporal_recursion", recursion, cfg)
    if isinstance(decay, (tuple, list)):
        raise _pair_refused("decay", decay, cfg)
    return _one_side(recursion, None if decay is None else _coefficient(decay, "decay"), "temporal_recursion")


def _pair_refused(name: str, value: object, cfg: ETraceConfig) -> ValueError:
    return ValueError(
        f"ETraceConfig: {name}={value!r} may only be a pair under io_factorized; "
        f"trace_factorization={cfg.trace_factorization!r} keeps one trace, give one value.")


def _check_compatibility(cfg: ETraceConfig) -> None:
    """The compatibility rules, on the canonical form, in order; the first that fails raises."""
    fact, scope = cfg.trace_factorization, cfg.recurrence_scope
    recursion, decay = cfg.temporal_recursion, cfg.decay
    consumer = recursion[1] if isinstance(recursion, tuple) else recursion
    if cfg.update_schedule != "per_step":
        _refuse(f"update_schedule={cfg.update_schedule!r} is recognised but not implemented; the "
                f"available schedule is 'per_step' (windows: vjp_method='multi-step' with MultiStepData).")
    if cfg.trace_filter == "kappa" and fact != "per_param":
        extra = "; for random_projection it would also break unbiasedness" if fact == "random_projection" else ""
        _refuse(f"trace_filter='kappa' needs trace_factorization='per_param', got {fact!r}: the filtered sum "
                f"of rank-one or factor-pair traces is not representable in that carrier{extra}. Use "
                f"per_param (EProp's coordinate) or trace_filter='none'.")
    if scope != "diagonal" and consumer != "jacobian":
        side = "the f side of temporal_recursion" if cfg.is_factorized else "temporal_recursion"
        _refuse(f"recurrence_scope={scope!r} needs {side} to be 'jacobian', got {consumer!r}: the scope "
                f"only changes what enters D, which {consumer!r} does not read. Use 'jacobian' there, or "
                f"recurrence_scope='diagonal'.")
    if isinstance(recursion, tuple) and recursion[0] == "jacobian":
        _refuse(f"temporal_recursion={recursion!r} has an x-side 'jacobian' under io_factorized: the input "
                f"trace never involves a Jacobian. Use ('scalar_leak', ...) or ('none', ...); the single "
                f"value 'jacobian' means ('scalar_leak', 'jacobian').")
    if recursion == "jacobian" and decay is not None:
        _refuse(f"decay={cfg.decay!r} with temporal_recursion='jacobian' would be silently ignored (the "
                f"Jacobian is the recursion). Drop decay, or use temporal_recursion='scalar_leak'.")
    if fact == "per_param" and recursion == "scalar_leak" and decay is None:
        _refuse("temporal_recursion='scalar_leak' needs decay in [0, 1): the leak is the rule, e.g. decay=0.9.")
    if cfg.is_factorized and (not isinstance(decay, tuple) or None in decay):
        _refuse(f"trace_factorization='io_factorized' needs the decay of both sides, got decay={decay!r}: "
                f"the smoothing coefficients are the rule. Give decay=α or decay=(α_x, α_f), each in [0, 1).")
    _check_coefficients(cfg)
    if fact == "random_projection" and scope != "coupled":
        _refuse(f"trace_factorization='random_projection' needs recurrence_scope='coupled', got {scope!r}: "
                f"'diagonal' would estimate an already-biased trace (more variance, same bias, no memory "
                f"saved); 'sparse_n' pays SnAp's memory for accuracy the estimator has in expectation.")
    if scope == "sparse_n" and fact != "per_param":
        _refuse(f"recurrence_scope='sparse_n' needs trace_factorization='per_param', got {fact!r}: the "
                f"factorised input side has no hidden index to widen. Use recurrence_scope='coupled'.")
    if scope == "sparse_n" and (cfg.sparse_n is None or cfg.sparse_n < 2):
        _refuse(f"recurrence_scope='sparse_n' with order {cfg.sparse_n!r} survived canonicalisation "
                f"(order 1 is 'coupled'); this is an internal error, please report it.")


def _refuse(reason: str) -> NoReturn:
    raise ValueError(f"ETraceConfig: {reason}")


def _check_coefficients(cfg: ETraceConfig) -> None:
    """A coefficient needs its category value and the category value its coefficient; then κ's range."""
    pairs = (("kappa", cfg.kappa, "trace_filter", "kappa", cfg.trace_filter),
             ("sparse_n", cfg.sparse_n, "recurrence_scope", "sparse_n", cfg.recurrence_scope),
             ("window_size", cfg.window_size, "update_schedule", "window", cfg.update_schedule))
    for name, value, axis, category, actual in pairs:
        if value is not None and actual != category:
            _refuse(f"{name}={value!r} without {axis}={category!r} ({axis}={actual!r}): a coefficient "
                    f"without its category is a typo. Add {axis}={category!r} or drop {name}.")
        if value is None and actual == category:
            _refuse(f"{axis}={category!r} needs its coefficient {name}.")
    if cfg.kappa is not None:
        _coefficient(cfg.kappa, "kappa")


# --- what the engines read off a config -----------------------------------------------------------


class Recurrence(NamedTuple):
    """The ``R`` a trace roll reads in place of a group's hidden Jacobian ``D``.

    Built from ``D``'s shape (``(..., S, S)``, any leading axes): ``D`` itself
    (``'jacobian'``), ``leak · I`` (``'scalar_leak'``) or zeros (``'none'``).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> Recurrence('scalar_leak', 0.5)(jnp.ones((3, 2, 2)))[0]
    Array([[0.5, 0. ],
           [0. , 0.5]], dtype=float32)
    """

    kind: str
    leak: float = 1.0

    def __call__(self, D: jax.Array) -> jax.Array:
        if self.kind == "jacobian":
            return D
        if self.kind == "none":
            return jnp.zeros_like(D)
        eye = jnp.eye(D.shape[-1], dtype=D.dtype)
        return jnp.broadcast_to(jnp.asarray(self.leak, D.dtype) * eye, D.shape)


def recurrence(config: ETraceConfig) -> Recurrence | None:
    """The substitute for ``D`` that ``config``'s trace roll reads (``None``: ``D`` itself).

    Under ``io_factorized`` it is the f side's: ``R = I`` for ``'scalar_leak'``, whose leak
    ``α_f`` the roll applies outside ``R``. Elsewhere ``'scalar_leak'`` is ``decay · I``.
    """
    if config.is_factorized:
        kind, leak = config.recursion_f, 1.0
    else:
        kind, leak = str(config.temporal_recursion), config.decay if isinstance(config.decay, float) else 0.0
    return None if kind == "jacobian" else Recurrence(kind, leak)


#: Where the learning signals no engine realises yet will come from.
_SIGNAL_PROVIDERS = {
    "modulatory": "learning_signal='modulatory' (a modulator in place of ∂L/∂h) is realised by the "
                  "per_param and io_factorized engines (braintrace.ThreeFactor is the per_param one)",
    "bootstrapped": "learning_signal='bootstrapped' needs a synthetic future gradient injected at every "
                    "window exit, a hook only the DNI learner overrides; use braintrace.DNI (compile "
                    "name 'dni') with a braintrace.SyntheticGradient",
    "random_feedback": "learning_signal='random_feedback' is realised by the per_param and io_factorized "
                       "engines",
}


def engine_config(config: object, factorization: str, learner: str, signals: Sequence[str]) -> ETraceConfig:
    """``config`` checked for an engine of ``factorization`` that realises ``signals``.

    Raises
    ------
    TypeError
        If ``config`` is not an :class:`ETraceConfig`.
    ValueError
        If it is a coordinate of another trace factorization.
    NotImplementedError
        If its learning signal is not one of ``signals``.
    """
    if not isinstance(config, ETraceConfig):
        raise TypeError(f"{learner}: config must be a braintrace.ETraceConfig, got {type(config).__name__} {config!r}.")
    other = config.trace_factorization
    if other != factorization:
        raise ValueError(
            f"{learner}: config has trace_factorization={other!r}, but {learner} is "
            f"{ENGINES[factorization]}. A {other!r} config runs on {ENGINES[other]}; "
            f"braintrace.compile(model, config, x) picks the engine.")
    if config.learning_signal not in signals:
        raise NotImplementedError(f"{learner}: {_SIGNAL_PROVIDERS[config.learning_signal]}.")
    return config


def require_single_step_modulator(config: ETraceConfig, vjp_method: str, learner: str) -> None:
    """Refuse ``learning_signal='modulatory'`` outside ``vjp_method='single-step'``."""
    if config.learning_signal == "modulatory" and vjp_method != "single-step":
        raise ValueError(
            f"{learner}: learning_signal='modulatory' needs vjp_method='single-step', got {vjp_method!r}: in a "
            f"multi-step window the exact in-window reverse-mode term of the relation weights would stay "
            f"unmodulated. Call the learner once per time step with its modulator.")


def require_feedback_key(config: ETraceConfig, key: object, learner: str) -> None:
    """Refuse ``learning_signal='random_feedback'`` without ``random_feedback_key``."""
    if config.learning_signal == "random_feedback" and key is None:
        raise ValueError(
            f"{learner}: learning_signal='random_feedback' needs random_feedback_key (an int seed or a "
            f"PRNG key) to draw the fixed feedback matrices, e.g. random_feedback_key=0.")

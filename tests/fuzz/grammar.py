"""The grammar of fuzzed models: frozen specs and the hypothesis strategies that draw them.

A :class:`ModelSpec` is one to three hidden groups and a readout. Each :class:`GroupSpec` says
where its drive comes from (the input or an earlier group's output), which operator family
computes the drive (:class:`OpSpec`: ``matmul``, ``sparse``, ``grouped``, ``lora``, ``einsum``,
``conv``, ``elemwise``, ``embedding``, each with an optional transform hook and bias), how the
group recurs (none, a constant or trainable element-wise leak, a mixing weight operation, a
roll), whether it carries a second hidden state (an adaptation ``a``), resets like a spiking
unit, wraps its update in control flow (``cond``, an inner ``lax.scan`` or
``brainstate.transform.for_loop``, a weight-free ``while``), reads its previous value past the
update, and keeps its state in ``mV``.

:func:`cases` draws every feature equally, so few of its models get an ``exact`` label;
:func:`exact_leaning_cases` draws the models a learner is exact for (element-wise recurrences
under D_RTRL and EProp at κ = 0, mixing ones under a saturated SnAp) with the other features
free, and :func:`mixed_cases`, the fuzzer's profile, draws two of those for each unconstrained one.

Specs are plain data with a ``repr`` that is valid Python, so a failure the fuzzer finds is
pasted into ``test_regressions.py`` as an explicit model. The sizes are tiny on purpose.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

__all__ = [
    "FAMILIES", "HOOKS", "RECURRENCES", "CONTROLS", "LEARNERS",
    "EXACT_LEARNERS", "OpSpec", "GroupSpec", "ModelSpec", "FuzzCase", "cases", "exact_leaning_cases", "mixed_cases",
]

FAMILIES = ("matmul", "sparse", "grouped", "lora", "einsum", "conv", "elemwise", "embedding")
#: Families that can read any source width (the rest fix the output width from the source).
FREE_WIDTH = ("matmul", "sparse", "lora", "einsum")
#: Families usable as a mixing recurrence ``op(h)`` (square, width to width).
MIXING = ("matmul", "sparse", "grouped", "lora", "einsum")
HOOKS = ("none", "tanh", "affine", "roll")
RECURRENCES = ("none", "const", "param", "mix", "roll")
CONTROLS = ("none", "cond", "scan", "for_loop", "while")
READS = ("new", "old")
READOUTS = ("plain", "etp", "identity")
#: ``name -> (algorithm, compile options, chunk size)``; the chunk is the window of a multi-step run.
LEARNERS: dict[str, tuple[str, dict[str, object], int]] = {
    "d_rtrl": ("d_rtrl", {}, 1),
    "d_rtrl_window": ("d_rtrl", {"vjp_method": "multi-step"}, 2),
    "pp_prop": ("pp_prop", {"decay_or_rank": 0.9}, 1),
    "eprop": ("eprop", {"kappa_filter_decay": 0.5}, 1),
    "eprop_k0": ("eprop", {"kappa_filter_decay": 0.0}, 1),
    "snap_saturated": ("snap", {"n": 10}, 1),
}
#: The learners that can label a relation exact (pp_prop's factorised trace and EProp's κ > 0 never do).
#: D_RTRL and EProp at κ = 0 are exact for element-wise recurrences; a saturated SnAp also for mixing ones.
EXACT_LEARNERS = ("d_rtrl", "d_rtrl_window", "eprop_k0", "snap_saturated")

N_IN = 3
VOCAB = 5


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One ETP operation ``src (..., n_in) -> (..., n_out)`` of one family.

    ``size`` is the family's own size: the groups of ``grouped``, the rank of ``lora``, the
    output channels of ``conv`` (``n_out = size * n_in``); unused elsewhere. ``seed`` draws
    the weights (and the sparsity pattern of ``sparse``).
    """

    family: str
    n_in: int
    n_out: int
    hook: str = "none"
    bias: bool = False
    size: int = 1
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One hidden group: a drive, a recurrence and the extras listed in the module docstring.

    ``source`` is ``-1`` for the input, else the index of an earlier group whose output drives
    this one. ``adapt`` is ``''`` (one state), ``'old'`` or ``'new'`` (a second state ``a``
    following the previous or the new value of ``h``). ``steps`` is the inner loop's length.
    """

    width: int
    drive: OpSpec
    source: int = -1
    recurrence: str = "const"
    mix: OpSpec | None = None
    adapt: str = ""
    reset: bool = False
    control: str = "none"
    steps: int = 2
    read: str = "new"
    unit: bool = False


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Groups, a readout of the concatenated group outputs, the batch size and the seed of the data."""

    groups: tuple[GroupSpec, ...]
    readout: str = "plain"
    batch: int | None = None
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """A model and the learner to run it with (a key of :data:`LEARNERS`)."""

    model: ModelSpec
    learner: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def op_specs(draw: st.DrawFn, n_in: int, families: tuple[str, ...], width: int | None = None) -> OpSpec:
    """An operation reading ``n_in`` features; ``width`` fixes its output (a mixing recurrence)."""
    family = draw(st.sampled_from(families))
    hook = draw(st.sampled_from(HOOKS))
    bias = draw(st.booleans()) if family in ("matmul", "sparse", "grouped", "lora", "conv") else False
    seed = draw(st.integers(0, 999))
    size = 1
    if family == "grouped":
        common = [d for d in _divisors(n_in) if width is None or width % d == 0]
        size = draw(st.sampled_from(common))
        n_out = width if width is not None else size * draw(st.integers(1, 3))
    elif family == "lora":
        size = draw(st.integers(1, 2))
        n_out = width if width is not None else draw(st.integers(2, 5))
    elif family == "conv":
        size = draw(st.integers(1, 2))
        n_out = size * n_in
    elif family in ("elemwise",):
        n_out = n_in
    elif family == "embedding":
        n_out = width if width is not None else draw(st.integers(2, 5))
    else:
        n_out = width if width is not None else draw(st.integers(2, 5))
    return OpSpec(family, n_in, n_out, hook, bias, size, seed)


def _group(draw: st.DrawFn, source: int, widths: list[int], recurrences: tuple[str, ...],
           controls: tuple[str, ...]) -> GroupSpec:
    """A group reading ``source`` (``-1``: the input), its recurrence and control flow drawn from
    ``recurrences`` and ``controls``, every other feature drawn freely."""
    n_src = N_IN if source < 0 else widths[source]
    families = FAMILIES if source < 0 else tuple(f for f in FAMILIES if f != "embedding")
    drive = draw(op_specs(n_src, families))
    width = drive.n_out
    recurrence = draw(st.sampled_from(recurrences))
    mix = draw(op_specs(width, MIXING, width=width)) if recurrence == "mix" else None
    return GroupSpec(
        width=width, drive=drive, source=source, recurrence=recurrence, mix=mix,
        adapt=draw(st.sampled_from(("", "", "old", "new"))), reset=draw(st.booleans()),
        control=draw(st.sampled_from(controls)), steps=draw(st.integers(1, 3)),
        read=draw(st.sampled_from(READS)), unit=draw(st.booleans()),
    )


@st.composite
def group_specs(draw: st.DrawFn, index: int, widths: list[int]) -> GroupSpec:
    """Group ``index``; ``widths`` are the output widths of the groups before it."""
    return _group(draw, draw(st.integers(-1, index - 1)), widths, RECURRENCES, CONTROLS)


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    n_groups = draw(st.integers(1, 3))
    groups: list[GroupSpec] = []
    for index in range(n_groups):
        groups.append(draw(group_specs(index, [g.width for g in groups])))
    return ModelSpec(
        groups=tuple(groups), readout=draw(st.sampled_from(READOUTS)),
        batch=draw(st.sampled_from((None, 2))), seed=draw(st.integers(0, 999)),
    )


def cases() -> st.SearchStrategy[FuzzCase]:
    """A model and a learner, every feature equally likely: mostly models no learner is exact for."""
    return st.builds(FuzzCase, model_specs(), st.sampled_from(tuple(LEARNERS)))


@st.composite
def exact_leaning_groups(draw: st.DrawFn, index: int, widths: list[int], mixing: bool) -> GroupSpec:
    """Group ``index`` of an exact-leaning model: an element-wise recurrence (a mixing one when
    ``mixing``, for a saturated SnAp), driven from the input through any family, mostly flat control.

    A stacked group (``source >= 0``) leaves the group it reads approximate (cross-group coupling)
    and its own drive exact, so it still reaches the element-wise comparison.
    """
    source = -1 if index == 0 or draw(st.integers(0, 3)) else draw(st.integers(0, index - 1))
    recurrences = ("mix",) if mixing else ("const", "param", "param", "none")
    return _group(draw, source, widths, recurrences, ("none", "none", "none", "cond", "while", "scan", "for_loop"))


@st.composite
def exact_leaning_cases(draw: st.DrawFn) -> FuzzCase:
    """A case a learner is likely to label exact, so that the element-wise BPTT comparison runs.

    One or two groups with element-wise recurrences (constant or trainable leak, or none; no
    mixing weight, no roll) under D_RTRL (one step or windows of two) or EProp at κ = 0; or
    mixing recurrences under a saturated SnAp. Drives, hooks, biases, adaptation, resets, units,
    readouts and batches vary as in :func:`cases`, so the surprising combinations still come up.
    """
    learner = draw(st.sampled_from(("d_rtrl", "d_rtrl", "d_rtrl_window", "eprop_k0", "snap_saturated")))
    mixing = learner == "snap_saturated" and draw(st.booleans())
    groups: list[GroupSpec] = []
    for index in range(draw(st.integers(1, 2))):
        groups.append(draw(exact_leaning_groups(index, [g.width for g in groups], mixing)))
    model = ModelSpec(
        groups=tuple(groups), readout=draw(st.sampled_from(READOUTS)),
        batch=draw(st.sampled_from((None, 2))), seed=draw(st.integers(0, 999)),
    )
    return FuzzCase(model, learner)


@st.composite
def mixed_cases(draw: st.DrawFn) -> FuzzCase:
    """Two exact-leaning cases for every unconstrained one (the profile of the fuzzer)."""
    return draw(exact_leaning_cases() if draw(st.integers(0, 2)) < 2 else cases())

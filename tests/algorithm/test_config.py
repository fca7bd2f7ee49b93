"""``braintrace.ETraceConfig``: the axis space, its canonical form and rules, and the engines that realise it.

The numeric checks run in float64 (the ``x64`` fixture) with finite windows or single-step
driving (one window over the whole sequence is exact reverse mode for every rule). Coordinates
that must coincide are compared bit for bit; every "differs" uses a relative threshold far above
round-off, and every "equals" has a negative control beside it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import braintrace
from braintrace._algorithm.engine.config import _check_compatibility
from braintrace._algorithm.engine.learning_signal import project_feedback
from tests.algorithm.bptt import Grads, max_rel_err, normal, single_step_grads, window_grads, x64
from tests.compiler import control_flow_models as cf

__all__ = ["x64"]  # the fixture is used by name

Config = braintrace.ETraceConfig
IO = "io_factorized"
RP = "random_projection"
T = 4
BATCH = 2


class Leaky(brainstate.nn.Module):
    """``h ← λ h + x W``: D is the constant ``λ``."""

    def __init__(self, lam: float = 0.9) -> None:
        super().__init__()
        self.lam = lam
        self.w = brainstate.ParamState(normal(0, (3, 4), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4)))

    def update(self, x: Any) -> Any:
        self.h.value = self.lam * self.h.value + braintrace.matmul(x, self.w.value)
        return self.h.value


class TanhRNN(brainstate.nn.Module):
    """``h ← tanh(0.6 h + x W_in + h W_rec)``: both weights traced, an element-wise leak through tanh."""

    def __init__(self, leak: float = 0.6) -> None:
        super().__init__()
        self.leak = leak
        self.w_in = brainstate.ParamState(normal(1, (3, 4), 0.6))
        self.w_rec = brainstate.ParamState(normal(2, (4, 4), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, 4)))

    def update(self, x: Any) -> Any:
        drive = braintrace.matmul(x, self.w_in.value) + braintrace.matmul(self.h.value, self.w_rec.value)
        self.h.value = jnp.tanh(self.leak * self.h.value + drive)
        return self.h.value


def inputs(steps: int = T) -> jax.Array:
    return normal(7, (steps, BATCH, 3))


def learner_of(model: Any, algorithm: Any, **options: Any) -> Any:
    return braintrace.compile(model, algorithm, inputs()[0], batch_size=BATCH, **options)


PATHS = {
    "single-step": {},
    "stacked": {"vjp_method": "multi-step", "chunked_trace": True},
    "fused": {"vjp_method": "multi-step", "chunked_trace": False},
}


MODELS = {"leaky": Leaky, "tanh": TanhRNN, "tanh-no-leak": lambda: TanhRNN(0.0)}


def run(model: str, algorithm: Any, path: str, **options: Any) -> Grads:
    """Summed online gradients over ``T`` steps of a fresh ``MODELS[model]``, single step or
    windows of 2 (``chunk < T``); cached, so that tests share their references."""
    return _run_cached(model, algorithm, path, tuple(sorted(options.items())))


@functools.lru_cache(maxsize=None)
def _run_cached(model: str, algorithm: Any, path: str, options: tuple[tuple[str, Any], ...]) -> Grads:
    assert jax.config.jax_enable_x64, "the numeric checks run under the x64 fixture"
    learner = learner_of(MODELS[model](), algorithm, **PATHS[path], **dict(options))
    xs = inputs()
    return single_step_grads(learner, xs) if path == "single-step" else window_grads(learner, xs, [2, 2])


def identical(a: Grads, b: Grads) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


# --- vocabulary, defaults, frozen, equality ------------------------------------------------


def test_defaults() -> None:
    cfg = Config()
    assert (cfg.trace_factorization, cfg.temporal_recursion, cfg.recurrence_scope) == ("per_param", "jacobian", "diagonal")
    assert (cfg.learning_signal, cfg.trace_filter, cfg.update_schedule) == ("symmetric", "none", "per_step")
    assert (cfg.decay, cfg.kappa, cfg.sparse_n, cfg.window_size) == (None, None, None, None)
    assert Config.__module__ == "braintrace" and braintrace.ETraceConfig is Config


@pytest.mark.parametrize("field, value", [
    ("trace_factorization", "per_parameter"), ("temporal_recursion", "jacobain"), ("recurrence_scope", "coupeld"),
    ("recurrence_scope", 2), ("learning_signal", "random"), ("trace_filter", "kapa"), ("update_schedule", "step"),
    ("temporal_recursion", ("scalar_leak", "leak")),
])
def test_unknown_values_are_named_with_the_legal_ones(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match="is not a known value; the legal values are"):
        Config(**{field: value})


def test_a_misspelling_gets_a_suggestion() -> None:
    with pytest.raises(ValueError, match="Did you mean 'jacobian'"):
        Config(temporal_recursion="jacobain")


def test_frozen_and_hashable() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.decay = 0.5  # type: ignore[misc]
    assert len({Config(), Config(), Config(recurrence_scope="coupled")}) == 2


def test_equality_is_by_canonical_coordinate() -> None:
    pairs = [
        (Config(recurrence_scope="sparse_n", sparse_n=1), Config(recurrence_scope="coupled")),
        (Config(trace_filter="kappa", kappa=0.0), Config()),
        (Config(temporal_recursion="scalar_leak", decay=0.0), Config(temporal_recursion="none")),
        (Config(trace_factorization=IO, decay=0.9), Config(trace_factorization=IO, decay=[0.9, 0.9],
                                                          temporal_recursion=["scalar_leak", "jacobian"])),
    ]
    for a, b in pairs:
        assert a == b and hash(a) == hash(b)
    assert Config(recurrence_scope="coupled") != Config()


# --- canonicalisation ----------------------------------------------------------------------


def test_zero_leak_is_none_and_none_has_decay_zero() -> None:
    cfg = Config(temporal_recursion="scalar_leak", decay=0.0)
    assert (cfg.temporal_recursion, cfg.decay) == ("none", 0.0)
    assert Config(temporal_recursion="none").decay == 0.0
    with pytest.raises(ValueError, match="is 'none' .* but its decay is 0.5"):
        Config(temporal_recursion="none", decay=0.5)


def test_per_param_jacobian_with_zero_decay_is_not_collapsed() -> None:
    with pytest.raises(ValueError, match="would be silently ignored"):
        Config(decay=0.0)


def test_io_expansion_demotion_and_zero_sides() -> None:
    cfg = Config(trace_factorization=IO, decay=0.5)
    assert (cfg.temporal_recursion, cfg.decay) == (("scalar_leak", "jacobian"), (0.5, 0.5))
    assert Config(trace_factorization=IO, temporal_recursion="scalar_leak", decay=0.5).temporal_recursion == (
        "scalar_leak", "scalar_leak")
    # A zero decay makes its side 'none' whatever the recursion, even an explicit x-side jacobian.
    cfg = Config(trace_factorization=IO, temporal_recursion=("jacobian", "jacobian"), decay=(0.0, 0.5))
    assert (cfg.temporal_recursion, cfg.decay) == (("none", "jacobian"), (0.0, 0.5))
    assert Config(trace_factorization=IO, decay=(0.9, 0.0)).temporal_recursion == ("scalar_leak", "none")
    assert Config(trace_factorization=IO, decay=0.0).temporal_recursion == ("none", "none")


def test_pairs_only_under_io() -> None:
    for kwargs in ({"temporal_recursion": ("scalar_leak", "jacobian")}, {"decay": (0.5, 0.5)}):
        for fact in ("per_param", RP):
            with pytest.raises(ValueError, match="may only be a pair under io_factorized"):
                Config(trace_factorization=fact, **kwargs)


def test_sparse_order_one_is_coupled_and_type_checked_first() -> None:
    cfg = Config(recurrence_scope="sparse_n", sparse_n=1)
    assert (cfg.recurrence_scope, cfg.sparse_n) == ("coupled", None)
    assert Config(recurrence_scope="sparse_n", sparse_n=np.int64(3)).sparse_n == 3
    with pytest.raises(TypeError, match="bool"):
        Config(recurrence_scope="sparse_n", sparse_n=True)
    with pytest.raises(TypeError, match="int"):
        Config(recurrence_scope="sparse_n", sparse_n=2.0)
    with pytest.raises(ValueError, match="n = 1 is recurrence_scope='coupled'; 'diagonal' is not n = 0"):
        Config(recurrence_scope="sparse_n", sparse_n=0)


PRESETS = [
    Config(), Config(recurrence_scope="coupled"), Config(trace_filter="kappa", kappa=0.5),
    Config(learning_signal="random_feedback"), Config(trace_factorization=IO, decay=0.9),
    Config(trace_factorization=IO, decay=(1e-6, 1e-6)), Config(trace_factorization=IO, decay=0.0),
    Config(recurrence_scope="sparse_n", sparse_n=3), Config(trace_factorization=RP, recurrence_scope="coupled"),
    Config(learning_signal="modulatory"), Config(learning_signal="bootstrapped"),
    Config(temporal_recursion="scalar_leak", decay=0.5), Config(temporal_recursion="none"),
]


@pytest.mark.parametrize("cfg", PRESETS, ids=[c.describe() for c in PRESETS])
def test_canonicalisation_is_idempotent_and_describe_round_trips(cfg: Config) -> None:
    again = Config(**dataclasses.asdict(cfg))
    assert again == cfg and dataclasses.asdict(again) == dataclasses.asdict(cfg)
    assert Config(**parse(cfg.describe())) == cfg
    assert cfg.describe().startswith("trace_factorization=")
    assert repr(cfg) == f"ETraceConfig({cfg.describe()})"


def parse(line: str) -> dict[str, Any]:
    """The fields of a ``describe()`` line (``field=<literal>, ...``)."""
    call = ast.parse(f"f({line})", mode="eval").body
    assert isinstance(call, ast.Call)
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}


# Legal coordinates by construction (a few combinations the rules refuse are skipped with assume).
PER_PARAM = st.one_of(
    st.fixed_dictionaries({"temporal_recursion": st.just("jacobian"),
                           "recurrence_scope": st.sampled_from(["diagonal", "coupled", "sparse_n"]),
                           "sparse_n": st.sampled_from([1, 2, 4])}),
    st.fixed_dictionaries({"temporal_recursion": st.just("scalar_leak"), "decay": st.sampled_from([0.0, 0.5, 0.9])}),
    st.fixed_dictionaries({"temporal_recursion": st.just("none"), "decay": st.sampled_from([None, 0.0])}),
).map(lambda d: {**d, "sparse_n": d.get("sparse_n") if d.get("recurrence_scope") == "sparse_n" else None})
IO_SIDES = st.fixed_dictionaries({
    "trace_factorization": st.just(IO),
    "temporal_recursion": st.one_of(st.sampled_from(["jacobian", "scalar_leak", "none"]),
                                    st.tuples(st.sampled_from(["scalar_leak", "none"]),
                                              st.sampled_from(["jacobian", "scalar_leak", "none"]))),
    "decay": st.one_of(st.sampled_from([0.0, 0.3, 0.9]), st.tuples(st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.7]))),
    "recurrence_scope": st.sampled_from(["diagonal", "coupled"]),
})
LEGAL = st.tuples(
    st.one_of(PER_PARAM, IO_SIDES, st.just({"trace_factorization": RP, "recurrence_scope": "coupled"})),
    st.sampled_from(["symmetric", "random_feedback", "modulatory", "bootstrapped"]),
    st.sampled_from([None, 0.0, 0.4]),
).map(lambda t: {**t[0], "learning_signal": t[1],
                 **({"trace_filter": "kappa", "kappa": t[2]} if t[2] is not None and "trace_factorization" not in t[0]
                    else {})})


def respell(cfg: Config, flips: list[bool]) -> dict[str, Any]:
    """``cfg``'s fields written another way that must canonicalise back to ``cfg``."""
    fields = dataclasses.asdict(cfg)
    recursion, decay = fields["temporal_recursion"], fields["decay"]
    if cfg.is_factorized:
        if flips[0]:
            fields["temporal_recursion"] = list(recursion)
        if flips[1] and decay[0] == decay[1]:
            fields["decay"] = decay[0]
        if flips[2] and recursion == ("scalar_leak", "jacobian"):
            fields["temporal_recursion"] = "jacobian"
        if flips[3] and recursion[1] == "none":  # a zero f-side decay makes that side 'none' anyway
            fields["temporal_recursion"] = (recursion[0], "scalar_leak")
    elif recursion == "none":
        fields["temporal_recursion"] = "scalar_leak" if flips[0] else "none"
        fields["decay"] = 0.0 if flips[0] or flips[1] else None
    if flips[4] and cfg.recurrence_scope == "coupled":
        fields.update(recurrence_scope="sparse_n", sparse_n=1)
    if flips[5] and cfg.trace_filter == "none":
        fields.update(trace_filter="kappa", kappa=0.0)
    return fields


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(fields=LEGAL, flips=st.lists(st.booleans(), min_size=6, max_size=6))
def test_equivalent_spellings_collapse_to_one_canonical_form(fields: dict[str, Any], flips: list[bool]) -> None:
    try:
        cfg = Config(**fields)
    except ValueError:  # an io 'coupled' scope whose f side is not 'jacobian'
        assume(False)
        return
    other = Config(**respell(cfg, flips))
    assert other == cfg and hash(other) == hash(cfg)
    assert Config(**dataclasses.asdict(cfg)) == cfg
    assert Config(**parse(cfg.describe())) == cfg


# --- the compatibility matrix --------------------------------------------------------------


MATRIX = [
    ("R8", {"update_schedule": "window", "window_size": 4}, "update_schedule='window' is recognised but not implemented"),
    ("R8", {"update_schedule": "sequence_end"}, "recognised but not implemented; the available schedule is 'per_step'"),
    ("R1", {"trace_factorization": IO, "decay": 0.5, "trace_filter": "kappa", "kappa": 0.5},
     "trace_filter='kappa' needs trace_factorization='per_param'"),
    ("R1", {"trace_factorization": RP, "recurrence_scope": "coupled", "trace_filter": "kappa", "kappa": 0.5},
     "break unbiasedness"),
    ("R2", {"recurrence_scope": "coupled", "temporal_recursion": "scalar_leak", "decay": 0.5},
     "recurrence_scope='coupled' needs temporal_recursion to be 'jacobian'"),
    ("R2", {"trace_factorization": IO, "recurrence_scope": "coupled", "temporal_recursion": "scalar_leak",
            "decay": 0.5}, "needs the f side of temporal_recursion to be 'jacobian'"),
    ("R3", {"trace_factorization": IO, "temporal_recursion": ("jacobian", "jacobian"), "decay": 0.5},
     "x-side 'jacobian' under io_factorized"),
    ("R4", {"decay": 0.5}, "decay=0.5 with temporal_recursion='jacobian' would be silently ignored"),
    ("R4", {"trace_factorization": RP, "recurrence_scope": "coupled", "decay": 0.5}, "would be silently ignored"),
    ("R5", {"temporal_recursion": "scalar_leak"}, "'scalar_leak' needs decay in \\[0, 1\\): the leak is the rule"),
    ("R6", {"trace_factorization": IO}, "needs the decay of both sides, got decay=None"),
    ("R6", {"trace_factorization": IO, "temporal_recursion": ("none", "jacobian")},
     "needs the decay of both sides, got decay=\\(0.0, None\\)"),
    ("R7", {"kappa": 0.5}, "kappa=0.5 without trace_filter='kappa'"),
    ("R7", {"trace_filter": "kappa"}, "trace_filter='kappa' needs its coefficient kappa"),
    ("R7", {"sparse_n": 3}, "sparse_n=3 without recurrence_scope='sparse_n'"),
    ("R7", {"recurrence_scope": "sparse_n"}, "recurrence_scope='sparse_n' needs its coefficient sparse_n"),
    ("R7", {"window_size": 4}, "window_size=4 without update_schedule='window'"),
    ("R7", {"trace_filter": "kappa", "kappa": 1.5}, "kappa=1.5 is outside \\[0, 1\\)"),
    ("R11", {"trace_factorization": RP}, "needs recurrence_scope='coupled', got 'diagonal'"),
    ("R11", {"trace_factorization": RP, "recurrence_scope": "sparse_n", "sparse_n": 2},
     "'sparse_n' pays SnAp's memory"),
    ("R9", {"trace_factorization": IO, "decay": 0.5, "recurrence_scope": "sparse_n", "sparse_n": 2},
     "recurrence_scope='sparse_n' needs trace_factorization='per_param'"),
]


@pytest.mark.parametrize("rule, kwargs, match", MATRIX, ids=[f"{m[0]}-{i}" for i, m in enumerate(MATRIX)])
def test_compatibility_rules(rule: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Config(**kwargs)


def test_rules_fire_in_order() -> None:
    # R8 before R1 before R2: the first failing rule names the combination.
    with pytest.raises(ValueError, match="update_schedule"):
        Config(trace_factorization=IO, decay=0.5, trace_filter="kappa", kappa=0.5, update_schedule="window")
    with pytest.raises(ValueError, match="trace_filter='kappa'"):
        Config(trace_factorization=IO, decay=0.5, trace_filter="kappa", kappa=0.5, recurrence_scope="coupled",
               temporal_recursion="scalar_leak")


def test_r10_the_surviving_order_one_is_an_explicit_error() -> None:
    cfg = Config(recurrence_scope="sparse_n", sparse_n=2)
    object.__setattr__(cfg, "sparse_n", 1)
    with pytest.raises(ValueError, match="internal error"):
        _check_compatibility(cfg)


def test_kappa_type_is_checked() -> None:
    with pytest.raises(TypeError, match="kappa must be a float in \\[0, 1\\)"):
        Config(trace_filter="kappa", kappa="0.5")
    with pytest.raises(TypeError, match="kappa"):
        Config(trace_filter="kappa", kappa=False)  # a bool is not the coefficient 0
    kappa = Config(trace_filter="kappa", kappa=np.float32(0.5)).kappa
    assert type(kappa) is float and kappa == 0.5


def test_random_projection_legal_coordinates() -> None:
    for signal in ("symmetric", "random_feedback", "modulatory", "bootstrapped"):
        cfg = Config(trace_factorization=RP, recurrence_scope="coupled", learning_signal=signal)
        assert cfg.include_recurrent_mixing and cfg.temporal_recursion == "jacobian"
    with pytest.raises(ValueError, match="needs temporal_recursion to be 'jacobian'"):
        Config(trace_factorization=RP, recurrence_scope="coupled", temporal_recursion="none")


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5, 19])
def test_decay_bounds(decay: Any) -> None:
    with pytest.raises(ValueError, match="outside \\[0, 1\\).*decay_or_rank"):
        Config(temporal_recursion="scalar_leak", decay=decay)
    with pytest.raises(ValueError, match="outside \\[0, 1\\)"):
        Config(trace_factorization=IO, decay=(0.5, decay))


@pytest.mark.parametrize("decay", ["0.9", True, object()])
def test_decay_types(decay: Any) -> None:
    with pytest.raises(TypeError, match="decay must be a float in \\[0, 1\\)"):
        Config(temporal_recursion="scalar_leak", decay=decay)


def test_pair_lengths() -> None:
    with pytest.raises(ValueError, match="one float or a pair"):
        Config(trace_factorization=IO, decay=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="got 3 entries"):
        Config(trace_factorization=IO, decay=0.5, temporal_recursion=("scalar_leak",) * 3)


# --- views and methods ---------------------------------------------------------------------


def test_views() -> None:
    io = Config(trace_factorization=IO, decay=(0.9, 0.0))
    assert io.is_factorized and not Config().is_factorized
    assert (io.recursion_x, io.recursion_f, io.decay_x, io.decay_f) == ("scalar_leak", "none", 0.9, 0.0)
    for view in ("recursion_x", "recursion_f", "decay_x", "decay_f"):
        with pytest.raises(AttributeError, match="io_factorized"):
            getattr(Config(), view)
    mixing = {scope: Config(recurrence_scope=scope, sparse_n=2 if scope == "sparse_n" else None).include_recurrent_mixing
              for scope in ("diagonal", "coupled", "sparse_n")}
    assert mixing == {"diagonal": False, "coupled": True, "sparse_n": True}


def test_replace_revalidates() -> None:
    cfg = Config(trace_filter="kappa", kappa=0.5)
    assert cfg.replace(kappa=0.0) == Config()
    with pytest.raises(ValueError, match="needs trace_factorization='per_param'"):
        cfg.replace(trace_factorization=IO, decay=0.5)


def test_describe_lists_non_default_axes_and_coefficients() -> None:
    assert Config().describe() == "trace_factorization='per_param'"
    assert parse(Config(trace_factorization=IO, decay=(0.9, 0.5)).describe()) == {
        "trace_factorization": IO, "temporal_recursion": ("scalar_leak", "jacobian"), "decay": (0.9, 0.5)}


# --- named algorithms as coordinates -------------------------------------------------------


def coordinate(cfg: Config) -> tuple[Any, ...]:
    return (cfg.trace_factorization, cfg.temporal_recursion, cfg.recurrence_scope, cfg.learning_signal,
            cfg.trace_filter, cfg.update_schedule, cfg.decay, cfg.kappa, cfg.sparse_n)


NAMED = {
    "D_RTRL": (lambda m: braintrace.D_RTRL(m),
               ("per_param", "jacobian", "diagonal", "symmetric", "none", "per_step", None, None, None)),
    "OSTLRecurrent": (lambda m: braintrace.OSTLRecurrent(m),
                      ("per_param", "jacobian", "coupled", "symmetric", "none", "per_step", None, None, None)),
    "EProp": (lambda m: braintrace.EProp(m),
              ("per_param", "jacobian", "diagonal", "symmetric", "none", "per_step", None, None, None)),
    "EProp-kappa": (lambda m: braintrace.EProp(m, kappa_filter_decay=0.5),
                    ("per_param", "jacobian", "diagonal", "symmetric", "kappa", "per_step", None, 0.5, None)),
    "EProp-random": (lambda m: braintrace.EProp(m, "random", random_feedback_key=0),
                     ("per_param", "jacobian", "diagonal", "random_feedback", "none", "per_step", None, None, None)),
    "pp_prop": (lambda m: braintrace.pp_prop(m, 0.9),
                (IO, ("scalar_leak", "jacobian"), "diagonal", "symmetric", "none", "per_step", (0.9, 0.9), None, None)),
    "ES_D_RTRL": (lambda m: braintrace.ES_D_RTRL(m, 19),
                  (IO, ("scalar_leak", "jacobian"), "diagonal", "symmetric", "none", "per_step", (0.9, 0.9), None, None)),
    "OSTLFeedforward": (lambda m: braintrace.OSTLFeedforward(m),
                        (IO, ("scalar_leak", "jacobian"), "diagonal", "symmetric", "none", "per_step", (1e-6, 1e-6),
                         None, None)),
    "OSTLFeedforward-0": (lambda m: braintrace.OSTLFeedforward(m, 0.0),
                          (IO, ("none", "none"), "diagonal", "symmetric", "none", "per_step", (0.0, 0.0), None, None)),
    "OSTLFeedforward-rank1": (lambda m: braintrace.OSTLFeedforward(m, 1),
                              (IO, ("none", "none"), "diagonal", "symmetric", "none", "per_step", (0.0, 0.0), None,
                               None)),
    "SnAp-3": (lambda m: braintrace.SnAp(m, n=3),
               ("per_param", "jacobian", "sparse_n", "symmetric", "none", "per_step", None, None, 3)),
    "SnAp-1": (lambda m: braintrace.SnAp(m, n=1),
               ("per_param", "jacobian", "coupled", "symmetric", "none", "per_step", None, None, None)),
    "UORO": (lambda m: braintrace.UORO(m),
             (RP, "jacobian", "coupled", "symmetric", "none", "per_step", None, None, None)),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_algorithms_are_coordinates(name: str) -> None:
    build, expected = NAMED[name]
    learner = build(Leaky())
    assert isinstance(learner.config, Config)
    assert coordinate(learner.config) == expected


def test_distinct_presets_are_distinct_coordinates() -> None:
    names = ["D_RTRL", "OSTLRecurrent", "EProp-kappa", "EProp-random", "pp_prop", "OSTLFeedforward",
             "OSTLFeedforward-0", "SnAp-3", "UORO"]
    configs = [NAMED[n][0](Leaky()).config for n in names]
    assert len(set(configs)) == len(names)
    assert NAMED["SnAp-1"][0](Leaky()).config == NAMED["OSTLRecurrent"][0](Leaky()).config
    assert NAMED["EProp"][0](Leaky()).config == NAMED["D_RTRL"][0](Leaky()).config


# --- engine refusals -----------------------------------------------------------------------


ENGINE_REFUSALS = [
    (lambda m: braintrace.ParamDimVjpAlgorithm(m, config=Config(trace_factorization=IO, decay=0.5)), ValueError,
     "is ParamDimVjpAlgorithm \\(the per-parameter trace engine\\)"),
    (lambda m: braintrace.D_RTRL(m, config=Config(trace_factorization=RP, recurrence_scope="coupled")), ValueError,
     "per-parameter trace engine.*runs on RandomProjectionVjpAlgorithm"),
    (lambda m: braintrace.IODimVjpAlgorithm(m, None, config=Config()), ValueError,
     "input/output-factorised trace engine"),
    (lambda m: braintrace.RandomProjectionVjpAlgorithm(m, config=Config()), ValueError,
     "random-projection trace engine"),
    (lambda m: braintrace.ParamDimVjpAlgorithm(m, config="per_param"), TypeError, "must be a braintrace.ETraceConfig"),
    (lambda m: braintrace.IODimVjpAlgorithm(m, 0.5, config={"decay": 0.5}), TypeError, "must be a braintrace.ETraceConfig"),
    (lambda m: braintrace.ParamDimVjpAlgorithm(m, config=Config(learning_signal="random_feedback")), ValueError,
     "needs random_feedback_key"),
    (lambda m: braintrace.pp_prop(m, None, config=Config(trace_factorization=IO, decay=0.5,
                                                       learning_signal="random_feedback")), ValueError,
     "needs random_feedback_key"),
    (lambda m: braintrace.ParamDimVjpAlgorithm(m, vjp_method="multi-step", config=Config(learning_signal="modulatory")),
     ValueError, "modulatory' needs vjp_method='single-step'"),
    (lambda m: braintrace.RandomProjectionVjpAlgorithm(
        m, config=Config(trace_factorization=RP, recurrence_scope="coupled", learning_signal="modulatory")),
     NotImplementedError, "per_param and io_factorized engines \\(braintrace.ThreeFactor"),
    (lambda m: braintrace.pp_prop(m, 0.5, config=Config(trace_factorization=IO, decay=0.5,
                                                      learning_signal="bootstrapped")), NotImplementedError, "DNI"),
    (lambda m: braintrace.RandomProjectionVjpAlgorithm(
        m, config=Config(trace_factorization=RP, recurrence_scope="coupled", learning_signal="random_feedback")),
     NotImplementedError, "per_param and io_factorized engines"),
    (lambda m: braintrace.pp_prop(m, 0.9, config=Config(trace_factorization=IO, decay=0.5)), ValueError,
     "disagrees with the config's decays"),
    (lambda m: braintrace.EProp(m, config=Config()), TypeError, "EProp takes no config"),
    (lambda m: braintrace.SnAp(m, config=Config()), TypeError, "takes no config"),
    (lambda m: braintrace.OSTTP(m, [jnp.ones((2, 4))], config=Config(learning_signal="random_feedback"),
                                random_feedback_key=0), ValueError, "target projection"),
    (lambda m: braintrace.D_RTRL(m, snap_max_jacobian_elements=0), ValueError, "snap_max_jacobian_elements"),
    (lambda m: braintrace.D_RTRL(m, snap_max_jacobian_elements=2.0), TypeError, "snap_max_jacobian_elements"),
]


@pytest.mark.parametrize("build, error, match", ENGINE_REFUSALS, ids=[f"refusal-{i}" for i in range(len(ENGINE_REFUSALS))])
def test_engine_refusals(build: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build(Leaky())


def test_the_config_is_authoritative_for_the_io_decays() -> None:
    cfg = Config(trace_factorization=IO, decay=(0.9, 0.5))
    for decay_or_rank in (None, (0.9, 0.5), (19, 0.5)):
        learner = braintrace.IODimVjpAlgorithm(Leaky(), decay_or_rank, config=cfg)
        assert learner.config is cfg and (learner.decay_x, learner.decay_f) == (0.9, 0.5)
    with pytest.raises(AttributeError, match="decay_x and decay_f"):
        learner.decay  # noqa: B018
    assert braintrace.OSTLFeedforward(Leaky(), config=cfg).config is cfg


def test_coupled_scopes_refuse_a_descended_scan() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for build in (braintrace.OSTLRecurrent, lambda m: braintrace.D_RTRL(m, config=Config(recurrence_scope="coupled"))):
            learner = build(cf.SubstepModel(length=20))
            with pytest.raises(NotImplementedError, match="recurrence_scope='coupled'.*descended scan"):
                learner.compile_graph(jnp.ones(3))
        braintrace.D_RTRL(cf.SubstepModel(length=20)).compile_graph(jnp.ones(3))  # the diagonal scope learns there


# --- compile with a config -----------------------------------------------------------------


@pytest.mark.parametrize("cfg, engine", [
    (Config(temporal_recursion="scalar_leak", decay=0.5), braintrace.ParamDimVjpAlgorithm),
    (Config(trace_factorization=IO, decay=(0.9, 0.5)), braintrace.IODimVjpAlgorithm),
    (Config(trace_factorization=RP, recurrence_scope="coupled"), braintrace.RandomProjectionVjpAlgorithm),
])
def test_compile_picks_the_engine_of_the_factorization(cfg: Config, engine: type) -> None:
    learner = learner_of(TanhRNN(), cfg)
    assert type(learner) is engine and learner.config == cfg
    grads = brainstate.transform.jit(
        lambda: brainstate.transform.grad(lambda: learner(inputs()[0]).sum(), learner.param_states)())()
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_compile_refuses_a_second_config() -> None:
    with pytest.raises(TypeError, match="pass it once"):
        learner_of(Leaky(), Config(), config=Config())
    with pytest.raises(NotImplementedError, match="DNI"):
        learner_of(Leaky(), Config(learning_signal="bootstrapped"))


# --- temporal_recursion on the three trace paths ---------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
def test_scalar_leak_reproduces_the_jacobian_bitwise_on_a_constant_leak(x64: None, path: str) -> None:
    jacobian = run("leaky", braintrace.D_RTRL, path)
    leak = run("leaky", Config(temporal_recursion="scalar_leak", decay=0.9), path)
    assert identical(jacobian, leak)
    if path == "single-step":  # the control
        assert max_rel_err(jacobian, run("leaky", Config(temporal_recursion="scalar_leak", decay=0.5), path)) > 1e-2


NEW_COORDINATES = [Config(temporal_recursion="scalar_leak", decay=0.5), Config(temporal_recursion="none")]


@pytest.mark.parametrize("path", list(PATHS))
def test_new_per_param_coordinates_run_on_every_path(x64: None, path: str) -> None:
    jacobian = run("tanh", braintrace.D_RTRL, path)
    for cfg in NEW_COORDINATES:
        got = run("tanh", cfg, path)
        assert all(np.all(np.isfinite(v)) for v in got.values())
        assert max_rel_err(jacobian, got) > 1e-3, cfg


def test_stacked_and_fused_windows_agree_for_the_new_coordinates(x64: None) -> None:
    # The same estimator rolled two ways: closed-form suffix products, or per step in the scan.
    for cfg in NEW_COORDINATES:
        assert max_rel_err(run("tanh", cfg, "stacked"), run("tanh", cfg, "fused")) < 1e-10


def test_none_equals_jacobian_when_the_only_recurrence_is_the_excluded_weight(x64: None) -> None:
    # h ← tanh(x W_in + h W_rec): the diagonal scope's D is zero, so 'none' is the same rule.
    jacobian = run("tanh-no-leak", braintrace.D_RTRL, "single-step")
    assert identical(jacobian, run("tanh-no-leak", Config(temporal_recursion="none"), "single-step"))
    assert max_rel_err(jacobian, run("tanh", braintrace.D_RTRL, "single-step")) > 1e-2  # the control


# --- the io_factorized engine's decays, scope and signal -------------------------------------


def test_io_decay_scalar_is_the_equal_pair_and_a_zero_f_side_differs(x64: None) -> None:
    scalar = run("tanh", braintrace.pp_prop, "single-step", decay_or_rank=0.9)
    pair = run("tanh", braintrace.pp_prop, "single-step", decay_or_rank=(0.9, 0.9))
    assert identical(scalar, pair)
    zero_f = run("tanh", braintrace.pp_prop, "single-step", decay_or_rank=(0.9, 0.0))
    zero_x = run("tanh", braintrace.pp_prop, "single-step", decay_or_rank=(0.0, 0.9))
    for other in (zero_f, zero_x):
        assert max_rel_err(scalar, other) > 1e-3
    assert max_rel_err(zero_f, zero_x) > 1e-3


def test_io_decay_zero_is_accepted_and_the_decay_is_read_only() -> None:
    learner = braintrace.pp_prop(Leaky(), 0.0)
    assert (learner.decay, learner.num_rank, learner.config.temporal_recursion) == (0.0, 1, ("none", "none"))
    with pytest.raises(AttributeError):
        learner.decay = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError, match="a pair is \\(x side, f side\\)"):
        braintrace.pp_prop(Leaky(), (0.5, 0.5, 0.5))


def test_io_coupled_scope_and_f_side_leak_differ_from_the_default(x64: None) -> None:
    base = run("tanh", Config(trace_factorization=IO, decay=0.9), "single-step")
    coupled = run("tanh", Config(trace_factorization=IO, decay=0.9, recurrence_scope="coupled"), "single-step")
    leak = run("tanh", Config(trace_factorization=IO, decay=0.9, temporal_recursion="scalar_leak"), "single-step")
    assert max_rel_err(base, coupled) > 1e-5
    assert max_rel_err(base, leak) > 1e-3
    assert identical(base, run("tanh", braintrace.pp_prop, "single-step", decay_or_rank=0.9))


# --- trace filter, random feedback and SnAp through a config ------------------------------------


def test_kappa_by_config_is_eprops_filter(x64: None) -> None:
    eprop = run("tanh", braintrace.EProp, "single-step", kappa_filter_decay=0.5)
    config = run("tanh", Config(trace_filter="kappa", kappa=0.5), "single-step")
    assert identical(eprop, config)
    assert max_rel_err(eprop, run("tanh", braintrace.D_RTRL, "single-step")) > 1e-3  # the control


@pytest.mark.parametrize("path", ["single-step", "fused"])
def test_random_feedback_by_config_is_eprops(x64: None, path: str) -> None:
    eprop = run("tanh", braintrace.EProp, path, feedback="random", random_feedback_key=3)
    config = run("tanh", Config(learning_signal="random_feedback"), path, random_feedback_key=3)
    assert identical(eprop, config)
    assert max_rel_err(eprop, run("tanh", braintrace.D_RTRL, path)) > 1e-2  # the control
    if path == "single-step":
        other_key = run("tanh", Config(learning_signal="random_feedback"), path, random_feedback_key=4)
        assert max_rel_err(eprop, other_key) > 1e-3


def test_random_feedback_on_the_io_engine_differs_from_symmetric(x64: None) -> None:
    cfg = Config(trace_factorization=IO, decay=0.9, learning_signal="random_feedback")
    random = run("tanh", cfg, "single-step", random_feedback_key=3)
    symmetric = run("tanh", braintrace.pp_prop, "single-step", decay_or_rank=0.9)
    assert max_rel_err(symmetric, random) > 1e-2
    assert all(np.all(np.isfinite(v)) for v in random.values())
    # The relation weights' gradients change, the readout-free model's others do not exist.
    assert set(random) == set(symmetric)


@pytest.mark.parametrize("cfg", [Config(learning_signal="random_feedback"),
                                 Config(trace_factorization=IO, decay=0.9, learning_signal="random_feedback")])
def test_random_feedback_without_its_matrices_is_a_runtime_error(cfg: Config) -> None:
    learner = learner_of(Leaky(), cfg, random_feedback_key=0)
    learner._feedback_matrices = {}
    with pytest.raises(RuntimeError, match="no feedback matrix.*never substituted"):
        brainstate.transform.grad(lambda: learner(inputs()[0]).sum(), learner.param_states)()


def test_random_feedback_refuses_a_matrix_of_another_width() -> None:
    with pytest.raises(ValueError, match="B must be \\(4, 4\\)"):
        project_feedback(jnp.ones((2, 4, 1)), jnp.ones((3, 3)))


def cell() -> Any:
    with brainstate.random.seed_context(0):
        return braintrace.nn.ValinaRNNCell(3, 4)


def test_snap_by_config_is_snap(x64: None) -> None:
    cfg = Config(recurrence_scope="sparse_n", sparse_n=3)
    by_config = learner_of(cell(), cfg)
    snap = learner_of(cell(), braintrace.SnAp, n=3)
    assert type(by_config) is braintrace.ParamDimVjpAlgorithm and by_config.config == snap.config
    assert by_config.graph.hidden_groups[0].snap.num_neighbour == snap.graph.hidden_groups[0].snap.num_neighbour == 4
    xs = inputs()
    got, ref = single_step_grads(by_config, xs), single_step_grads(snap, xs)
    assert identical(got, ref)
    for a, b in zip(jax.tree.leaves(by_config.named_etraces()), jax.tree.leaves(snap.named_etraces())):
        assert np.array_equal(a, b)
    coupled = single_step_grads(learner_of(cell(), braintrace.OSTLRecurrent), xs)
    assert max_rel_err(ref, coupled) > 1e-3  # the control: the widened trace is not the coupled one

"""``braintrace.compile``: algorithm resolution, argument checks, seeding, the report, vmap.

Also runs the seed tutorial's ``TinyRNN`` cell verbatim.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._compile import ALGORITHM_NAMES
from tests.algorithm.bptt import normal, single_step_run

B, I, O = 2, 3, 4


class Leaky(brainstate.nn.Module):
    """``h = sigmoid(leak) ⊙ h + tanh(x @ W + b)`` read out by a plain ``h @ R``.

    ``random_init`` starts the hidden state from ``brainstate.random`` (to observe ``seed=``).
    """

    def __init__(self, random_init: bool = False) -> None:
        super().__init__()
        self.random_init = random_init
        self.w = brainstate.ParamState(normal(1, (I, O), 0.5))
        self.b = brainstate.ParamState(normal(2, (O,), 0.1))
        self.leak = brainstate.ParamState(normal(3, (O,)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (O,) if batch_size is None else (batch_size, O)
        value = brainstate.random.normal(size=shape) if self.random_init else jnp.zeros(shape)
        self.h = brainstate.HiddenState(value)

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.leak.value, weight_fn=jax.nn.sigmoid)
        self.h.value = leak * self.h.value + jnp.tanh(braintrace.matmul(x, self.w.value, self.b.value))
        return self.h.value


class PlainOnly(brainstate.nn.Module):
    """No ETP operation at all: nothing can learn online."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(normal(4, (I, O)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size or 1, O)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + x @ self.w.value
        return self.h.value


@pytest.fixture
def quiet() -> Iterator[None]:
    """The compiler's diagnostics are not under test here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


X0 = np.zeros((B, I), np.float32)


# --- algorithm resolution -----------------------------------------------------------------


@pytest.mark.parametrize("algorithm", [braintrace.D_RTRL, "d_rtrl", " D_RTRL ", "D_rtrl"])
def test_algorithm_by_class_or_case_insensitive_name(quiet: None, algorithm: Any) -> None:
    learner = braintrace.compile(Leaky(), algorithm, X0, batch_size=B)
    assert type(learner) is braintrace.D_RTRL
    assert learner.is_compiled


def test_unknown_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'ostl'") as err:
        braintrace.compile(Leaky(), "ostl", X0, batch_size=B)
    for name in ALGORITHM_NAMES:
        assert repr(name) in str(err.value)
    assert "subclass" in str(err.value)


@pytest.mark.parametrize("algorithm", [42, None, Leaky, lambda m: m], ids=["int", "None", "module-class", "function"])
def test_non_algorithm_is_a_type_error(algorithm: Any) -> None:
    with pytest.raises(TypeError, match="algorithm"):
        braintrace.compile(Leaky(), algorithm, X0, batch_size=B)


# --- argument checks ----------------------------------------------------------------------


def test_missing_example_input() -> None:
    with pytest.raises(ValueError, match="example input"):
        braintrace.compile(Leaky(), braintrace.D_RTRL, batch_size=B)


@pytest.mark.parametrize("verbose", [3, -1, 2.5, "1"])
def test_verbose_outside_0_1_2(verbose: Any) -> None:
    with pytest.raises(ValueError, match="verbose must be 0, 1 or 2"):
        braintrace.compile(Leaky(), braintrace.D_RTRL, X0, batch_size=B, verbose=verbose)


def test_vmap_needs_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        braintrace.compile(Leaky(), braintrace.D_RTRL, X0, vmap=True)


def test_no_relation_is_a_compilation_error(quiet: None) -> None:
    with pytest.raises(braintrace.CompilationError, match="No trainable weights"):
        braintrace.compile(PlainOnly(), braintrace.D_RTRL, X0, batch_size=B)


def test_options_reach_the_algorithm(quiet: None) -> None:
    learner = braintrace.compile(Leaky(), "d_rtrl", X0, batch_size=B, vjp_method="multi-step", chunked_trace=False)
    assert learner.vjp_method == "multi-step" and learner.chunked_trace is False
    with pytest.raises(TypeError):
        braintrace.compile(Leaky(), "d_rtrl", X0, batch_size=B, no_such_option=1)


# --- seeding ------------------------------------------------------------------------------


def test_seed_makes_state_init_reproducible(quiet: None) -> None:
    key_before = np.asarray(brainstate.random.get_key_data())

    def initial_hidden(seed: int) -> np.ndarray:
        model = Leaky(random_init=True)
        braintrace.compile(model, braintrace.D_RTRL, X0, batch_size=B, seed=seed)
        return np.asarray(model.h.value)

    a, b, c = initial_hidden(3), initial_hidden(3), initial_hidden(4)
    assert a.shape == (B, O) and np.any(a != 0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    key_after = np.asarray(brainstate.random.get_key_data())
    np.testing.assert_array_equal(key_before, key_after)  # the global random state is restored


# --- the report ---------------------------------------------------------------------------


def test_verbose_1_prints_the_report(quiet: None, capsys: pytest.CaptureFixture[str]) -> None:
    braintrace.compile(Leaky(), braintrace.D_RTRL, X0, batch_size=B, verbose=1)
    out = capsys.readouterr().out
    assert "The hidden groups are:" in out
    assert "('h',)" in out and "('w',)" in out and "('leak',)" in out


def test_verbose_0_prints_nothing(quiet: None, capsys: pytest.CaptureFixture[str]) -> None:
    braintrace.compile(Leaky(), braintrace.D_RTRL, X0, batch_size=B)
    assert capsys.readouterr().out == ""


# --- the seed tutorial --------------------------------------------------------------------

#: The last code cell of the seed tutorial "Creating Custom ETP Primitives", verbatim.
TINY_RNN_CELL = '''
import brainstate


brainstate.random.seed(19)


class TinyRNN(brainstate.nn.Module):
    def __init__(self, in_dim=4, hid_dim=6):
        super().__init__()
        self.in_dim = in_dim
        self.hid_dim = hid_dim
        # Recurrent weight: ETP-enabled (online learning via D-RTRL).
        self.W_rec = brainstate.ParamState(
            0.1 * brainstate.random.normal(size=(hid_dim, hid_dim))
        )
        # Input weight: plain matmul, learned via BPTT instead.
        self.W_in = brainstate.ParamState(
            0.1 * brainstate.random.normal(size=(in_dim, hid_dim))
        )

    def init_state(self, batch_size=None, **kwargs):
        # ``HiddenState`` is what the ETP compiler traces through.
        self.h = brainstate.HiddenState(
            jnp.zeros((batch_size or 1, self.hid_dim))
        )

    def update(self, x):
        # W_in is NOT marked -> excluded from ETP.
        input_drive = x @ self.W_in.value
        # W_rec IS marked -> included in ETP.
        rec_drive = braintrace.matmul(self.h.value, self.W_rec.value)
        self.h.value = jax.nn.tanh(input_drive + rec_drive)
        return self.h.value


model = TinyRNN(in_dim=4, hid_dim=6)

# braintrace.compile initialises states, compiles the ETP graph, and returns a ready learner.
alg = braintrace.compile(model, braintrace.D_RTRL, jnp.zeros((2, model.in_dim)), batch_size=2)

print("Compiled ETP relations:", len(alg.graph.hidden_param_op_relations))
for rel in alg.graph.hidden_param_op_relations:
    print("   primitive =", rel.primitive.name,
          "  trainable keys =", list(rel.trainable_vars.keys()))
'''


def test_seed_tutorial_tiny_rnn_cell_runs_verbatim(quiet: None, capsys: pytest.CaptureFixture[str]) -> None:
    # The tutorial's first cell imports these; the cell itself reseeds the global generator.
    namespace: dict[str, Any] = {"jax": jax, "jnp": jnp, "braintrace": braintrace}
    key = brainstate.random.get_key()
    try:
        exec(compile(TINY_RNN_CELL, "<seed tutorial: TinyRNN>", "exec"), namespace)
    finally:
        brainstate.random.set_key(key)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines == [
        "Compiled ETP relations: 1",
        "   primitive = etp_mm   trainable keys = ['weight']",
    ]
    alg = namespace["alg"]
    assert alg.graph.hidden_param_op_relations[0].trainable_paths == {"weight": ("W_rec",)}


# --- vmap ---------------------------------------------------------------------------------


def test_vmap_learner_equals_the_batched_learner(quiet: None) -> None:
    xs = normal(5, (3, B, I))
    vmapped = braintrace.compile(Leaky(), braintrace.D_RTRL, xs[0], batch_size=B, vmap=True)
    batched = braintrace.compile(Leaky(), braintrace.D_RTRL, xs[0], batch_size=B)
    assert isinstance(vmapped, brainstate.nn.Vmap) and isinstance(vmapped.module, braintrace.D_RTRL)
    assert type(vmapped) is braintrace.ETraceVmap
    # Per-sample traces: one lane per sample on axis 0, each the unbatched (etp_mv) layout.
    (lane_shapes,) = [
        {k: v.shape for k, v in st.value.items()}
        for st in vmapped.module.etrace_bwg.values() if "bias" in st.value
    ]
    assert lane_shapes == {"weight": (B, I, O, 1), "bias": (B, O, 1)}

    g_v, out_v = single_step_run(vmapped, xs, params=vmapped.module.param_states)
    g_b, out_b = single_step_run(batched, xs)
    assert out_v.shape == (xs.shape[0], B, O)
    np.testing.assert_allclose(out_v, out_b, rtol=1e-6, atol=1e-6)
    assert set(g_v) == set(g_b)
    for p in g_b:
        np.testing.assert_allclose(g_v[p], g_b[p], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vmap", [False, True])
def test_a_shape_only_example_input(quiet: None, vmap: bool) -> None:
    example = jax.ShapeDtypeStruct((B, I), jnp.float32)
    learner = braintrace.compile(Leaky(), braintrace.D_RTRL, example, batch_size=B, vmap=vmap)
    assert learner.hidden_states[("h",)].value.shape == (B, O)
    out = brainstate.transform.jit(lambda: learner(jnp.ones((B, I))))()
    assert out.shape == (B, O)


def test_vmap_with_seed_is_reproducible(quiet: None) -> None:
    def initial_hidden(seed: int) -> np.ndarray:
        model = Leaky(random_init=True)
        braintrace.compile(model, braintrace.D_RTRL, X0, batch_size=B, vmap=True, seed=seed)
        return np.asarray(model.h.value)

    a, b = initial_hidden(5), initial_hidden(5)
    assert a.shape == (B, O)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[0], a[1]), "each sample draws its own initial state"


def test_a_state_reset_to_another_shape_is_a_clear_error(quiet: None) -> None:
    cell = braintrace.nn.GRUCell(3, 4)
    learner = braintrace.compile(cell, braintrace.D_RTRL, jnp.ones((2, 3)), batch_size=2)
    brainstate.nn.reset_all_states(cell)  # no batch size: the cell's state becomes (4,)
    with pytest.raises(ValueError, match=r"\('h',\) has shape \(4,\).*compiled for \(2, 4\).*learner.reset\(\)"):
        learner(jnp.ones((2, 3)))
    brainstate.nn.reset_all_states(cell, batch_size=2)
    assert learner(jnp.ones((2, 3))).shape == (2, 4)


def test_vmap_pp_prop_equals_the_batched_learner(quiet: None) -> None:
    xs = normal(6, (3, B, I))
    vmapped = braintrace.compile(Leaky(), braintrace.pp_prop, xs[0], batch_size=B, vmap=True, decay_or_rank=0.9)
    batched = braintrace.compile(Leaky(), braintrace.pp_prop, xs[0], batch_size=B, decay_or_rank=0.9)
    g_v, out_v = single_step_run(vmapped, xs, params=vmapped.module.param_states)
    g_b, out_b = single_step_run(batched, xs)
    np.testing.assert_allclose(out_v, out_b, rtol=1e-6, atol=1e-6)
    assert set(g_v) == set(g_b)
    for p in g_b:
        np.testing.assert_allclose(g_v[p], g_b[p], rtol=1e-5, atol=1e-6)


def test_a_learner_names_its_states_the_same_before_and_after_a_call() -> None:
    # The learner caches the model's states by kind; the cache is not a path to them (its name
    # sorts before 'model4compile', and every state was named by its cache slot once it ran).
    learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), "d_rtrl", jnp.ones(3))
    before = list(learner.states())
    learner(jnp.ones(3))
    assert list(learner.states()) == before
    assert ("model4compile", "W", "weight") in before

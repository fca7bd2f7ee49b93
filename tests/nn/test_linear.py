"""The linear family: forwards against plain-JAX references, ETP wiring, and exact online gradients."""

from __future__ import annotations

from typing import Any, Callable

import brainevent
import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._op import etp_lora_mm_p, etp_mm_p, etp_mv_p
from tests.nn.helpers import bptt_grads, max_rel_err, normal, online_grads, compile_quiet

W = normal(0, (3, 4), 0.5)
B = normal(1, (4,), 0.5)


def primitives(fn: Callable[..., Any], *args: Any) -> list[str]:
    return [eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


# --- Linear ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3,), (2, 3), (2, 5, 3)])
def test_linear_matches_x_at_w_plus_b(shape: tuple[int, ...]) -> None:
    layer = braintrace.nn.Linear(3, 4, w_init=W, b_init=B)
    x = normal(2, shape)
    np.testing.assert_allclose(layer(x), x @ W + B, rtol=1e-6, atol=1e-6)
    assert layer(x).shape == (*shape[:-1], 4)
    # the parent computes the same numbers without the ETP primitive
    np.testing.assert_allclose(layer(x), brainstate.nn.Linear.update(layer, x), rtol=1e-6)


def test_linear_binds_mv_for_vectors_and_mm_for_batches() -> None:
    layer = braintrace.nn.Linear(3, 4)
    assert etp_mv_p.name in primitives(layer, jnp.ones(3))
    assert etp_mm_p.name in primitives(layer, jnp.ones((2, 3)))
    assert etp_mm_p.name in primitives(layer, jnp.ones((2, 5, 3)))  # folded to (10, 3)


def test_linear_parameter_tree_follows_brainstate() -> None:
    layer = braintrace.nn.Linear((2, 3), (2, 4))
    assert layer.in_size == (2, 3) and layer.out_size == (2, 4)
    assert set(layer.weight.value) == {"weight", "bias"}
    assert layer.weight.value["weight"].shape == (3, 4)
    assert set(braintrace.nn.Linear(3, 4, b_init=None).weight.value) == {"weight"}


def test_linear_mask_zeroes_output_and_gradient() -> None:
    mask = jnp.array(np.random.default_rng(3).random((3, 4)) > 0.5, dtype=float)
    layer = braintrace.nn.Linear(3, 4, w_init=W, b_init=None, w_mask=mask)
    x = normal(4, (2, 3))
    np.testing.assert_allclose(layer(x), x @ (W * mask), rtol=1e-6, atol=1e-6)
    grads = brainstate.transform.grad(lambda: layer(x).sum(), layer.states(brainstate.ParamState))()
    (g,) = grads.values()
    assert np.all(np.asarray(g["weight"])[np.asarray(mask) == 0] == 0)
    zero = braintrace.nn.Linear(3, 4, w_init=W, w_mask=jnp.zeros((3, 4)))
    np.testing.assert_array_equal(zero(x), jnp.zeros((2, 4)))


def test_linear_keeps_input_units() -> None:
    layer = braintrace.nn.Linear(3, 4, w_init=W, b_init=None)
    y = layer(jnp.ones((2, 3)) * u.mV)
    assert u.get_unit(y) == u.mV
    np.testing.assert_allclose(u.get_mantissa(y), jnp.ones((2, 3)) @ W, rtol=1e-6)


# --- SignedWLinear, ScaledWSLinear ----------------------------------------------------------


def test_signed_linear_uses_abs_weight_times_sign() -> None:
    sign = jnp.where(jnp.arange(3)[:, None] < 2, 1.0, -1.0) * jnp.ones((3, 4))
    layer = braintrace.nn.SignedWLinear(3, 4, w_init=W, w_sign=sign)
    x = normal(5, (2, 3))
    np.testing.assert_allclose(layer(x), x @ (jnp.abs(W) * sign), rtol=1e-6, atol=1e-6)
    unsigned = braintrace.nn.SignedWLinear(3, 4, w_init=W)
    np.testing.assert_allclose(unsigned(x), x @ jnp.abs(W), rtol=1e-6, atol=1e-6)
    # the gradient is with respect to the raw weight (sign(W) · sign · x)
    grads = brainstate.transform.grad(lambda: layer(x).sum(), layer.states(brainstate.ParamState))()
    expected = jax.grad(lambda w: (x @ (jnp.abs(w) * sign)).sum())(W)
    np.testing.assert_allclose(list(grads.values())[0], expected, rtol=1e-6)


@pytest.mark.parametrize("ws_gain", [True, False])
@pytest.mark.parametrize("shape", [(3,), (2, 3), (2, 2, 3)])
def test_scaled_ws_linear_matches_brainstate(ws_gain: bool, shape: tuple[int, ...]) -> None:
    layer = braintrace.nn.ScaledWSLinear(3, 4, w_init=W, w_mask=jnp.array([[1.0], [0.0], [1.0]]), ws_gain=ws_gain)
    if ws_gain:
        layer.weight.value = {**layer.weight.value, "gain": jnp.array([[0.5, 1.0, 2.0, -1.0]])}
    x = normal(6, shape)
    expected = brainstate.nn.ScaledWSLinear.update(layer, x)
    assert layer(x).shape == expected.shape == (*shape[:-1], 4)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_scaled_ws_linear_only_weight_enters_the_primitive(quiet: list) -> None:
    class Leaky(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = braintrace.nn.ScaledWSLinear(3, 4)

        def init_state(self, batch_size: int | None = None, **kw: Any) -> None:
            self.h = brainstate.HiddenState(jnp.zeros(4))

        def update(self, x: Any) -> Any:
            self.h.value = 0.5 * self.h.value + self.proj(x)
            return self.h.value

    model = Leaky()
    model.init_state()
    (rel,) = braintrace.compile_etrace_graph(model, jnp.ones(3)).hidden_param_op_relations
    assert set(rel.trainable_paths) == {"weight"}


# --- SparseLinear ---------------------------------------------------------------------------


def _csr(seed: int = 7) -> brainevent.CSR:
    dense = np.random.default_rng(seed).standard_normal((3, 4)) * (np.random.default_rng(seed + 1).random((3, 4)) > 0.4)
    return brainevent.CSR.fromdense(jnp.asarray(dense, dtype=float))


@pytest.mark.parametrize("shape", [(3,), (2, 3)])
def test_sparse_linear_matches_dense_product(shape: tuple[int, ...]) -> None:
    csr = _csr()
    layer = braintrace.nn.SparseLinear(csr, b_init=B)
    assert layer.weight.value["weight"].shape == csr.data.shape
    x = normal(8, shape)
    np.testing.assert_allclose(layer(x), x @ csr.todense() + B, rtol=1e-5, atol=1e-5)


def test_sparse_linear_needs_a_brainevent_structure() -> None:
    dense = jnp.eye(3)
    layer = braintrace.nn.SparseLinear(u.sparse.CSR.fromdense(dense))
    with pytest.raises(TypeError, match="brainevent"):
        layer(jnp.ones(3))


# --- LoRA -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3,), (2, 3), (2, 5, 3)])
def test_lora_is_scaled_by_one_over_rank(shape: tuple[int, ...]) -> None:
    layer = braintrace.nn.LoRA(3, 2, 4)
    a, b = layer.weight.value["lora_a"], layer.weight.value["lora_b"]
    x = normal(9, shape)
    np.testing.assert_allclose(layer(x), x @ a @ b / 2, rtol=1e-5, atol=1e-6)
    # brainstate's LoRA omits the 1/r factor
    np.testing.assert_allclose(layer(x) * 2, brainstate.nn.LoRA.__call__(layer, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.update(x), layer(x))


def test_lora_adds_its_base_module_and_rejects_a_non_callable_one() -> None:
    base = braintrace.nn.Linear(3, 4, w_init=W, b_init=B)
    layer = braintrace.nn.LoRA(3, 2, 4, base_module=base)
    x = normal(10, (2, 3))
    a, b = layer.weight.value["lora_a"], layer.weight.value["lora_b"]
    np.testing.assert_allclose(layer(x), x @ a @ b / 2 + x @ W + B, rtol=1e-5, atol=1e-5)
    bad = braintrace.nn.LoRA(3, 2, 4)
    bad.base_module = 3.0
    with pytest.raises(ValueError, match="base_module must be callable"):
        bad(x)


def test_lora_in_size_override() -> None:
    layer = braintrace.nn.LoRA(3, 2, 4, in_size=(5, 3))
    assert layer.in_size == (5, 3) and layer.out_size == (5, 4)


def test_lora_relation_keys_are_swapped_relative_to_leaf_names() -> None:
    class Leaky(brainstate.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lora = braintrace.nn.LoRA(3, 2, 4)

        def init_state(self, batch_size: int | None = None, **kw: Any) -> None:
            self.h = brainstate.HiddenState(jnp.zeros((2, 4)))

        def update(self, x: Any) -> Any:
            self.h.value = 0.5 * self.h.value + self.lora(x)
            return self.h.value

    model = Leaky()
    model.init_state()
    (rel,) = braintrace.compile_etrace_graph(model, jnp.ones((2, 3))).hidden_param_op_relations
    assert rel.primitive is etp_lora_mm_p
    # leaves of {'lora_a', 'lora_b'} are in key order: the primitive's 'lora_b' (its B, in x r)
    # is the layer's lora_a (leaf 0)
    assert rel.trainable_leaf_indices == {"lora_b": 0, "lora_a": 1}


# --- GroupedLinear --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3), (4, 2, 3), (6, 5, 2, 3)])
def test_grouped_linear_is_block_diagonal(shape: tuple[int, ...]) -> None:
    layer = braintrace.nn.GroupedLinear(2, 3, 4)
    w, b = layer.weight.value["weight"], layer.weight.value["bias"]
    x = normal(11, shape)
    expected = jnp.einsum("...gk,gkn->...gn", x, w) + b
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert layer.in_size == (2, 3) and layer.out_size == (2, 4)
    assert set(braintrace.nn.GroupedLinear(2, 3, 4, b_init=None).weight.value) == {"weight"}


@pytest.mark.parametrize("arg", ["num_groups", "in_features", "out_features"])
@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_grouped_linear_rejects_bad_sizes(arg: str, bad: Any) -> None:
    sizes = {"num_groups": 2, "in_features": 3, "out_features": 4, arg: bad}
    with pytest.raises(ValueError, match=f"GroupedLinear: {arg} must be a positive int, got {bad!r}"):
        braintrace.nn.GroupedLinear(**sizes)


# --- online gradients are exact on a leaky recurrence ---------------------------------------


class LeakyDrive(brainstate.nn.Module):
    """``h = 0.7 h + tanh(layer(x))``: an element-wise leak, so D-RTRL equals BPTT."""

    def __init__(self, layer: Any, n_out: int, batch: int) -> None:
        super().__init__()
        self.layer, self.n_out, self.batch = layer, n_out, batch

    def init_state(self, batch_size: int | None = None, **kw: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((self.batch, self.n_out)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.7 * self.h.value + jnp.tanh(self.layer(x))
        return self.h.value


LAYERS: dict[str, Callable[[], Any]] = {
    "Linear+mask": lambda: braintrace.nn.Linear(3, 4, w_init=W, b_init=B, w_mask=(jnp.arange(12).reshape(3, 4) % 3 > 0) * 1.0),
    "SignedWLinear": lambda: braintrace.nn.SignedWLinear(3, 4, w_init=W, w_sign=jnp.sign(normal(12, (3, 4)))),
    "ScaledWSLinear": lambda: braintrace.nn.ScaledWSLinear(3, 4, w_init=W, b_init=None, ws_gain=False),
    "SparseLinear": lambda: braintrace.nn.SparseLinear(_csr(), b_init=B),
    "LoRA": lambda: braintrace.nn.LoRA(3, 2, 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_single_step_d_rtrl_equals_bptt(name: str) -> None:
    xs, ys = normal(13, (4, 2, 3)), normal(14, (4, 2, 4))
    brainstate.random.seed(0)
    model = LeakyDrive(LAYERS[name](), 4, 2)
    ref = bptt_grads(model, xs, ys)
    learner = compile_quiet(model, xs[0])
    got = online_grads(learner, xs, ys)
    assert max_rel_err(ref, got) < 1e-4
    assert len(learner.graph.hidden_param_op_relations) == 1

"""Every public ETP operator rejects a transform hook that changes its parameter's shape.

The check runs at the public call, before anything is bound: a shape-changing ``weight_fn``
(``w[:, :2]``), ``bias_fn``, ``kernel_fn``, ``a_fn`` or ``b_fn`` raises a ``ValueError`` naming
the hook, instead of a broadcasting error deep inside D-RTRL or a bare assertion in a kernel.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainevent
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import braintrace
from braintrace._op import _registries as reg
from braintrace._op.conv import conv
from tests.op.opcase import rand

B, I, O, G, K, V = 2, 3, 4, 2, 3, 5

_MASK = np.array([[1, 0, 1, 0], [0, 1, 1, 1], [1, 0, 0, 1]], dtype=np.float32)
_CSR = brainevent.CSR.fromdense(jnp.asarray(_MASK))
_NNZ = int(_MASK.sum())


def _drop_first(w: Any) -> Any:
    return w[..., 1:]


def _add_axis(w: Any) -> Any:
    return w[None]


def _total(w: Any) -> Any:
    return jnp.sum(w)


#: ``(id, call, hook name)``: ``call(hook)`` passes ``hook`` under that name.
CALLS: list[tuple[str, Callable[[Any], Any], str]] = [
    ("matmul-mm-weight", lambda f: braintrace.matmul(rand(1, (B, I)), rand(2, (I, O)), weight_fn=f), "weight_fn"),
    ("matmul-mv-weight", lambda f: braintrace.matmul(rand(1, (I,)), rand(2, (I, O)), weight_fn=f), "weight_fn"),
    (
        "matmul-bias",
        lambda f: braintrace.matmul(rand(1, (B, I)), rand(2, (I, O)), rand(3, (O,)), bias_fn=f),
        "bias_fn",
    ),
    (
        "grouped-weight",
        lambda f: braintrace.grouped_matmul(rand(1, (B, G, K)), rand(2, (G, K, O)), weight_fn=f),
        "weight_fn",
    ),
    (
        "grouped-bias",
        lambda f: braintrace.grouped_matmul(rand(1, (G, K)), rand(2, (G, K, O)), rand(3, (G, O)), bias_fn=f),
        "bias_fn",
    ),
    (
        "sparse-weight",
        lambda f: braintrace.sparse_matmul(rand(1, (B, I)), rand(2, (_NNZ,)), sparse_mat=_CSR, weight_fn=f),
        "weight_fn",
    ),
    (
        "sparse-bias",
        lambda f: braintrace.sparse_matmul(
            rand(1, (I,)), rand(2, (_NNZ,)), sparse_mat=_CSR, bias=rand(3, (O,)), bias_fn=f
        ),
        "bias_fn",
    ),
    ("embedding", lambda f: braintrace.embedding(jnp.array([0, 3]), rand(2, (V, O)), weight_fn=f), "weight_fn"),
    ("element_wise", lambda f: braintrace.element_wise(rand(2, (O,)), weight_fn=f), "weight_fn"),
    (
        "lora-b",
        lambda f: braintrace.lora_matmul(rand(1, (B, I)), rand(2, (I, 2)), rand(3, (2, O)), b_fn=f),
        "b_fn",
    ),
    (
        "lora-a",
        lambda f: braintrace.lora_matmul(rand(1, (B, I)), rand(2, (I, 2)), rand(3, (2, O)), a_fn=f),
        "a_fn",
    ),
    (
        "lora-bias",
        lambda f: braintrace.lora_matmul(
            rand(1, (I,)), rand(2, (I, 2)), rand(3, (2, O)), bias=rand(4, (O,)), bias_fn=f
        ),
        "bias_fn",
    ),
    ("einsum", lambda f: braintrace.einsum("bk,kn->bn", rand(1, (B, I)), rand(2, (I, O)), weight_fn=f), "weight_fn"),
    ("conv-kernel", lambda f: conv(rand(1, (B, 2, 5)), rand(2, (3, 2, 3)), kernel_fn=f), "kernel_fn"),
    (
        "conv-bias",
        lambda f: conv(rand(1, (B, 2, 5)), rand(2, (3, 2, 3)), rand(3, (3,)), bias_fn=f),
        "bias_fn",
    ),
]
every_call = pytest.mark.parametrize("call, arg", [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])


@every_call
@pytest.mark.parametrize("hook", [_drop_first, _add_axis, _total], ids=["slice", "new-axis", "sum"])
def test_a_shape_changing_hook_is_rejected_at_the_call(call: Any, arg: str, hook: Any) -> None:
    with pytest.raises(ValueError, match=rf"{arg} must preserve"):
        jax.make_jaxpr(lambda: call(hook))()
    with pytest.raises(ValueError, match=rf"{arg} must preserve"):
        call(hook)  # eagerly as well


@every_call
def test_a_shape_preserving_hook_is_accepted(call: Any, arg: str) -> None:
    jaxpr = jax.make_jaxpr(lambda: call(jnp.tanh))()
    assert any(e.primitive in reg.ETP_PRIMITIVES for e in jaxpr.eqns)


class _SlicedReadIn(brainstate.nn.Module):
    """A leaky state driven by a matmul whose ``weight_fn`` drops columns (the documented symptom)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(rand(2, (I, O)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((batch_size, 2)))

    def update(self, x: Any) -> Any:
        self.h.value = 0.9 * self.h.value + braintrace.matmul(x, self.w.value, weight_fn=lambda w: w[:, :2])
        return self.h.value


def test_d_rtrl_compile_reports_the_hook_not_a_broadcasting_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ValueError, match=r"weight_fn must preserve the shape \(3, 4\)"):
            braintrace.compile(_SlicedReadIn(), braintrace.D_RTRL, rand(1, (B, I)), batch_size=B)

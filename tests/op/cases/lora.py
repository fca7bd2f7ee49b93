"""Rows for ``etp_lora_mm`` / ``etp_lora_mv``: plain, scaled with bias, and with each hook.

Trace geometry (see ``braintrace/_op/lora.py``): every trace lives in the space of an
*effective* operand that reaches a single output: ``W_eff = α f_B(B) f_A(A)`` for
``'lora_b'``, ``f_A(A)`` for ``'lora_a'`` and ``f_b(b)`` for ``'bias'``. ``lora_trace`` obtains
``∂fn/∂(effective operand)`` from the Jacobian of ``fn`` itself, by the chain rule through an
invertible reparametrisation:

* ``f_A(A)`` and ``f_b(b)``: ``∂fn/∂θ = ∂fn/∂f(θ) · f'(θ)``, so ``∂fn/∂f(θ) = ∂fn/∂θ · f'(θ)⁻¹``
  (the identity when there is no hook);
* ``W_eff``: the impl is rank-agnostic, so ``fn`` is evaluated with the rank raised to ``in``
  and ``B = I``; then ``W_eff = α f_B(I) f_A(A')`` is a free ``(in, out)`` variable with an
  invertible Jacobian in ``A'``. ``fn`` is affine in ``W_eff`` with a coefficient that does not
  depend on the point, so the Jacobian is that of the original point.

Then the entries with matching output index are selected.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from braintrace._op._rule_helpers import apply_hook
from braintrace._op.lora import _etp_lora_impl, etp_lora_mm_p, etp_lora_mv_p
from tests.op.opcase import OpCase, rand

I, R, O, B = 3, 2, 4, 2


def _jac_through(fn_of: Callable[[Any], Any], theta: Any, hook: Any) -> Any:
    """``∂fn/∂hook(θ)`` of shape ``(*y, *θ)``: ``∂fn/∂θ · (∂hook/∂θ)⁻¹``."""
    j = jax.jacrev(fn_of)(theta)
    if hook is None:
        return j
    n = theta.size
    jh = jax.jacfwd(hook)(theta).reshape(n, n)  # [k, m] = ∂hook(θ)[k] / ∂θ[m]
    return (j.reshape(-1, n) @ jnp.linalg.inv(jh)).reshape(j.shape)


def lora_trace(fn: Any, x: Any, ws: dict, params: dict) -> dict:
    """``ε_B[..., i, o] = ∂y[..., o]/∂W_eff[i, o]``, ``ε_A[..., r, o] = ∂y[..., o]/∂f_A(A)[r, o]``,
    ``ε_b[..., o] = ∂y[..., o]/∂f_b(b)[o]``."""
    batched = x.ndim == 2
    b_fn, a_fn = params["b_fn"], params["a_fn"]
    eye = jnp.eye(ws["lora_b"].shape[0], dtype=ws["lora_b"].dtype)

    def w_eff(a_prime: Any) -> Any:
        return params["alpha"] * apply_hook(b_fn, eye) @ apply_hook(a_fn, a_prime)

    j_w = _jac_through(
        lambda a_prime: fn(x, {**ws, "lora_b": eye, "lora_a": a_prime}),
        ws["lora_b"] @ ws["lora_a"],
        w_eff,
    )
    j_a = _jac_through(lambda a: fn(x, {**ws, "lora_a": a}), ws["lora_a"], a_fn)
    out = {
        "lora_b": jnp.einsum("boio->bio" if batched else "oio->io", j_w),
        "lora_a": jnp.einsum("boro->bro" if batched else "oro->ro", j_a),
    }
    if "bias" in ws:
        j_b = _jac_through(lambda b: fn(x, {**ws, "bias": b}), ws["bias"], params["bias_fn"])
        out["bias"] = jnp.einsum("boo->bo" if batched else "oo->o", j_b)
    return out


def _case(
    name: str,
    batched: bool,
    bias: bool,
    alpha: float = 1.0,
    b_fn: Any = None,
    a_fn: Any = None,
    bias_fn: Any = None,
) -> OpCase:
    # Moderate scales keep the hooks well-conditioned: trace_of inverts their Jacobians.
    weights = {"lora_b": 0.5 * rand(2, (I, R)), "lora_a": 0.5 * rand(3, (R, O))}
    if bias:
        weights["bias"] = rand(4, (O,))
    lead = (B,) if batched else ()
    shapes = {"lora_b": (*lead, I, O), "lora_a": (*lead, R, O)}
    if bias:
        shapes["bias"] = (*lead, O)
    return OpCase(
        id=name,
        prim=etp_lora_mm_p if batched else etp_lora_mv_p,
        impl=_etp_lora_impl,
        x=rand(1, (B, I) if batched else (I,)),
        weights=weights,
        params=dict(alpha=alpha, has_bias=bias, b_fn=b_fn, a_fn=a_fn, bias_fn=bias_fn),
        trace_of=lora_trace,
        drtrl_shapes=shapes,
        hooked=any(h is not None for h in (b_fn, a_fn, bias_fn)),
    )


def mix_columns(a: Any) -> Any:
    """A transform that couples entries across outputs (invertible: circulant ``1 + ½ shift``)."""
    return a + 0.5 * jnp.roll(jnp.tanh(a), 1, axis=-1)


def centre(b: Any) -> Any:
    """A bias transform that couples every output with every other one (invertible)."""
    return b - 0.5 * jnp.mean(b)


def _square(w: Any) -> Any:
    return w**2


CASES = [
    _case("lora-mm", True, False),
    _case("lora-mm-alpha2-bias", True, True, alpha=2.0),
    _case("lora-mv", False, False),
    _case("lora-mv-bias", False, True, alpha=0.5),
    _case("lora-mm-bias-btanh", True, True, b_fn=jnp.tanh),
    _case("lora-mv-atanh", False, False, a_fn=jnp.tanh),
    _case("lora-mm-bias-biasfn-square", True, True, bias_fn=_square),
    _case("lora-mm-bias-coupled-a-and-bias", True, True, alpha=2.0, a_fn=mix_columns, bias_fn=centre),
    _case("lora-mv-bias-all-hooks", False, True, alpha=0.5, b_fn=jnp.tanh, a_fn=jnp.tanh, bias_fn=centre),
]

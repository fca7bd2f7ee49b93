"""Hand-built brainstate models for the compiler tests (the scenario matrix and cell profiles).

Each model keeps its sizes tiny. ``init_state`` builds the hidden states for an optional batch;
the constructors call it once unbatched so a model is ready to compile.
"""

from __future__ import annotations

from typing import Any

import brainstate
import jax
import jax.numpy as jnp

import braintrace


def _w(key: int, shape: tuple[int, ...], scale: float = 0.3) -> brainstate.ParamState:
    return brainstate.ParamState(scale * jax.random.normal(jax.random.PRNGKey(key), shape))


@jax.custom_vjp
def soft_spike(v: Any) -> Any:
    """A sigmoid whose VJP is a user's surrogate slope ``1 / (1 + |v|)²``, not the sigmoid's
    derivative: a ``custom_vjp`` function, which forward mode cannot differentiate."""
    return jax.nn.sigmoid(4.0 * v)


soft_spike.defvjp(lambda v: (soft_spike(v), v), lambda v, g: (g / (1.0 + jnp.abs(v)) ** 2,))


def _linear(key: int, n_in: int, n_out: int) -> brainstate.ParamState:
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    return brainstate.ParamState({
        "weight": 0.3 * jax.random.normal(k1, (n_in, n_out)),
        "bias": 0.1 * jax.random.normal(k2, (n_out,)),
    })


class _Base(brainstate.nn.Module):
    hidden_names: tuple[str, ...] = ("h",)

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__()
        self.n_in, self.n_hid = n_in, n_hid

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hid,) if batch_size is None else (batch_size, self.n_hid)
        for name in self.hidden_names:
            setattr(self, name, brainstate.HiddenState(jnp.zeros(shape)))


class VanillaRNN(_Base):
    """``h = tanh([x, h] @ W)``: the recurrence is a weight mix -> zero-recurrence group."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W = _linear(1, n_in + n_hid, n_hid)
        self.init_state()

    def update(self, x: Any) -> Any:
        xh = jnp.concatenate([x, self.h.value], axis=-1)
        self.h.value = jnp.tanh(braintrace.matmul(xh, self.W.value["weight"], self.W.value["bias"]))
        return self.h.value


class LeakyRNN(_Base):
    """``h = a h + tanh(x @ W_in + h @ W_rec)``: element-wise leak, plain recurrent weight."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W_in = _w(2, (n_in, n_hid))
        self.W_rec = _w(3, (n_hid, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        drive = braintrace.matmul(x, self.W_in.value) + self.h.value @ self.W_rec.value
        self.h.value = 0.8 * self.h.value + jnp.tanh(drive)
        return self.h.value


class GRU(_Base):
    """A GRU with three ETP linears; ``Wr`` reaches ``h`` only through ``Wh`` (excluded)."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.Wz = _linear(4, n_in + n_hid, n_hid)
        self.Wr = _linear(5, n_in + n_hid, n_hid)
        self.Wh = _linear(6, n_in + n_hid, n_hid)
        self.init_state()

    def update(self, x: Any) -> Any:
        old = self.h.value
        xh = jnp.concatenate([x, old], axis=-1)
        z = jax.nn.sigmoid(braintrace.matmul(xh, self.Wz.value["weight"], self.Wz.value["bias"]))
        r = jax.nn.sigmoid(braintrace.matmul(xh, self.Wr.value["weight"], self.Wr.value["bias"]))
        cand = jnp.tanh(braintrace.matmul(jnp.concatenate([x, r * old], axis=-1), self.Wh.value["weight"], self.Wh.value["bias"]))
        self.h.value = (1 - z) * old + z * cand
        return self.h.value


class LSTM(_Base):
    """An LSTM with four ETP gates; ``c`` and ``h`` form one group."""

    hidden_names = ("c", "h")

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.Wi, self.Wf = _linear(7, n_in + n_hid, n_hid), _linear(8, n_in + n_hid, n_hid)
        self.Wg, self.Wo = _linear(9, n_in + n_hid, n_hid), _linear(10, n_in + n_hid, n_hid)
        self.init_state()

    def update(self, x: Any) -> Any:
        xh = jnp.concatenate([x, self.h.value], axis=-1)

        def gate(p: brainstate.ParamState) -> Any:
            return braintrace.matmul(xh, p.value["weight"], p.value["bias"])

        i, f = jax.nn.sigmoid(gate(self.Wi)), jax.nn.sigmoid(gate(self.Wf))
        g, o = jnp.tanh(gate(self.Wg)), jax.nn.sigmoid(gate(self.Wo))
        c = f * self.c.value + i * g
        self.c.value = c
        self.h.value = o * jnp.tanh(c)
        return self.h.value


def spike(v: Any) -> Any:
    """Heaviside with a sigmoid-derivative surrogate gradient."""
    @jax.custom_jvp
    def fn(v: Any) -> Any:
        return (v > 0).astype(v.dtype)

    @fn.defjvp
    def fn_jvp(primals: Any, tangents: Any) -> Any:
        (x,), (t,) = primals, tangents
        s = jax.nn.sigmoid(4 * x)
        return fn(x), 4 * s * (1 - s) * t

    return fn(v)


class LIF(_Base):
    """A recurrent LIF layer: trainable element-wise leak (``element_wise``), input and recurrent matmuls."""

    hidden_names = ("v",)

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.tau = brainstate.ParamState(jnp.full((n_hid,), 1.5))
        self.W_in = _w(11, (n_in, n_hid))
        self.W_rec = _w(12, (n_hid, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        s = spike(self.v.value - 1.0)
        i_syn = braintrace.matmul(x, self.W_in.value) + braintrace.matmul(s, self.W_rec.value)
        self.v.value = leak * self.v.value * (1 - s) + i_syn
        return spike(self.v.value - 1.0)


class TwoMatmulsInSeries(_Base):
    """``h = a h + matmul(matmul(x, W1), W2)``: only ``W2`` learns online."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W1, self.W2 = _w(13, (n_in, n_hid)), _w(14, (n_hid, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(braintrace.matmul(x, self.W1.value), self.W2.value)
        return self.h.value


class FanIn(_Base):
    """Two ETP inputs into one hidden state: two relations to the same group."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.Wa, self.Wb = _w(15, (n_in, n_hid)), _w(16, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.Wa.value) + braintrace.matmul(2 * x, self.Wb.value)
        return self.h.value


class FanOut(_Base):
    """One ETP op driving two independent hidden states: one relation, two groups."""

    hidden_names = ("h1", "h2")

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W = _w(17, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        y = braintrace.matmul(x, self.W.value)
        self.h1.value = 0.5 * self.h1.value + y
        self.h2.value = 0.9 * self.h2.value + jnp.tanh(y)
        return self.h1.value + self.h2.value


class Independent(_Base):
    """Two hidden states, each with its own weight."""

    hidden_names = ("h1", "h2")

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W1, self.W2 = _w(18, (n_in, n_hid)), _w(19, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.h1.value = 0.5 * self.h1.value + braintrace.matmul(x, self.W1.value)
        self.h2.value = 0.7 * self.h2.value + braintrace.matmul(x, self.W2.value)
        return self.h1.value * self.h2.value


class PlainMatmul(_Base):
    """``x @ W`` without an ETP op: no relation."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W = _w(20, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + x @ self.W.value
        return self.h.value


class TiedWeight(_Base):
    """One ParamState used at two call sites: two relations."""

    def __init__(self, n_in: int = 4, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W = _w(21, (n_hid, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.W.value) + braintrace.matmul(jnp.tanh(x), self.W.value)
        return self.h.value


class Layer(brainstate.nn.Module):
    """A leaky layer used by the stacked and nested models."""

    def __init__(self, key: int, n_in: int, n_hid: int) -> None:
        super().__init__()
        self.W = _w(key, (n_in, n_hid))
        self.h = brainstate.HiddenState(jnp.zeros(n_hid))

    def update(self, x: Any) -> Any:
        self.h.value = 0.6 * self.h.value + jnp.tanh(braintrace.matmul(x, self.W.value))
        return self.h.value


class Stacked(brainstate.nn.Module):
    """Two layers in a list: each weight scoped to its own layer's hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [Layer(22, 3, 4), Layer(23, 4, 4)]

    def update(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


class Residual(brainstate.nn.Module):
    """Layer with a residual skip from its own hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.W = _w(24, (3, 4))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        y = braintrace.matmul(x, self.W.value)
        self.h.value = 0.5 * self.h.value + jnp.tanh(y) + self.h.value * 0.1
        return self.h.value


class Nested(brainstate.nn.Module):
    """Deep nesting: paths like ('outer', 'inner', 'W')."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = brainstate.nn.Module()
        self.outer.inner = Layer(25, 3, 4)

    def update(self, x: Any) -> Any:
        return self.outer.inner(x)


class ConstWeightParamBias(_Base):
    """A constant weight with a ParamState bias: the relation registers through the bias."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.b = brainstate.ParamState(jnp.zeros(n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, jnp.ones((self.n_in, self.n_hid)), self.b.value)
        return self.h.value


class ElemwiseChain(_Base):
    """``h = a h + element_wise(g) * matmul(x, W)``: both ``g`` and ``W`` learn online."""

    def __init__(self, n_in: int = 3, n_hid: int = 4, weight_fn: Any = None) -> None:
        super().__init__(n_in, n_hid)
        self.weight_fn = weight_fn
        self.g = brainstate.ParamState(jnp.ones(n_hid))
        self.W = _w(26, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        gain = braintrace.element_wise(self.g.value, weight_fn=self.weight_fn)
        self.h.value = 0.5 * self.h.value + gain * braintrace.matmul(x, self.W.value)
        return self.h.value


class PartialPath(_Base):
    """``y1`` reaches ``h`` directly and through ``W2``: ``W1`` is MIXED."""

    def __init__(self, n_in: int = 4, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W1, self.W2 = _w(27, (n_in, n_hid)), _w(28, (n_hid, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        y1 = braintrace.matmul(x, self.W1.value)
        self.h.value = 0.5 * self.h.value + y1 + braintrace.matmul(y1, self.W2.value)
        return self.h.value


class SelfProduct(_Base):
    """``h * h`` in one equation (upstream raises; we support it)."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W = _w(29, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        h = self.h.value
        self.h.value = 0.5 * h * h + braintrace.matmul(x, self.W.value)
        return self.h.value


class JitInside(_Base):
    """The ETP op and the hidden update inside a user ``jax.jit``."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W = _w(30, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        @jax.jit
        def step(h: Any, w: Any, x: Any) -> Any:
            return 0.5 * h + braintrace.matmul(x, w)

        self.h.value = step(self.h.value, self.W.value, x)
        return self.h.value


class WritesWeight(_Base):
    """Writes its ParamState inside the step: not supported."""

    def __init__(self, n_in: int = 3, n_hid: int = 4) -> None:
        super().__init__(n_in, n_hid)
        self.W = _w(31, (n_in, n_hid))
        self.init_state()

    def update(self, x: Any) -> Any:
        self.W.value = self.W.value * 0.99
        self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.W.value)
        return self.h.value


class NoHidden(brainstate.nn.Module):
    """A feed-forward model: no hidden state at all."""

    def __init__(self) -> None:
        super().__init__()
        self.W = _w(32, (3, 4))

    def update(self, x: Any) -> Any:
        return braintrace.matmul(x, self.W.value)

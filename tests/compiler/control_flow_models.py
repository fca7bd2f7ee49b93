"""Models with control flow inside the step, each with a hand-flattened twin (``flat=True``).

A twin computes the same function without the control flow (``select_n`` for a cond, a
Python loop for a scan or while), so the canonicalised model must equal it in values and
gradients, and both must learn identically. Every model reads its hidden states *after* the
loop (``h @ w_out``), which is what online learning sees. Sizes are tiny; weights are drawn
at construction in the default float dtype (so a test that enables float64 first gets float64).
"""

from __future__ import annotations

from typing import Any

import brainstate
import jax
import jax.numpy as jnp

import braintrace


def _w(key: int, shape: tuple[int, ...], scale: float = 0.4) -> brainstate.ParamState:
    return brainstate.ParamState(scale * jax.random.normal(jax.random.PRNGKey(key), shape))


class _Model(brainstate.nn.Module):
    """One or more hidden states ``(n_hid,)`` (or ``(batch, n_hid)``) and a plain readout."""

    hidden_names: tuple[str, ...] = ("h",)

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False) -> None:
        super().__init__()
        self.n_in, self.n_hid, self.flat = n_in, n_hid, flat
        self.w_out = _w(99, (n_hid, 2))
        self.init_state()

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_hid,) if batch_size is None else (batch_size, self.n_hid)
        for name in self.hidden_names:
            setattr(self, name, brainstate.HiddenState(jnp.zeros(shape)))

    def readout(self) -> Any:
        return getattr(self, self.hidden_names[0]).value @ self.w_out.value


class CondModel(_Model):
    """``h = 0.8 h + cond(x[0] > 0, x @ W1, tanh(x @ W2))``; the twin selects with ``select_n``."""

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False) -> None:
        self.w1, self.w2 = _w(1, (n_in, n_hid)), _w(2, (n_in, n_hid))
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        def on_true(x: Any) -> Any:
            return braintrace.matmul(x, self.w1.value)

        def on_false(x: Any) -> Any:
            return jnp.tanh(braintrace.matmul(x, self.w2.value))

        pred = x[0] > 0
        if self.flat:
            y = jax.lax.select_n(pred, on_false(x), on_true(x))
        else:
            y = jax.lax.cond(pred, on_true, on_false, x)
        self.h.value = 0.8 * self.h.value + y
        return self.readout()


class SwitchModel(_Model):
    """A three-way ``lax.switch`` over three ETP branches; the twin uses a 3-way ``select_n``."""

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False) -> None:
        self.ws = [_w(3 + k, (n_in, n_hid)) for k in range(3)]
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        branches = [
            lambda x: braintrace.matmul(x, self.ws[0].value),
            lambda x: jnp.tanh(braintrace.matmul(x, self.ws[1].value)),
            lambda x: 0.5 * braintrace.matmul(x, self.ws[2].value),
        ]
        index = jnp.clip(jnp.floor(x[0] + 1.5), 0, 2).astype(jnp.int32)
        if self.flat:
            y = jax.lax.select_n(index, *[b(x) for b in branches])
        else:
            y = jax.lax.switch(index, branches, x)
        self.h.value = 0.7 * self.h.value + y
        return self.readout()


class CondInScanModel(_Model):
    """Three substeps, each choosing between two ETP drives with a cond on the substep index."""

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False) -> None:
        self.w1, self.w2 = _w(6, (n_in, n_hid)), _w(7, (n_in, n_hid))
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        def drive(i: Any) -> Any:
            even = i % 2 == 0
            a = lambda: braintrace.matmul(x, self.w1.value)  # noqa: E731
            b = lambda: 0.5 * braintrace.matmul(x, self.w2.value)  # noqa: E731
            return jax.lax.select_n(even, b(), a()) if self.flat else jax.lax.cond(even, a, b)

        def substep(h: Any, i: Any) -> Any:
            return 0.8 * h + 0.2 * jnp.tanh(drive(i)), None

        if self.flat:
            h = self.h.value
            for i in range(3):
                h, _ = substep(h, jnp.asarray(i))
        else:
            h, _ = jax.lax.scan(substep, self.h.value, jnp.arange(3))
        self.h.value = h
        return self.readout()


class SubstepModel(_Model):
    """``length`` substeps ``h = leak h + 0.1 tanh(x_k @ W)`` over per-substep inputs ``x_k``.

    ``leak`` is a trainable element-wise ETP operation. With ``reverse`` the substeps run from
    the last input to the first; ``api='for_loop'`` uses ``brainstate.transform.for_loop``
    (hidden state written inside the body) instead of ``lax.scan``. With ``read_ys`` the
    output reads the last substep through the scan's stacked outputs instead of the state.
    """

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False, length: int = 3,
                 reverse: bool = False, api: str = "scan", read_ys: bool = False) -> None:
        self.length, self.reverse, self.api, self.read_ys = length, reverse, api, read_ys
        self.w = _w(8, (n_in, n_hid))
        self.tau = brainstate.ParamState(jnp.linspace(0.5, 2.0, n_hid))
        super().__init__(n_in, n_hid, flat)

    def substep(self, h: Any, x_k: Any) -> Any:
        leak = braintrace.element_wise(self.tau.value, weight_fn=jax.nn.sigmoid)
        return leak * h + 0.1 * jnp.tanh(braintrace.matmul(x_k, self.w.value))

    def update(self, x: Any) -> Any:
        scales = jnp.linspace(0.5, 1.5, self.length).reshape(self.length, *([1] * x.ndim))
        x_seq = scales * x[None]
        if self.flat:
            h = self.h.value
            order = range(self.length - 1, -1, -1) if self.reverse else range(self.length)
            for k in order:
                h = self.substep(h, x_seq[k])
            self.h.value = h
        elif self.api == "for_loop":
            def body(x_k: Any) -> None:
                self.h.value = self.substep(self.h.value, x_k)

            brainstate.transform.for_loop(body, x_seq, reverse=self.reverse)
        else:
            def scan_body(h: Any, x_k: Any) -> Any:
                new = self.substep(h, x_k)
                return new, new

            self.h.value, ys = jax.lax.scan(scan_body, self.h.value, x_seq, reverse=self.reverse)
            if self.read_ys:  # the same value as the state, read through the stacked outputs
                return ys[-1] @ self.w_out.value
        return self.readout()


class TwoStateModel(_Model):
    """Carries ``v`` and an adaptation ``a`` (one group, two states) and a counter for ``length`` substeps.

    Each update reads only the previous values: a hidden state read again in the step after its
    update would feed the single-step learning signal of one state into the other's.
    """

    hidden_names = ("v", "a")

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False, length: int = 3) -> None:
        self.length = length
        self.w = _w(9, (n_in, n_hid))
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        def substep(carry: Any, _: Any) -> Any:
            v, a, k = carry  # both updates read the previous values (see the class docstring)
            new_v = 0.8 * v - 0.2 * a + 0.1 * jnp.tanh(braintrace.matmul(x, self.w.value))
            return (new_v, 0.9 * a + 0.1 * v, k + 1), None

        carry = (self.v.value, self.a.value, jnp.zeros((), jnp.int32))
        if self.flat:
            for _ in range(self.length):
                carry, _ = substep(carry, None)
        else:
            carry, _ = jax.lax.scan(substep, carry, None, length=self.length)
        self.v.value, self.a.value, _ = carry
        return self.readout()


class HalvedDriveModel(_Model):
    """``h = 0.7 h + z``, with ``z = tanh(x @ W)`` halved by a weight-free ``while_loop`` while it
    is large (at most three times): the loop sits between the weight product and the hidden state,
    its trip count depends on the data. The twin halves with ``jnp.where`` in a Python loop.
    """

    #: The drive is halved while its largest magnitude exceeds this.
    limit = 0.4

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False) -> None:
        self.w = _w(13, (n_in, n_hid))
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        z = self.halve(jnp.tanh(braintrace.matmul(x, self.w.value)))
        self.h.value = 0.7 * self.h.value + z
        return self.readout()

    def halve(self, z: Any) -> Any:
        """``z`` halved while its largest magnitude exceeds :attr:`limit`, at most three times."""
        if self.flat:
            for _ in range(3):
                z = jnp.where(jnp.max(jnp.abs(z)) > self.limit, 0.5 * z, z)
            return z
        z, _ = jax.lax.while_loop(lambda c: (c[1] < 3) & (jnp.max(jnp.abs(c[0])) > self.limit),
                                  lambda c: (0.5 * c[0], c[1] + 1), (z, 0))
        return z


class FeedforwardHalvedModel(HalvedDriveModel):
    """:class:`HalvedDriveModel` without the leak, ``h = z``: a feedforward step, where pp_prop's
    feedforward coordinate (``decay_or_rank=0.0``) is exact."""

    def update(self, x: Any) -> Any:
        self.h.value = self.halve(jnp.tanh(braintrace.matmul(x, self.w.value)))
        return self.readout()


class HalvedInBranchModel(HalvedDriveModel):
    """:class:`HalvedDriveModel` whose halving loop runs in one branch of a ``lax.cond`` (taken when
    ``x[0] > 0``): a ``while_loop`` nested in another equation's body, which the compiler keeps as a
    cond. The twin selects between the flat halving and ``z`` with ``jnp.where``.
    """

    def update(self, x: Any) -> Any:
        z = jnp.tanh(braintrace.matmul(x, self.w.value))
        if self.flat:
            z = jnp.where(x[0] > 0, self.halve(z), z)
        else:
            z = jax.lax.cond(x[0] > 0, self.halve, lambda z: z, z)
        self.h.value = 0.7 * self.h.value + z
        return self.readout()


class HalvedInScanModel(HalvedDriveModel):
    """Three substeps ``h = 0.8 h + 0.2 halve(z + h)`` in a ``lax.scan``, ``z = tanh(x @ W)``: a
    ``while_loop`` in a scan body on the recurrent path, which the compiler keeps as a scan. The
    twin iterates in Python (with the flat halving)."""

    def update(self, x: Any) -> Any:
        z = jnp.tanh(braintrace.matmul(x, self.w.value))

        def body(h: Any, _: Any) -> tuple[Any, None]:
            return 0.8 * h + 0.2 * self.halve(z + h), None

        if self.flat:
            h = self.h.value
            for _ in range(3):
                h, _ = body(h, None)
        else:
            h, _ = jax.lax.scan(body, self.h.value, None, length=3)
        self.h.value = h
        return self.readout()


class InputLoopModel(_Model):
    """``h = 0.9 h + tanh(s @ W)``, with ``s`` computed from the input alone by a weight-free
    ``while_loop`` (three relaxation steps ``s = 0.5 s + 1``); the twin iterates in Python."""

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False) -> None:
        self.w = _w(14, (n_in, n_hid))
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        if self.flat:
            s = x
            for _ in range(3):
                s = 0.5 * s + 1.0
        else:
            s, _ = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (0.5 * c[0] + 1.0, c[1] + 1), (x, 0))
        self.h.value = 0.9 * self.h.value + jnp.tanh(braintrace.matmul(s, self.w.value))
        return self.readout()


class MixingModel(_Model):
    """``length`` substeps ``h = 0.9 h + 0.1 tanh(x @ W + h @ U)`` (the body mixes ``h`` through an ETP matmul)."""

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False, length: int = 20) -> None:
        self.length = length
        self.w, self.u = _w(10, (n_in, n_hid)), _w(11, (n_hid, n_hid), 0.8)
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        def body(h: Any, _: Any) -> Any:
            drive = jnp.tanh(braintrace.matmul(x, self.w.value) + braintrace.matmul(h, self.u.value))
            return 0.9 * h + 0.1 * drive, None

        self.h.value, _ = jax.lax.scan(body, self.h.value, None, length=self.length)
        return self.readout()


class SettleModel(_Model):
    """``h`` relaxed by a weight-free ``while_loop`` towards ``0.8 h + tanh(x @ W)``, ``n`` iterations.

    The twin iterates in Python. With ``coupled``, a second hidden state ``a = 0.9 a + drive``
    (updated outside the loop) also pulls the target: the ETP output then reaches the group
    both through the loop (``h``) and around it (``a``).
    """

    def __init__(self, n_in: int = 3, n_hid: int = 4, flat: bool = False, n: int = 6, coupled: bool = False) -> None:
        self.n, self.coupled = n, coupled
        if coupled:
            self.hidden_names = ("h", "a")
        self.w = _w(12, (n_in, n_hid))
        super().__init__(n_in, n_hid, flat)

    def update(self, x: Any) -> Any:
        drive = jnp.tanh(braintrace.matmul(x, self.w.value))
        h = self.h.value
        target = 0.8 * h + drive
        if self.coupled:
            target = target + 0.1 * self.a.value
            self.a.value = 0.9 * self.a.value + drive
        if self.flat:
            v = h
            for _ in range(self.n):
                v = 0.5 * v + 0.5 * target
        else:
            v, _ = jax.lax.while_loop(
                lambda c: c[1] < self.n, lambda c: (0.5 * c[0] + 0.5 * target, c[1] + 1), (h, 0)
            )
        self.h.value = v
        return self.readout()


class WeightInWhile(brainstate.nn.Module):
    """A ``while_loop`` whose body reads a trainable weight (refused: no twin).

    ``h ← tanh((h + x) @ W)`` three times per step, ``h`` of shape ``(4,)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = brainstate.ParamState(0.3 * jnp.ones((4, 4)))
        self.h = brainstate.HiddenState(jnp.zeros(4))

    def update(self, x: Any) -> Any:
        self.h.value, _ = jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (jnp.tanh(braintrace.matmul(c[0], self.w.value)), c[1] + 1),
            (self.h.value + x, 0))
        return self.h.value

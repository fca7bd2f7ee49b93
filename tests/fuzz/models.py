"""One interpreter of :class:`~tests.fuzz.grammar.ModelSpec`, two backends: the model and its BPTT reference.

:func:`step` runs one time step of a spec against a backend. :class:`EtpBackend` is the model
braintrace compiles: the weights go through braintrace's ETP operators, the control flow is
``lax.cond`` / ``lax.scan`` / ``brainstate.transform.for_loop`` / ``lax.while_loop``, the
states of a ``unit`` group are ``brainunit`` quantities in ``mV``. :class:`PlainBackend` is the
reference: the same arithmetic in plain ``jax.numpy`` (``x @ W``, a dense matrix for a sparse
one, ``lax.conv_general_dilated``), ``jnp.where`` for the cond, Python loops for the inner loops
and a masked loop for the ``while``, no units. :func:`bptt_reference` differentiates the summed
loss of the plain backend through the whole time loop with ``jax.grad``: nothing of braintrace
takes part in it.

Both backends draw their weights from :func:`init_params` (NumPy, float64), keyed by name; the
model stores each one as a ``ParamState`` attribute of that name (its path is ``(name,)``).
"""

from __future__ import annotations

from typing import Any, Callable

import brainevent
import brainstate
import brainunit as u
import jax
import jax.numpy as jnp
import numpy as np

import braintrace
from tests.fuzz.grammar import N_IN, VOCAB, GroupSpec, ModelSpec, OpSpec

__all__ = ["FuzzModel", "PlainBackend", "EtpBackend", "init_params", "bptt_reference", "sequences", "OUT"]

OUT = 2  # width of the plain and ETP readouts
T = 4  # steps of a fuzzed sequence

Hook = Callable[[Any], Any] | None


def hook_fn(name: str) -> Hook:
    """A shape-preserving transform of a stored weight (``roll`` mixes entries)."""
    return {
        "none": None,
        "tanh": jnp.tanh,
        "affine": lambda w: 0.5 * w + 0.1,
        "roll": lambda w: jnp.roll(w, 1, axis=-1),
    }[name]


def apply_hook(hook: Hook, w: Any) -> Any:
    return w if hook is None else hook(w)


def sparse_mask(spec: OpSpec) -> np.ndarray:
    """The ``(n_in, n_out)`` connectivity of a sparse operation (at least one connection)."""
    mask = np.random.default_rng(spec.seed + 7).random((spec.n_in, spec.n_out)) < 0.6
    mask[0, 0] = True
    return mask


def _op_params(spec: OpSpec, prefix: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    n, m = spec.n_in, spec.n_out
    scale = 0.8 / np.sqrt(n)
    shapes: dict[str, tuple[int, ...]] = {
        "matmul": {"w": (n, m), "b": (m,)},
        "einsum": {"w": (n, m)},
        "sparse": {"w": (int(sparse_mask(spec).sum()),), "b": (m,)},
        "grouped": {"w": (spec.size, n // spec.size, m // spec.size), "b": (spec.size, m // spec.size)},
        "lora": {"w": (n, spec.size), "a": (spec.size, m), "b": (m,)},
        "conv": {"w": (spec.size, 1, 3), "b": (spec.size,)},
        "elemwise": {"w": (n,)},
        "embedding": {"w": (VOCAB, m)},
    }[spec.family]
    params = {}
    for key, shape in shapes.items():
        if key == "b" and not spec.bias:
            continue
        params[f"{prefix}_{key}"] = (1.0 if spec.family == "elemwise" else scale) * rng.standard_normal(shape)
    return params


def init_params(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Every weight of the model, ``name -> float64 array``."""
    params: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(spec.seed + 1)
    for gi, g in enumerate(spec.groups):
        params.update(_op_params(g.drive, f"g{gi}_drive"))
        if g.mix is not None:
            params.update(_op_params(g.mix, f"g{gi}_mix"))
        if g.recurrence == "param":
            params[f"g{gi}_tau"] = rng.standard_normal(g.width)
    if spec.readout in ("plain", "etp"):
        params["readout"] = 0.5 * rng.standard_normal((sum(g.width for g in spec.groups), OUT))
    return params


def indices_of(x: Any) -> Any:
    """Embedding indices from the input's first feature: ``(batch,)`` or a scalar."""
    return (jnp.floor(jnp.abs(x[..., 0]) * 2.0)).astype(jnp.int32) % VOCAB


# --- the backends ---------------------------------------------------------------------------------


class PlainBackend:
    """Plain ``jax.numpy``, no units: the reference."""

    unit_of_group = staticmethod(lambda g: 1.0)

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def p(self, name: str) -> Any:
        return self.params[name]

    def op(self, spec: OpSpec, prefix: str, src: Any, x: Any, unit: Any = 1.0) -> Any:
        """``src (..., n_in) -> (..., n_out)``; ``unit`` is the unit of ``src`` (and so of the bias)."""
        hook = hook_fn(spec.hook)
        w = apply_hook(hook, self.p(f"{prefix}_w"))
        bias = self.params.get(f"{prefix}_b")
        if spec.family in ("matmul", "einsum"):
            y = src @ w
        elif spec.family == "sparse":
            rows, cols = np.nonzero(sparse_mask(spec))
            y = src @ jnp.zeros((spec.n_in, spec.n_out), w.dtype).at[rows, cols].set(w)
        elif spec.family == "grouped":
            xs = src.reshape((*src.shape[:-1], spec.size, spec.n_in // spec.size))
            y = jnp.einsum("...gi,gio->...go", xs, w)
            y = (y if bias is None else y + bias).reshape((*src.shape[:-1], spec.n_out))
            bias = None
        elif spec.family == "lora":
            y = 0.5 * (src @ w @ self.p(f"{prefix}_a"))
        elif spec.family == "conv":
            lhs = (src if src.ndim == 2 else src[None])[:, None, :]
            y = jax.lax.conv_general_dilated(lhs, w, (1,), "SAME")
            if bias is not None:
                y = y + bias[:, None]
                bias = None
            y = y.reshape(lhs.shape[0], spec.n_out)
            y = y if src.ndim == 2 else y[0]
        elif spec.family == "elemwise":
            y = w * src
        else:
            y = w[indices_of(x)]
        return y if bias is None else y + bias

    def leak(self, tau: Any) -> Any:
        return jax.nn.sigmoid(tau)

    def readout(self, cat: Any) -> Any:
        return cat @ self.p("readout")

    def cond(self, pred: Any, on_true: Callable[[], Any], on_false: Callable[[], Any]) -> Any:
        return jnp.where(pred, on_true(), on_false())

    def loop(self, kind: str, gi: int, body: Callable[..., Any], carry: Any, steps: int) -> Any:
        for k in range(steps):
            carry = body(carry, k)
        return carry

    def settle(self, h: Any, unit: Any, steps: int) -> Any:
        for _ in range(steps):
            h = jnp.where(jnp.max(jnp.abs(h / unit)) > 1.5, 0.5 * h, h)
        return h


class EtpBackend(PlainBackend):
    """braintrace's operators and JAX control flow, ``mV`` states: the compiled model."""

    unit_of_group = staticmethod(lambda g: u.mV if g.unit else 1.0)

    def __init__(self, model: "FuzzModel") -> None:
        super().__init__({})
        self.model = model

    def p(self, name: str) -> Any:
        return getattr(self.model, name).value  # read where used (inside the bodies)

    def op(self, spec: OpSpec, prefix: str, src: Any, x: Any, unit: Any = 1.0) -> Any:
        hook = hook_fn(spec.hook)
        w = self.p(f"{prefix}_w")
        bias = self.p(f"{prefix}_b") * unit if spec.bias else None  # in the unit of x·W
        if spec.family == "matmul":
            return braintrace.matmul(src, w, bias, weight_fn=hook)
        if spec.family == "einsum":
            y = braintrace.einsum("bk,kn->bn", src if src.ndim == 2 else src[None], w, weight_fn=hook)
            return y if src.ndim == 2 else y[0]
        if spec.family == "sparse":
            csr = self.model.sparse_matrix(prefix)
            return braintrace.sparse_matmul(src, w, sparse_mat=csr, bias=bias, weight_fn=hook)
        if spec.family == "grouped":
            xs = src.reshape((*src.shape[:-1], spec.size, spec.n_in // spec.size))
            y = braintrace.grouped_matmul(xs, w, bias, weight_fn=hook)
            return y.reshape((*src.shape[:-1], spec.n_out))
        if spec.family == "lora":
            return braintrace.lora_matmul(src, w, self.p(f"{prefix}_a"), alpha=0.5, bias=bias, b_fn=hook)
        if spec.family == "conv":
            lhs = (src if src.ndim == 2 else src[None])[:, None, :]
            y = braintrace.conv(lhs, w, bias, padding="SAME", kernel_fn=hook)
            y = y.reshape(lhs.shape[0], spec.n_out)
            return y if src.ndim == 2 else y[0]
        if spec.family == "elemwise":
            return braintrace.element_wise(w, weight_fn=hook) * src
        return braintrace.embedding(indices_of(x), w, weight_fn=hook)

    def leak(self, tau: Any) -> Any:
        return braintrace.element_wise(tau, weight_fn=jax.nn.sigmoid)

    def readout(self, cat: Any) -> Any:
        if self.model.spec.readout == "etp":
            return braintrace.matmul(cat, self.p("readout"))
        return cat @ self.p("readout")

    def cond(self, pred: Any, on_true: Callable[[], Any], on_false: Callable[[], Any]) -> Any:
        return jax.lax.cond(pred, on_true, on_false)

    def loop(self, kind: str, gi: int, body: Callable[..., Any], carry: Any, steps: int) -> Any:
        if kind == "scan":
            return jax.lax.scan(lambda c, k: (body(c, k), None), carry, jnp.arange(steps))[0]
        # for_loop: the hidden states are written inside the body, the spike comes back as ys
        h_state, a_state = self.model.group_states(gi)
        h_state.value, a_state_value, _ = carry
        if a_state is not None:
            a_state.value = a_state_value

        def step(k: Any) -> Any:
            a = a_state.value if a_state is not None else a_state_value
            h, a, s = body((h_state.value, a, jnp.zeros_like(u.get_mantissa(h_state.value))), k)
            h_state.value = h
            if a_state is not None:
                a_state.value = a
            return s

        spikes = brainstate.transform.for_loop(step, jnp.arange(steps))
        return h_state.value, (a_state.value if a_state is not None else a_state_value), spikes[-1]

    def settle(self, h: Any, unit: Any, steps: int) -> Any:
        def keep_going(carry: Any) -> Any:
            value, i = carry
            return (jnp.max(jnp.abs(value / unit)) > 1.5) & (i < steps)

        return jax.lax.while_loop(keep_going, lambda c: (0.5 * c[0], c[1] + 1), (h, 0))[0]


# --- one step -------------------------------------------------------------------------------------


def _group_step(B: PlainBackend, g: GroupSpec, gi: int, h: Any, a: Any, x: Any, src: Any) -> tuple[Any, Any, Any]:
    """``(new h, new a, output)`` of group ``gi``."""
    unit = B.unit_of_group(g)

    def drive(k: Any) -> Any:
        def raw() -> Any:
            return B.op(g.drive, f"g{gi}_drive", src, x) * unit

        d = B.cond(jnp.sum(x) > 0, raw, lambda: 0.5 * raw()) if g.control == "cond" else raw()
        return d * (0.5 + 0.25 * k)

    def substep(carry: tuple[Any, Any, Any], k: Any) -> tuple[Any, Any, Any]:
        h, a, _ = carry
        d = drive(k)
        if g.recurrence == "none":
            pre = d
        elif g.recurrence == "const":
            pre = jnp.linspace(0.5, 0.9, g.width) * h + d
        elif g.recurrence == "param":
            pre = B.leak(B.p(f"g{gi}_tau")) * h + d
        elif g.recurrence == "mix":
            pre = jnp.tanh((B.op(g.mix, f"g{gi}_mix", h, x, unit) + d) / unit) * unit
        else:
            pre = 0.8 * (u.math.roll(h, 1, axis=-1) if g.unit else jnp.roll(h, 1, axis=-1)) + d
        if g.adapt:
            pre = pre - 0.3 * a
        spike = jax.nn.sigmoid(4.0 * (pre / unit - 0.5))
        new_h = pre * (1.0 - spike) if g.reset else pre
        new_a = 0.9 * a + 0.1 * (h if g.adapt == "old" else new_h) if g.adapt else a
        return new_h, new_a, spike

    carry = (h, a, None)
    if g.control in ("scan", "for_loop"):
        zeros = jnp.zeros_like(h / unit)
        new_h, new_a, spike = B.loop(g.control, gi, substep, (h, a, zeros), g.steps)
    else:
        new_h, new_a, spike = substep(carry, 1)
    if g.control == "while":
        new_h = B.settle(new_h, unit, g.steps)
    out = spike if g.reset else jnp.tanh(new_h / unit)
    if g.read == "old":
        out = out + 0.5 * jnp.tanh(h / unit)
    return new_h, new_a, out


def step(B: PlainBackend, spec: ModelSpec, states: dict[str, Any], x: Any) -> tuple[dict[str, Any], Any]:
    """``(new states, output)`` of one time step; ``states`` holds ``h{i}`` (and ``a{i}``) per group."""
    outs: list[Any] = []
    new: dict[str, Any] = {}
    for gi, g in enumerate(spec.groups):
        src = x if g.source < 0 else outs[g.source]
        unit = B.unit_of_group(g)
        a = states.get(f"a{gi}", jnp.zeros_like(states[f"h{gi}"] / unit) * unit)
        new[f"h{gi}"], a, out = _group_step(B, g, gi, states[f"h{gi}"], a, x, src)
        if g.adapt:
            new[f"a{gi}"] = a
        outs.append(out)
    cat = jnp.concatenate(outs, axis=-1)
    return new, (cat if spec.readout == "identity" else B.readout(cat))


def zero_states(spec: ModelSpec, batch: int | None, unit_of_group: Callable[[GroupSpec], Any]) -> dict[str, Any]:
    states = {}
    for gi, g in enumerate(spec.groups):
        shape = (g.width,) if batch is None else (batch, g.width)
        states[f"h{gi}"] = jnp.zeros(shape) * unit_of_group(g)
        if g.adapt:
            states[f"a{gi}"] = jnp.zeros(shape) * unit_of_group(g)
    return states


# --- the model ------------------------------------------------------------------------------------


class FuzzModel(brainstate.nn.Module):
    """The compiled model of a spec: one ``ParamState`` per weight name, ``HiddenState`` ``h{i}`` / ``a{i}``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        # The CSR structures are built here, outside any trace (their nnz must be concrete).
        ops = {f"g{gi}_{role}": op for gi, g in enumerate(spec.groups) for role, op in (("drive", g.drive), ("mix", g.mix))
               if op is not None and op.family == "sparse"}
        self._csr = {prefix: brainevent.CSR.fromdense(jnp.asarray(sparse_mask(op), jnp.result_type(float)))
                     for prefix, op in ops.items()}
        for name, value in init_params(spec).items():
            setattr(self, name, brainstate.ParamState(jnp.asarray(value)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        for name, value in zero_states(self.spec, batch_size, EtpBackend.unit_of_group).items():
            setattr(self, name, brainstate.HiddenState(value))

    def sparse_matrix(self, prefix: str) -> Any:
        """The CSR structure of the sparse operation ``prefix`` (its ``(n_in, n_out)`` mask)."""
        return self._csr[prefix]

    def group_states(self, gi: int) -> tuple[Any, Any]:
        return getattr(self, f"h{gi}"), getattr(self, f"a{gi}", None)

    def update(self, x: Any) -> Any:
        names = [f"{k}{gi}" for gi, g in enumerate(self.spec.groups) for k in ("h", "a") if k == "h" or g.adapt]
        states = {name: getattr(self, name).value for name in names}
        new, out = step(EtpBackend(self), self.spec, states, x)
        for name, value in new.items():
            getattr(self, name).value = value
        return out


# --- data and the reference -----------------------------------------------------------------------


def sequences(spec: ModelSpec) -> tuple[jax.Array, jax.Array]:
    """``(inputs (T, [batch,] N_IN), targets (T, [batch,] out))`` in float64."""
    rng = np.random.default_rng(spec.seed + 2)
    lead = (T,) if spec.batch is None else (T, spec.batch)
    width = sum(g.width for g in spec.groups) if spec.readout == "identity" else OUT
    xs = rng.standard_normal((*lead, N_IN))
    return jnp.asarray(xs, jnp.float64), jnp.asarray(rng.standard_normal((*lead, width)), jnp.float64)


def bptt_reference(spec: ModelSpec, xs: Any, ys: Any) -> tuple[dict[str, np.ndarray], float]:
    """``(name -> ∂J/∂w, J)`` for ``J = Σ_t Σ (out_t - y_t)²``, plain ``jax.grad`` through the loop."""

    def total(params: dict[str, Any]) -> Any:
        backend = PlainBackend(params)
        states = zero_states(spec, spec.batch, PlainBackend.unit_of_group)
        loss = jnp.zeros(())
        for t in range(xs.shape[0]):
            states, out = step(backend, spec, states, xs[t])
            loss = loss + jnp.sum((out - ys[t]) ** 2)
        return loss

    params = {k: jnp.asarray(v, jnp.float64) for k, v in init_params(spec).items()}
    loss, grads = jax.jit(jax.value_and_grad(total))(params)
    return {k: np.asarray(v) for k, v in grads.items()}, float(loss)

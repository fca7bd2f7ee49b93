"""Classic recurrent cells learned online: ``ValinaRNNCell``, ``GRUCell``, ``MGUCell``,
``LSTMCell``, ``URLSTMCell`` and ``CFNCell``.

Notation: ``[a, b]`` concatenates on the last axis, ``σ`` is the logistic sigmoid and ``φ``
the cell's activation. Every gate is a :class:`braintrace.nn.Linear` over ``[x, h]``; a gate
whose output reaches the hidden state only through another gate's weight (GRU's reset gate)
is traced by SnAp (``n >= 2``) and UORO; per-position learners leave it out of the
eligibility-trace graph and give it only its one-step (or in-window) gradient.
"""

from __future__ import annotations


import brainstate
import braintools
import jax
import jax.numpy as jnp

from braintrace._op import element_wise
from braintrace._typing import Initializer, Value, ValueFn
from braintrace.nn._linear import Linear
from braintrace.nn._rnn_base import CellBase, concat, resolve_activation

__all__ = ["ValinaRNNCell", "GRUCell", "MGUCell", "LSTMCell", "URLSTMCell", "CFNCell"]

sigmoid = brainstate.nn.sigmoid


class ValinaRNNCell(CellBase):
    r"""Vanilla RNN cell, :math:`h \leftarrow φ(W [x, h] + b)`.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
        Input and hidden sizes (feature counts are the last entries).
    state_init : initializer or array
        Initial hidden state (default ``ZeroInit()``). Note: it comes before ``w_init``.
    w_init, b_init : initializer or array
        Initialisers of ``W`` (default ``XavierNormal()``) and its bias (``ZeroInit()``).
    activation : str or callable
        ``φ``: a ``brainstate.nn`` function name or a callable (default ``'relu'``).
    name : str, optional

    Attributes
    ----------
    W : braintrace.nn.Linear
        ``(n_in + n) -> n``.
    h : HiddenState
        Created by ``init_state``.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.ValinaRNNCell(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        state_init: Initializer = braintools.init.ZeroInit(),
        w_init: Initializer = braintools.init.XavierNormal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        activation: str | ValueFn = "relu",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        self.activation = resolve_activation(activation, "ValinaRNNCell")
        self.W = Linear(self.num_in + self.num_out, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        self.h.value = self.activation(self.W(concat(x, self.h.value)))
        return self.h.value


class GRUCell(CellBase):
    r"""Gated recurrent unit.

    .. math::

        z = σ(W_z [x, h]),\quad r = σ(W_r [x, h]),\quad
        \hat h = φ(W_h [x, r \odot h]),\quad h \leftarrow (1 - z) \odot h + z \odot \hat h

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init, b_init : initializer or array
        Gate weight (default ``Orthogonal()``) and bias (``ZeroInit()``) initialisers.
    state_init : initializer or array
        Initial hidden state (default ``ZeroInit()``).
    activation : str or callable
        ``φ`` (default ``'tanh'``).
    name : str, optional

    Attributes
    ----------
    Wz, Wr, Wh : braintrace.nn.Linear
        ``(n_in + n) -> n`` each.
    h : HiddenState

    Notes
    -----
    ``Wr`` reaches ``h`` only through ``Wh``. Per-position traces (D_RTRL, pp_prop, EProp,
    OSTLRecurrent) cannot hold that influence: the compiler leaves ``Wr`` out (weight → weight
    → hidden, reported in ``learner.report``) and it learns from its one-step (or in-window)
    gradient. ``SnAp`` (``n >= 2``) and ``UORO`` trace it through ``Wh``; saturated SnAp is
    then exact on every weight.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.GRUCell(3, 4)
    >>> cell.init_state(batch_size=2)
    >>> cell(jnp.ones((2, 3))).shape
    (2, 4)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.Orthogonal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        state_init: Initializer = braintools.init.ZeroInit(),
        activation: str | ValueFn = "tanh",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        self.activation = resolve_activation(activation, "GRUCell")
        n_xh = self.num_in + self.num_out
        self.Wz = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wr = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wh = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        old_h = self.h.value
        xh = concat(x, old_h)
        z = sigmoid(self.Wz(xh))
        r = sigmoid(self.Wr(xh))
        candidate = self.activation(self.Wh(concat(x, r * old_h)))
        self.h.value = (1 - z) * old_h + z * candidate
        return self.h.value


class MGUCell(CellBase):
    r"""Minimal gated unit.

    .. math::

        f = σ(W_f [x, h]),\quad \hat h = φ(W_h [x, f \odot h]),\quad
        h \leftarrow (1 - f) \odot h + f \odot \hat h

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init, b_init : initializer or array
        Gate weight (default ``Orthogonal()``) and bias (``ZeroInit()``) initialisers.
    state_init : initializer or array
        Initial hidden state (default ``ZeroInit()``).
    activation : str or callable
        ``φ`` (default ``'tanh'``).
    name : str, optional

    Attributes
    ----------
    Wf, Wh : braintrace.nn.Linear
        ``(n_in + n) -> n`` each.
    h : HiddenState

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.MGUCell(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.Orthogonal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        state_init: Initializer = braintools.init.ZeroInit(),
        activation: str | ValueFn = "tanh",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        self.activation = resolve_activation(activation, "MGUCell")
        n_xh = self.num_in + self.num_out
        self.Wf = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wh = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        old_h = self.h.value
        f = sigmoid(self.Wf(concat(x, old_h)))
        candidate = self.activation(self.Wh(concat(x, f * old_h)))
        self.h.value = (1 - f) * old_h + f * candidate
        return self.h.value


class LSTMCell(CellBase):
    r"""Long short-term memory cell (forget-gate bias of +1).

    .. math::

        i, g, f, o = W_i[x, h], W_g[x, h], W_f[x, h], W_o[x, h],\quad
        c \leftarrow σ(f + 1) \odot c + σ(i) \odot φ(g),\quad h \leftarrow σ(o) \odot φ(c)

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init, b_init : initializer or array
        Gate weight (default ``XavierNormal()``) and bias (``ZeroInit()``) initialisers.
    state_init : initializer or array
        Initial ``c`` and ``h`` (default ``ZeroInit()``).
    activation : str or callable
        ``φ`` (default ``'tanh'``).
    name : str, optional

    Attributes
    ----------
    Wi, Wg, Wf, Wo : braintrace.nn.Linear
        ``(n_in + n) -> n`` each.
    c, h : HiddenState
        Created in that order by ``init_state``; the cell returns ``h``.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.LSTMCell(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"
    state_names = ("c", "h")

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.XavierNormal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        state_init: Initializer = braintools.init.ZeroInit(),
        activation: str | ValueFn = "tanh",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        self.activation = resolve_activation(activation, "LSTMCell")
        n_xh = self.num_in + self.num_out
        self.Wi = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wg = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wf = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wo = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        xh = concat(x, self.h.value)
        i, g, f, o = self.Wi(xh), self.Wg(xh), self.Wf(xh), self.Wo(xh)
        c = sigmoid(f + 1.0) * self.c.value + sigmoid(i) * self.activation(g)
        self.c.value = c
        self.h.value = sigmoid(o) * self.activation(c)
        return self.h.value


def _logit_uniform_bias(n: int) -> jax.Array:
    """``-log(1/u - 1)`` for ``u ~ Uniform(1/n, 1 - 1/n)``: forget biases spread over timescales."""
    u = brainstate.random.uniform(1.0 / n, 1.0 - 1.0 / n, (n,))
    return -jnp.log(1.0 / u - 1.0)


class URLSTMCell(CellBase):
    r"""LSTM with uniform-initialised forget bias and a refine gate (UR-LSTM).

    .. math::

        f, r, u, o = W_f[x, h], W_r[x, h], W_u[x, h], W_o[x, h],\quad
        f' = σ(b + f),\quad r' = σ(r - b),\quad g = 2 r' f' + (1 - 2 r') f'^2,

        c \leftarrow g \odot c + (1 - g) \odot φ(u),\quad h \leftarrow σ(o) \odot φ(c)

    The shared bias ``b`` goes through :func:`braintrace.element_wise` at both uses, giving
    two relations.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init : initializer or array
        Gate weight initialiser (default ``XavierNormal()``); the gates have no own bias.
    state_init : initializer or array
        Initial ``c`` and ``h`` (default ``ZeroInit()``).
    activation : str or callable
        ``φ`` (default ``'tanh'``).
    name : str, optional

    Attributes
    ----------
    Wu, Wf, Wr, Wo : braintrace.nn.Linear
        ``(n_in + n) -> n``, without bias.
    bias : ParamState
        ``(n,)``, the logit of ``u ~ Uniform(1/n, 1 - 1/n)`` drawn from ``brainstate.random``.
    c, h : HiddenState

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.URLSTMCell(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"
    state_names = ("c", "h")

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.XavierNormal(),
        state_init: Initializer = braintools.init.ZeroInit(),
        activation: str | ValueFn = "tanh",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        self.activation = resolve_activation(activation, "URLSTMCell")
        n_xh = self.num_in + self.num_out
        self.Wu = Linear(n_xh, self.num_out, w_init=w_init, b_init=None)
        self.Wf = Linear(n_xh, self.num_out, w_init=w_init, b_init=None)
        self.Wr = Linear(n_xh, self.num_out, w_init=w_init, b_init=None)
        self.Wo = Linear(n_xh, self.num_out, w_init=w_init, b_init=None)
        self.bias = brainstate.ParamState(_logit_uniform_bias(self.num_out))

    def update(self, x: Value) -> Value:
        self._check_input(x)
        xh = concat(x, self.h.value)
        f, r, u, o = self.Wf(xh), self.Wr(xh), self.Wu(xh), self.Wo(xh)
        f_gate = sigmoid(element_wise(self.bias.value) + f)
        r_gate = sigmoid(-(element_wise(self.bias.value) - r))
        g = 2 * r_gate * f_gate + (1 - 2 * r_gate) * f_gate**2
        self.c.value = g * self.c.value + (1 - g) * self.activation(u)
        self.h.value = sigmoid(o) * self.activation(self.c.value)
        return self.h.value


class CFNCell(CellBase):
    r"""Chaos-free network cell.

    .. math::

        f = σ(W_f [x, h]),\quad i = σ(W_i [x, h]),\quad
        h \leftarrow f \odot φ(h) + i \odot φ(W_h x)

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init, b_init : initializer or array
        Weight (default ``Orthogonal()``) and bias (``ZeroInit()``) initialisers.
    state_init : initializer or array
        Initial hidden state (default ``ZeroInit()``).
    activation : str or callable
        ``φ`` (default ``'tanh'``).
    name : str, optional

    Attributes
    ----------
    Wf, Wi : braintrace.nn.Linear
        ``(n_in + n) -> n``.
    Wh : braintrace.nn.Linear
        ``n_in -> n`` (it reads the input only).
    h : HiddenState

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.CFNCell(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.Orthogonal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        state_init: Initializer = braintools.init.ZeroInit(),
        activation: str | ValueFn = "tanh",
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        self.activation = resolve_activation(activation, "CFNCell")
        n_xh = self.num_in + self.num_out
        self.Wf = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wi = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.Wh = Linear(self.num_in, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        old_h = self.h.value
        xh = concat(x, old_h)
        f = sigmoid(self.Wf(xh))
        i = sigmoid(self.Wi(xh))
        self.h.value = f * self.activation(old_h) + i * self.activation(self.Wh(x))
        return self.h.value
